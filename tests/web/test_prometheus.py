"""GET /metrics (Prometheus text format, read back with prometheus_client's own parser) and
GET /health: off by default, behind a bearer token, the gauges of live runs (rows written through
the actions layer, and a real run trained by the Celery worker), queue lengths from the setup's
broker, WebSocket clients counted across the consumers, and /health naming the part that is down."""
from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
from channels.layers import InMemoryChannelLayer
from conftest import ROOT
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from trainer.observe import metric_names
from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import MetricPoint, Run
from webapp.dashboard.monitoring import collector, sockets

TOKEN = "prometheus-test-token-0123456789"
AUTH = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}


@pytest.fixture
def metrics_on(settings):
    settings.RLPILOT_METRICS_ENABLED = True
    settings.RLPILOT_METRICS_TOKEN = TOKEN
    return settings


def scrape(client) -> tuple[dict[tuple, float], set[str]]:
    """({(sample name, sorted label pairs): value}, family names) of one GET /metrics."""
    r = client.get("/metrics", **AUTH)
    assert r.status_code == 200, r.content[:500]
    assert r["Content-Type"].startswith("text/plain; version=0.0.4")
    samples, families = {}, set()
    for family in text_string_to_metric_families(r.content.decode()):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, families


def run_labels(run) -> tuple:
    return tuple(sorted({"run_id": str(run.pk), "name": run.name, "preset": run.preset,
                         "owner": run.owner.get_username()}.items()))


# --- access ------------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_off_by_default_both_endpoints_are_404(client, settings):
    settings.RLPILOT_METRICS_TOKEN = TOKEN   # a token alone does not turn them on
    for url in ("/metrics", "/health"):
        assert client.get(url, **AUTH).status_code == 404


@pytest.mark.django_db
@pytest.mark.parametrize("header", [None, "Bearer wrong-token-0123456789abcdef", f"Bearer {TOKEN}x",
                                    f"Token {TOKEN}", TOKEN, "Bearer "])
def test_refused_without_the_token_or_with_a_wrong_one(client, metrics_on, header):
    extra = {} if header is None else {"HTTP_AUTHORIZATION": header}
    for url in ("/metrics", "/health"):
        r = client.get(url, **extra)
        assert r.status_code == 401, (url, header)
        assert r["WWW-Authenticate"] == 'Bearer realm="rlpilot-metrics"'
        assert b"rlpilot_" not in r.content


@pytest.mark.django_db
def test_without_a_token_only_when_the_settings_allow_it(client, settings):
    settings.RLPILOT_METRICS_ENABLED = True
    settings.RLPILOT_METRICS_TOKEN = ""   # settings.py refuses this unless ALLOW_NO_TOKEN (below)
    assert client.get("/metrics").status_code == 200
    assert client.post("/metrics").status_code == 405


