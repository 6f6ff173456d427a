"""WebSocket consumer (Channels' communicator): backlog, live rows, resume from a cursor without
loss or duplicates, knob changes, permissions and malformed messages. Also the database sink and
control source the Celery task gives the trainer."""
import asyncio
import json
import threading
import time

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connection

from trainer.run.controls import PAUSE, RESUME, SET_KNOBS, STOP
from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import HistogramSnapshot, KnobChange, MetricPoint, Run, RunEvent
from webapp.dashboard.worker.telemetry import DbControlSource, DbSink

pytestmark = pytest.mark.django_db(transaction=True)
ORIGIN = (b"origin", b"http://localhost")
HOST = (b"host", b"localhost")  # a browser sends both; the origin must be the host's own


def app():
    from webapp.asgi import application

    return application


def run_async(coro):
    """asyncio.run, closing the channel layer's connections to this loop (channels_redis)."""
    from channels.layers import get_channel_layer

    async def main():
        try:
            await coro
        finally:
            layer = get_channel_layer()
            if hasattr(layer, "close_pools"):
                await layer.close_pools()
    asyncio.run(main())


def session_cookie(client):
    return (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())


def communicator(client, run_id, after=None, origin=ORIGIN):
    headers = [h for h in (HOST, origin, session_cookie(client) if client is not None else None) if h]
    path = f"/ws/runs/{run_id}/" + (f"?after={after}" if after is not None else "")
    return WebsocketCommunicator(app(), path, headers=headers)


async def receive_until(comm, pred, timeout=10.0):
    """Messages up to and including the first one matching pred."""
    out = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no matching message in {timeout} s; got {out[-5:]}")
        m = json.loads(await comm.receive_from(timeout=left))
        out.append(m)
        if pred(m):
            return out


def write_steps(run_id, first, n):
    recs = []
    for step in range(first, first + n):
        recs.append(Record("points", step, "", {"reward/mean": step / 10, "timing/step_s": 0.1}))
        recs.append(Record("histogram", step, "rollout/response_len", {"edges": [0, 8, 16], "counts": [step, 1]}))
    return actions.append(run_id, recs)


def test_backlog_then_cursor(alice, user, make_run):
    run = make_run(user, "running")
    last = write_steps(run.pk, 1, 20)
    actions.event(run.pk, 20, "warning", {"message": "<b>careful</b>"})
    last += 1

    async def go():
        comm = communicator(alice, run.pk, after=0)
        ok, _ = await comm.connect()
        assert ok
        msgs = await receive_until(comm, lambda m: m.get("cursor") == last)
        assert [m["cursor"] for m in msgs] == list(range(1, last + 1))
        assert msgs[0]["type"] == "status" and msgs[0]["status"] == "running"
        assert msgs[1] == {"type": "metrics", "step": 1, "values": {"reward/mean": 0.1, "timing/step_s": 0.1},
                           "cursor": 2}
        assert msgs[2]["type"] == "histogram" and msgs[2]["counts"] == [1, 1]
        assert msgs[-1]["type"] == "event" and msgs[-1]["kind"] == "warning"
        assert msgs[-1]["data"] == {"message": "<b>careful</b>"}
        assert await comm.receive_nothing(0.5)
        await comm.disconnect()

        comm = communicator(alice, run.pk, after=30)
        ok, _ = await comm.connect()
        msgs = await receive_until(comm, lambda m: m.get("cursor") == last)
        assert msgs[0]["cursor"] == 31 and len(msgs) == last - 30
        await comm.disconnect()
    run_async(go())


def test_live_and_resume_from_cursor_without_loss_or_duplicates(alice, user, make_run):
    run = make_run(user, "running")
    total_steps = 60
    done = threading.Event()

    def writer():
        try:
            for step in range(1, total_steps + 1):
                write_steps(run.pk, step, 1)
                time.sleep(0.02)
        finally:
            connection.close()
            done.set()

    async def go():
        seen = []
        comm = communicator(alice, run.pk, after=0)
        ok, _ = await comm.connect()
        assert ok
        t = threading.Thread(target=writer)
        t.start()
        # read part of the stream, drop the socket, reconnect from the last cursor
        while len(seen) < 40:
            seen.append(json.loads(await comm.receive_from(timeout=10)))
        await comm.disconnect()
        await asyncio.sleep(0.3)
        comm = communicator(alice, run.pk, after=seen[-1]["cursor"])
        ok, _ = await comm.connect()
        assert ok
        final = 1 + 2 * total_steps
        while seen[-1]["cursor"] < final:
            seen.append(json.loads(await comm.receive_from(timeout=10)))
        await comm.disconnect()
        await sync_to_async(t.join)()
        cursors = [m["cursor"] for m in seen]
        assert cursors == list(range(1, final + 1)), "lost or duplicated rows"
        steps = [m["step"] for m in seen if m["type"] == "metrics"]
        assert steps == list(range(1, total_steps + 1))
    run_async(go())
    assert done.is_set()


