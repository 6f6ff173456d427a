"""Latency from a metric leaving the trainer (MetricsSink.scalars) to its arrival at WebSocket
clients, p50/p95, for the embedded setup (SQLite + polling consumers) and with Redis
(PostgreSQL + channels_redis doorbell), with 1 and 50 viewers; and how much the database sink
slows the trainer.

    python manage.py bench_stream --json

Each setup runs in its own processes, like production: a daphne server, a trainer process (a
real tiny run: the demo preset shrunk to ~0.1-0.3 s per step, with the database sink and control
source the Celery task uses) and N WebSocket clients in this process. Every step's scalars carry
`bench/t_sent` (time.time() when the trainer hands them to the sink); a client's latency is its
receive time minus that.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

TINY = {"rollout.rollout_batch_size": 4, "rollout.n_samples_per_prompt": 4,
        "rollout.max_response_len": 64, "rollout.max_slots": 16, "run.eval_every": 0,
        "run.checkpoint_every": 0, "run.reward_workers": 0, "model.threads": 1}
ROOT = Path(settings.BASE_DIR)


def pct(values, q):
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    f = int(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


class Command(BaseCommand):
    help = "Measure metric -> WebSocket latency (p50/p95), embedded and with Redis, 1 and 50 viewers."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="print only the JSON result")
        parser.add_argument("--steps", type=int, default=40, help="trainer steps per measurement")
        parser.add_argument("--viewers", default="1,50")
        parser.add_argument("--setups", default="embedded,redis")
        parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
        parser.add_argument("--database-url", default=os.environ.get(
            "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/rlpilot_bench"))
        # internal: the child roles
        parser.add_argument("--child", choices=["prepare", "trainer"], help=argparse_hidden())
        parser.add_argument("--run-id", type=int)
        parser.add_argument("--runs", type=int, default=1)

    def handle(self, *args, **o):
        if o["child"] == "prepare":
            return self.child_prepare(o["runs"])
        if o["child"] == "trainer":
            return self.child_trainer(o["run_id"], o["steps"])
        viewers = [int(v) for v in o["viewers"].split(",") if v]
        result = {}
        for setup in [s for s in o["setups"].split(",") if s]:
            if setup not in ("embedded", "redis"):
                raise CommandError(f"unknown setup {setup!r}")
            self.log(o, f"== {setup}")
            result[setup] = self.bench_setup(setup, viewers, o)
        result["goal"] = {"embedded_p95_ms": 1000, "redis_p95_ms": 300, "trainer_overhead_pct": 2.0}
        self.stdout.write(json.dumps(result, indent=None if o["json"] else 2))

    def log(self, o, msg):
        if not o["json"]:
            self.stderr.write(msg)

    # --- orchestration ----------------------------------------------------------------------------
    def setup_env(self, setup: str, o, tmp: Path) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ("DATABASE_URL", "REDIS_URL", "RLPILOT_TEST_DB_NAME")}
        env.update({"RLPILOT_VAR_DIR": str(tmp), "DJANGO_SETTINGS_MODULE": "webapp.settings",
                    # one key for the processes that make the session and the server that reads it
                    "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(50),
                    "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "DEBUG": "false"})
        if setup == "redis":
            self.ensure_pg_database(o["database_url"])
            env["DATABASE_URL"] = o["database_url"]
            env["REDIS_URL"] = o["redis_url"]
            env["RLPILOT_CHANNEL_PREFIX"] = f"rlpilot-bench-{os.getpid()}"
        return env

    def ensure_pg_database(self, url: str):
        from urllib.parse import urlparse

        import psycopg

        u = urlparse(url)
        name = u.path.lstrip("/")
        admin = url.rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:   # a fresh database per benchmark
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')

    def manage(self, env, *args, timeout=300) -> str:
        out = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=timeout)
        if out.returncode:
            raise CommandError(f"manage.py {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        return out.stdout

    def bench_setup(self, setup, viewer_counts, o) -> dict:
        from websockets.exceptions import ConnectionClosed

        from webapp.dashboard.management.commands.serve import server_command

        tmp = Path(tempfile.mkdtemp(prefix=f"rlpilot-bench-{setup}-"))
        env = self.setup_env(setup, o, tmp)
        self.manage(env, "migrate", "-v0")
        prep = json.loads(self.manage(env, "bench_stream", "--child", "prepare", "--runs", str(len(viewer_counts))))
        port = _free_port()
        server_log = open(tmp / "server.log", "wb")
        server = subprocess.Popen(server_command("127.0.0.1", port), cwd=ROOT, env=env,
                                  stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
        out = {}
        try:
            _wait_port(port, 60)
            for n, run_id in zip(viewer_counts, prep["runs"]):
                self.log(o, f"   {n} viewer(s), run {run_id}")
                lat: list[float] = []
                lock = threading.Lock()
                clients = [_ws_connect(port, run_id, prep["session"]) for _ in range(n)]
                finished = []

                def reader(c, lock=lock, lat=lat, finished=finished):  # this round's lists
                    try:
                        while True:
                            m = c.recv(timeout=_WS_TIMEOUT_S)
                            t = time.time()
                            d = json.loads(m)
                            if d.get("type") == "metrics" and "bench/t_sent" in d["values"]:
                                with lock:
                                    lat.append((t - d["values"]["bench/t_sent"]) * 1000)
                            if d.get("type") == "event" and d.get("kind") in ("run_finished", "run_stopped", "error"):
                                finished.append(1)
                                return
                    except (OSError, ConnectionClosed):   # TimeoutError is an OSError
                        return
                threads = [threading.Thread(target=reader, args=(c,), daemon=True) for c in clients]
                for t in threads:
                    t.start()
                trainer = subprocess.run([sys.executable, "manage.py", "bench_stream", "--child", "trainer",
                                          "--run-id", str(run_id), "--steps", str(o["steps"])],
                                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
                if trainer.returncode:
                    raise CommandError(f"trainer failed:\n{trainer.stderr[-4000:]}")
                stats = json.loads(trainer.stdout.strip().splitlines()[-1])
                for t in threads:
                    t.join(30)
                for c in clients:
                    c.close()
                out[str(n)] = {"p50_ms": _r(pct(lat, 0.5)), "p95_ms": _r(pct(lat, 0.95)),
                               "max_ms": _r(max(lat) if lat else None), "samples": len(lat),
                               "viewers_finished": len(finished), **stats}
                if not lat or len(finished) < n:
                    self.stderr.write(f"{setup}/{n}: {len(finished)} of {n} viewers saw the end; server log:\n"
                                      + (tmp / "server.log").read_text(errors="replace")[-3000:])
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        return out

    # --- children ---------------------------------------------------------------------------------
    def child_prepare(self, runs: int):
        from django.contrib.auth import get_user_model
        from django.contrib.sessions.backends.db import SessionStore

        from trainer import config as config_mod
        from webapp.dashboard.models import Run, Status

        User = get_user_model()
        user, _ = User.objects.get_or_create(username="bench")
        s = SessionStore()
        s["_auth_user_id"] = str(user.pk)
        s["_auth_user_backend"] = settings.AUTHENTICATION_BACKENDS[0]  # what the server accepts
        s["_auth_user_hash"] = user.get_session_auth_hash()
        s.create()
        ids = []
        for i in range(runs):
            cfg = config_mod.load("demo", TINY)
            ids.append(Run.objects.create(owner=user, name=f"bench {i}", preset="demo", config=cfg.to_dict(),
                                          knobs=cfg.knob_values(), max_steps=cfg.run.max_steps,
                                          status=Status.RUNNING).pk)
        self.stdout.write(json.dumps({"session": s.session_key, "runs": ids}))

    def child_trainer(self, run_id: int, steps: int):
        from trainer import config as config_mod
        from trainer.run.runner import Runner
        from webapp.dashboard.worker.telemetry import DbControlSource, DbSink

        cfg = config_mod.load("demo", {**TINY, "run.max_steps": steps})
        inner = DbSink(run_id)
        sink = _TimedSink(inner)
        source = DbControlSource(run_id, inner)
        controls = _TimedControls(source, sink)
        with tempfile.TemporaryDirectory() as d, Runner(cfg, d, sink=sink, controls=controls,
                                                          log=lambda *a: None) as runner:
            t0 = time.perf_counter()
            runner.run()
            total = time.perf_counter() - t0
        source.close()
        inner.close()
        self.stdout.write("\n" + json.dumps({
            "steps": steps, "trainer_s": round(total, 3),
            "telemetry_s": round(sink.seconds, 4),
            "writer_thread_s": round(inner.write_seconds, 4),
            "trainer_overhead_pct": round(100 * sink.seconds / max(total - sink.seconds, 1e-9), 3)}))


class _TimedSink:
    """Wraps the DbSink: stamps bench/t_sent and counts the time the trainer spends in it."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def _timed(self, fn, *a):
        t0 = time.perf_counter()
        try:
            return fn(*a)
        finally:
            self.seconds += time.perf_counter() - t0

    def scalars(self, step, values):
        values = dict(values)
        values["bench/t_sent"] = time.time()
        self._timed(self.inner.scalars, step, values)

    def histogram(self, step, name, hist):
        self._timed(self.inner.histogram, step, name, hist)

    def event(self, step, kind, data=None):
        self._timed(self.inner.event, step, kind, data)

    def samples(self, step, rows):
        self._timed(self.inner.samples, step, rows)

    def timeline(self, step, spans):
        self._timed(self.inner.timeline, step, spans)

    def flush(self):
        self._timed(self.inner.flush)

    def close(self):
        pass


