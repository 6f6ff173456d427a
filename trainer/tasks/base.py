"""The task interface.

A task hands out problems by index (so a data cursor is one integer and a run resumes exactly)
and scores a completion with a pure, picklable function that the reward pool runs in another
process: `score(kind, answer, completion) -> float` in `trainer.rewards`.
"""
from __future__ import annotations

from dataclasses import dataclass
import functools
import random
from typing import Any


@dataclass(frozen=True)
class Problem:
    id: str            # stable across runs: used for GRESO traces and reports
    prompt: str        # the text given to the model
    answer: Any        # what the verifier needs (an int, a LaTeX string, tests...)
    kind: str          # which verifier scores it: "sum", "math" or "code"


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

    def problem(self, row: int) -> Problem:
        """Row `row` of the training set."""
        raise NotImplementedError

    def train_problem(self, index: int) -> Problem:
        """The index-th training draw (deterministic for a given seed)."""
        return self.problem(epoch_order(index, self.train_size, self.seed))

    def eval_problems(self, n: int) -> list[Problem]:
        """n held-out problems, the same every call."""
        raise NotImplementedError


def build_task(cfg) -> Task:
    """Build the task named by a Config's data section."""
    if cfg.data.task == "sum":
        from trainer.tasks.sum import SumTask
        return SumTask(max_len=cfg.data.max_list_len, alpha=cfg.data.length_alpha,
                       max_operand=cfg.data.max_operand, train_size=cfg.data.train_size,
                       seed=cfg.run.seed)
    from trainer.tasks.jsonl import JsonlTask
    return JsonlTask(cfg.data.path, kind=cfg.data.task, template=cfg.data.prompt_template,
                     eval_path=cfg.data.eval_path, seed=cfg.run.seed)
