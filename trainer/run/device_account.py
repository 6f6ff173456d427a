"""The run's device account: the device-seconds it holds, by kind, and the step row's cost figures.

    seconds(kind) += wall × count(kind)       wall: the time the new spans cover past `reach`
    cost/gpu_hours = seconds(gpu) / 3600      cost/cpu_core_hours = seconds(cpu) / 3600
    cost/price     = Σ seconds(kind) × rate(kind) / 3600   (only when the run's [cost] sets a rate)

The wall counted is the union of the steps' timelines (asynchronous steps overlap; trainer/
accounting/cost.py `new_cover`), so no second counts twice. What each process holds (`layout`)
is read once per start of the run: the layout is fixed. A checkpoint carries `seconds`, so a
resumed run counts on from its checkpoint.
"""
from __future__ import annotations

from typing import Callable

import torch

from trainer.accounting import cost
from trainer.engine import generation_device


class DeviceAccount:
    """`layout()`: what each process holds (`process_layout`), asked the first time it is needed."""

    def __init__(self, layout: Callable[[], dict]):
        self.seconds: dict[str, float] = {}   # device-seconds held so far, by kind (cost/*)
        self._reach = float("-inf")             # the latest time they count to
        self._layout = layout
        self._held: dict | None = None

    def held(self) -> dict:
        """What each process holds in this start of the run (read once: the layout is fixed)."""
        if self._held is None:
            self._held = self._layout()
        return self._held

    def count(self, spans: list) -> None:
        """Add the time `spans` (a step's recorded timeline) cover past what was counted."""
        wall, self._reach = cost.new_cover(spans, self._reach)
        for kind, n in cost.kind_counts(self.held()).items():
            self.seconds[kind] = self.seconds.get(kind, 0.0) + wall * n

    def seconds_now(self, pending: list) -> dict[str, float]:
        """Device-seconds held so far by kind: the timelines counted and the spans not yet
        recorded (`pending`, the timeline's)."""
        wall, _ = cost.new_cover(pending, self._reach)
        return {k: self.seconds.get(k, 0.0) + wall * n for k, n in cost.kind_counts(self.held()).items()}

    def figures(self, pending: list, rates_cfg) -> dict[str, float]:
        """The step row's device-hours so far by kind (its evaluation and checkpoint count in the
        next step's row) and their price at the run's own rates (`rates_cfg`: its [cost])."""
        held = self.seconds_now(pending)
        m = {"cost/gpu_hours": held["gpu"] / 3600, "cost/cpu_core_hours": held["cpu"] / 3600}
        money = cost.price(held, cost.run_rates(rates_cfg.gpu_hour, rates_cfg.cpu_core_hour))
        if money is not None:
            m["cost/price"] = money
        return m


def process_layout(engine, device: torch.device, train_procs: int, worker_threads: int) -> dict:
    """What each process holds, for the cost account (trainer/accounting/cost.py): the training
    processes, the engine's generation processes or servers, the asynchronous worker's threads."""
    lanes = getattr(engine, "lane_pids", dict)()
    # generation processes on CUDA share the trainer's GPU when the machine has too few
    own_gpu = device.type != "cuda" or generation_device(device, 0, max(len(lanes), 1)) != device
    return cost.layout_devices(device.type, train_procs, torch.get_num_threads(), lanes,
                               worker_threads, len(getattr(engine, "servers", ())),
                               engine_own_gpu=own_gpu)