def test_the_settings_refuse_to_enable_without_a_token(tmp_path):
    """Each case imports the settings afresh in one child interpreter."""
    code = textwrap.dedent("""
        import importlib, json, os
        cases = {
            "on, no token": {"RLPILOT_METRICS_ENABLED": "true"},
            "on, no token, allowed": {"RLPILOT_METRICS_ENABLED": "true", "RLPILOT_METRICS_ALLOW_NO_TOKEN": "1"},
            "on, token": {"RLPILOT_METRICS_ENABLED": "yes", "RLPILOT_METRICS_TOKEN": " %s "},
            "short token": {"RLPILOT_METRICS_TOKEN": "abc"},
            "bad flag": {"RLPILOT_METRICS_ENABLED": "maybe"},
            "bad ping timeout": {"RLPILOT_HEALTH_PING_TIMEOUT_S": "0"},
            "off": {},
        }
        out, settings = {}, None
        for name, env in cases.items():
            for k in ("RLPILOT_METRICS_ENABLED", "RLPILOT_METRICS_TOKEN", "RLPILOT_METRICS_ALLOW_NO_TOKEN",
                      "RLPILOT_HEALTH_PING_TIMEOUT_S"):
                os.environ.pop(k, None)
            os.environ.update(env)
            try:
                import webapp.settings as settings
                settings = importlib.reload(settings)
                out[name] = [settings.RLPILOT_METRICS_ENABLED, settings.RLPILOT_METRICS_TOKEN]
            except ValueError as e:
                out[name] = str(e)
        print(json.dumps(out))
    """ % TOKEN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLPILOT_METRICS_", "RLPILOT_HEALTH_"))}
    env.update(RLPILOT_VAR_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "needs RLPILOT_METRICS_TOKEN" in out["on, no token"]
    assert "RLPILOT_METRICS_ALLOW_NO_TOKEN=true" in out["on, no token"]
    assert out["on, no token, allowed"] == [True, ""]
    assert out["on, token"] == [True, TOKEN]   # surrounding blanks dropped
    assert "RLPILOT_METRICS_TOKEN: 3 characters; expected at least 16" in out["short token"]
    assert out["bad flag"] == "RLPILOT_METRICS_ENABLED='maybe': expected true or false"
    assert out["bad ping timeout"] == "RLPILOT_HEALTH_PING_TIMEOUT_S=0: expected seconds in (0, 60]"
    assert out["off"] == [False, ""]


# --- /metrics ----------------------------------------------------------------------------------------

def test_every_run_figure_is_a_declared_trainer_metric():
    for gauge, key, _, _ in collector.RUN_FIGURES:
        assert metric_names.declared(key), (gauge, key)
        assert gauge.startswith("rlpilot_run_")


@pytest.mark.django_db
def test_metrics_hold_the_latest_figures_of_live_runs(client, metrics_on, user, other_user, make_run, settings):
    settings.RLPILOT_RATE_GPU_HOUR, settings.RLPILOT_RATE_CPU_CORE_HOUR = 2.0, 0.36
    now = timezone.now()
    run = make_run(user, status="running", name='grpo "α" run', max_steps=50,
                   worker_host="gpu-h200@host7:4242", heartbeat_at=now - timedelta(seconds=3))
    paused = make_run(other_user, status="paused", name="second", worker_host="gpu-h200@host7:4243",
                      heartbeat_at=now - timedelta(seconds=1))
    ended = make_run(user, status="finished", name="done", worker_host="old@host1:1", heartbeat_at=now)
    make_run(user, status="queued", name="waiting")
    for step, reward in ((1, 0.25), (2, 0.5), (3, 0.75)):
        actions.append(run.pk, [Record("points", step, "", {
            "reward/mean": reward, "reward/accuracy": reward / 2, "actor/kl": 0.01 * step,
            "perf/gen_tokens_per_s": 100.0 * step, "async/staleness/mean": 0.5,
            "async/staleness/max": 2, "system/gpu_util": 80.0, "system/gpu_mem_gb": 1.5,
            "timing/step_s": 2.0})], {"step": step})
    # a figure the trainer last reported as NaN is NaN here, not its earlier value
    actions.append(run.pk, [Record("points", 4, "", {"actor/kl": float("nan")})], {"step": 4})
    actions.append(paused.pk, [Record("points", 1, "", {"reward/mean": -1.0, "system/cpu_util": 37.5,
                                                         "system/ram_gb": 2.0})], {"step": 1})
    # device-hours so far, priced at the run's own rate (a knob) or the deployment's
    actions.append(run.pk, [Record("points", 4, "", {"cost/gpu_hours": 1.5, "cost/cpu_core_hours": 0.0})])
    Run.objects.filter(pk=run.pk).update(knobs={**run.knobs, "cost.gpu_hour": 3.0})
    actions.append(paused.pk, [Record("points", 1, "", {"cost/gpu_hours": 0.0, "cost/cpu_core_hours": 0.5})])
    actions.append(ended.pk, [Record("points", 1, "", {"reward/mean": 9.0})], {"step": 1})

    samples, _ = scrape(client)
    labels, labels2 = run_labels(run), run_labels(paused)
    # (the labels hold the run's quoted, non-ASCII name: it came back whole)
    assert samples[("rlpilot_run_step", labels)] == 4
    assert samples[("rlpilot_run_max_steps", labels)] == 50
    assert samples[("rlpilot_run_reward_mean", labels)] == 0.75
    assert samples[("rlpilot_run_reward_accuracy", labels)] == 0.375
    assert math.isnan(samples[("rlpilot_run_kl", labels)])
    assert samples[("rlpilot_run_generated_tokens_per_second", labels)] == 300.0
    assert samples[("rlpilot_run_staleness_mean", labels)] == 0.5
    assert samples[("rlpilot_run_staleness_max", labels)] == 2
    assert samples[("rlpilot_run_gpu_utilization_percent", labels)] == 80.0
    assert samples[("rlpilot_run_gpu_memory_used_bytes", labels)] == 1.5 * 2 ** 30
    assert samples[("rlpilot_run_step_duration_seconds", labels)] == 2.0
    assert 3 <= samples[("rlpilot_run_heartbeat_age_seconds", labels)] < 60
    assert samples[("rlpilot_run_status", labels + (("status", "running"),))] == 1
    assert ("rlpilot_run_cpu_utilization_percent", labels) not in samples   # never reported
    assert samples[("rlpilot_run_reward_mean", labels2)] == -1.0
    assert samples[("rlpilot_run_cpu_utilization_percent", labels2)] == 37.5
    assert samples[("rlpilot_run_memory_rss_bytes", labels2)] == 2.0 * 2 ** 30
    assert samples[("rlpilot_run_status", labels2 + (("status", "paused"),))] == 1
    assert samples[("rlpilot_run_gpu_hours", labels)] == 1.5 and samples[("rlpilot_run_price", labels)] == 4.5
    assert samples[("rlpilot_run_cpu_core_hours", labels2)] == 0.5
    assert samples[("rlpilot_run_price", labels2)] == pytest.approx(0.18)   # 0.5 core-hours at 0.36
    # an ended run is counted, not shown
    assert not [k for k in samples if dict(k[1]).get("run_id") == str(ended.pk)]
    counts = {dict(k[1])["status"]: v for k, v in samples.items() if k[0] == "rlpilot_runs"}
    assert counts == {"queued": 1, "running": 1, "paused": 1, "stopping": 0, "stopped": 0,
                      "finished": 1, "failed": 0, "interrupted": 0}
    # one worker node, two processes: its freshest heartbeat
    assert 1 <= samples[("rlpilot_worker_heartbeat_age_seconds", (("worker", "gpu-h200@host7"),))] < 3
    assert samples[("rlpilot_workers_seen", ())] == 1
    assert samples[("rlpilot_broker_up", ())] == 1


@pytest.mark.django_db
def test_queue_lengths_come_from_the_setups_broker(client, metrics_on):
    from webapp.celery import app

    queue = f"metrics-probe-{os.getpid()}"
    metrics_on.RLPILOT_QUEUES = [*metrics_on.RLPILOT_QUEUES, queue]
    samples, _ = scrape(client)
    assert samples[("rlpilot_celery_queue_length", (("queue", queue),))] == 0
    assert samples[("rlpilot_celery_queue_length", (("queue", metrics_on.SWEEP_QUEUE),))] >= 0
    try:
        for _ in range(3):   # nobody consumes this queue
            app.send_task("nothing.here", queue=queue)
        samples, _ = scrape(client)
        assert samples[("rlpilot_celery_queue_length", (("queue", queue),))] == 3
    finally:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_purge(queue)
    samples, _ = scrape(client)
    assert samples[("rlpilot_celery_queue_length", (("queue", queue),))] == 0


@pytest.mark.django_db(transaction=True)
def test_websocket_clients_are_counted_while_connected(alice, metrics_on, user, make_run, wait_until):
    from channels.testing import WebsocketCommunicator

    from webapp.asgi import application

    run = make_run(user)
    key = ("rlpilot_websocket_clients", (("process", sockets.PROCESS),))

    def clients():
        return scrape(alice)[0].get(key)

    async def open_sockets(n):
        comms = []
        for _ in range(n):
            comm = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/", headers=[
                (b"host", b"localhost"), (b"origin", b"http://localhost"),
                (b"cookie", f"sessionid={alice.cookies['sessionid'].value}".encode())])
            ok, _ = await comm.connect()
            assert ok
            comms.append(comm)
        return comms

    async def scenario():
        comms = await open_sockets(3)
        await asyncio.to_thread(wait_until, lambda: clients() == 3, 10, "3 clients in /metrics")
        for comm in comms[:2]:
            await comm.disconnect()
        await asyncio.to_thread(wait_until, lambda: clients() == 1, 10, "1 client in /metrics")
        await comms[2].disconnect()
        await asyncio.to_thread(wait_until, lambda: clients() == 0, 10, "no client in /metrics")

    asyncio.run(scenario())
    assert scrape(alice)[0][("rlpilot_cache_up", ())] == 1


