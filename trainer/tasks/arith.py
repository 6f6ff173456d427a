"""A built-in math task for real instruct models: arithmetic and short word problems.

    "What is 37 + 18?"                                                      answer: "55"
    "Mia has 12 marbles. She buys 7 more. How many marbles does Mia have now?"  answer: "19"

Problems are generated from the seed (a separate stream for the held-out ones), so nothing is
downloaded and a run resumes exactly. Operands are at most `max_operand` (products use one
factor of at most 12). Their kind is "math": the reward is math-verify's comparison of the
completion's final answer (its last \\boxed{...}, else its last number) with the answer, so the
prompt template should ask for a boxed answer (the `smollm2-math` preset does).
"""
from __future__ import annotations

import random

from trainer.tasks.base import Problem, Task
from trainer.tasks.prompts import PromptRenderer

_EVAL_STREAM = 1_000_003
_NAMES = [("Mia", "She"), ("Tom", "He"), ("Ana", "She"), ("Leo", "He"), ("Sara", "She"),
          ("Ben", "He"), ("Lily", "She"), ("Sam", "He")]
_ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells"]


def _bare(rng: random.Random, hi: int) -> tuple[str, int]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, min(hi, 12)), rng.randint(2, hi)
        return f"What is {a} * {b}?", a * b
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    if op == "-":
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", a - b
    return f"What is {a} + {b}?", a + b


def _word(rng: random.Random, hi: int) -> tuple[str, int]:
    (name, pron), item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(4)
    a, b = rng.randint(2, hi), rng.randint(2, hi)
    if kind == 0:
        return (f"{name} has {a} {item}. {pron} buys {b} more. "
                f"How many {item} does {name} have now?", a + b)
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return (f"{name} had {a} {item} and gave {b} of them to a friend. "
                f"How many {item} does {name} have left?", a - b)
    if kind == 2:
        a = rng.randint(2, min(hi, 12))
        return (f"There are {a} boxes with {b} {item} in each box. "
                f"How many {item} are there in total?", a * b)
    c = rng.randint(2, hi)
    return (f"{name} has {a} {item}, gets {b} more, then gives away {min(c, a + b)}. "
            f"How many {item} does {name} have now?", a + b - min(c, a + b))


def make_problem(rng: random.Random, max_operand: int) -> tuple[str, int]:
    """(problem text, integer answer): half bare arithmetic, half word problems."""
    hi = max(2, max_operand)
    return _bare(rng, hi) if rng.random() < 0.5 else _word(rng, hi)


class ArithTask(Task):
    name = "arith"

    def __init__(self, max_operand: int = 50, train_size: int = 4096, seed: int = 0,
                 renderer: PromptRenderer | None = None):
        self.max_operand, self.train_size, self.seed = max_operand, train_size, seed
        if renderer is not None:
            self.renderer = renderer

    def _problem(self, stream: int, index: int) -> Problem:
        text, answer = make_problem(random.Random(f"arith:{self.seed}:{stream}:{index}"),
                                    self.max_operand)
        return Problem(id=f"arith:{stream}:{index}", prompt=self.renderer.render(text),
                       answer=str(answer), kind="math")

    def problem(self, row: int) -> Problem:
        return self._problem(0, row)

    def eval_problems(self, n: int) -> list[Problem]:
        return [self._problem(_EVAL_STREAM, i) for i in range(n)]
