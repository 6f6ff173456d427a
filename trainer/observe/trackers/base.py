"""What every tracker adapter does (trainer/observe/trackers/<name>.py): the mirror (mirror.py) calls
these on its own thread, one at a time, and disables an adapter at its first exception."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainer import config as config_mod


class Tracker:
    name = "tracker"

    def __init__(self, cfg: config_mod.Config, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)

    def start(self) -> dict[str, Any]:
        """Open the tracker (import its package, log in, create the run). Returns what the
        `tracker_started` event says of it: {"url": ... or None, "dir": ... or None}."""
        raise NotImplementedError

    def scalars(self, step: int, values: dict[str, float]) -> None: ...
    def histogram(self, step: int, name: str, hist: dict[str, Any]) -> None: ...
    def event(self, step: int, kind: str, data: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a step (booleans as 0/1); anything else is not a scalar."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


def finite(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if math.isfinite(v)}


def knob_changes(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """{key: new value} of a knob change event (a person's or an automatic one), else {}."""
    if kind != "knob_applied":   # automatic changes (auto_staleness) arrive as knob_applied too
        return {}
    changes = data.get("changes") or {}
    return {k: ch.get("new") for k, ch in changes.items() if isinstance(ch, dict)}


def flat_config(cfg: config_mod.Config) -> dict[str, Any]:
    """{"optim.lr": 1e-05, ...}: the config as dotted keys."""
    return {f"{section}.{k}": v for section, values in cfg.to_dict().items() for k, v in values.items()}
