"""Rollout: turning prompts into scored groups of responses.

`SyncRollout` is the synchronous baseline: it draws N prompts, generates G responses for each
with continuous batching, and returns when the last response is done (the barrier at the end
of the step that APRIL and the asynchronous mode remove).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from trainer.engine.base import RolloutEngine, Sample, SamplingParams
from trainer.tasks.base import Problem, Task


@dataclass
class Group:
    problem: Problem
    samples: list[Sample]
    rewards: list[float] = field(default_factory=list)
    draw: int = 0  # index of the draw that produced it (data cursor position)

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def zero_variance(self) -> bool:
        return len(set(self.rewards)) <= 1


class PromptSource:
    """Hands out training problems in order; the cursor is the only state (checkpointed)."""

    def __init__(self, task: Task, cursor: int = 0):
        self.task, self.cursor = task, cursor

    def next(self) -> tuple[int, Problem]:
        draw = self.cursor
        self.cursor += 1
        return draw, self.task.train_problem(draw)


def new_group(draw: int, problem: Problem, tokenizer, n: int, params: SamplingParams) -> Group:
    prompt_ids = tokenizer(problem.prompt).input_ids
    samples = [Sample(list(prompt_ids), params, meta={"draw": draw, "index": k})
               for k in range(n)]
    return Group(problem=problem, samples=samples, draw=draw)


@dataclass
class RolloutResult:
    groups: list[Group]
    gen_seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


class SyncRollout:
    def __init__(self, engine: RolloutEngine, tokenizer, prompts: PromptSource):
        self.engine, self.tokenizer, self.prompts = engine, tokenizer, prompts

    def collect(self, n_groups: int, group_size: int, params: SamplingParams) -> RolloutResult:
        groups = [new_group(*self.prompts.next(), self.tokenizer, group_size, params)
                  for _ in range(n_groups)]
        t0 = time.monotonic()
        self.engine.generate([s for g in groups for s in g.samples])
        return RolloutResult(groups=groups, gen_seconds=time.monotonic() - t0)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
