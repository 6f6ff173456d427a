"""The live stream survives a channel-layer outage.

The channel layer only rings a doorbell; the database is the source of truth. With the layer
down a socket must stay open (and a new one must connect), poll the database, say so with a
`{"type": "stream", "mode": "polling"}` frame, re-join its group once the layer is back
(`"mode": "live"`), and lose or duplicate no row. The trainer's side (the database sink and its
doorbell) must keep writing through the outage.

Two tests: one with a channel layer that fails on demand (every setup), one with a real
redis-server of the test's own, stopped and restarted mid-stream (redis setup only).
"""
import asyncio
import json
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest
from asgiref.sync import sync_to_async
from channels.layers import InMemoryChannelLayer, channel_layers
from django.db import connection
from test_web_ws import communicator, run_async

from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import Run
from webapp.dashboard.worker.telemetry import DbSink, Doorbell

pytestmark = pytest.mark.django_db(transaction=True)
SETUP = os.environ.get("RLPILOT_TEST_SETUP", "embedded")


class Stream:
    """Reads every frame of one socket in the background: rows (with a cursor) and `stream`
    frames, in arrival order."""

    def __init__(self, comm, name):
        self.comm, self.name = comm, name
        self.frames: list[dict] = []
        self.task = asyncio.ensure_future(self._read())

    async def _read(self):
        while True:
            # a close frame instead of text fails here: the socket must stay open
            self.frames.append(json.loads(await self.comm.receive_from(timeout=120)))

    @property
    def cursors(self):
        return [f["cursor"] for f in self.frames if "cursor" in f and f["type"] != "pong"]

    @property
    def cursor(self):
        return max(self.cursors, default=0)

    def modes(self):
        return [f["mode"] for f in self.frames if f.get("type") == "stream"]

    def index_of_mode(self, mode, nth=1):
        seen = 0
        for i, f in enumerate(self.frames):
            if f.get("type") == "stream" and f["mode"] == mode:
                seen += 1
                if seen == nth:
                    return i
        return None

    async def until(self, pred, timeout, what):
        deadline = time.monotonic() + timeout
        while not pred():
            if self.task.done():
                self.task.result()   # raises what ended the reader
                raise AssertionError(f"{self.name}: the reader ended")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {what} after {timeout} s; "
                                     f"last frames {self.frames[-4:]}")
            await asyncio.sleep(0.02)

    async def close(self):
        self.task.cancel()
        try:
            await self.task
        except (asyncio.CancelledError, Exception):
            pass
        await self.comm.disconnect()


def last_seq(run_id):
    return Run.objects.filter(pk=run_id).values_list("last_seq", flat=True).first()


def assert_exactly_once(stream: Stream, first: int, final: int):
    cursors = stream.cursors
    assert len(cursors) == len(set(cursors)), f"{stream.name}: duplicated rows"
    assert cursors == list(range(first, final + 1)), f"{stream.name}: lost or reordered rows"


def fast_settings(settings, poll=30.0):
    # live: rows come only with the doorbell (a 30 s poll would time the test out); degraded:
    # the fallback poll brings them
    settings.WS_POLL_INTERVAL_S = poll
    settings.WS_FALLBACK_POLL_S = 0.2
    settings.CHANNEL_LAYER_RETRY_S = 0.3
    settings.CHANNEL_LAYER_TIMEOUT_S = 1.0


# --- a channel layer that fails on demand (every setup) -------------------------------------------

class FlakyLayer(InMemoryChannelLayer):
    """The in-memory layer, with an outage switch: while `down`, every call raises and a blocked
    receive fails (as channels_redis does when Redis goes away)."""

    def __init__(self):
        super().__init__()
        self.down = False

    def _check(self):
        if self.down:
            raise ConnectionError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")

    async def group_add(self, group, channel):
        self._check()
        await super().group_add(group, channel)

    async def group_discard(self, group, channel):
        self._check()
        await super().group_discard(group, channel)

    async def group_send(self, group, message):
        self._check()
        await super().group_send(group, message)

    async def receive(self, channel):
        while True:
            self._check()
            try:
                return await asyncio.wait_for(super().receive(channel), 0.05)
            except asyncio.TimeoutError:
                continue


