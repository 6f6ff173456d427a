"""The JSON API: schema, launching, validation, permissions, state machine, metrics."""
import json

import pytest

from trainer import config as config_mod
from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import ApiToken, KnobChange, Run, RunEvent
from webapp.dashboard.worker import sweep

pytestmark = pytest.mark.django_db


def post(client, url, data=None, raw=None, **extra):
    body = raw if raw is not None else json.dumps(data if data is not None else {})
    return client.post(url, body, content_type="application/json", **extra)


def test_knobs_is_the_trainer_schema(alice):
    r = alice.get("/api/knobs")
    assert r.status_code == 200
    rows = r.json()
    assert rows == [json.loads(json.dumps(p.as_json())) for p in config_mod.schema()]
    assert set(rows[0]) == {"name", "type", "min", "max", "choices", "default", "help", "tunable"}
    assert any(row["name"] == "optim.lr" and row["tunable"] for row in rows)


def test_presets(alice):
    r = alice.get("/api/presets")
    assert r.status_code == 200
    names = [p["name"] for p in r.json()]
    assert names == config_mod.preset_names()
    demo = next(p for p in r.json() if p["name"] == "demo")
    assert demo["config"]["run"]["max_steps"] == config_mod.load("demo").run.max_steps
    assert "[optim]" in demo["toml"] and demo["requires"] is None
    opt_in = next(p for p in r.json() if p["name"] == "smollm2-math")
    assert opt_in["requires"] == config_mod.preset_requires("smollm2-math")


def test_login_required_and_token_auth(client, user):
    assert client.get("/api/runs").status_code == 401
    assert client.get("/api/runs").json()["message"].startswith("authentication required")
    assert client.get("/api/runs", HTTP_AUTHORIZATION="Token nope").status_code == 401
    tok = ApiToken.objects.create(user=user)
    r = client.get("/api/runs", HTTP_AUTHORIZATION=f"Token {tok.key}")
    assert r.status_code == 200
    # scripts with a token need no CSRF token
    r = post(client, "/api/runs", {"name": "x", "preset": "demo"}, HTTP_AUTHORIZATION=f"Token {tok.key}")
    assert r.status_code == 201
    # pages redirect to the login view
    r = client.get("/")
    assert r.status_code == 302 and "/accounts/login/" in r["Location"]


def test_create_api_token_command(user):
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("create_api_token", "alice", stdout=out)
    key = out.getvalue().strip()
    assert ApiToken.objects.get(key=key).user == user


def test_launch_run(alice, tiny):
    r = post(alice, "/api/runs", {"name": "tiny", "preset": "demo", "overrides": {**tiny, "run.max_steps": 40}})
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["status"] == "queued" and body["url"] == f"/runs/{body['id']}/"
    run = Run.objects.get(pk=body["id"])
    assert run.config["run"]["max_steps"] == 40 and run.max_steps == 40
    assert run.knobs == config_mod.from_dict(run.config).knob_values()
    assert run.celery_task_id
    detail = alice.get(f"/api/runs/{run.pk}").json()
    assert detail["config"]["rollout"]["rollout_batch_size"] == 4
    assert detail["knobs"]["optim.lr"] == pytest.approx(config_mod.load("demo").optim.lr)
    assert detail["owner"] == "alice" and detail["status"] == "queued"


def test_launch_with_toml(alice):
    toml = config_mod.to_toml(config_mod.load("demo", {"run.max_steps": 7}))
    r = post(alice, "/api/runs", {"name": "t", "toml": toml, "overrides": {"optim.lr": 3e-5}})
    assert r.status_code == 201, r.content
    run = Run.objects.get(pk=r.json()["id"])
    assert run.max_steps == 7 and run.config["optim"]["lr"] == 3e-5
    r = post(alice, "/api/runs", {"name": "t", "toml": "[run\nmax_steps = 3"})
    assert r.status_code == 400 and "toml" in r.json()["errors"]


