"""The step boundary: where knob changes, pause, resume and stop take effect.

Commands arrive from a `ControlSource` (trainer/run/controls.py) at any time but are applied only
here, between two steps, so a change never lands in the middle of one. Every knob change goes
this one way, whoever asks: a person (dashboard, CLI) or the trainer itself (`request`, e.g.
`async.auto_staleness` moving eta, `requested_by="auto"`; the autopilot, `requested_by="autopilot"`).
At a boundary the trainer's own changes apply first, then a scheduled one (async.staleness_schedule,
`requested_by="schedule"`: it wins over the trainer's own at its step), then people's, so a person's
change to the same knob wins.
A change is validated as a whole
(every key or none, the config's cross-field rules) and recorded as
a `knob_applied` or `knob_rejected` event with who asked, as is every pause, resume and stop.

A step that waits for groups (asynchronous rollout) asks `interrupted()`: it reads the commands
without applying them and says whether a stop or pause waits, so the step can give its groups
back and come here at once instead of waiting for groups that may never come. With several
training processes only rank 0 (the controller) has a boundary; the config it goes on with
reaches the other ranks with the step's update (trainer/run/training_ranks.py).
"""
from __future__ import annotations

import time
from typing import Callable

from trainer import config as config_mod
from trainer.observe import clock
from trainer.observe.metrics import MetricsSink
from trainer.rollout.base import Driver
from trainer.run.controls import AUTO, AUTOMATIC, PAUSE, RESUME, SCHEDULE, SET_KNOBS, STOP, Command, ControlSource

PAUSED_POLL_S = 0.2      # how often a paused run looks for resume/stop
INTERRUPT_POLL_S = 0.25  # how often a waiting step reads the controls


class StepBoundary:
    def __init__(self, controls: ControlSource, sink: MetricsSink, driver: Driver):
        self.controls, self.sink, self.driver = controls, sink, driver
        # told of every knob change applied (True) or refused (False): the autopilot listens
        self.on_knobs: Callable[[Command, bool], None] = lambda cmd, applied: None
        self.pending: list[Command] = []   # read (or requested by the trainer), not yet applied
        self._polled_at = 0.0
        self.pauses: list[tuple[float, float]] = []   # (start, end) of each hold here, clock.now()

    def request(self, knobs: dict, reason: dict, requested_by: str = AUTO) -> Command:
        """Queue the trainer's own knob change for the next boundary (`reason`: its rule and
        the figures it saw, kept in the event)."""
        cmd = Command(SET_KNOBS, knobs=dict(knobs), requested_by=requested_by, reason=dict(reason))
        self.pending.append(cmd)
        return cmd

    def request_stop(self, reason: dict, requested_by: str) -> Command:
        """Queue the trainer's own stop for the next boundary (`reason`: why, kept in the
        stop_requested event; e.g. run.stop_on_violation)."""
        cmd = Command(STOP, requested_by=requested_by, reason=dict(reason))
        self.pending.append(cmd)
        return cmd

    def interrupted(self) -> bool:
        """Is a stop or pause waiting? Reads the controls (at most every INTERRUPT_POLL_S) and
        keeps what it read for `cross`. Cheap enough to call in a wait loop."""
        now = time.monotonic()
        if now - self._polled_at >= INTERRUPT_POLL_S:
            self._polled_at = now
            self.pending += self.controls.poll()
        return any(cmd.kind in (STOP, PAUSE) for cmd in self.pending)

    def cross(self, step: int, cfg: config_mod.Config) -> config_mod.Config | None:
        """Apply the pending commands at `step`; hold here while paused. Returns the config to
        go on with (knob changes applied), or None when the run must stop."""
        paused = False
        while True:
            commands, self.pending = self.pending + self.controls.poll(), []
            commands.sort(key=_order)   # stable: automatic, then scheduled, then people's
            for cmd in commands:
                if cmd.kind == SET_KNOBS:
                    cfg = self.apply_knobs(step, cfg, cmd)
                elif cmd.kind == PAUSE and not paused:
                    paused, paused_at = True, clock.now()
                    self.driver.pause()
                    self._record(step, cmd, "paused")
                elif cmd.kind == RESUME and paused:
                    paused = False
                    self.pauses.append((paused_at, clock.now()))
                    self.driver.resume()
                    self._record(step, cmd, "resumed")
                elif cmd.kind == STOP:
                    if paused:
                        self.pauses.append((paused_at, clock.now()))
                    self.driver.resume()  # a paused generation worker must reach the checkpoint
                    self._record(step, cmd, "stop_requested")
                    return None
            if not paused:
                return cfg
            self.sink.flush()
            time.sleep(PAUSED_POLL_S)

    def apply_knobs(self, step: int, cfg: config_mod.Config, cmd: Command) -> config_mod.Config:
        """The config with `cmd`'s knob values, or `cfg` unchanged when any of them is refused."""
        who = {"change_id": cmd.id, "requested_by": cmd.requested_by,
               **({"reason": cmd.reason} if cmd.reason else {})}
        try:
            new_cfg, changes = config_mod.apply_knob_change(cfg, cmd.knobs)
        except config_mod.ConfigError as e:
            self.sink.event(step, "knob_rejected", {**who, "errors": e.errors})
            self.on_knobs(cmd, False)
            return cfg
        self.driver.set_config(new_cfg)
        self.sink.event(step, "knob_applied", {
            **who, "changes": changes, "requested_at": cmd.requested_at,
            "applied_at": time.time()})
        self.on_knobs(cmd, True)
        return new_cfg

    def _record(self, step: int, cmd: Command, kind: str) -> None:
        self.sink.event(step, kind, {"requested_by": cmd.requested_by,
                                     **({"reason": cmd.reason} if cmd.reason else {})})


def _order(cmd: Command) -> int:
    """Who applies first at a boundary (the last change of a knob stands)."""
    if cmd.requested_by == SCHEDULE:
        return 1
    return 0 if cmd.requested_by in AUTOMATIC else 2
