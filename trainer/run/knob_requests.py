"""The knob changes a run asks of itself, queued at the next step boundary like a person's, and
what its autopilot hears back.

Three askers besides a person: the rollout driver's own retune (e.g. async.auto_staleness moves
eta; `requested_by = "auto"`), async.staleness_schedule's point due at a boundary (`"schedule"`),
and the pilot after each step (its advice said as events, its autopilot's move queued as
`"autopilot"`). Each change's fate, applied or refused (trainer/run/boundary.py `on_knobs`), is
told to the autopilot, which keeps its hands off a knob a person set.
"""
from __future__ import annotations

from trainer.pilot import episodes as single_turn
from trainer.rollout import staleness_schedule
from trainer.run.controls import AUTO, AUTOPILOT, SCHEDULE


def retune(rollout, boundary, cfg, train_metrics: dict) -> None:
    """The driver's own knob change, proposed from the step's train metrics, queued."""
    proposal = rollout.retune(cfg, train_metrics)
    if proposal:
        changes = proposal.pop("changes")
        boundary.request({k: ch["new"] for k, ch in changes.items()},
                         reason={"rule": proposal.pop("kind"), **proposal})


def schedule_point(boundary, cfg, through: int, step: int) -> int:
    """async.staleness_schedule's point due at the boundary after `step`, if any, queued
    (trainer/rollout/staleness_schedule.py: each point once, also across a resume: `through`
    is the last boundary looked at). Returns the new `through`: `step`."""
    text = cfg.async_.staleness_schedule
    point = staleness_schedule.due(staleness_schedule.parse(text), through,
                                   step) if text.strip() else None
    if point is not None:
        boundary.request({"async.max_staleness": point.eta}, requested_by=SCHEDULE,
                         reason={"rule": "staleness_schedule", "point": f"{point.step}:{point.eta}",
                                 "schedule": text})
    return step


def pilot_after_step(pilot, sink, boundary, step: int, m: dict, cfg) -> None:
    """The pilot reads the step's record `m`: new advice announced as events (the single-turn
    fallback an alert too), the autopilot's move queued."""
    advice, move = pilot.after_step(step, m, cfg)
    for a in advice:
        sink.event(step, "advice", a.as_json())
        if a.reason == single_turn.REASON:   # no silent fallback: an event too (an alert)
            sink.event(step, single_turn.EVENT, {"message": a.message})
    if move is not None:
        boundary.request(move.knobs, reason=move.reason, requested_by=AUTOPILOT)


def tell_autopilot(pilot, cmd, applied: bool) -> None:
    """A knob command's fate told to `pilot`'s autopilot (the step boundary's `on_knobs`): a
    person's change applied is theirs from now on, a scheduled one is not a person's, the
    driver's own is nobody's, and the autopilot's own move applied or refused."""
    if cmd.requested_by == AUTO:   # async.auto_staleness: neither a person nor the autopilot
        return
    if cmd.requested_by == SCHEDULE:   # a point set at launch: not a person's knob from now on
        if applied:
            pilot.autopilot.knob_scheduled(list(cmd.knobs))
        return
    if applied:
        pilot.autopilot.knob_applied(list(cmd.knobs), cmd.requested_by == AUTOPILOT)
    elif cmd.requested_by == AUTOPILOT:
        pilot.autopilot.knob_refused(list(cmd.knobs))