@pytest.mark.parametrize("payload, keys", [
    ({"name": "x", "preset": "demo", "overrides": {"optim.lr": 5}}, {"optim.lr"}),
    ({"name": "x", "preset": "demo", "overrides": {"optim.nope": 1, "zzz.a": 1, "flat": 2}},
     {"optim.nope", "zzz.a", "flat"}),
    ({"name": "x", "preset": "demo", "overrides": {"run.max_steps": "many"}}, {"run.max_steps"}),
    ({"name": "x", "preset": "demo", "overrides": ["run.max_steps=3"]}, {"overrides"}),
    ({"name": "", "preset": "nope"}, {"name", "preset"}),
    ({"name": ["x"], "preset": 3}, {"name", "preset"}),
    ({"name": "x", "extra": 1}, {"extra"}),
    ({"name": "x" * 201}, {"name"}),
    ({"name": "a\x00b", "preset": "demo", "overrides": {"data.prompt_template": "{prompt}\x00",
                                                         "optim.lr": float("nan")}},
     {"name", "data.prompt_template", "optim.lr"}),  # every bad key at once
    ({"name": "x", "preset": "demo", "overrides": {"data.prompt_template": "{prompt}\x00"}},
     {"data.prompt_template"}),
    ({"name": "x", "preset": "demo", "overrides": {"run.max_steps": 10**30, "optim.lr": {"a": 1}}},
     {"run.max_steps", "optim.lr"}),
])
def test_launch_errors_are_per_key(alice, payload, keys):
    r = post(alice, "/api/runs", payload)
    assert r.status_code == 400, r.content
    assert set(r.json()["errors"]) == keys
    assert all(isinstance(v, str) and v for v in r.json()["errors"].values())
    assert not Run.objects.exists()


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", "\"s\"", "null", "\xff\xfe"])
def test_bad_bodies_are_400_not_500(alice, raw):
    r = post(alice, "/api/runs", raw=raw)
    assert r.status_code == 400
    assert "message" in r.json()


def test_bad_ids_and_methods(alice):
    assert alice.get("/api/runs/999").status_code == 404
    assert post(alice, "/api/runs/999/stop").status_code == 404
    assert alice.get("/api/runs/999/metrics").status_code == 404
    assert alice.put("/api/runs").status_code == 405
    assert alice.get("/api/runs?limit=abc").status_code == 400


def test_session_writes_need_csrf(user):
    from django.test import Client

    c = Client(enforce_csrf_checks=True)
    c.force_login(user)
    r = post(c, "/api/runs", {"name": "x", "preset": "demo"})
    assert r.status_code == 403 and "CSRF" in r.json()["message"]
    c.get("/")  # sets the csrftoken cookie
    token = c.cookies["csrftoken"].value
    r = post(c, "/api/runs", {"name": "x", "preset": "demo"}, HTTP_X_CSRFTOKEN=token)
    assert r.status_code == 201


def test_knob_changes(alice, bob, user, make_run):
    run = make_run(user, "running")
    r = post(alice, f"/api/runs/{run.pk}/knobs", {"optim.lr": "5e-5", "rollout.temperature": 0.7})
    assert r.status_code == 202, r.content
    (cid,) = r.json()["change_ids"]
    kc = KnobChange.objects.get(change_id=cid)
    assert kc.knobs == {"optim.lr": 5e-5, "rollout.temperature": 0.7} and kc.status == "pending"
    assert RunEvent.objects.filter(run=run, kind="knob_requested").exists()
    # out of range / not tunable / unknown / empty: 400 with the key
    r = post(alice, f"/api/runs/{run.pk}/knobs", {"optim.lr": 5})
    assert r.status_code == 400 and set(r.json()["errors"]) == {"optim.lr"}
    r = post(alice, f"/api/runs/{run.pk}/knobs", {"run.max_steps": 5})
    assert r.status_code == 400 and "not a knob" in r.json()["errors"]["run.max_steps"]
    r = post(alice, f"/api/runs/{run.pk}/knobs", {"optim.zzz": 5})
    assert r.status_code == 400 and "optim.zzz" in r.json()["errors"]
    assert post(alice, f"/api/runs/{run.pk}/knobs", {}).status_code == 400
    # another user may watch but not tune
    assert bob.get(f"/api/runs/{run.pk}").status_code == 200
    r = post(bob, f"/api/runs/{run.pk}/knobs", {"optim.lr": 1e-5})
    assert r.status_code == 403
    assert KnobChange.objects.count() == 1
    # a finished run takes no knobs
    Run.objects.filter(pk=run.pk).update(status="finished")
    assert post(alice, f"/api/runs/{run.pk}/knobs", {"optim.lr": 1e-5}).status_code == 409


def test_cross_field_knob_check(alice, user, make_run):
    run = make_run(user, "running")
    # overlong_buffer must stay below max_response_len (64) when the penalty is on
    r = post(alice, f"/api/runs/{run.pk}/knobs", {"algo.overlong_penalty": True, "algo.overlong_buffer": 64})
    assert r.status_code == 400 and "algo.overlong_buffer" in r.json()["errors"]