def test_outage_of_the_channel_layer_falls_back_to_polling(alice, user, make_run, settings, monkeypatch):
    fast_settings(settings)
    layer = FlakyLayer()
    monkeypatch.setitem(channel_layers.backends, "default", layer)
    run = make_run(user, "running")
    step = 0

    async def write(n, ring=True):
        nonlocal step
        recs = []
        for _ in range(n):
            step += 1
            recs.append(Record("points", step, "", {"reward/mean": step / 100}))
        seq = await sync_to_async(actions.append)(run.pk, recs, ring_bell=False)
        if ring:
            try:
                await layer.group_send(actions.group_name(run.pk), {"type": "doorbell", "seq": seq})
            except ConnectionError:
                pass
        return seq

    async def go():
        a = Stream(communicator(alice, run.pk, after=0), "a")
        ok, _ = await a.comm.connect()
        assert ok
        await asyncio.sleep(0.2)            # joined
        seq = await write(3)
        await a.until(lambda: a.cursor == seq, 3, "rows rung live")
        assert a.modes() == []              # nothing to say while the layer is fine

        layer.down = True
        await a.until(lambda: a.modes() == ["polling"], 5, "polling frame")
        frame = a.frames[a.index_of_mode("polling")]
        assert frame == {"type": "stream", "mode": "polling", "message": frame["message"]}
        assert "channel layer unreachable" in frame["message"]
        assert "polling the database every 0.2 s" in frame["message"]
        # a new socket during the outage connects (no 500), gets its backlog and the same news
        b = Stream(communicator(alice, run.pk, after=2), "b")
        ok, _ = await b.comm.connect()
        assert ok, "connect refused while the channel layer is down"
        await b.until(lambda: b.modes() == ["polling"], 5, "polling frame")
        during = 0
        for _ in range(5):                  # rows written during the outage: no ring reaches anyone
            during = await write(2)
            await asyncio.sleep(0.1)
        await a.until(lambda: a.cursor == during, 3, "rows written during the outage")
        await b.until(lambda: b.cursor == during, 3, "rows written during the outage")

        layer.down = False
        await a.until(lambda: "live" in a.modes(), 5, "live frame")
        await b.until(lambda: "live" in b.modes(), 5, "live frame")
        assert a.modes() == ["polling", "live"] and b.modes() == ["polling", "live"]
        assert "restored" in a.frames[a.index_of_mode("live")]["message"]
        # every row of the outage came before the live frame: they were polled
        assert max(f.get("cursor", 0) for f in a.frames[:a.index_of_mode("live")]) >= during
        # live again: the doorbell (not the 30 s poll) brings the next rows
        final = await write(4)
        await a.until(lambda: a.cursor == final, 3, "rows rung after the outage")
        await b.until(lambda: b.cursor == final, 3, "rows rung after the outage")
        for s in (a, b):
            await s.comm.send_to(text_data=json.dumps({"type": "ping"}))
            await s.until(lambda s=s: s.frames[-1].get("type") == "pong", 3, "pong")
        assert_exactly_once(a, 1, final)
        assert_exactly_once(b, 3, final)
        await a.close()
        await b.close()
    run_async(go())


# --- the trainer-side doorbell with the layer down -------------------------------------------------

class DeadLayer:
    def __init__(self):
        self.calls = 0

    async def group_send(self, group, message):
        self.calls += 1
        await asyncio.sleep(0.05)
        raise ConnectionError("Connection refused")


def test_doorbell_rings_never_block_or_raise_while_the_layer_is_down(settings, caplog):
    settings.CHANNEL_LAYER_RETRY_S = 0.5
    bell = Doorbell(layer=DeadLayer())
    try:
        t0 = time.monotonic()
        for i in range(300):                # 1.5 s of rings, 200 per second
            bell.ring(1, i)
            time.sleep(0.005)
        assert time.monotonic() - t0 < 3.0, "ringing blocked the caller"
        # once the first failure is known, rings are dropped and the layer is only probed every
        # retry interval (the first ~50 ms of rings were already on their way)
        assert bell.down_since is not None and bell.dropped > 200
        assert bell.layer.calls < 40
        warnings = [r.getMessage() for r in caplog.records if "doorbell" in r.getMessage()]
        assert len(warnings) == 1 and "unreachable" in warnings[0], warnings
        # back: the next probe goes through and says so
        bell.layer = InMemoryChannelLayer()
        time.sleep(0.6)
        bell.ring(1, 301)
        bell.last.result(2)
        assert bell.down_since is None
        assert any("reachable again" in r.getMessage() for r in caplog.records)
    finally:
        bell.close()


# --- a real redis-server, stopped and restarted mid-stream (redis setup) -------------------------

class RedisServer:
    def __init__(self, directory, port):
        self.exe = shutil.which("redis-server")
        self.dir, self.port = directory, port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = None
        self.log = open(directory / "redis.log", "ab")

    def start(self):
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--dir", str(self.dir)],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start: "
                                   + (self.dir / "redis.log").read_text(errors="replace")[-2000:])
            time.sleep(0.05)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path, free_port):
    if SETUP != "redis":
        pytest.skip("needs the redis setup (RLPILOT_TEST_SETUP=redis): the embedded setup has no "
                    "cross-process channel layer to lose")
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (the redis setup needs it for this test)")
    server = RedisServer(tmp_path, free_port)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        server.log.close()


