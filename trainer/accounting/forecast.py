"""How long, and how much, until a run ends: its recent pace carried forward, with a range.

With the last W steps' wall seconds x_1..x_W (each step's timeline cover: generation, training,
evaluation, checkpoints), mean m and standard deviation s, and R steps left:

    time left   = R × m
    its spread  = sqrt(R × s² + (R × s)² / W)     each step's own noise, and the pace's own error
    range       = time left ± 2 × spread, never below 0

The steps since the last knob change are the window when there are at least MIN_WINDOW of them:
a change that moved the pace (η, N′, a segment limit) is forecast from the new pace. The price
follows: time × every process's devices × their rate (trainer/accounting/cost.py).

To a target accuracy (`steps_to_target`): a straight line through the last TREND_EVALS
evaluations (step t_i, accuracy a_i), least squares: slope b, its standard error se (n ≥ 3),
and the line's value â at the latest evaluation's step. Steps to go = (target − â) / b, the
range from the slopes b + 2·se (sooner) and b − 2·se (later; none when that slope is not above
0: the target may never be reached at this trend). A slope not above 0: no forecast, said so.
"""
from __future__ import annotations

import math
import statistics

from trainer.accounting import cost

WINDOW = 20        # recent steps the pace is taken from
MIN_WINDOW = 3     # fewer steps than this since a knob change: the window before it is used
TREND_EVALS = 5    # the latest evaluations the accuracy trend is drawn through


def window(step_seconds: list[float], since_change: int | None = None) -> list[float]:
    """The steps the pace is read from: those since the last knob change (`since_change` =
    how many of the last steps followed it) when there are enough, else the last WINDOW."""
    if since_change is not None and since_change >= MIN_WINDOW:
        return step_seconds[-min(since_change, WINDOW):]
    return step_seconds[-WINDOW:]


def time_left(recent: list[float], steps_left: int) -> dict | None:
    """Seconds to go for `steps_left` more steps at the pace of `recent` step times: the
    estimate and its range (low, high). None without a step to go on."""
    if not recent or steps_left < 0:
        return None
    m = statistics.fmean(recent)
    s = statistics.stdev(recent) if len(recent) > 1 else m   # one step: as unsure as it is long
    spread = math.sqrt(steps_left * s * s + (steps_left * s) ** 2 / len(recent))
    est = steps_left * m
    return {"steps_left": steps_left, "pace_s": m, "seconds": est,
            "low_s": max(est - 2 * spread, 0.0), "high_s": est + 2 * spread, "window": len(recent)}


def with_price(f: dict | None, devices: dict[str, dict], rates: dict[str, float]) -> dict | None:
    """The forecast's device-seconds per kind and, where rates are set, its price and range."""
    if f is None:
        return None
    return with_price_range(f, devices, rates)


def with_price_range(f: dict, devices: dict[str, dict], rates: dict[str, float]) -> dict:
    """`f`'s seconds (and its low/high ends, where known) as device-seconds and price; a
    forecast without seconds (reached, or a flat trend) is returned as it is."""
    if f.get("seconds") is None:
        return f
    held = {k: n for k, n in cost.kind_counts(devices).items() if n}
    per_s = cost.price(held, rates)   # n devices held for a second: their price per wall second

    def money(s):
        return None if per_s is None or s is None else s * per_s

    return {**f, "device_s": {k: n * f["seconds"] for k, n in held.items()},
            "price": money(f["seconds"]), "price_low": money(f.get("low_s")),
            "price_high": money(f.get("high_s"))}


def replay(step_seconds: list[float], at=(0.25, 0.5, 0.75)) -> list[dict]:
    """A finished run's forecast as it would have been: at each fraction of its steps, the
    time left forecast from the steps so far against the time the rest really took (error =
    forecast / actual − 1), and whether the actual fell in the range."""
    n, out = len(step_seconds), []
    for frac in at:
        done = max(1, min(n - 1, round(n * frac)))
        f = time_left(window(step_seconds[:done]), n - done)
        actual = sum(step_seconds[done:])
        out.append({"at": frac, "step": done, "forecast_s": f["seconds"], "actual_s": actual,
                    "error": f["seconds"] / actual - 1 if actual else None,
                    "in_range": f["low_s"] <= actual <= f["high_s"]})
    return out


def steps_to_target(evals: list[tuple[int, float]], target: float) -> dict | None:
    """Steps until the accuracy trend of `evals` ((step, accuracy), in order) reaches `target`
    (see the module docstring). None with fewer than 2 evaluations at distinct steps.
    {"reached": True} when the latest evaluation is at or above it; {"steps": None, ...} when
    the trend is flat or falling."""
    pts = evals[-TREND_EVALS:]
    if pts and pts[-1][1] >= target:
        return {"reached": True, "target": target, "accuracy": pts[-1][1], "at_step": pts[-1][0]}
    n = len(pts)
    if n < 2:
        return None
    mt, ma = statistics.fmean(t for t, _ in pts), statistics.fmean(a for _, a in pts)
    sxx = sum((t - mt) ** 2 for t, _ in pts)
    if sxx == 0:
        return None
    b = sum((t - mt) * (a - ma) for t, a in pts) / sxx
    last = pts[-1][0]
    fit = ma + b * (last - mt)
    se = (math.sqrt(sum((a - (ma + b * (t - mt))) ** 2 for t, a in pts) / (n - 2) / sxx)
          if n > 2 else None)
    # the trend in accuracy points (100 x the accuracy's share) per 100 steps
    out = {"reached": False, "target": target, "accuracy": pts[-1][1], "at_step": last,
           "points_per_100_steps": 100 * 100 * b, "evals": n, "steps": None, "steps_low": None, "steps_high": None}
    if b <= 0:
        return out
    gap = max(target - fit, 0.0)
    fast, slow = (b + 2 * se, b - 2 * se) if se is not None else (None, None)
    return {**out, "steps": _whole_steps(gap / b),
            "steps_low": _whole_steps(gap / fast) if fast else None,
            "steps_high": _whole_steps(gap / slow) if slow and slow > 0 else None}


def _whole_steps(x: float) -> int:
    # 10.000000001 steps from float error is 10; at least 1: the line may already pass the target
    # while the latest evaluation has not
    return max(1, math.ceil(x - 1e-9))


def to_target(trend: dict | None, recent: list[float]) -> dict | None:
    """The target's steps as time at the pace of `recent` step times (its range: the steps'
    range at the mean pace; an unbounded end stays None)."""
    if trend is None or trend["reached"] or trend["steps"] is None or not recent:
        return trend
    m = statistics.fmean(recent)
    return {**trend, "seconds": trend["steps"] * m,
            "low_s": None if trend["steps_low"] is None else trend["steps_low"] * m,
            "high_s": None if trend["steps_high"] is None else trend["steps_high"] * m}