def test_state_machine(alice, bob, staff_user, user, make_run):
    from django.test import Client

    run = make_run(user, "running")
    assert post(bob, f"/api/runs/{run.pk}/pause").status_code == 403
    assert post(alice, f"/api/runs/{run.pk}/resume").status_code == 409
    r = post(alice, f"/api/runs/{run.pk}/pause")
    assert r.status_code == 202 and r.json()["desired"] == "pause"
    assert post(alice, f"/api/runs/{run.pk}/pause").status_code == 409
    Run.objects.filter(pk=run.pk).update(status="paused")   # what the worker does on ack
    r = post(alice, f"/api/runs/{run.pk}/resume")
    assert r.status_code == 202 and r.json()["desired"] == "run"
    Run.objects.filter(pk=run.pk).update(status="running")
    staff = Client()
    staff.force_login(staff_user)
    r = post(staff, f"/api/runs/{run.pk}/stop")        # staff may control anyone's run
    assert r.status_code == 202 and r.json()["status"] == "stopping"
    assert post(alice, f"/api/runs/{run.pk}/stop").status_code == 409
    assert post(alice, f"/api/runs/{run.pk}/pause").status_code == 409
    r = post(alice, f"/api/runs/{run.pk}/kill")
    assert r.status_code == 202 and r.json()["status"] == "stopped"
    assert post(alice, f"/api/runs/{run.pk}/kill").status_code == 409
    assert post(alice, f"/api/runs/{run.pk}/stop").status_code == 409
    # stopped -> resume queues it again
    r = post(alice, f"/api/runs/{run.pk}/resume")
    assert r.status_code == 202 and r.json()["status"] == "queued"
    # queued -> stop is immediate
    r = post(alice, f"/api/runs/{run.pk}/stop")
    assert r.status_code == 202 and r.json()["status"] == "stopped"
    Run.objects.filter(pk=run.pk).update(status="finished")
    for action in ("stop", "pause", "resume", "kill"):
        assert post(alice, f"/api/runs/{run.pk}/{action}").status_code == 409
    statuses = list(RunEvent.objects.filter(run=run, kind="status").order_by("seq")
                    .values_list("data__status", flat=True))
    assert statuses == ["running", "stopping", "stopped", "queued", "stopped"]


def test_resuming_an_interrupted_run_clears_its_heartbeat_alert(alice, user, make_run):
    run = make_run(user, "interrupted")
    other = {"message": "KL 0.9 > 0.5", "step": 3}
    Run.objects.filter(pk=run.pk).update(alerts={"active": {
        "heartbeat": {"message": "heartbeat lost", "step": 3}, "kl_high": other}})
    r = post(alice, f"/api/runs/{run.pk}/resume")
    assert r.status_code == 202 and r.json()["status"] == "queued"
    assert Run.objects.get(pk=run.pk).alerts["active"] == {"kl_high": other}
    cleared = RunEvent.objects.filter(run=run, kind="alert_cleared")
    assert [e.data["rule"] for e in cleared] == ["heartbeat"]
    # nothing to clear the next time: no second event
    Run.objects.filter(pk=run.pk).update(status="interrupted")
    assert post(alice, f"/api/runs/{run.pk}/resume").status_code == 202
    assert RunEvent.objects.filter(run=run, kind="alert_cleared").count() == 1


def test_delete(alice, bob, user, make_run):
    run = make_run(user, "running")
    assert alice.delete(f"/api/runs/{run.pk}").status_code == 409
    Run.objects.filter(pk=run.pk).update(status="stopped")
    assert bob.delete(f"/api/runs/{run.pk}").status_code == 403
    assert alice.delete(f"/api/runs/{run.pk}").status_code == 200
    assert not Run.objects.filter(pk=run.pk).exists()


def test_list_and_filter(alice, user, other_user, make_run):
    make_run(user, "running", name="alpha")
    make_run(other_user, "finished", name="beta")
    runs = alice.get("/api/runs").json()["runs"]
    assert [r["name"] for r in runs] == ["beta", "alpha"]
    assert [r["name"] for r in alice.get("/api/runs?status=finished").json()["runs"]] == ["beta"]
    assert [r["name"] for r in alice.get("/api/runs?owner=alice").json()["runs"]] == ["alpha"]
    assert [r["name"] for r in alice.get("/api/runs?q=ALP").json()["runs"]] == ["alpha"]
    assert alice.get("/api/runs?q=%00&owner=%00&status=%00").status_code == 200
    assert alice.get("/?q=%00").status_code == 200
    assert runs[0]["can_control"] is False and runs[1]["can_control"] is True