def test_redis_outage_mid_stream(alice, user, make_run, settings, redis_server):
    layers = dict(settings.CHANNEL_LAYERS)
    layers["default"] = {**layers["default"], "CONFIG": {
        **layers["default"]["CONFIG"],
        "hosts": [{**layers["default"]["CONFIG"]["hosts"][0], "address": redis_server.url}]}}
    settings.CHANNEL_LAYERS = layers    # consumers and the trainer's doorbell use our redis-server
    fast_settings(settings)
    run = make_run(user, "running")
    stop_writing = threading.Event()
    stats = {"steps": 0, "slowest_flush_s": 0.0, "during_outage": 0}
    outage = threading.Event()
    bell = Doorbell()
    assert bell.layer.hosts[0]["address"] == redis_server.url
    sink = DbSink(run.pk, doorbell=bell)

    def trainer():
        """What the runner does: scalars, then a flush at every step boundary (~20 steps/s)."""
        try:
            step = 0
            while not stop_writing.is_set():
                step += 1
                sink.scalars(step, {"reward/mean": step / 100, "timing/step_s": 0.05})
                t0 = time.monotonic()
                sink.flush()
                stats["slowest_flush_s"] = max(stats["slowest_flush_s"], time.monotonic() - t0)
                stats["steps"] = step
                stats["during_outage"] += outage.is_set()
                time.sleep(0.05)
            sink.close()
        finally:
            bell.close()
            connection.close()

    async def go():
        a = Stream(communicator(alice, run.pk, after=0), "a")
        ok, _ = await a.comm.connect()
        assert ok
        await asyncio.sleep(0.5)
        t = threading.Thread(target=trainer, daemon=True)
        t.start()
        try:
            # live: with a 30 s poll only the doorbell can bring these in time
            await a.until(lambda: a.cursor >= 20, 10, "rows rung live")
            assert a.modes() == []

            await sync_to_async(redis_server.stop)()
            outage.set()
            await a.until(lambda: "polling" in a.modes(), 20, "polling frame")
            assert "polling the database every 0.2 s" in a.frames[a.index_of_mode("polling")]["message"]
            # connecting during the outage works (it was an HTTP 500)
            b = Stream(communicator(alice, run.pk, after=5), "b")
            ok, _ = await b.comm.connect()
            assert ok, "connect refused while Redis is down"
            await b.until(lambda: "polling" in b.modes(), 20, "polling frame")
            await asyncio.sleep(2.0)
            during = await sync_to_async(last_seq)(run.pk)
            await asyncio.sleep(1.0)        # the fallback poll (0.2 s) brings them meanwhile
            for s in (a, b):
                await s.until(lambda s=s: s.cursor >= during, 5, "rows written during the outage")

            await sync_to_async(redis_server.start)()
            outage.clear()
            for s in (a, b):
                await s.until(lambda s=s: "live" in s.modes(), 20, "live frame")
                assert s.modes() == ["polling", "live"]
                # the outage's rows came by polling, before the live frame
                assert max(f.get("cursor", 0) for f in s.frames[:s.index_of_mode("live")]) >= during
            # live again: consumers re-joined and the trainer's doorbell rings again (the 30 s
            # poll cannot bring these in time)
            await asyncio.sleep(1.5)
            rung = await sync_to_async(last_seq)(run.pk)
            for s in (a, b):
                await s.until(lambda s=s: s.cursor >= rung, 5, "rows rung after the restart")
        finally:
            stop_writing.set()
            await sync_to_async(t.join)(30)
        final = await sync_to_async(last_seq)(run.pk)
        for s in (a, b):
            await s.until(lambda s=s: s.cursor >= final, 40, "the last rows")
            await s.comm.send_to(text_data=json.dumps({"type": "ping"}))
            await s.until(lambda s=s: s.frames[-1].get("type") == "pong", 5, "pong")
        assert_exactly_once(a, 1, final)
        assert_exactly_once(b, 6, final)
        assert a.modes() == b.modes() == ["polling", "live"]   # no flapping after the restart
        await a.close()
        await b.close()
    run_async(go())
    # the trainer went on through the outage, never waiting for the channel layer
    assert sink.errors == 0
    assert stats["during_outage"] >= 40, stats
    assert stats["slowest_flush_s"] < 0.5, stats
    assert Run.objects.get(pk=run.pk).step == stats["steps"]
