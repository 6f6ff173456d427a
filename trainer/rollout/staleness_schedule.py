"""async.staleness_schedule: eta by step, set at launch (AReaL's curriculum: a small eta for the
basics, then a larger one for speed).

    "0:0, 50:2, 200:4"   ->   points (0, 0), (50, 2), (200, 4)

A point STEP:ETA is applied at the step boundary after step STEP (where a knob change recorded at
step STEP applies; 0: before the first step), so steps STEP + 1 on train with that eta. Before
the first point, async.max_staleness holds. At the boundary after step s the schedule applies

    the last point p with  through < p.step <= s      (through: the last boundary it looked at)

so each point is applied once: a boundary crossed again (a stop or pause while a step waited)
or a resumed run (`through` from the checkpoint) never applies a point twice, and a schedule
given mid-run (a knob), at a resume or a fork applies only its points after that boundary.
Between two points eta is anyone's knob: a person, the autopilot or async.auto_staleness may
move it, and the next point sets it again. The runner applies the points
(trainer/run/runner.py); this module only reads them.
"""
from __future__ import annotations

from typing import Sequence

from trainer.config.values import Point, parse_schedule

__all__ = ["Point", "ahead", "due", "parse", "text"]


parse = parse_schedule   # the parameter's type (trainer/config/values.py)


def due(points: Sequence[Point], through: int, step: int) -> Point | None:
    """The point to apply at the boundary after `step`, when the boundaries up to `through`
    were looked at already: the last with through < p.step <= step, or None."""
    fresh = [p for p in points if through < p.step <= step]
    return fresh[-1] if fresh else None


def ahead(points: Sequence[Point], step: int) -> list[Point]:
    """The points still to come after the boundary at `step` (the chart draws them)."""
    return [p for p in points if p.step > step]


def text(points: Sequence[Point]) -> str:
    return ", ".join(f"{p.step}:{p.eta}" for p in points)
