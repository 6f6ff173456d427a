"""The pilot's advice on the live page and in the report (docs/pilot.md): a knob change
applied from a piece of advice carries its marker to the trainer's command and back in its
knob_applied event; a malformed marker is refused naming the field; Dismiss records an event,
the advice API flags it until the evidence changes; watchers can do neither; the report lists
what was advised, applied (with the figures before and after) and dismissed. The page itself in
Chromium: test_advice_panel_browser.py."""
from __future__ import annotations

import json

import pytest
from django.test import Client
from django.utils.html import escape

from trainer import config as config_mod
from trainer.run.boundary import StepBoundary
from trainer.run.controls import SET_KNOBS
from webapp.dashboard import actions, formatting
from webapp.dashboard.actions import Record
from webapp.dashboard.models import ApiToken, KnobChange, Run, RunEvent
from webapp.dashboard.reports import summary
from webapp.dashboard.worker.telemetry import DbControlSource

pytestmark = pytest.mark.django_db


def advice_rows(first: int = 1, last: int = 30, truncated: float = 0.2) -> list[Record]:
    """Metric rows that trigger three pieces of advice over the last 20 steps: the KL runs away
    from step 21 (health: algo.kl_coef 0 -> 0.01), the entropy collapses from step 21 (health:
    rollout.temperature + 0.2) and `truncated` of the responses hit the length limit (length: not
    a knob). Throughput and accuracy rise from step 21, for the report's before/after."""
    return [Record("points", s, "", {
        "actor/kl": 0.1 if s <= 20 else 0.8, "actor/entropy": 0.5 if s <= 20 else 0.05,
        "rollout/truncated_ratio": truncated, "rollout/response_len/p90": 60.0, "reward/mean": 0.5,
        "reward/accuracy": 0.5 if s <= 20 else 0.6, "perf/trained_tokens_per_s": 100.0 if s <= 20 else 150.0,
        "actor/pg_loss": 0.1}) for s in range(first, last + 1)]


def advised_run(make_run, owner, **fields) -> Run:
    run = make_run(owner, "running", **fields)
    actions.append(run.pk, advice_rows(), {"step": 30})
    run.refresh_from_db()
    return run


def post(client, url, body, **extra):
    return client.post(url, json.dumps(body), content_type="application/json", **extra)


def current_advice(client, run) -> dict:
    r = client.get(f"/api/runs/{run.pk}/advice")
    assert r.status_code == 200, r.content
    return {a["reason"]: a for a in r.json()["advice"]}


def marker(a: dict) -> dict:
    return {"rule": a["rule"], "reason": a["reason"], "evidence_key": a["evidence_key"]}


class Recorder:
    """The trainer's sink, keeping the events it is handed (trainer.run.boundary writes them)."""

    def __init__(self):
        self.events = []

    def event(self, step, kind, data=None):
        self.events.append((step, kind, dict(data or {})))


class Driver:
    def set_config(self, cfg):
        self.cfg = cfg


def trainer_applies(run: Run, step: int) -> list[tuple]:
    """What the trainer does at its next step boundary with the run's pending changes, through
    its own code: the control source's commands applied by trainer.run.boundary, and the events it
    records appended as its database sink appends them. Returns those events."""
    commands = DbControlSource(run.pk, min_interval=0).poll()
    sink = Recorder()
    boundary = StepBoundary(None, sink, Driver())
    cfg = config_mod.apply_overrides(config_mod.from_dict(run.config), run.knobs)
    for cmd in commands:
        if cmd.kind == SET_KNOBS:
            cfg = boundary.apply_knobs(step, cfg, cmd)
    actions.append(run.pk, [Record("event", s, kind, data) for s, kind, data in sink.events])
    return sink.events


# --- Apply ------------------------------------------------------------------------------------

