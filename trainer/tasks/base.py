"""The task interface.

A task hands out problems by index, so a data cursor is one integer and a run resumes exactly.
It does not score them: the registry (trainer/tasks/__init__.py) names each task's verifier, a
pure function that the reward pool runs in another process.
"""
from __future__ import annotations

import functools
import random

from trainer.episode.interface import Problem  # noqa: F401 -- a task hands out these
from trainer.tasks.prompts import PromptRenderer


def epoch_order(index: int, size: int, seed: int) -> int:
    """Map the index-th draw to a dataset row: epochs over the dataset, each in its own
    seeded shuffle, so prompts recur (GRESO needs their history) and a cursor is one int."""
    epoch, pos = divmod(index, size)
    return _shuffled(size, seed, epoch)[pos]


@functools.lru_cache(maxsize=4)
def _shuffled(size: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(size))
    random.Random(f"epoch:{seed}:{epoch}").shuffle(order)
    return tuple(order)


class Task:
    name: str = ""
    train_size: int = 0
    # how problem text becomes the prompt (trainer/tasks/prompts.py); Problem.prompt is its output
    renderer: PromptRenderer = PromptRenderer()

    def problem(self, row: int) -> Problem:
        """Row `row` of the training set."""
        raise NotImplementedError

    def train_problem(self, index: int) -> Problem:
        """The index-th training draw (deterministic for a given seed)."""
        return self.problem(epoch_order(index, self.train_size, self.seed))

    def eval_problems(self, n: int) -> list[Problem]:
        """n held-out problems, the same every call."""
        raise NotImplementedError

    def begin_step(self, step: int) -> None:
        """The run is about to collect training step `step` (a task that drifts reads it)."""

    def problem_ids(self) -> list[str]:
        """The ids of the training rows (GRESO's warm start carries the history of these)."""
        return [self.problem(row).id for row in range(self.train_size)]

    def max_sequence_len(self, tokenizer, cfg) -> int:
        """Positions an engine slot needs: twice the longest prompt seen (or possible, for the
        list task) plus the response budget, with a little room."""
        longest = max(len(tokenizer(p.prompt).input_ids) for p in self.eval_problems(64))
        widest = self.widest_prompt(cfg)
        if widest is not None:  # the longest possible prompt (the list task)
            longest = max(longest, len(tokenizer(self.renderer.render(widest)).input_ids))
        return longest * 2 + cfg.rollout.max_response_len + 8

    def widest_prompt(self, cfg) -> str | None:
        """The problem text of the longest prompt the task can produce, when there is a bound
        (None: the 64 evaluation problems stand for the rest)."""
        return None
