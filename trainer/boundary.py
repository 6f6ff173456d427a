"""The step boundary: where knob changes, pause, resume and stop take effect.

Commands arrive from a `ControlSource` (trainer/controls.py) at any time but are applied only
here, between two steps, so a change never lands in the middle of one. Under data parallelism
rank 0 reads the commands and broadcasts them, so every rank applies the same ones at the same
step. A knob change is validated as a whole (every key or none) and recorded as an event, as is
every pause, resume and stop.
"""
from __future__ import annotations

import time

from trainer import config as config_mod
from trainer import distributed
from trainer.controls import PAUSE, RESUME, SET_KNOBS, STOP, Command, ControlSource
from trainer.metrics import MetricsSink
from trainer.rollout.base import Driver

PAUSED_POLL_S = 0.2   # how often a paused run looks for resume/stop


class StepBoundary:
    def __init__(self, controls: ControlSource, sink: MetricsSink, dist, driver: Driver):
        self.controls, self.sink, self.dist, self.driver = controls, sink, dist, driver

    def cross(self, step: int, cfg: config_mod.Config) -> config_mod.Config | None:
        """Apply the pending commands at `step`; hold here while paused. Returns the config to
        go on with (knob changes applied), or None when the run must stop."""
        paused = False
        while True:
            for cmd in self.dist.broadcast_object(self.controls.poll()):  # rank 0's commands
                if cmd.kind == SET_KNOBS:
                    cfg = self.apply_knobs(step, cfg, cmd)
                elif cmd.kind == PAUSE and not paused:
                    paused = True
                    self.driver.pause()
                    self._record(step, cmd, "paused")
                elif cmd.kind == RESUME and paused:
                    paused = False
                    self.driver.resume()
                    self._record(step, cmd, "resumed")
                elif cmd.kind == STOP:
                    self.driver.resume()  # a paused generation worker must reach the checkpoint
                    self._record(step, cmd, "stop_requested")
                    return None
                else:
                    self.controls.acknowledge(cmd, step, True, "no effect in this state")
            if not paused:
                return cfg
            self.sink.flush()
            time.sleep(PAUSED_POLL_S)

    def apply_knobs(self, step: int, cfg: config_mod.Config, cmd: Command) -> config_mod.Config:
        """The config with `cmd`'s knob values, or `cfg` unchanged when any of them is refused."""
        try:
            new_cfg, changes = config_mod.apply_knob_change(cfg, cmd.knobs)
            distributed.check_config(new_cfg, self.dist.size)
        except config_mod.ConfigError as e:
            self.sink.event(step, "knob_rejected", {"change_id": cmd.id, "errors": e.errors,
                                                    "requested_by": cmd.requested_by})
            self.controls.acknowledge(cmd, step, False, "; ".join(e.errors.values()))
            return cfg
        self.driver.set_config(new_cfg)
        self.sink.event(step, "knob_applied", {
            "change_id": cmd.id, "changes": changes, "requested_by": cmd.requested_by,
            "requested_at": cmd.requested_at, "applied_at": time.time()})
        self.controls.acknowledge(cmd, step, True)
        return new_cfg

    def _record(self, step: int, cmd: Command, kind: str) -> None:
        self.sink.event(step, kind, {"requested_by": cmd.requested_by})
        self.controls.acknowledge(cmd, step, True)