def test_apply_from_advice_carries_the_marker_to_the_trainer_and_back(alice, user, make_run):
    run = advised_run(make_run, user)
    kl = current_advice(alice, run)["kl_runaway"]
    assert (kl["knob"], kl["current"], kl["proposed"], kl["dismissed"]) == ("algo.kl_coef", 0.0, 0.01, False)
    r = post(alice, f"/api/runs/{run.pk}/knobs", {"knobs": {kl["knob"]: kl["proposed"]}, "advice": marker(kl)})
    assert r.status_code == 202, r.content
    assert r.json()["advice"] == marker(kl) and r.json()["knobs"] == {"algo.kl_coef": 0.01}
    change = KnobChange.objects.get(change_id=r.json()["change_id"])
    assert change.advice == marker(kl)
    requested = RunEvent.objects.get(run=run, kind="knob_requested")
    assert requested.data["advice"] == marker(kl)
    assert formatting.describe_event("knob_requested", requested.data) == \
        "algo.kl_coef = 0.01 (by alice, from health advice)"
    # the command the control source hands the trainer has the marker as its reason ...
    [cmd] = DbControlSource(run.pk, min_interval=0).poll()
    assert (cmd.id, cmd.requested_by, cmd.reason) == (change.change_id, "alice", marker(kl))
    # ... and the trainer's own boundary code writes it back into knob_applied
    [(step, kind, data)] = trainer_applies(run, 30)
    assert kind == "knob_applied" and data["reason"] == marker(kl) and data["change_id"] == change.change_id
    change.refresh_from_db()
    assert (change.status, change.applied_step) == ("applied", 30)
    applied = RunEvent.objects.get(run=run, kind="knob_applied")
    assert formatting.describe_event("knob_applied", applied.data) == \
        "algo.kl_coef: 0 → 0.01 (by alice, from health advice)"
    # the knob moved: the KL still runs away, and the rule now advises from the new value (a new
    # evidence_key, so the page tells the applied advice from the next one)
    after = current_advice(alice, run)["kl_runaway"]
    assert (after["current"], after["proposed"]) == (0.01, 0.02) and after["evidence_key"] != kl["evidence_key"]


def test_the_plain_knobs_object_still_works_and_carries_no_reason(alice, user, make_run):
    run = advised_run(make_run, user)
    r = post(alice, f"/api/runs/{run.pk}/knobs", {"optim.lr": 5e-5})
    assert r.status_code == 202, r.content
    assert r.json()["advice"] is None and KnobChange.objects.get().advice is None
    assert "advice" not in RunEvent.objects.get(run=run, kind="knob_requested").data
    [cmd] = DbControlSource(run.pk, min_interval=0).poll()
    assert cmd.reason == {} and cmd.knobs == {"optim.lr": 5e-5}
    # the wrapped form without advice is a plain change too
    r = post(alice, f"/api/runs/{run.pk}/knobs", {"knobs": {"optim.lr": 4e-5}})
    assert r.status_code == 202 and r.json()["advice"] is None


GOOD = {"rule": "health", "reason": "kl_runaway", "evidence_key": "db5b4f877a0d"}


@pytest.mark.parametrize("body,field,words", [
    ({"knobs": {"algo.kl_coef": 0.01}, "advice": "health"}, "advice", "rule"),
    ({"knobs": {"algo.kl_coef": 0.01}, "advice": {**GOOD, "rule": "hunch"}}, "advice.rule", "unknown rule"),
    ({"knobs": {"algo.kl_coef": 0.01}, "advice": {"rule": "health", "reason": "kl_runaway"}},
     "advice.evidence_key", "required"),
    ({"knobs": {"algo.kl_coef": 0.01}, "advice": {**GOOD, "evidence_key": "xyz"}}, "advice.evidence_key", "12 hex"),
    ({"knobs": {"algo.kl_coef": 0.01}, "advice": {**GOOD, "reason": "Kl Runaway!"}}, "advice.reason", "reason"),
    ({"knobs": {"algo.kl_coef": 0.01}, "advice": {**GOOD, "why": "x"}}, "advice.why", "unknown field"),
    ({"knobs": {"algo.kl_coef": 0.01}, "advice": {**GOOD, "rule": 5}}, "advice.rule", "a string"),
    ({"advice": GOOD}, "knobs", "required with advice"),
    ({"knobs": {"algo.kl_coef": 0.01}, "advice": GOOD, "note": "x"}, "note", "unknown field"),
])
def test_a_malformed_advice_marker_is_refused_naming_the_problem(alice, user, make_run, body, field, words):
    run = advised_run(make_run, user)
    r = post(alice, f"/api/runs/{run.pk}/knobs", body)
    assert r.status_code == 400, r.content
    assert words in r.json()["errors"][field], r.json()
    assert not KnobChange.objects.exists() and not RunEvent.objects.filter(kind="knob_requested").exists()


