"""What the engine benches share to measure: waiting for the device, the spread of repeated
runs, and the arguments with some fields replaced (a warm-up's, one batch size's)."""
from __future__ import annotations

import statistics

import torch


def sync(device):
    """Wait for the device's queued work (CUDA), so that a timer reads what ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(xs: list[float], nd: int = 3) -> dict:
    """Median, min, max and every run of a measured quantity."""
    return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd),
            "max": round(max(xs), nd), "runs": [round(x, nd) for x in xs]}


class Replaced:
    """`args` with some fields replaced (a warm-up's, one batch size's)."""

    def __init__(self, base, **over):
        self.__dict__.update(vars(base))
        self.__dict__.update(over)
