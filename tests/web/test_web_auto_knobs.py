"""The trainer's own knob changes (async.auto_staleness moving eta) reach the run's knobs like a
person's: the API, the run page's tuning panel ("current") and the knob timeline show the new
value, with who asked ("auto") and why."""
import json
import re

import pytest
from helpers import NoBell

from trainer import config as C
from trainer.rollout.asynchronous import AsyncDriver
from trainer.run.runner import Runner
from webapp.dashboard.models import Run
from webapp.dashboard.reports import summary
from webapp.dashboard.worker.telemetry import DbSink

pytestmark = pytest.mark.django_db(transaction=True)



@pytest.fixture
def auto_eta_run(user, make_run, tmp_path, monkeypatch):
    """A real asynchronous run whose behaviour weights drift every step: auto_staleness lowers
    eta 2 -> 1 -> 0, through the database sink the web app gives the trainer."""
    real = AsyncDriver.retune
    monkeypatch.setattr(AsyncDriver, "retune",
                        lambda self, cfg, tm: real(self, cfg, {**tm, "actor/behave_imp_weight": 1.5}))
    run = make_run(user, "running", max_steps=4)
    cfg = C.apply_overrides(C.from_dict(run.config), {
        "async.enabled": True, "async.worker": "thread", "async.max_staleness": 2,
        "async.auto_staleness": True, "async.prox_logp": "loglinear", "run.max_steps": 4})
    Run.objects.filter(pk=run.pk).update(config=cfg.to_dict(), knobs=cfg.knob_values())
    sink = DbSink(run.pk, doorbell=NoBell())
    try:
        with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as r:
            assert r.run() == "finished"
    finally:
        sink.close()
    assert r.cfg.async_.max_staleness == 0  # guard: the trainer did move eta, twice
    return run


def test_an_automatic_eta_change_shows_in_the_api(alice, auto_eta_run):
    body = alice.get(f"/api/runs/{auto_eta_run.pk}").json()
    assert body["knobs"]["async.max_staleness"] == 0


def test_an_automatic_eta_change_shows_in_the_tuning_panel(alice, auto_eta_run):
    html = alice.get(f"/runs/{auto_eta_run.pk}/").content.decode()
    page = json.loads(re.search(r'<script id="run-page" type="application/json">(.*?)</script>',
                                html, re.S).group(1))
    assert page["knobs"]["async.max_staleness"] == 0  # the panel's "current" column reads these


def test_the_knob_timeline_says_the_trainer_asked_and_why(auto_eta_run):
    rows = [t for t in summary.knob_timeline(auto_eta_run) if t["key"] == "async.max_staleness"]
    assert [(t["old"], t["new"], t["who"]) for t in rows] == [(2, 1, "auto"), (1, 0, "auto")]
    event = auto_eta_run.events.filter(kind="knob_applied").first()
    assert event.data["reason"]["rule"] == "auto_staleness"
    assert event.data["reason"]["behave_imp_weight"] == 1.5