@pytest.mark.django_db(transaction=True)
def test_apply_over_the_websocket_carries_the_marker(alice, user, make_run):
    from test_web_ws import communicator, receive_until, run_async

    run = advised_run(make_run, user)
    kl = current_advice(alice, run)["kl_runaway"]

    async def go():
        comm = communicator(alice, run.pk)
        ok, _ = await comm.connect()
        assert ok
        await comm.send_to(text_data=json.dumps({"type": "set_knobs", "knobs": {"algo.kl_coef": 0.01},
                                                 "advice": {**marker(kl), "rule": "hunch"}, "request_id": "a1"}))
        err = (await receive_until(comm, lambda m: m["type"] == "error"))[-1]
        assert err["request_id"] == "a1" and "unknown rule" in err["errors"]["advice.rule"]
        await comm.send_to(text_data=json.dumps({"type": "set_knobs", "knobs": {"algo.kl_coef": 0.01},
                                                 "advice": marker(kl), "request_id": "a2"}))
        ack = (await receive_until(comm, lambda m: m["type"] == "knob_ack"))[-1]
        assert ack["request_id"] == "a2" and ack["advice"] == marker(kl)
        requested = (await receive_until(comm, lambda m: m.get("kind") == "knob_requested"))[-1]
        assert requested["data"]["advice"] == marker(kl)
        await comm.disconnect()
    run_async(go())
    assert KnobChange.objects.get().advice == marker(kl)


# --- Dismiss ----------------------------------------------------------------------------------

def test_dismiss_records_an_event_the_api_flags_it_and_new_evidence_brings_it_back(alice, user, make_run):
    run = advised_run(make_run, user)
    entropy = current_advice(alice, run)["entropy_collapse"]
    url = f"/api/runs/{run.pk}/advice/dismiss"
    r = post(alice, url, {"rule": entropy["rule"], "evidence_key": entropy["evidence_key"]})
    assert r.status_code == 201, r.content
    event = RunEvent.objects.get(run=run, kind="advice_dismissed")
    assert event.data["requested_by"] == "alice" and event.data["knob"] == "rollout.temperature"
    assert event.data["message"] == entropy["message"] and event.step == 30
    assert formatting.describe_event("advice_dismissed", event.data) == \
        "dismissed health advice: rollout.temperature 1 → 1.2 (by alice)"
    advice = current_advice(alice, run)
    assert advice["entropy_collapse"]["dismissed"] is True
    assert advice["kl_runaway"]["dismissed"] is False    # the other health advice stays
    # twice: nothing new recorded
    r = post(alice, url, {"rule": entropy["rule"], "evidence_key": entropy["evidence_key"]})
    assert r.status_code == 200 and RunEvent.objects.filter(kind="advice_dismissed").count() == 1
    # the temperature moves (another change): the same rule advises from the new value, shown again
    Run.objects.filter(pk=run.pk).update(knobs={**run.knobs, "rollout.temperature": 1.5})
    again = current_advice(alice, run)["entropy_collapse"]
    assert again["evidence_key"] != entropy["evidence_key"] and again["dismissed"] is False
    assert (again["current"], again["proposed"]) == (1.5, 1.7)


def test_dismiss_refuses_bad_input_and_advice_the_run_does_not_give(alice, user, make_run):
    run = advised_run(make_run, user)
    url = f"/api/runs/{run.pk}/advice/dismiss"
    r = post(alice, url, {"rule": "health"})
    assert r.status_code == 400 and "required" in r.json()["errors"]["evidence_key"]
    r = post(alice, url, {"rule": "vibes", "evidence_key": "db5b4f877a0d"})
    assert r.status_code == 400 and "unknown rule" in r.json()["errors"]["rule"]
    r = post(alice, url, {"rule": "health", "evidence_key": "db5b4f877a0d", "extra": 1})
    assert r.status_code == 400 and "extra" in r.json()["errors"]
    r = post(alice, url, {"rule": "health", "evidence_key": "db5b4f877a0d", "window": 0})
    assert r.status_code == 400 and "window" in r.json()["errors"]
    r = post(alice, url, {"rule": "health", "evidence_key": "0123456789ab"})   # well formed, not advised
    assert r.status_code == 409 and "no current advice" in r.json()["message"]
    assert not RunEvent.objects.filter(kind="advice_dismissed").exists()


