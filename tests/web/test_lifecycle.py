"""The run lifecycle's rules (webapp/dashboard/lifecycle.py), table-driven, and each place that
moves a run's status following them: a person's controls (actions.control), the trainer's events
written by the sink, the worker's end, the sweep, and the allowed actions the pages receive."""
# the named users are fixtures imported from named_users.py; tests take them as parameters
# ruff: noqa: F811
from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.utils import timezone
from named_users import alice  # noqa: F401 (a fixture)

from trainer.run.controls import PAUSE, RESUME, STOP
from webapp.dashboard import actions, lifecycle
from webapp.dashboard.actions import Record
from webapp.dashboard.lifecycle import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    PAUSED,
    QUEUED,
    RUN,
    RUNNING,
    STOPPED,
    STOPPING,
)
from webapp.dashboard.lifecycle import PAUSE as WANT_PAUSE
from webapp.dashboard.lifecycle import STOP as WANT_STOP
from webapp.dashboard.models import KnobChange, Run, RunEvent, Status
from webapp.dashboard.rows import stream

# (status, desired, action) -> (new status, new desired) for every action a person may take;
# every other (status, desired, action) is refused. Written out by hand from the product's rules
# (docs/design.md#run-lifecycle), not derived from lifecycle.TRANSITIONS.
ALLOWED = {
    (QUEUED, RUN, "stop"): (STOPPED, WANT_STOP),
    (QUEUED, RUN, "kill"): (STOPPED, WANT_STOP),
    (RUNNING, RUN, "stop"): (STOPPING, WANT_STOP),
    (RUNNING, RUN, "pause"): (RUNNING, WANT_PAUSE),
    (RUNNING, RUN, "kill"): (STOPPED, WANT_STOP),
    (RUNNING, WANT_PAUSE, "stop"): (STOPPING, WANT_STOP),
    (RUNNING, WANT_PAUSE, "resume"): (RUNNING, RUN),          # the pause is still pending
    (RUNNING, WANT_PAUSE, "kill"): (STOPPED, WANT_STOP),
    (RUNNING, WANT_STOP, "stop"): (STOPPING, WANT_STOP),         # asked before the status moved
    (RUNNING, WANT_STOP, "kill"): (STOPPED, WANT_STOP),
    (PAUSED, WANT_PAUSE, "stop"): (STOPPING, WANT_STOP),
    (PAUSED, WANT_PAUSE, "resume"): (PAUSED, RUN),            # running again once the trainer says so
    (PAUSED, WANT_PAUSE, "kill"): (STOPPED, WANT_STOP),
    (PAUSED, RUN, "stop"): (STOPPING, WANT_STOP),             # a resume is pending
    (PAUSED, RUN, "resume"): (PAUSED, RUN),
    (PAUSED, RUN, "kill"): (STOPPED, WANT_STOP),
    (STOPPING, WANT_STOP, "kill"): (STOPPED, WANT_STOP),
    (STOPPED, WANT_STOP, "resume"): (QUEUED, RUN),
    (FAILED, WANT_STOP, "resume"): (QUEUED, RUN),
    (FAILED, RUN, "resume"): (QUEUED, RUN),
    (INTERRUPTED, RUN, "resume"): (QUEUED, RUN),
    (INTERRUPTED, WANT_STOP, "resume"): (QUEUED, RUN),
}
# the (status, desired) states a run can be in
STATES = [(QUEUED, RUN), (RUNNING, RUN), (RUNNING, WANT_PAUSE), (RUNNING, WANT_STOP),
          (PAUSED, WANT_PAUSE), (PAUSED, RUN), (STOPPING, WANT_STOP), (STOPPED, WANT_STOP),
          (FINISHED, RUN), (FINISHED, WANT_STOP), (FAILED, RUN), (FAILED, WANT_STOP),
          (INTERRUPTED, RUN), (INTERRUPTED, WANT_STOP)]
ALL = list(itertools.product(STATES, lifecycle.ACTIONS))


def test_the_table_covers_every_status_and_action():
    assert set(lifecycle.STATUSES) == {s for s, _ in STATES} == set(Status.values)
    assert {(s, a) for (s, _d, a) in ALLOWED} == set(lifecycle.TRANSITIONS)


