"""The built-in tool task: sum a list, by hand or with a calculator.

    prompt:      "[23,58,91]="
    by hand:     "23+58=81;81+91=172;>172"  then end-of-sequence
    calculator:  "<calc>23+58+91</calc>"  (the model's turn ends at the closing tag), the
                 environment appends "<result>172</result>", then the model writes ">172" and
                 end-of-sequence

Only the final turn is scored, by the sum task's verifier (`score_sum`: the number after the last
'>'), so a policy is free to choose. Lists are short (uniform length in [2, max_len]) but their
operands are large (up to `max_operand`, two digits by default): the calculator is always right
and the built-in model's carried scratchpad often is not, so RL has a reason to learn the tool.
The episode engine (trainer/episode/) runs the calculator; this module only hands out problems.
"""
from __future__ import annotations

import random

from trainer.tasks.prompts import PromptRenderer
from trainer.tasks.sum import SumTask


def sample_calc_list(rng: random.Random, max_len: int, max_operand: int) -> list[int]:
    """A list of uniform length in [2, max_len] (1 only when max_len is 1): unlike the sum task's
    heavy tail, every length is common, so long lists (where the tool pays off) are not rare."""
    length = rng.randint(min(2, max_len), max_len)
    return [rng.randint(1, max_operand) for _ in range(length)]


def calc_call(values: list[int]) -> str:
    """The model's calculator turn for `values` (what the warm-up teaches)."""
    return "<calc>" + "+".join(map(str, values)) + "</calc>"


def calc_result(total: int) -> str:
    """The text the environment appends after a calculator call: never the model's tokens."""
    return f"<result>{total}</result>"


class CalcTask(SumTask):
    """The list-sum task with lists of `max_len` at most, for episodes with a calculator."""
    name = "calc"

    def __init__(self, max_len: int = 6, max_operand: int = 99, train_size: int = 4096,
                 seed: int = 0, renderer: PromptRenderer | None = None):
        super().__init__(max_len=max_len, max_operand=max_operand, train_size=train_size,
                         seed=seed, renderer=renderer)

    def values(self, stream: int, index: int) -> list[int]:
        rng = random.Random(f"calc:{self.seed}:{stream}:{index}")
        return sample_calc_list(rng, self.max_len, self.max_operand)