def test_dismiss_takes_token_auth_and_needs_csrf_with_a_session(user, make_run):
    run = advised_run(make_run, user)
    length = current_advice(_logged_in(user), run)["responses_truncated"]
    body = {"rule": length["rule"], "evidence_key": length["evidence_key"]}
    url = f"/api/runs/{run.pk}/advice/dismiss"
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(user)
    r = post(browser, url, body)
    assert r.status_code == 403 and "CSRF" in r.json()["message"]
    tok = ApiToken.objects.create(user=user)
    r = post(Client(enforce_csrf_checks=True), url, body, HTTP_AUTHORIZATION=f"Token {tok.key}")
    assert r.status_code == 201, r.content
    assert RunEvent.objects.get(kind="advice_dismissed").data["knob"] is None


def _logged_in(user) -> Client:
    c = Client()
    c.force_login(user)
    return c


# --- who may ------------------------------------------------------------------------------------

def test_a_watcher_can_neither_apply_nor_dismiss_but_staff_can(bob, staff_user, user, make_run):
    run = advised_run(make_run, user)
    kl = current_advice(bob, run)["kl_runaway"]   # reading is for anyone logged in
    r = post(bob, f"/api/runs/{run.pk}/knobs", {"knobs": {"algo.kl_coef": 0.01}, "advice": marker(kl)})
    assert r.status_code == 403 and "owner" in r.json()["message"]
    r = post(bob, f"/api/runs/{run.pk}/advice/dismiss", {"rule": kl["rule"], "evidence_key": kl["evidence_key"]})
    assert r.status_code == 403 and "owner" in r.json()["message"]
    assert not KnobChange.objects.exists() and not RunEvent.objects.filter(kind="advice_dismissed").exists()
    staff = _logged_in(staff_user)
    assert post(staff, f"/api/runs/{run.pk}/advice/dismiss",
                {"rule": kl["rule"], "evidence_key": kl["evidence_key"]}).status_code == 201


# --- the event log's text -----------------------------------------------------------------------

@pytest.mark.parametrize("kind,data,text", [
    ("advice", {"rule": "staleness", "reason": "eta_starves_generation", "knob": "async.max_staleness",
                "current": 0, "proposed": 1, "message": "eta holds generation back"},
     "staleness: async.max_staleness 0 → 1 — eta holds generation back"),
    ("advice", {"rule": "length", "knob": None, "message": "relaunch with a longer limit"},
     "length: no knob — relaunch with a longer limit"),
    ("knob_applied", {"requested_by": "autopilot", "changes": {"async.max_staleness": {"old": 0, "new": 1}},
                      "reason": {"rule": "staleness", "reason": "eta_starves_generation",
                                 "evidence_key": "0123456789ab", "message": "eta holds generation back"}},
     "autopilot: async.max_staleness 0 → 1 (staleness: eta holds generation back)"),
    ("knob_applied", {"requested_by": "autopilot", "changes": {"async.max_staleness": {"old": 1, "new": 0}},
                      "reason": {"undo_of": "0123456789ab", "guard": "guard_throughput_drop"}},
     "autopilot undo: async.max_staleness 1 → 0 (guard: guard_throughput_drop)"),
    ("knob_applied", {"requested_by": "autopilot", "changes": {"optim.lr": {"old": 2e-4, "new": 1e-4}},
                      "reason": {"undo_of": "0123456789ab",
                                 "guard": {"name": "accuracy", "message": "accuracy fell 0.08"}}},
     "autopilot undo: optim.lr 0.0002 → 0.0001 (guard: accuracy fell 0.08)"),
    ("knob_requested", {"knobs": {"pilot.autopilot": ["staleness", "april"]}, "requested_by": "alice"},
     "pilot.autopilot = [staleness, april] (by alice)"),
])
def test_advice_events_read_as_text(kind, data, text):
    assert formatting.describe_event(kind, data) == text


# --- the report ---------------------------------------------------------------------------------