@pytest.mark.parametrize("state, action", ALL, ids=[f"{s}+{d}-{a}" for (s, d), a in ALL])
def test_transition(state, action):
    status, desired = state
    t = lifecycle.transition(status, desired, action)
    expect = ALLOWED.get((status, desired, action))
    if expect is None:
        assert t is None
        assert lifecycle.refusal(status, desired, action).startswith(f"cannot {action} a run that is {status}")
    else:
        assert t is not None and (t.status, t.desired) == expect
    assert (action in lifecycle.allowed_actions(status, desired)) == (expect is not None)


@pytest.mark.parametrize("status", lifecycle.STATUSES)
def test_knob_changes_are_allowed_while_queued_running_or_paused(status):
    assert ("knobs" in lifecycle.allowed_actions(status)) == (status in (QUEUED, RUNNING, PAUSED))


def test_resume_is_allowed_while_a_pause_is_pending():
    assert lifecycle.allowed_actions(RUNNING, WANT_PAUSE) == ["stop", "resume", "kill", "knobs"]
    assert lifecycle.allowed_actions(RUNNING, RUN) == ["stop", "pause", "kill", "knobs"]


@pytest.mark.parametrize("status", lifecycle.STATUSES)
@pytest.mark.parametrize("kind", ["paused", "resumed", "stop_requested", "checkpoint"])
def test_trainer_events_move_only_a_live_run(kind, status):
    expect = {"paused": PAUSED, "resumed": RUNNING, "stop_requested": STOPPING}.get(kind)
    live = status in (RUNNING, PAUSED, STOPPING)
    assert lifecycle.status_after_event(kind, status) == (expect if live else None)


@pytest.mark.parametrize("status, desired, paused, stop_sent, orphaned_s, command", [
    (RUNNING, RUN, False, False, None, None),
    (RUNNING, WANT_PAUSE, False, False, None, PAUSE),
    (RUNNING, WANT_PAUSE, True, False, None, None),        # already told
    (PAUSED, RUN, True, False, None, RESUME),
    (PAUSED, RUN, False, False, None, None),
    (STOPPING, WANT_STOP, False, False, None, STOP),
    (STOPPING, WANT_STOP, True, True, None, None),         # told once
    (PAUSED, WANT_STOP, True, False, None, STOP),          # stop wins over the held pause
    (STOPPED, WANT_STOP, False, False, 1.0, None),         # a kill may still land: wait
    (STOPPED, WANT_STOP, False, False, 5.5, STOP),         # orphaned: stop cooperatively
    (STOPPED, WANT_STOP, False, True, 60.0, None),
])
def test_the_command_the_trainer_gets(status, desired, paused, stop_sent, orphaned_s, command):
    assert lifecycle.trainer_command(status, desired, paused=paused, stop_sent=stop_sent,
                                     orphaned_s=orphaned_s) == command


# --- the places that move a run follow the table --------------------------------------------------------


def _state(run):
    row = Run.objects.get(pk=run.pk)
    return row.status, row.desired


@pytest.mark.django_db
@pytest.mark.parametrize("state, action", ALL, ids=[f"{s}+{d}-{a}" for (s, d), a in ALL])
def test_control_follows_the_table(state, action, alice, make_run):
    status, desired = state
    run = make_run(alice, status, desired=desired)
    expect = ALLOWED.get((status, desired, action))
    if expect is None:
        with pytest.raises(actions.Conflict):
            actions.control(run, alice, action)
        assert _state(run) == state
    else:
        actions.control(run, alice, action)
        assert _state(run) == expect


