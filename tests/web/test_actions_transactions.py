"""A change and the event that records it are one transaction: a failure between the two writes
leaves neither (a page never shows a status without its event, a note without `annotated`, a
pending knob change nobody was told about). Each test makes the second write fail and checks that
the first did not stay."""
# the named users are fixtures imported from named_users.py; tests take them as parameters
# ruff: noqa: F811
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from named_users import alice, running  # noqa: F401 (fixtures)

from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import KnobChange, Run, RunEvent
from webapp.dashboard.worker import alerts

pytestmark = pytest.mark.django_db


class Boom(Exception):
    pass


@pytest.fixture
def fail_on_event(monkeypatch):
    """Make the insert of a batch of events holding one of `kinds` fail after it wrote its rows
    (the write after the first one fails)."""
    def arm(*kinds):
        real = RunEvent.objects.bulk_create

        def bulk_create(objs, *a, **k):
            out = real(objs, *a, **k)
            if any(o.kind in kinds for o in objs):
                raise Boom(f"failing after writing {[o.kind for o in objs]}")
            return out
        monkeypatch.setattr(RunEvent.objects, "bulk_create", bulk_create)
    return arm


def row(run) -> Run:
    return Run.objects.get(pk=run.pk)


def events(run) -> list[str]:
    return list(RunEvent.objects.filter(run=run).order_by("seq").values_list("kind", flat=True))


def test_the_trainers_pause_and_the_status_it_causes_commit_together(running, fail_on_event):
    fail_on_event("status")
    with pytest.raises(Boom):
        actions.append(running.pk, [Record("event", 2, "paused", {"requested_by": "web"})])
    assert row(running).status == "running" and events(running) == ["status"]   # make_run's only


def test_a_knob_request_and_its_event_commit_together(running, alice, fail_on_event):
    version = row(running).knob_version
    fail_on_event("knob_requested")
    with pytest.raises(Boom):
        actions.request_knobs(running, alice, {"optim.lr": 2e-5})
    assert not KnobChange.objects.exists() and row(running).knob_version == version


def test_a_note_and_its_event_commit_together(running, alice, fail_on_event):
    fail_on_event("annotated")
    with pytest.raises(Boom):
        actions.annotate_run(running, alice, note="lost")
    assert row(running).note == ""


def test_a_kill_and_its_events_commit_together(running, alice, fail_on_event):
    fail_on_event("killed")
    with pytest.raises(Boom):
        actions.control(running, alice, "kill")
    assert (row(running).status, row(running).desired) == ("running", "run")
    assert events(running) == ["status"]


def test_a_lost_worker_s_status_and_alert_commit_together(running, fail_on_event):
    Run.objects.filter(pk=running.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    fail_on_event("alert")
    with pytest.raises(Boom):
        actions.interrupt_lost_run(running.pk, timezone.now(), "lost",
                                   alert=lambda run: alerts.heartbeat_alert(run, run.step))
    r = row(running)
    assert r.status == "running" and not (r.alerts or {}).get("active")