def test_the_report_lists_advised_applied_and_dismissed_with_what_happened_next(alice, user, make_run):
    run = advised_run(make_run, user)
    advice = current_advice(alice, run)
    kl, length = advice["kl_runaway"], advice["responses_truncated"]
    # the trainer advised at step 20 (its `advice` event, Advice.as_json())
    actions.append(run.pk, [Record("event", 20, "advice", kl)])
    # alice applied it; the trainer applied it at step 20 (throughput 100 before, 150 after)
    Run.objects.filter(pk=run.pk).update(step=20)
    run.refresh_from_db()
    assert post(alice, f"/api/runs/{run.pk}/knobs",
                {"knobs": {"algo.kl_coef": 0.01}, "advice": marker(kl)}).status_code == 202
    trainer_applies(run, 20)
    # the autopilot's own change at step 26 and its undo at step 28, as the trainer records them
    auto = {"rule": "staleness", "reason": "eta_starves_generation", "evidence_key": "0123456789ab",
            "message": "eta holds generation back", "evidence": []}
    actions.append(run.pk, [
        Record("event", 26, "knob_applied", {"change_id": "auto1", "requested_by": "autopilot",
                                             "changes": {"optim.lr": {"old": 2e-4, "new": 1e-4}}, "reason": auto}),
        Record("event", 28, "knob_applied", {"change_id": "auto2", "requested_by": "autopilot",
                                             "changes": {"optim.lr": {"old": 1e-4, "new": 2e-4}},
                                             "reason": {"undo_of": "0123456789ab", "guard": "guard_accuracy_drop"}}),
        # a person's ordinary change is no advice
        Record("event", 29, "knob_applied", {"change_id": "c9", "requested_by": "alice",
                                             "changes": {"optim.lr": {"old": 2e-4, "new": 3e-4}}}),
    ], {"step": 30})
    assert post(alice, f"/api/runs/{run.pk}/advice/dismiss",
                {"rule": "length", "evidence_key": length["evidence_key"]}).status_code == 201

    history = summary.advice_history(Run.objects.get(pk=run.pk))
    assert [(a["step"], a["rule"], a["move"]) for a in history["advised"]] == [(20, "health", "algo.kl_coef 0 → 0.01")]
    assert [(a["step"], a["by"], a["changes"]) for a in history["applied"]] == [
        (20, "alice (from advice)", "algo.kl_coef 0 → 0.01"),
        (26, "autopilot", "optim.lr 0.0002 → 0.0001"),
        (28, "autopilot (undo)", "optim.lr 0.0001 → 0.0002")]
    first = {f["key"]: f for f in history["applied"][0]["effect"]}
    tps = first["perf/trained_tokens_per_s"]
    assert (tps["before"], tps["after"], tps["steps_before"], tps["steps_after"]) == (100.0, 150.0, 10, 10)
    acc = first["reward/accuracy"]
    assert (acc["before"], acc["steps_after"]) == (0.5, 10) and abs(acc["after"] - 0.6) < 1e-9
    # the autopilot's change at 26: 10 steps before (17-26: four at 100, six at 150), four after
    tps26 = {f["key"]: f for f in history["applied"][1]["effect"]}["perf/trained_tokens_per_s"]
    assert (tps26["before"], tps26["after"], tps26["steps_after"]) == (130.0, 150.0, 4)
    assert [(d["by"], d["rule"], d["move"]) for d in history["dismissed"]] == [("alice", "length", "no knob")]

    for url in (f"/runs/{run.pk}/report/", f"/api/runs/{run.pk}/export?format=html"):
        html = alice.get(url).content.decode()
        section = html[html.index('id="advice-report"'):]
        section = section[:section.index("</section>")]
        applied = section[section.index('id="advice-applied"'):section.index('id="advice-dismissed"')]
        assert "alice (from advice)" in applied and "algo.kl_coef 0 → 0.01" in applied
        assert "trained tokens/s: 100 → 150 (+50%), 10 steps before and 10 after" in applied
        assert "accuracy: 0.5 → 0.6 (+20%), 10 steps before and 10 after" in applied
        assert "autopilot (undo)" in applied and "guard: guard_accuracy_drop" in applied
        assert "eta holds generation back" in applied
        assert "optim.lr 0.0002 → 0.0003" not in applied
        advised = section[section.index('id="advice-advised"'):section.index('id="advice-applied"')]
        assert escape(kl["message"]) in advised and "algo.kl_coef 0 → 0.01" in advised
        dismissed = section[section.index('id="advice-dismissed"'):]
        assert "alice" in dismissed and escape(length["message"]) in dismissed
    export = json.loads(alice.get(f"/api/runs/{run.pk}/export?format=json").content)
    assert [a["by"] for a in export["advice"]["applied"]] == ["alice (from advice)", "autopilot", "autopilot (undo)"]
    assert export["advice"]["dismissed"][0]["evidence_key"] == length["evidence_key"]
    assert export["advice"]["applied"][0]["effect"][0]["text"].startswith("100 → 150 (+50%)")


def test_a_report_without_advice_says_so(alice, user, make_run):
    run = make_run(user, "finished")
    html = alice.get(f"/runs/{run.pk}/report/").content.decode()
    assert "No advice was recorded, applied or dismissed on this run." in html