@pytest.mark.django_db
def test_every_status_frame_carries_the_allowed_actions(alice, make_run):
    run = make_run(alice, RUNNING)
    actions.control(run, alice, "pause")
    actions.append(run.pk, [Record("event", 1, "paused", {})])
    actions.control(run, alice, "stop")
    msgs, _ = stream.messages_after(run.pk, 0)
    frames = [(m["type"], m.get("kind"), m.get("allowed_actions")) for m in msgs]
    assert frames == [
        ("status", None, ["stop", "pause", "kill", "knobs"]),              # make_run's
        ("event", "pause_requested", ["stop", "resume", "kill", "knobs"]),  # pause pending
        ("event", "paused", None),
        ("status", None, ["stop", "resume", "kill", "knobs"]),
        ("status", None, ["kill"]),                                        # stopping
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("kind, status, expect", [
    ("paused", RUNNING, PAUSED), ("resumed", PAUSED, RUNNING), ("stop_requested", PAUSED, STOPPING),
    ("paused", STOPPED, STOPPED), ("resumed", INTERRUPTED, INTERRUPTED),
])
def test_a_trainer_event_moves_the_status_in_the_same_write(kind, status, expect, alice, make_run):
    run = make_run(alice, status)
    seq = actions.append(run.pk, [Record("event", 3, kind, {})])
    row = Run.objects.get(pk=run.pk)
    assert row.status == expect and row.last_seq == seq
    kinds = list(RunEvent.objects.filter(run=run, seq__gt=1).order_by("seq").values_list("kind", flat=True))
    assert kinds == ([kind, "status"] if expect != status else [kind])


@pytest.mark.django_db
@pytest.mark.parametrize("status, ends", [(RUNNING, True), (PAUSED, True), (STOPPING, True),
                                          (QUEUED, False), (STOPPED, False), (INTERRUPTED, False)])
def test_end_run_ends_only_a_live_run(status, ends, alice, make_run):
    run = make_run(alice, status)
    assert actions.end_run(run.pk, FINISHED) is ends
    row = Run.objects.get(pk=run.pk)
    assert row.status == (FINISHED if ends else status)
    assert (row.finished_at is not None) is ends


@pytest.mark.django_db
def test_end_run_refuses_a_status_that_is_no_end(alice, make_run):
    run = make_run(alice, RUNNING)
    with pytest.raises(ValueError, match="got 'paused'"):
        actions.end_run(run.pk, PAUSED)


@pytest.mark.django_db
@pytest.mark.parametrize("status, lost", [(RUNNING, True), (PAUSED, True), (STOPPING, True),
                                          (QUEUED, False), (STOPPED, False), (FINISHED, False)])
def test_the_sweep_interrupts_only_a_live_run(status, lost, alice, make_run):
    from webapp.dashboard.worker import sweep

    run = make_run(alice, status, heartbeat_at=timezone.now() - timedelta(hours=1))
    assert sweep.mark_stale_runs(force=True) == int(lost)
    row = Run.objects.get(pk=run.pk)
    assert row.status == (INTERRUPTED if lost else status)
    if lost:   # the status change and the heartbeat alert are one write
        last = list(RunEvent.objects.filter(run=run).order_by("-seq")[:2])
        assert [e.kind for e in last] == ["alert", "status"] and last[1].data["message"] == sweep.LOST
        assert "heartbeat" in row.alerts["active"]


@pytest.mark.django_db
def test_resuming_an_ended_run_rejects_its_pending_knob_changes(alice, make_run):
    run = make_run(alice, STOPPED, desired=WANT_STOP)
    KnobChange.objects.create(run=run, change_id="c1", knobs={"optim.lr": 1e-5}, requested_by=alice)
    actions.control(run, alice, "resume")
    assert KnobChange.objects.get(change_id="c1").status == KnobChange.REJECTED


@pytest.mark.django_db
def test_the_control_source_stops_an_orphaned_run_after_the_grace_period(alice, make_run, monkeypatch):
    from webapp.dashboard.worker import telemetry

    clock = [1000.0]
    monkeypatch.setattr(telemetry.time, "monotonic", lambda: clock[0])
    run = make_run(alice, RUNNING)
    controls = telemetry.DbControlSource(run.pk, min_interval=0)
    assert controls.poll() == []
    Run.objects.filter(pk=run.pk).update(status=STOPPED)   # killed, but the signal got lost
    assert controls.poll() == []                            # a kill may still land
    clock[0] += lifecycle.ORPHAN_GRACE_S + 0.5
    assert [c.kind for c in controls.poll()] == [STOP]
    assert controls.poll() == []                            # told once