def test_heartbeat_lost_marks_interrupted_and_resume(alice, user, make_run):
    from datetime import timedelta

    from django.utils import timezone

    run = make_run(user, "running", heartbeat_at=timezone.now() - timedelta(minutes=5))
    fresh = make_run(user, "running", heartbeat_at=timezone.now())
    assert sweep.mark_stale_runs(force=True) == 1
    assert alice.get(f"/api/runs/{run.pk}").json()["status"] == "interrupted"
    assert alice.get(f"/api/runs/{fresh.pk}").json()["status"] == "running"
    r = post(alice, f"/api/runs/{run.pk}/resume")
    assert r.status_code == 202 and r.json()["status"] == "queued"


def test_metrics_cursor_keys_and_downsampling(alice, user, make_run):
    run = make_run(user, "running", max_steps=5000)
    base = run.last_seq
    recs = []
    for step in range(1, 3001):
        recs.append(Record("points", step, "", {"reward/mean": step % 97, "actor/kl": -step,
                                                "bad": float("nan")}))
    recs.append(Record("histogram", 3000, "rollout/response_len", {"edges": [0, 1, 2], "counts": [3, 4]}))
    recs.append(Record("event", 3000, "knob_applied",
                       {"change_id": "c1", "changes": {"optim.lr": {"old": 1e-4, "new": 5e-5}}}))
    actions.append(run.pk, recs)
    r = alice.get(f"/api/runs/{run.pk}/metrics?keys=reward/mean,bad&max_points=200")
    assert r.status_code == 200
    data = r.json()
    assert set(data["points"]) == {"reward/mean", "bad"}
    s = data["points"]["reward/mean"]
    assert len(s["steps"]) <= 200 and data["downsampled"]
    assert max(s["values"]) == 96 and min(s["values"]) == 0     # min/max kept per bucket
    assert s["steps"] == sorted(s["steps"])
    assert data["points"]["bad"]["values"][0] is None             # NaN -> null
    # fewer points: min/max per bucket in Python, exact steps
    exact = alice.get(f"/api/runs/{run.pk}/metrics?keys=actor/kl&max_points=1000").json()["points"]["actor/kl"]
    assert len(exact["steps"]) <= 1000 and min(exact["values"]) == -3000 and max(exact["values"]) == -1
    assert all(-v == st for st, v in zip(exact["steps"], exact["values"]))
    assert data["cursor"] == base + 3002
    assert data["histograms"][-1]["counts"] == [3, 4]
    assert data["events"][-1]["kind"] == "knob_applied"
    assert Run.objects.get(pk=run.pk).knobs["optim.lr"] == 5e-5
    # after a cursor: raw rows, paged
    r = alice.get(f"/api/runs/{run.pk}/metrics?after={base + 2998}").json()
    assert r["points"]["actor/kl"]["steps"] == [2999, 3000]
    assert r["cursor"] == base + 3002
    assert alice.get(f"/api/runs/{run.pk}/metrics?after=-1").status_code == 400
    assert alice.get(f"/api/runs/{run.pk}/metrics?max_points=x").status_code == 400


def test_downsample_keeps_extremes():
    from webapp.dashboard.rows.stream import downsample

    steps = list(range(10_000))
    values = [0.0] * 10_000
    values[1234], values[7777] = 50.0, -50.0
    s, v = downsample(steps, values, 100)
    assert len(s) <= 100 and 50.0 in v and -50.0 in v and s == sorted(s)
    assert downsample([1, 2], [1.0, 2.0], 100) == ([1, 2], [1.0, 2.0])


def test_a_knob_event_and_its_change_row_are_written_together(user, make_run):
    """The trainer's knob_applied / knob_rejected event turns the change's row applied /
    rejected in the same transaction (a reader of the event never finds it pending)."""
    run = make_run(user, "running")
    ok = KnobChange.objects.create(run=run, change_id="c-ok", knobs={"optim.lr": 1e-5}, requested_by=user)
    bad = KnobChange.objects.create(run=run, change_id="c-bad", knobs={"optim.lr": -1}, requested_by=user)
    actions.append(run.pk, [
        Record("event", 7, "knob_applied", {"change_id": "c-ok", "changes": {"optim.lr": {"old": 2e-4, "new": 1e-5}}}),
        Record("event", 8, "knob_rejected", {"change_id": "c-bad", "errors": {"optim.lr": "must be >= 0"}})],
        ring_bell=False)
    ok.refresh_from_db(), bad.refresh_from_db()
    assert (ok.status, ok.applied_step) == (KnobChange.APPLIED, 7)
    assert (bad.status, bad.applied_step, bad.message) == (KnobChange.REJECTED, 8, "must be >= 0")
    assert Run.objects.get(pk=run.pk).knobs["optim.lr"] == 1e-5
