"""actions.append and its handlers, one behaviour per test: a record's row and what it does to
the run (key figures, knobs, knob-change rows, samples and their thinning, status), in one write."""
# the named users are fixtures imported from named_users.py; tests take them as parameters
# ruff: noqa: F811
from __future__ import annotations

import pytest
from named_users import alice, running  # noqa: F401 (fixtures)

from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import HistogramSnapshot, KnobChange, MetricPoint, RolloutSample, Run, RunEvent

pytestmark = pytest.mark.django_db


def row(run) -> Run:
    return Run.objects.get(pk=run.pk)


def sample(group: int, index: int = 0) -> dict:
    return {"group": group, "index": index, "prompt": "1+1", "completion": "2", "reward": 1.0,
            "length": 3, "finish": "stop"}


def knob_event(name: str, change_id: str | None, **data) -> Record:
    return Record("event", 5, name, {**({"change_id": change_id} if change_id else {}), **data})


# --- sequence numbers --------------------------------------------------------------------------------

def test_records_take_consecutive_sequence_numbers_after_the_runs_last(running):
    start = row(running).last_seq
    seq = actions.append(running.pk, [Record("points", 1, "", {"a": 1.0, "b": 2.0}),
                                  Record("histogram", 1, "h", {"edges": [0, 1], "counts": [3]}),
                                  Record("event", 1, "checkpoint", {"path": "x"})])
    assert seq == start + 3 == row(running).last_seq
    assert set(MetricPoint.objects.filter(run=running).values_list("seq", flat=True)) == {start + 1}
    assert HistogramSnapshot.objects.get(run=running).seq == start + 2
    assert RunEvent.objects.get(run=running, kind="checkpoint").seq == start + 3


def test_an_unknown_record_kind_is_refused_by_name_and_writes_nothing(running):
    start = row(running).last_seq
    with pytest.raises(ValueError, match="unknown record kind 'metric'"):
        actions.append(running.pk, [Record("event", 1, "checkpoint"), Record("metric", 1)])
    assert row(running).last_seq == start and not RunEvent.objects.filter(kind="checkpoint").exists()


def test_the_doorbell_rings_once_the_write_commits(running, django_capture_on_commit_callbacks, monkeypatch):
    rung = []
    monkeypatch.setattr("webapp.dashboard.doorbell.ring", lambda run_id, seq: rung.append((run_id, seq)))
    with django_capture_on_commit_callbacks(execute=True):
        seq = actions.append(running.pk, [Record("event", 1, "checkpoint")])
        assert rung == []
    assert rung == [(running.pk, seq)]


# --- key figures -----------------------------------------------------------------------------------------

def test_a_scalar_batch_keeps_the_latest_key_figures_on_the_run(running):
    actions.append(running.pk, [Record("points", 1, "", {"reward/mean": 0.25, "actor/kl": 0.5, "other": 9.0})])
    actions.append(running.pk, [Record("points", 2, "", {"reward/mean": 0.75})])
    assert row(running).summary["latest"] == {"reward/mean": 0.75, "actor/kl": 0.5}


def test_a_non_finite_figure_is_stored_as_null(running):
    actions.append(running.pk, [Record("points", 1, "", {"reward/mean": float("nan"), "x": "inf"})])
    assert set(MetricPoint.objects.filter(run=running).values_list("value", flat=True)) == {None}
    assert row(running).summary["latest"] == {"reward/mean": None}


# --- knobs -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("requested_by", ["alice", "cli", "auto"])
def test_knob_applied_updates_the_runs_knobs_whoever_asked(running, requested_by):
    before = row(running).knobs
    actions.append(running.pk, [knob_event("knob_applied", None, requested_by=requested_by, changes={
        "async.max_staleness": {"old": before.get("async.max_staleness"), "new": 3}})])
    knobs = row(running).knobs
    assert knobs["async.max_staleness"] == 3
    assert {k: v for k, v in knobs.items() if k != "async.max_staleness"} == \
        {k: v for k, v in before.items() if k != "async.max_staleness"}


def test_knob_applied_turns_its_change_row_applied_at_its_step(running, alice):
    KnobChange.objects.create(run=running, change_id="c1", knobs={"optim.lr": 1e-5}, requested_by=alice)
    actions.append(running.pk, [knob_event("knob_applied", "c1", changes={"optim.lr": {"old": 1e-6, "new": 1e-5}})])
    change = KnobChange.objects.get(change_id="c1")
    assert (change.status, change.applied_step, change.message) == (KnobChange.APPLIED, 5, "")


def test_knob_rejected_turns_its_change_row_rejected_with_the_reasons(running, alice):
    KnobChange.objects.create(run=running, change_id="c2", knobs={"optim.lr": 1e-5}, requested_by=alice)
    actions.append(running.pk, [knob_event("knob_rejected", "c2", errors={"optim.lr": "too big", "x": "no"})])
    change = KnobChange.objects.get(change_id="c2")
    assert (change.status, change.message) == (KnobChange.REJECTED, "too big; no")
    assert row(running).knobs == running.knobs   # a rejected change changes no knob


def test_a_knob_outcome_touches_only_its_own_change_row(running, alice):
    KnobChange.objects.create(run=running, change_id="mine", knobs={"optim.lr": 1e-5}, requested_by=alice)
    actions.append(running.pk, [knob_event("knob_applied", "other", changes={})])
    assert KnobChange.objects.get(change_id="mine").status == KnobChange.PENDING


# --- rollout samples ----------------------------------------------------------------------------------------

def test_a_steps_samples_share_one_sequence_number(running):
    seq = actions.append(running.pk, [Record("samples", 1, "", {"rows": [sample(0, 0), sample(0, 1), "junk"]})])
    assert list(RolloutSample.objects.filter(run=running).values_list("seq", flat=True)) == [seq, seq]


def test_samples_past_the_cap_thin_the_oldest_steps_in_the_same_write(running, settings):
    settings.SAMPLES_PER_RUN = 4
    for step in (1, 2, 3):
        actions.append(running.pk, [Record("samples", step, "", {"rows": [sample(step, 0), sample(step, 1)]})])
    steps = sorted(RolloutSample.objects.filter(run=running).values_list("step", flat=True))
    assert steps == [2, 2, 3, 3]   # the odd oldest step went first, whole


# --- status -----------------------------------------------------------------------------------------------

def test_a_status_record_writes_the_status_event_and_the_run_row(running):
    actions.append(running.pk, [actions.status_record("failed", 4, "boom")], {"error": "boom"})
    r = row(running)
    assert (r.status, r.error) == ("failed", "boom") and r.finished_at is not None
    e = RunEvent.objects.filter(run=running, kind="status").latest("seq")
    assert e.step == 4 and e.data == {"status": "failed", "previous": "running", "desired": "run",
                                      "message": "boom"}


def test_set_status_only_from_leaves_another_status_alone(running):
    assert actions.set_status(running.pk, "queued", only_from=["stopped"]) is False
    assert row(running).status == "running"
    assert RunEvent.objects.filter(run=running, kind="status").count() == 1   # make_run's
