"""How long, and how much, until a run ends: its recent pace carried forward, with a range.

With the last W steps' wall seconds x_1..x_W (each step's timeline cover: generation, training,
evaluation, checkpoints), mean m and standard deviation s, and R steps left:

    time left   = R × m
    its spread  = sqrt(R × s² + (R × s)² / W)     each step's own noise, and the pace's own error
    range       = time left ± 2 × spread, never below 0

The steps since the last knob change are the window when there are at least MIN_WINDOW of them:
a change that moved the pace (η, N′, a segment limit) is forecast from the new pace. The price
follows: time × every process's devices × their rate (trainer/observe/cost.py).
"""
from __future__ import annotations

import math
import statistics

WINDOW = 20        # recent steps the pace is taken from
MIN_WINDOW = 3     # fewer steps than this since a knob change: the window before it is used


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
    held = {}
    for d in devices.values():
        held[d["kind"]] = held.get(d["kind"], 0) + int(d["count"])
    per_s = sum(n / 3600 * rates[k] for k, n in held.items() if rates.get(k))
    priced = any(rates.get(k) for k in held)
    return {**f, "device_s": {k: n * f["seconds"] for k, n in held.items()},
            "price": f["seconds"] * per_s if priced else None,
            "price_low": f["low_s"] * per_s if priced else None,
            "price_high": f["high_s"] * per_s if priced else None}


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
