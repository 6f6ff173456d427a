"""The recent metric rows of a run, read as series: the figures the rules base their advice on."""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Sequence


def number(v: Any) -> float | None:
    """A metric value as a finite float; None for a missing, non-numeric or non-finite one
    (metrics.jsonl writes NaN/inf as strings)."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def median_halves(values: Sequence[float]) -> tuple[float, float] | None:
    """Median of the first and of the second half of `values` (None under 4 values). Medians:
    one spiky step (small batches make KL jump 10x for a step) moves neither."""
    if len(values) < 4:
        return None
    h = len(values) // 2
    return statistics.median(values[:h]), statistics.median(values[h:])


def standard_error_of_difference(b: Sequence[float], a: Sequence[float]) -> float:
    """Welch's standard error of mean(a) - mean(b), from each side's own step-to-step spread: a
    difference within two of it is the batches' noise. 0 with fewer than two values on a side
    (no spread to estimate from: the caller's threshold alone decides)."""
    if len(b) < 2 or len(a) < 2:
        return 0.0
    return math.sqrt(statistics.variance(b) / len(b) + statistics.variance(a) / len(a))


def kl_rising(values: Sequence[float], factor: float, floor: float) -> tuple[float, float] | None:
    """(earlier median, recent median) when the KL's recent half has a median at least `factor`
    times the earlier half's and at least `floor`: a runaway, not the slow rise of a learning
    policy (whose KL grows too, but far from doubling within a window once it is above the
    floor). None otherwise. The dashboard's kl_rising alert and the pilot's KL rule use it."""
    halves = median_halves(values)
    if halves is None:
        return None
    before, recent = halves
    return halves if recent >= floor and recent >= factor * before else None


class Window:
    """Metric rows ({"step": N, name: value, ...}, as in metrics.jsonl), oldest first."""

    def __init__(self, rows: Sequence[dict]):
        self.rows = sorted((r for r in rows if number(r.get("step")) is not None),
                           key=lambda r: r["step"])

    def __len__(self) -> int:
        return len(self.rows)

    def series(self, name: str) -> list[tuple[int, float]]:
        """(step, value) for the rows that have a finite value of `name`."""
        out = []
        for r in self.rows:
            v = number(r.get(name))
            if v is not None:
                out.append((int(r["step"]), v))
        return out

    def has(self, name: str) -> bool:
        return bool(self.series(name))

    def steps(self, name: str) -> tuple[int, int] | None:
        s = self.series(name)
        return (s[0][0], s[-1][0]) if s else None

    def mean(self, name: str) -> float | None:
        s = self.series(name)
        return statistics.fmean(v for _, v in s) if s else None   # fsum: 20 x 0.01 is 0.01

    def last(self, name: str) -> float | None:
        s = self.series(name)
        return s[-1][1] if s else None

    def share(self, name: str, test: Callable[[float], bool]) -> float | None:
        """Share of the steps with a value of `name` for which `test` holds."""
        s = self.series(name)
        return sum(1 for _, v in s if test(v)) / len(s) if s else None

    def halves(self, name: str) -> tuple[float, float] | None:
        """Mean of the first and of the second half of the series (None under 4 values)."""
        s = [v for _, v in self.series(name)]
        if len(s) < 4:
            return None
        h = len(s) // 2
        return statistics.fmean(s[:h]), statistics.fmean(s[h:])

    def halves_noise(self, name: str) -> float:
        """Twice the standard error of the halves' difference (see halves): the change between
        them that the steps' own spread explains."""
        s = [v for _, v in self.series(name)]
        h = len(s) // 2
        return 2.0 * standard_error_of_difference(s[:h], s[h:])
