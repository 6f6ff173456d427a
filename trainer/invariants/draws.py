"""Data accounting: every prompt the data cursor hands out reaches an outcome, once.

The cursor hands out positions 0, 1, 2, ... (`PromptSource`; position p is prompt
epoch_order(p mod size) of epoch p // size), so every prompt of an epoch is drawn exactly once
exactly when every position below the cursor is drawn once and reaches an outcome. At each
step end `DrawAccount.step` takes the cursor and the positions that reached one this step:

    scored        a group of it was generated to its end and scored (trained or not)
    greso         GRESO skipped it on purpose (counted apart)
    dropped       a driver dropped its unfinished group on purpose (APRIL's surplus beyond a
                  lowered N'; counted apart)

and the positions still held (APRIL's buffer, the asynchronous queue and groups generating).
A position handed out at least one step ago that is neither settled nor held was lost:
`prompts_skipped` (a resume, a fork or a killed worker that forgot a group). A cursor that moves
back hands positions out again: `prompts_repeated`. The state (the cursor seen, the positions
still open) goes into checkpoints. Pure logic: tests/test_draw_account.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

RULES = ("prompts_skipped", "prompts_repeated")


@dataclass
class DrawStep:
    skipped: list[int] = field(default_factory=list)   # positions lost this step
    repeated: list[int] = field(default_factory=list)   # positions to be handed out again
    greso: int = 0
    dropped: int = 0

    def figures(self) -> dict[str, float]:
        return {"invariants/prompts_skipped": float(len(self.skipped)),
                "invariants/prompts_repeated": float(len(self.repeated)),
                "invariants/prompts_greso_skipped": float(self.greso),
                "invariants/prompts_dropped": float(self.dropped)}


class DrawAccount:
    def __init__(self, cursor: int = 0):
        self.next = cursor          # positions below it were handed out
        self.judged_below = cursor  # positions below it are judged: settled, held, or lost
        self.open: set[int] = set()

    def step(self, cursor: int, scored, greso, dropped, held) -> DrawStep:
        """The step's accounting; `held`: the positions the driver still holds."""
        out = DrawStep(greso=len(greso), dropped=len(dropped))
        settled = set(scored) | set(greso) | set(dropped)
        if cursor < self.judged_below:   # the cursor went back: those positions come again
            out.repeated = list(range(cursor, self.judged_below))
            self.open = {p for p in self.open if p < cursor}
            self.next = cursor
        # an asynchronous worker draws on while the step ends: a position it settled is handed out
        reach = max([cursor, self.next, *(p + 1 for p in settled)])
        self.open |= set(range(self.next, reach))
        self.next = reach
        self.open -= settled
        held = set(held)
        lost = sorted(p for p in self.open if p < self.judged_below and p not in held)
        self.open -= set(lost)
        out.skipped = lost
        self.judged_below = cursor
        return out

    def state_dict(self) -> dict:
        return {"next": self.next, "judged_below": self.judged_below, "open": sorted(self.open)}

    def load_state_dict(self, state: dict, cursor: int) -> None:
        """A checkpoint's account (`cursor`: the checkpoint's; one from before the accounting
        starts here, everything below it taken as settled)."""
        self.next = int(state.get("next", cursor))
        self.judged_below = int(state.get("judged_below", cursor))
        self.open = set(map(int, state.get("open", [])))
