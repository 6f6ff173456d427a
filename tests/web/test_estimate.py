"""A run's estimate before its launch (POST /api/estimates, webapp/dashboard/actions/estimate.py,
reports/estimate.py, the worker's `estimate` task): from a recorded run of the same shape at
once, named; else a calibration the worker runs, bounded, recorded done or failed with why;
a config that could not be launched gets no estimate, with the errors by field."""
from __future__ import annotations

import psutil
import pytest
from conftest import TINY
from test_cost_report import recorded

from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import Estimate

pytestmark = pytest.mark.django_db

# a target accuracy with evaluations, as a person sets one: the calibration turns both off
ASK = {"preset": "demo", "overrides": {**TINY, "run.max_steps": 10, "run.eval_every": 5, "run.target_accuracy": 0.6}}


@pytest.fixture
def sent(monkeypatch):
    """The Celery tasks the request sent, kept here (no worker takes them)."""
    from webapp.celery import app

    out = []
    monkeypatch.setattr(app, "send_task", lambda name, args=(), queue=None, **kw: out.append((name, args, queue)))
    return out


def test_a_recorded_run_of_the_same_shape_answers_at_once_and_is_named(alice, user, make_run, settings, sent):
    settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.36
    past = recorded(make_run, user)
    # a third step of 6 s: step 1, the warm-up, is left out, steps 2 and 3 took 4 s and 6 s
    actions.append(past.pk, [Record("timeline", 3, values={"spans": [
        {"lane": "rank 0", "phase": "training", "start": 120.0, "end": 126.0},
        {"lane": "rank 0", "phase": "evaluating", "start": 126.0, "end": 140.0}]})])   # not a step's time
    other = recorded(make_run, user)   # another shape: a longer response limit
    other.config["rollout"]["max_response_len"] = 128
    other.save()
    r = alice.post("/api/estimates", ASK, content_type="application/json")
    assert r.status_code == 200, r.json()
    e = r.json()
    assert e["status"] == "done" and sent == []
    res = e["result"]
    assert res["source"] == "history" and res["runs"] == [{"id": past.pk, "name": past.name}]
    # its steps took 4 s and 6 s: 10 steps at 5 s, the spread sqrt(10 x 2 + (10 x 1.414)^2 / 2)
    assert res["seconds"] == pytest.approx(50.0) and res["high_s"] == pytest.approx(50 + 2 * 120 ** 0.5)
    assert res["device_s"] == {"cpu": pytest.approx(150.0)}   # 3 cores held
    assert res["price"] == pytest.approx(150 / 3600 * 0.36)
    assert alice.get(e["url"]).json() == e


def test_without_history_a_worker_calibrates_the_run_within_its_time(
        alice, user, settings, sent, django_capture_on_commit_callbacks):
    from webapp.dashboard.worker import tasks

    settings.RLPILOT_ESTIMATE_SECONDS = 6.0
    queue = settings.RLPILOT_QUEUES[0]
    with django_capture_on_commit_callbacks(execute=True):   # sent once the row is committed
        r = alice.post("/api/estimates", {**ASK, "queue": queue}, content_type="application/json")
    assert r.status_code == 202, r.json()
    e = r.json()
    assert e["status"] == "pending" and sent == [("webapp.dashboard.tasks.estimate", [e["id"]], queue)]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert tasks.calibrate_estimate(e["id"]) == "done"
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    done = alice.get(e["url"]).json()
    assert done["status"] == "done" and done["error"] == ""
    res = done["result"]
    assert res["source"] == "calibration" and res["calibration_s"] == 6.0 and res["steps_measured"] >= 1
    assert res["max_steps"] == 10 and res["seconds"] > 0 and res["price"] is None   # no rate: hours only
    assert tasks.calibrate_estimate(e["id"]) == "skipped"   # a task delivered twice calibrates once


def test_a_calibration_that_overstays_is_killed_and_says_why(alice, user, settings, sent, monkeypatch):
    from trainer.accounting import estimate as estimate_rule
    from webapp.dashboard.worker import tasks

    settings.RLPILOT_ESTIMATE_SECONDS = 0.5
    monkeypatch.setattr(estimate_rule, "GRACE_S", 0.0)   # killed before Python has even loaded torch
    e = alice.post("/api/estimates", ASK, content_type="application/json").json()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert tasks.calibrate_estimate(e["id"]) == "failed"
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    row = Estimate.objects.get(pk=e["id"])
    assert row.status == "failed" and row.result is None
    assert "trained 0 step(s) past its first in 0.5 s, too few to estimate from" in row.error
    assert "RLPILOT_ESTIMATE_SECONDS" in row.error and "overstayed" in row.error


@pytest.mark.parametrize("body, key", [
    ({"preset": "nope"}, "preset"),
    ({"preset": "demo", "overrides": {"run.max_steps": -3}}, "run.max_steps"),
    ({"preset": "demo", "queue": "elsewhere"}, "queue"),
    ({"preset": "demo", "name": "x"}, "name"),
])
def test_a_config_that_could_not_launch_gets_no_estimate(alice, body, key, sent):
    r = alice.post("/api/estimates", body, content_type="application/json")
    assert r.status_code == 400 and key in r.json()["errors"], r.json()
    assert not Estimate.objects.exists() and sent == []


def test_an_estimate_is_its_owners(alice, user, make_run, django_user_model, client, sent):
    recorded(make_run, user)
    e = alice.post("/api/estimates", ASK, content_type="application/json").json()
    django_user_model.objects.create_user("bob", password="bob-pw-123")
    client.login(username="bob", password="bob-pw-123")
    assert client.get(e["url"]).status_code == 404


def test_one_calibration_at_a_time_and_a_lost_one_is_failed(alice, user, settings, sent):
    from datetime import timedelta

    from django.utils import timezone

    first = alice.post("/api/estimates", ASK, content_type="application/json")
    assert first.status_code == 202
    again = alice.post("/api/estimates", ASK, content_type="application/json")
    assert again.status_code == 429
    assert f"your estimate #{first.json()['id']} is still pending" in again.json()["errors"]["estimate"]
    # its worker never answers: after STALE_AFTER_S the next request fails it, and is taken
    Estimate.objects.filter(pk=first.json()["id"]).update(created_at=timezone.now() - timedelta(hours=1))
    assert alice.post("/api/estimates", ASK, content_type="application/json").status_code == 202
    lost = alice.get(first.json()["url"]).json()
    assert lost["status"] == "failed" and "no worker took its queue" in lost["error"]


def test_the_worker_refuses_a_calibration_its_own_settings_refuse(alice, user, settings, sent):
    from webapp.dashboard.worker import tasks

    e = alice.post("/api/estimates", {**ASK, "overrides": {**ASK["overrides"], "cluster.gen_procs": 1}},
                   content_type="application/json").json()
    settings.RLPILOT_MAX_GEN_PROCS = 0   # the worker's settings, read when it takes the calibration
    assert tasks.calibrate_estimate(e["id"]) == "failed"
    row = Estimate.objects.get(pk=e["id"])
    assert row.error.startswith("refused by this worker's settings: cluster.gen_procs: at most 0 generation")
