"""A real Celery worker (prefork, the setup's broker) running tiny runs: to completion, and
live control -- knob change, pause, resume, stop, resume from the checkpoint, kill."""
import asyncio
import json
import time

import pytest

from webapp.dashboard.models import KnobChange, MetricPoint, Run, RunEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def post(client, url, data=None):
    return client.post(url, json.dumps(data or {}), content_type="application/json")


def status_of(run_id):
    return Run.objects.filter(pk=run_id).values_list("status", flat=True).first()


def test_tiny_run_to_completion(celery_worker, alice, tiny, wait_until):
    r = post(alice, "/api/runs", {"name": "tiny", "preset": "demo", "overrides": {**tiny, "run.max_steps": 4}})
    assert r.status_code == 201
    rid = r.json()["id"]
    wait_until(lambda: status_of(rid) in ("finished", "failed"), 120, "the run to finish")
    run = Run.objects.get(pk=rid)
    assert run.status == "finished", run.error + celery_worker.text()[-3000:]
    assert run.step == 4 and run.summary["final"]["steps"] == 4
    assert run.worker_host and run.started_at and run.finished_at and run.heartbeat_at
    steps = sorted(set(MetricPoint.objects.filter(run=run, key="reward/mean").values_list("step", flat=True)))
    assert steps == [1, 2, 3, 4]
    assert MetricPoint.objects.filter(run=run, key="train/policy_version").count() == 4
    kinds = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("kind", flat=True))
    assert kinds[:3] == ["status", "status", "run_started"]
    assert "checkpoint" in kinds and kinds[-2:] == ["run_finished", "status"]
    detail = alice.get(f"/api/runs/{rid}").json()
    assert detail["status"] == "finished" and detail["progress"] == 1.0
    data = alice.get(f"/api/runs/{rid}/metrics?keys=reward/accuracy").json()
    assert len(data["points"]["reward/accuracy"]["steps"]) == 4
    assert [h["step"] for h in data["histograms"] if h["name"] == "rollout/response_len"] == [1, 2, 3, 4]


def test_live_control_of_a_run(celery_worker, alice, tiny, wait_until):
    from channels.testing import WebsocketCommunicator

    from webapp.asgi import application

    r = post(alice, "/api/runs", {"name": "long", "preset": "demo",
                                  "overrides": {**tiny, "run.max_steps": 2000}})
    rid = r.json()["id"]
    wait_until(lambda: Run.objects.filter(pk=rid, step__gte=2).exists(), 120, "a few steps")

    # a knob change over the WebSocket, applied at a step boundary
    async def tune():
        comm = WebsocketCommunicator(application, f"/ws/runs/{rid}/", headers=[
            (b"host", b"localhost"), (b"origin", b"http://localhost"),
            (b"cookie", f"sessionid={alice.cookies['sessionid'].value}".encode())])
        ok, _ = await comm.connect()
        assert ok
        await comm.send_to(text_data=json.dumps({"type": "set_knobs", "knobs": {"optim.lr": 2e-5}}))
        deadline = time.monotonic() + 60
        ack = None
        while time.monotonic() < deadline:
            m = json.loads(await comm.receive_from(timeout=30))
            if m["type"] == "knob_ack":
                ack = m
            if m.get("kind") == "knob_applied" and ack and m["data"]["change_id"] == ack["change_id"]:
                await comm.disconnect()
                return m
        raise AssertionError("no knob_applied")
    applied = asyncio.run(tune())
    assert applied["data"]["changes"]["optim.lr"]["new"] == 2e-5 and applied["step"] >= 2
    kc = KnobChange.objects.get(run_id=rid)
    assert kc.status == "applied" and kc.applied_step == applied["step"]
    assert Run.objects.get(pk=rid).knobs["optim.lr"] == 2e-5
    wait_until(lambda: MetricPoint.objects.filter(run_id=rid, key="actor/lr", value=2e-5).exists(), 30,
               "the new learning rate in the metrics")

    # pause holds the trainer at a step boundary; resume continues
    assert post(alice, f"/api/runs/{rid}/pause").status_code == 202
    wait_until(lambda: status_of(rid) == "paused", 30, "paused")
    step = Run.objects.get(pk=rid).step
    time.sleep(1.5)
    assert Run.objects.get(pk=rid).step == step
    assert post(alice, f"/api/runs/{rid}/resume").status_code == 202
    wait_until(lambda: Run.objects.filter(pk=rid, status="running", step__gt=step).exists(), 30, "running again")

    # cooperative stop: finishes its step, checkpoints, exits
    assert post(alice, f"/api/runs/{rid}/stop").status_code == 202
    wait_until(lambda: status_of(rid) == "stopped", 60, "stopped")
    stopped_at = Run.objects.get(pk=rid).step
    kinds = set(RunEvent.objects.filter(run_id=rid).values_list("kind", flat=True))
    assert {"stop_requested", "checkpoint", "run_stopped", "paused", "resumed"} <= kinds

    # resume from the checkpoint, then kill
    assert post(alice, f"/api/runs/{rid}/resume").status_code == 202
    wait_until(lambda: Run.objects.filter(pk=rid, status="running", step__gt=stopped_at).exists(), 120,
               "resumed past the checkpoint")
    assert RunEvent.objects.filter(run_id=rid, kind="run_resumed").exists()
    assert post(alice, f"/api/runs/{rid}/kill").status_code == 202
    assert status_of(rid) == "stopped"
    # the process is gone: no more rows after a moment
    time.sleep(2.0)
    last = Run.objects.get(pk=rid).last_seq
    time.sleep(2.0)
    assert Run.objects.get(pk=rid).last_seq == last, "the killed run is still writing"
    killed = RunEvent.objects.get(run_id=rid, kind="killed").seq
    assert not RunEvent.objects.filter(run_id=rid, seq__gt=killed, kind="run_stopped").exists(), \
        "the run stopped cooperatively instead of being killed"
    # the worker survives a kill and takes the next run
    r = post(alice, "/api/runs", {"name": "after-kill", "preset": "demo", "overrides": {**tiny, "run.max_steps": 2}})
    wait_until(lambda: status_of(r.json()["id"]) == "finished", 120, "the next run to finish")
