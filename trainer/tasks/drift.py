"""A built-in task whose difficulty shifts mid-run: list sums that change under the same ids.

Before training step `drift_step` every row is a long list (LONG_LEN numbers): the built-in
model gets nearly none right, so its groups are all-wrong and GRESO learns to skip them as
"hard". From `drift_step` on, every even row is a short list instead (SHORT_LEN numbers, which
the model gets right about half the time: groups with signal), under the same problem id; odd
rows stay long. An old all-wrong record of an even row now misleads the filter: skipping it
wastes a group that would have had signal (a wrong skip). GRESO's forgetting
(`greso.forget_half_life`) is meant for exactly this; `bench greso --drift` measures it.

Why the shift goes from hard to easier: the built-in model is weak, so "all wrong" is the only
zero-variance outcome it produces reliably, and a stale record must be a reliable one to be
misleading. `drift_step` 0 never shifts (every row stays long).

The run tells the task which step it is collecting (`begin_step`); problems already drawn keep
what they were drawn as (a checkpoint holds them whole), so a resumed run draws as a straight
one does. Held-out problems follow the same phase. Scored by the list task's verifier.
"""
from __future__ import annotations

import random

from trainer.tasks.base import Problem, Task
from trainer.tasks.prompts import PromptRenderer
from trainer.tasks.sum import format_prompt

_EVAL_STREAM = 1_000_003
LONG_LEN = (10, 14)     # before the shift (and odd rows after it): all-wrong groups
SHORT_LEN = (2, 2)      # even rows from the shift on: mixed groups (the model gets ~20% right)


class DriftTask(Task):
    name = "drift"

    def __init__(self, drift_step: int = 0, max_operand: int = 9, train_size: int = 64,
                 seed: int = 0, renderer: PromptRenderer | None = None):
        self.drift_step, self.max_operand = drift_step, max_operand
        self.train_size, self.seed = train_size, seed
        self.step = 0   # the training step being collected
        if renderer is not None:
            self.renderer = renderer

    def begin_step(self, step: int) -> None:
        self.step = step

    @property
    def shifted(self) -> bool:
        return bool(self.drift_step) and self.step >= self.drift_step

    def values(self, stream: int, index: int, shifted: bool) -> list[int]:
        """The list of problem `index` of `stream`, before or after the shift."""
        short = shifted and index % 2 == 0
        rng = random.Random(f"drift:{self.seed}:{stream}:{index}:{'short' if short else 'long'}")
        length = rng.randint(*(SHORT_LEN if short else LONG_LEN))
        return [rng.randint(1, self.max_operand) for _ in range(length)]

    def _problem(self, stream: int, index: int) -> Problem:
        values = self.values(stream, index, self.shifted)
        return Problem(id=f"{self.name}:{stream}:{index}",
                       prompt=self.renderer.render(format_prompt(values)),
                       answer=sum(values), kind="sum")

    def problem(self, row: int) -> Problem:
        return self._problem(0, row)

    def eval_problems(self, n: int) -> list[Problem]:
        return [self._problem(_EVAL_STREAM, i) for i in range(n)]

    def widest_prompt(self, cfg) -> str:
        return format_prompt([self.max_operand] * LONG_LEN[1])