def test_the_grafana_dashboard_queries_only_metrics_that_exist(client, metrics_on, db):
    dashboard = json.loads((ROOT / "docs" / "grafana" / "rlpilot.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    queried = {m for e in exprs for m in re.findall(r"\brlpilot_[a-z_]+", e)}
    _, families = scrape(client)
    assert len(queried) >= 20 and queried <= families, queried - families


# --- /health -------------------------------------------------------------------------------------------

class SendFailsLayer(InMemoryChannelLayer):
    """An in-memory layer that is down: every send raises, as channels_redis's does when Redis
    refuses connections."""

    async def send(self, channel, message):
        raise ConnectionRefusedError(111, "Connection refused (this test's channel layer is down)")


@pytest.mark.django_db
@pytest.mark.parametrize("layer", [
    {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": ["redis://127.0.0.1:1/0"]}},
    {"BACKEND": f"{__name__}.SendFailsLayer"},
], ids=["redis at a closed port", "a layer whose send raises"])
def test_health_is_503_naming_the_channel_layer_when_it_is_down(client, metrics_on, user, make_run, layer):
    # a live run whose worker beat just now: the worker check passes without a ping
    make_run(user, status="running", worker_host="w1@host:7", heartbeat_at=timezone.now())
    metrics_on.CHANNEL_LAYERS = {"default": layer}
    r = client.get("/health", **AUTH)
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "down" and body["down"] == ["channel_layer"]
    assert "Connect" in body["checks"]["channel_layer"]["error"]
    assert body["checks"]["database"]["ok"] and body["checks"]["broker"]["ok"]
    assert body["checks"]["worker"] == {**body["checks"]["worker"], "ok": True, "seen_by": "heartbeat",
                                        "workers": ["w1@host"]}


@pytest.mark.django_db
def test_health_is_503_naming_the_worker_when_none_is_seen(client, metrics_on, user, make_run):
    metrics_on.RLPILOT_HEALTH_PING_TIMEOUT_S = 0.5
    # a live run whose heartbeat is too old does not count
    make_run(user, status="running", worker_host="w1@host:7",
             heartbeat_at=timezone.now() - timedelta(seconds=metrics_on.HEARTBEAT_TIMEOUT_S + 5))
    r = client.get("/health", **AUTH)
    body = r.json()
    assert r.status_code == 503 and body["down"] == ["worker"], body
    assert "no Celery worker answered a ping within 0.5 s" in body["checks"]["worker"]["error"]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_with_a_real_worker_health_is_200_and_metrics_show_its_run(celery_worker, alice, metrics_on, tiny,
                                                                   wait_until):
    # an idle worker answers the ping
    r = alice.get("/health", **AUTH)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "ok" and body["down"] == [], body
    assert set(body["checks"]) == {"database", "channel_layer", "broker", "worker"}
    assert all(c["ok"] for c in body["checks"].values())
    assert body["checks"]["worker"]["seen_by"] == "ping" and body["checks"]["worker"]["workers"]

    r = alice.post("/api/runs", json.dumps({"name": "watched", "preset": "demo",
                                            "overrides": {**tiny, "run.max_steps": 2000}}),
                   content_type="application/json")
    rid = r.json()["id"]
    wait_until(lambda: Run.objects.filter(pk=rid, step__gte=2).exists(), 120, "a few steps")
    # paused, the figures hold still: the gauges must equal the latest points
    assert alice.post(f"/api/runs/{rid}/pause", "{}", content_type="application/json").status_code == 202
    wait_until(lambda: Run.objects.filter(pk=rid, status="paused").exists(), 60, "the run to pause")
    run = Run.objects.select_related("owner").get(pk=rid)
    samples, _ = scrape(alice)
    labels = run_labels(run)
    assert samples[("rlpilot_run_step", labels)] == run.step
    assert samples[("rlpilot_run_status", labels + (("status", "paused"),))] == 1
    for gauge, key, _, factor in collector.RUN_FIGURES:
        point = MetricPoint.objects.filter(run_id=rid, key=key).order_by("-step", "-seq").first()
        if point is not None:
            assert samples[(gauge, labels)] == pytest.approx(point.value * factor), gauge
    assert ("rlpilot_run_reward_mean", labels) in samples and ("rlpilot_run_kl", labels) in samples
    node = collector.worker_node(run.worker_host)
    assert samples[("rlpilot_worker_heartbeat_age_seconds", (("worker", node),))] < 30
    assert samples[("rlpilot_workers_seen", ())] == 1
    body = alice.get("/health", **AUTH).json()
    assert body["status"] == "ok" and body["checks"]["worker"]["seen_by"] == "heartbeat"
    assert body["checks"]["worker"]["workers"] == [node]

    assert alice.post(f"/api/runs/{rid}/stop", "{}", content_type="application/json").status_code == 202
    wait_until(lambda: Run.objects.filter(pk=rid, status__in=["stopped", "finished"]).exists(), 60,
               "the run to stop")
    samples, _ = scrape(alice)
    assert not [k for k in samples if dict(k[1]).get("run_id") == str(rid)]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_real_server_counts_its_sockets_and_answers_health(celery_worker, test_db_env, free_port, user,
                                                             make_run, tmp_path, wait_until, setup_name):
    """daphne (another process) with the endpoints enabled: its WebSocket clients in its /metrics
    (and, with Redis, in the shared cache this process reads), and /health 200 from its event loop."""
    import socket
    import urllib.request

    from conftest import Proc
    from django.test import Client
    from websockets.sync.client import connect

    from webapp.dashboard.management.commands.serve import server_command

    env = {**test_db_env, "RLPILOT_METRICS_ENABLED": "true", "RLPILOT_METRICS_TOKEN": TOKEN}
    proc = Proc("daphne", server_command("127.0.0.1", free_port), env, tmp_path / "daphne.log")
    base = f"http://127.0.0.1:{free_port}"

    def listening():
        try:
            socket.create_connection(("127.0.0.1", free_port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def get(path):
        req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def server_clients():
        status, text = get("/metrics")
        assert status == 200, text
        return {s.labels["process"]: s.value for f in text_string_to_metric_families(text)
                if f.name == "rlpilot_websocket_clients" for s in f.samples}

    try:
        proc.wait_for(listening, 60, "listening port")
        run = make_run(user)
        browser = Client()
        browser.force_login(user)
        headers = {"Cookie": f"sessionid={browser.cookies['sessionid'].value}", "Origin": base}
        url = f"ws://127.0.0.1:{free_port}/ws/runs/{run.pk}/"
        with connect(url, additional_headers=headers) as one, connect(url, additional_headers=headers):
            one.recv(timeout=30)   # the socket is served (its run's backlog)
            counts = wait_until(lambda: (c := server_clients()) and sum(c.values()) == 2 and c, 15,
                                "2 clients in the server's /metrics")
            # counted by the server process; this process, and with Redis an earlier test's server that
            # stopped less than sockets.TTL_S ago, may still show a 0
            assert sorted(n for p, n in counts.items() if p != sockets.PROCESS)[-1:] == [2]
            assert sum(counts.values()) == 2
            if setup_name == "redis":   # the count is in Redis, shared by every web process
                assert sum(sockets.counts().values()) == 2
        wait_until(lambda: sum(server_clients().values()) == 0, 15, "no client after they closed")

        status, text = get("/health")
        body = json.loads(text)
        assert status == 200 and body["down"] == [], body
        assert body["checks"]["channel_layer"]["ok"] and body["checks"]["worker"]["workers"]
        assert get("/metrics")[0] == 200
        req = urllib.request.Request(base + "/metrics")   # no token
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 401
    finally:
        proc.stop()


@pytest.mark.django_db
def test_a_broker_down_empties_the_queue_gauges_and_fails_health(client, metrics_on, user, make_run, monkeypatch):
    from webapp.celery import app

    make_run(user, status="running", worker_host="w1@host:7", heartbeat_at=timezone.now())
    monkeypatch.setitem(app.conf, "broker_url", "redis://127.0.0.1:1/0")   # nothing listens there
    monkeypatch.setitem(app.conf, "broker_read_url", None)
    monkeypatch.setitem(app.conf, "broker_write_url", None)
    samples, _ = scrape(client)
    assert samples[("rlpilot_broker_up", ())] == 0
    assert not [k for k in samples if k[0] == "rlpilot_celery_queue_length"]
    assert samples[("rlpilot_runs", (("status", "running"),))] == 1   # the rest is still there
    r = client.get("/health", **AUTH)
    body = r.json()
    assert r.status_code == 503 and body["down"] == ["broker"], body
    assert "127.0.0.1:1" in body["checks"]["broker"]["error"]