def test_knob_change_over_the_socket(alice, user, make_run):
    run = make_run(user, "running")

    def trainer_applies():
        """What the runner does at a step boundary with the database control source."""
        sink = DbSink(run.pk)
        controls = DbControlSource(run.pk, sink, min_interval=0)
        try:
            (cmd,) = controls.poll()
            assert cmd.kind == SET_KNOBS and cmd.knobs == {"optim.lr": 5e-5} and cmd.requested_by == "alice"
            sink.event(7, "knob_applied", {"change_id": cmd.id, "changes": {"optim.lr": {"old": 1e-4, "new": 5e-5}},
                                           "requested_by": cmd.requested_by, "requested_at": cmd.requested_at,
                                           "applied_at": time.time()})
            assert controls.poll() == []
            sink.close()
        finally:
            connection.close()

    async def go():
        comm = communicator(alice, run.pk)
        ok, _ = await comm.connect()
        assert ok
        await receive_until(comm, lambda m: m["type"] == "status")
        await comm.send_to(text_data=json.dumps({"type": "set_knobs", "knobs": {"optim.lr": "5e-5"}}))
        ack = (await receive_until(comm, lambda m: m["type"] == "knob_ack"))[-1]
        assert ack["status"] == "pending" and ack["knobs"] == {"optim.lr": 5e-5}
        await sync_to_async(trainer_applies, thread_sensitive=False)()
        msgs = await receive_until(comm, lambda m: m.get("kind") == "knob_applied")
        applied = msgs[-1]
        assert applied["type"] == "event" and applied["step"] == 7
        assert applied["data"]["change_id"] == ack["change_id"]
        assert any(m.get("kind") == "knob_requested" for m in msgs)
        # out of range: an error frame naming the key, and the socket stays open
        await comm.send_to(text_data=json.dumps({"type": "set_knobs", "knobs": {"optim.lr": 7}}))
        err = (await receive_until(comm, lambda m: m["type"] == "error"))[-1]
        assert "optim.lr" in err["errors"] and err["status"] == 400
        await comm.send_to(text_data=json.dumps({"type": "set_knobs", "knobs": {"run.seed": 3}}))
        err = (await receive_until(comm, lambda m: m["type"] == "error"))[-1]
        assert "run.seed" in err["errors"]
        await comm.send_to(text_data=json.dumps({"type": "ping"}))
        await receive_until(comm, lambda m: m["type"] == "pong")
        await comm.disconnect()
    run_async(go())
    kc = KnobChange.objects.get()
    assert kc.status == "applied" and kc.applied_step == 7
    assert Run.objects.get(pk=run.pk).knobs["optim.lr"] == 5e-5


def test_watchers_cannot_tune(bob, user, make_run):
    run = make_run(user, "running")

    async def go():
        comm = communicator(bob, run.pk)
        ok, _ = await comm.connect()
        assert ok
        await comm.send_to(text_data=json.dumps({"type": "set_knobs", "knobs": {"optim.lr": 1e-5}}))
        err = (await receive_until(comm, lambda m: m["type"] == "error"))[-1]
        assert err["status"] == 403 and "owner" in err["message"]
        await comm.send_to(text_data=json.dumps({"type": "ping"}))
        await receive_until(comm, lambda m: m["type"] == "pong")
        await comm.disconnect()
    run_async(go())
    assert not KnobChange.objects.exists()


@pytest.mark.parametrize("frame", ["not json", "[1, 2]", '{"type": 5}', '{"type": "nope"}',
                                   '{"type": "set_knobs", "knobs": "x"}', '{"type": "set_knobs"}', "{}"])
def test_malformed_messages_get_an_error_and_the_socket_stays_open(alice, user, make_run, frame):
    run = make_run(user, "running")

    async def go():
        comm = communicator(alice, run.pk)
        ok, _ = await comm.connect()
        assert ok
        await comm.send_to(text_data=frame)
        err = (await receive_until(comm, lambda m: m["type"] == "error"))[-1]
        assert err["message"]
        await comm.send_to(text_data=json.dumps({"type": "ping"}))
        await receive_until(comm, lambda m: m["type"] == "pong")
        await comm.disconnect()
    run_async(go())


def test_refused_connections(client, alice, user, make_run):
    run = make_run(user, "running")

    async def go():
        anonymous = communicator(None, run.pk)
        ok, _ = await anonymous.connect()
        assert not ok
        for origin in ((b"origin", b"http://evil.example.com"), None):
            comm = communicator(alice, run.pk, origin=origin)
            ok, _ = await comm.connect()
            assert not ok
        comm = communicator(alice, 99999)
        ok, _ = await comm.connect()
        assert not ok
    run_async(go())


def test_db_sink_and_control_source(user, make_run):
    run = make_run(user, "running")
    sink = DbSink(run.pk)
    controls = DbControlSource(run.pk, sink, min_interval=0)
    sink.scalars(1, {"reward/mean": 0.5, "reward/accuracy": float("nan")})
    sink.histogram(1, "rollout/response_len", {"edges": [0, 1], "counts": [2]})
    time.sleep(0.2)
    assert not MetricPoint.objects.exists()          # buffered until the step boundary
    assert controls.poll() == []
    sink.drain()                                     # written by the sink's thread
    assert MetricPoint.objects.filter(run=run).count() == 2
    assert HistogramSnapshot.objects.filter(run=run).count() == 1
    run.refresh_from_db()
    assert run.step == 1 and run.summary["latest"]["reward/mean"] == 0.5
    seqs = sorted(set(MetricPoint.objects.values_list("seq", flat=True)) |
                  set(HistogramSnapshot.objects.values_list("seq", flat=True)))
    assert seqs == [run.last_seq - 1, run.last_seq]

    Run.objects.filter(pk=run.pk).update(desired="pause")
    assert [c.kind for c in controls.poll()] == [PAUSE]
    assert controls.poll() == []
    sink.event(1, "paused", {"requested_by": "web"})
    sink.drain()
    assert Run.objects.get(pk=run.pk).status == "paused"
    Run.objects.filter(pk=run.pk).update(desired="run")
    assert [c.kind for c in controls.poll()] == [RESUME]
    sink.event(1, "resumed", {})
    sink.drain()
    assert Run.objects.get(pk=run.pk).status == "running"
    actions.control(run, user, "stop")
    assert [c.kind for c in controls.poll()] == [STOP]
    assert controls.poll() == []
    kinds = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("kind", flat=True))
    assert kinds == ["status", "paused", "status", "resumed", "status", "status"]
    sink.close()
