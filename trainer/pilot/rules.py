"""Every rule over the latest window of a run's metrics."""
from __future__ import annotations

from typing import Sequence

from trainer.pilot import april, episodes, greso, health, mismatch, staleness
from trainer.pilot.advice import Advice
from trainer.pilot.thresholds import DEFAULT, Thresholds
from trainer.pilot.window import Window

RULES = (*staleness.RULES, *april.RULES, *greso.RULES, *health.RULES, *mismatch.RULES,
         *episodes.RULES)


def advise(rows: Sequence[dict], cfg, *, window: int | None = None,
           thresholds: Thresholds = DEFAULT) -> list[Advice]:
    """The advice for the last `window` rows (default thresholds.window) of `rows` (metric rows
    as in metrics.jsonl), in rule order; at most one piece of advice per knob (the first)."""
    n = thresholds.window if window is None else window
    if n < 1:
        raise ValueError(f"window must be at least 1 step, got {n}")
    w = Window(rows)
    w = Window(w.rows[-n:])
    out: list[Advice] = []
    for rule in RULES:
        a = rule(w, cfg, thresholds)
        if a is not None and (a.knob is None or a.knob not in {x.knob for x in out}):
            out.append(a)
    return out