class _TimedControls:
    def __init__(self, inner, sink):
        self.inner, self.sink = inner, sink

    def poll(self):
        return self.sink._timed(self.inner.poll)


_WS_TIMEOUT_S = 120.0   # handshake, and the longest wait for a message


def _ws_connect(port: int, run_id: int, session_key: str):
    """A viewer: the `websockets` sync client with the session cookie. The consumer checks that
    Origin is this server's scheme://host:port (the client sends Host from the URL)."""
    from websockets.exceptions import InvalidHandshake
    from websockets.sync.client import connect

    url = f"ws://127.0.0.1:{port}/ws/runs/{run_id}/?after=0"
    try:
        return connect(url, origin=f"http://127.0.0.1:{port}",
                       additional_headers={"Cookie": f"sessionid={session_key}"},
                       open_timeout=_WS_TIMEOUT_S, close_timeout=5,
                       proxy=None,          # straight to 127.0.0.1, whatever the environment says
                       compression=None,    # as measured before: no permessage-deflate
                       max_size=None)       # our own server: no message size limit
    except (InvalidHandshake, OSError) as e:
        raise CommandError(f"WebSocket {url}: {type(e).__name__}: {e}") from e


def _r(v):
    return None if v is None else round(v, 1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float):
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise CommandError(f"the ASGI server did not listen on {port}")


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS
