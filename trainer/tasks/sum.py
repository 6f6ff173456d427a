"""The built-in verifiable task: sum a list, step by step.

    prompt:   "[3,5,1,7]="
    response: "3+5=8;8+1=9;9+7=16;>16"  then end-of-sequence

The list length is Pareto-distributed (shape `alpha`, capped at `max_len`), so response lengths
are heavy-tailed as in reasoning RL: most answers are a few tokens, ~10% of prompts produce
about half of all generated tokens. Short lists become all-correct groups, long ones all-wrong.
"""
from __future__ import annotations

import random
import re

from trainer.tasks.base import Problem, Task
from trainer.tasks.prompts import PromptRenderer

_EVAL_STREAM = 1_000_003  # held-out problems come from a separate random stream


def sample_list(rng: random.Random, max_len: int, alpha: float, max_operand: int) -> list[int]:
    length = min(max_len, int(rng.paretovariate(alpha)))
    return [rng.randint(1, max_operand) for _ in range(max(1, length))]


def format_prompt(values: list[int]) -> str:
    return "[" + ",".join(map(str, values)) + "]="


def reference_solution(values: list[int]) -> str:
    """The scratchpad a perfect policy writes (used for the supervised warm-up)."""
    steps, total = [], values[0]
    for v in values[1:]:
        steps.append(f"{total}+{v}={total + v};")
        total += v
    return "".join(steps) + f">{total}"


_ANSWER = re.compile(r">(-?\d+)\s*$")


def score_sum(answer: int, completion: str) -> float:
    """1.0 when the text after the final '>' is the right total, else 0.0.

    Only the final answer counts (the scratchpad is not checked), as with real math tasks."""
    m = _ANSWER.search(completion.strip())
    return 1.0 if m is not None and int(m.group(1)) == int(answer) else 0.0


class SumTask(Task):
    name = "sum"

    def __init__(self, max_len: int = 24, alpha: float = 1.0, max_operand: int = 9,
                 train_size: int = 4096, seed: int = 0, renderer: PromptRenderer | None = None):
        self.max_len, self.alpha, self.max_operand = max_len, alpha, max_operand
        self.train_size, self.seed = train_size, seed
        if renderer is not None:
            self.renderer = renderer

    def values(self, stream: int, index: int) -> list[int]:
        """The list of problem `index` of `stream` (0: training rows; the eval stream)."""
        rng = random.Random(f"{self.seed}:{stream}:{index}")
        return sample_list(rng, self.max_len, self.alpha, self.max_operand)

    def _problem(self, stream: int, index: int) -> Problem:
        values = self.values(stream, index)
        prompt = self.renderer.render(format_prompt(values))
        return Problem(id=f"{self.name}:{stream}:{index}", prompt=prompt, answer=sum(values),
                       kind="sum")

    def problem(self, row: int) -> Problem:
        return self._problem(0, row)

    def eval_problems(self, n: int) -> list[Problem]:
        return [self._problem(_EVAL_STREAM, i) for i in range(n)]

    def widest_prompt(self, cfg) -> str:
        return format_prompt([self.max_operand] * self.max_len)
