"""The actions layer's run controls and the worker's side, one behaviour per test: who may
control a run, what each control records and sends to Celery, knob requests, notes, and the
worker's rewind, heartbeat and end. Which (status, action) pairs are allowed is table-tested in
test_lifecycle.py."""
# the named users are fixtures imported from named_users.py; tests take them as parameters
# ruff: noqa: F811
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from named_users import alice, bob, carol, running  # noqa: F401 (fixtures)

from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.errors import TooManyRuns
from webapp.dashboard.models import KnobChange, MetricPoint, RolloutSample, Run, RunEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def celery_calls(monkeypatch):
    """What the actions send to Celery (once their transaction commits): [(what, args, kwargs)]."""
    from webapp.celery import app

    calls = []
    monkeypatch.setattr(app.control, "revoke", lambda *a, **k: calls.append(("revoke", a, k)))
    monkeypatch.setattr(app, "send_task", lambda *a, **k: calls.append(("send_task", a, k)))
    return calls


@pytest.fixture
def committed(django_capture_on_commit_callbacks):
    """A block whose on-commit callbacks run when it ends, as after a real commit."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def last_event(run, kind):
    return RunEvent.objects.filter(run=run, kind=kind).latest("seq")


def row(run) -> Run:
    return Run.objects.get(pk=run.pk)


# --- who may control ----------------------------------------------------------------------------------

@pytest.mark.parametrize("action", ["stop", "pause", "resume", "kill"])
def test_another_user_may_not_control_a_run(running, bob, action):
    with pytest.raises(actions.Forbidden):
        actions.control(running, bob, action)
    assert (row(running).status, row(running).desired) == ("running", "run")


def test_staff_may_control_anyone_s_run(running, carol):
    assert actions.control(running, carol, "stop").status == "stopping"


def test_an_unknown_action_is_invalid_and_names_the_actions(running, alice):
    with pytest.raises(actions.Invalid) as e:
        actions.control(running, alice, "explode")
    assert e.value.errors == {"action": "one of stop, pause, resume, kill"}


def test_a_refused_action_says_why(running, alice):
    actions.control(running, alice, "pause")
    with pytest.raises(actions.Conflict, match="a pause or stop is already pending"):
        actions.control(running, alice, "pause")


# --- what each control records and sends ------------------------------------------------------------------

def test_pause_records_who_asked_and_the_state_it_leaves(running, alice):
    actions.control(running, alice, "pause")
    assert last_event(running, "pause_requested").data == {
        "requested_by": "alice", "status": "running", "desired": "pause"}


def test_stop_records_the_status_change_with_the_desired_state(running, alice):
    actions.control(running, alice, "stop")
    assert last_event(running, "status").data == {"status": "stopping", "previous": "running",
                                                  "desired": "stop"}


def test_kill_of_a_running_run_sigkills_its_task(running, alice, celery_calls, committed):
    with committed():
        actions.control(running, alice, "kill")
    assert celery_calls == [("revoke", ("task-1",), {"terminate": True, "signal": "SIGKILL"})]
    assert last_event(running, "killed").data == {"requested_by": "alice"}
    assert row(running).finished_at is not None


def test_stop_of_a_queued_run_revokes_its_task_without_killing(alice, make_run, celery_calls, committed):
    run = make_run(alice, "queued", celery_task_id="task-2")
    with committed():
        actions.control(run, alice, "stop")
    assert celery_calls == [("revoke", ("task-2",), {})]
    assert row(run).status == "stopped"


def test_resume_of_an_ended_run_requeues_it_from_the_asked_checkpoint(alice, make_run, celery_calls,
                                                                      committed):
    run = make_run(alice, "failed", desired="stop", error="boom", heartbeat_at=timezone.now())
    with committed():
        actions.control(run, alice, "resume", resume_step=20)
    r = row(run)
    assert (r.status, r.desired, r.error, r.finished_at, r.heartbeat_at) == ("queued", "run", "", None, None)
    [(what, args, kwargs)] = celery_calls
    assert what == "send_task" and args == (actions.TRAIN_TASK,)
    assert kwargs["args"] == [run.pk] and kwargs["kwargs"] == {"resume": True, "resume_step": 20}
    assert kwargs["task_id"] == r.celery_task_id


def test_resume_of_an_ended_run_counts_against_its_owner_s_quota(alice, make_run, settings):
    settings.RLPILOT_MAX_ACTIVE_RUNS_PER_USER = 1
    make_run(alice, "running")
    run = make_run(alice, "stopped")
    with pytest.raises(TooManyRuns):
        actions.control(run, alice, "resume")
    assert row(run).status == "stopped"


def test_staff_resume_is_not_held_by_the_owner_s_quota(alice, carol, make_run, settings):
    settings.RLPILOT_MAX_ACTIVE_RUNS_PER_USER = 1
    make_run(alice, "running")
    run = make_run(alice, "stopped")
    assert actions.control(run, carol, "resume").status == "queued"


# --- knob requests ---------------------------------------------------------------------------------------------

def test_a_knob_request_queues_a_pending_change_and_bumps_the_knob_version(running, alice):
    before = row(running).knob_version
    change = actions.request_knobs(running, alice, {"optim.lr": "2e-5"})
    assert change.status == KnobChange.PENDING and change.knobs == {"optim.lr": 2e-5}
    assert row(running).knob_version == before + 1
    assert last_event(running, "knob_requested").data == {
        "change_id": change.change_id, "knobs": {"optim.lr": 2e-5}, "requested_by": "alice"}


def test_a_knob_request_for_an_ended_run_is_a_conflict(alice, make_run):
    run = make_run(alice, "finished")
    with pytest.raises(actions.Conflict, match="the run is finished"):
        actions.request_knobs(run, alice, {"optim.lr": 2e-5})
    assert not KnobChange.objects.exists()


def test_a_knob_request_for_a_parameter_that_is_no_knob_names_it(running, alice):
    with pytest.raises(actions.Invalid) as e:
        actions.request_knobs(running, alice, {"model.path": "x"})
    assert "not a knob" in e.value.errors["model.path"]


# --- notes -------------------------------------------------------------------------------------------------------

def test_annotating_saves_the_fields_with_an_event_naming_them(running, alice):
    actions.annotate_run(running, alice, note="baseline", tags=["april", "x"])
    r = row(running)
    assert (r.note, r.tags) == ("baseline", ["april", "x"])
    assert last_event(running, "annotated").data == {"by": "alice", "fields": ["note", "tags"]}


def test_an_active_run_cannot_be_archived(running, alice):
    with pytest.raises(actions.Invalid) as e:
        actions.annotate_run(running, alice, archived=True)
    assert "stop it before archiving" in e.value.errors["archived"] and not row(running).archived


# --- the worker's side ---------------------------------------------------------------------------------------------

def test_rewind_drops_later_rows_and_moves_the_step_back(running):
    for step in (1, 2, 3):
        actions.append(running.pk, [Record("points", step, "", {"m": step}),
                                    Record("samples", step, "", {"rows": [{"group": step, "index": 0}]})])
    actions.rewind(running.pk, 1, from_checkpoint=True)
    assert list(MetricPoint.objects.filter(run=running).values_list("step", flat=True)) == [1]
    assert list(RolloutSample.objects.filter(run=running).values_list("step", flat=True)) == [1]
    assert row(running).step == 1
    assert last_event(running, "rewound").data == {"step": 1, "from_checkpoint": True}


def test_end_run_merges_the_final_summary_under_the_latest_figures(running):
    actions.append(running.pk, [Record("points", 1, "", {"reward/mean": 0.5})])
    assert actions.end_run(running.pk, "finished", final_summary={"steps": 1, "loss": float("nan")})
    assert row(running).summary == {"latest": {"reward/mean": 0.5}, "final": {"steps": 1, "loss": "nan"}}


def test_end_run_records_the_error_as_the_status_message(running):
    actions.end_run(running.pk, "failed", error="RuntimeError: boom")
    assert row(running).error == "RuntimeError: boom"
    assert last_event(running, "status").data["message"] == "RuntimeError: boom"


def test_heartbeat_beats_only_for_a_live_run(alice, make_run):
    at = timezone.now() - timedelta(seconds=5)
    live, ended = make_run(alice, "paused"), make_run(alice, "stopped")
    assert actions.heartbeat(live.pk, at) and row(live).heartbeat_at == at
    assert not actions.heartbeat(ended.pk, at) and row(ended).heartbeat_at is None
