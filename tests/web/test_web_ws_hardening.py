"""Nothing a client sends crashes the socket (an error frame answers, the socket stays open),
and an open socket never outlives the session or the rights it was opened with."""
import json

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from tests.web.test_web_ws import communicator, receive_until, run_async

pytestmark = pytest.mark.django_db(transaction=True)


async def still_open(comm):
    await comm.send_to(text_data=json.dumps({"type": "ping"}))
    await receive_until(comm, lambda m: m["type"] == "pong")


@pytest.mark.parametrize("frame, message", [
    (json.dumps({"type": "set_knobs", "knobs": {"optim.lr": 10 ** 400}}), "knob change refused"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (json.dumps({"type": "set_knobs", "knobs": {"data.prompt_template": "a\ud800"}}),
     "knob change refused"),
    (json.dumps({"type": "x" * 10_000}), "unknown message type"),
    (json.dumps({"type": "ping", "request_id": ["no"]}), "request_id"),
    ("\x00\x01", "malformed message"),
])
def test_bad_frames_get_an_error_frame_and_the_socket_stays_open(alice, user, make_run, frame,
                                                                 message):
    run = make_run(user, "running")

    async def go():
        comm = communicator(alice, run.pk)
        assert (await comm.connect())[0]
        await comm.send_to(text_data=frame)
        err = (await receive_until(comm, lambda m: m["type"] == "error"))[-1]
        assert message in err["message"], err
        assert len(json.dumps(err)) < 2000  # the bad value is not echoed whole
        await still_open(comm)
        await comm.disconnect()
    run_async(go())


def test_set_knobs_after_the_run_was_deleted(alice, user, make_run):
    run = make_run(user, "running")

    async def go():
        comm = communicator(alice, run.pk)
        assert (await comm.connect())[0]
        await sync_to_async(run.delete)()
        await comm.send_to(text_data=json.dumps({"type": "set_knobs", "knobs": {"optim.lr": 1e-4}}))
        err = (await receive_until(comm, lambda m: m["type"] == "error"))[-1]
        assert err["status"] == 404 and "no longer exists" in err["message"]
        await still_open(comm)
        await comm.disconnect()
    run_async(go())


def _deactivate(user):
    user.is_active = False
    user.save()


def _lose_staff(user):
    user.is_staff = False
    user.save()


@pytest.mark.parametrize("change", ["logout", "deactivate", "lose_staff"])
def test_a_control_message_rechecks_the_user(client, django_user_model, make_run, change):
    owner = django_user_model.objects.create_user("olga", password="pw", is_staff=True)
    client.force_login(owner)
    run = make_run(owner, "running")

    async def go():
        comm = communicator(client, run.pk)
        assert (await comm.connect())[0]
        await still_open(comm)
        if change == "logout":
            await sync_to_async(client.logout)()
        elif change == "deactivate":
            await sync_to_async(_deactivate)(owner)
        else:
            await sync_to_async(_lose_staff)(owner)
        await comm.send_to(text_data=json.dumps({"type": "set_knobs", "knobs": {"optim.lr": 1e-4}}))
        err = (await receive_until(comm, lambda m: m["type"] == "error"))[-1]
        assert err["status"] == 401
        out = await comm.receive_output(timeout=5)
        assert out["type"] == "websocket.close" and out["code"] == 4401
    run_async(go())
    assert not run.knob_changes.exists()  # nothing was requested


@override_settings(WS_USER_RECHECK_S=0.2)
def test_a_streaming_socket_is_closed_once_the_user_is_deactivated(alice, user, make_run):
    run = make_run(user, "running")

    async def go():
        comm = communicator(alice, run.pk)
        assert (await comm.connect())[0]
        await still_open(comm)
        await sync_to_async(_deactivate)(user)
        while True:  # no message from the client: the periodic check closes it
            out = await comm.receive_output(timeout=5)
            if out["type"] == "websocket.close":
                assert out["code"] == 4401
                break
    run_async(go())


def _random_value(rng, depth=0):
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return rng.choice([0, -1, 1, 10 ** rng.randrange(1, 500), -(10 ** 400), 2 ** 63])
    if kind == 1:
        return rng.choice([0.5, -1e308, 1e-300, 3.0])
    if kind == 2:
        return rng.choice(["", "a\ud800b", "\x00", "x" * rng.randrange(1, 5000), "<script>",
                           "optim.lr", "set_knobs", "\U0001F600"])
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.choice(["1e-4", "nan", "inf", "-0"])
    if kind == 5:
        return {}
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["type", "knobs", "request_id", "optim.lr", "async.max_staleness", "rollout.top_p",
            "model.path", "x" * 300, ""]
    return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _random_frame(rng) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        knobs = {rng.choice(["optim.lr", "async.max_staleness", "rollout.temperature",
                             "model.path", "greso.alpha", "nope", ""]): _random_value(rng)
                 for _ in range(rng.randrange(1, 4))}
        return json.dumps({"type": "set_knobs", "knobs": knobs, "request_id": _random_value(rng)})
    if kind == 1:
        extra = _random_value(rng, 1)
        return json.dumps({"type": rng.choice(["ping", "set_knobs", "", "x"]),
                           **(extra if isinstance(extra, dict) else {"knobs": extra})})
    if kind == 2:
        n = rng.randrange(1, 3000)
        return rng.choice(["[", "{\"a\":"]) * n + rng.choice(["]", "}"]) * n
    if kind == 3:
        return json.dumps(_random_value(rng))
    if kind == 4:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(1, 50)))
    return '{"type": "set_knobs", "knobs": {"optim.lr": ' + "9" * rng.randrange(300, 5000) + "}}"


def test_fuzzed_frames_never_close_the_socket(alice, user, make_run):
    """A fixed seed, a few hundred generated frames: each one is answered, none closes the
    socket (no 1011), and the socket still answers a ping at the end."""
    import random

    rng = random.Random(12)
    run = make_run(user, "running")

    async def go():
        comm = communicator(alice, run.pk)
        assert (await comm.connect())[0]
        for i in range(300):
            frame = _random_frame(rng)
            await comm.send_to(text_data=frame)
            reply = await comm.receive_output(timeout=10)
            while reply["type"] == "websocket.send" and json.loads(reply["text"])["type"] not in (
                    "error", "knob_ack", "pong"):
                reply = await comm.receive_output(timeout=10)   # rows the consumer streams
            assert reply["type"] == "websocket.send", (i, frame[:200], reply)
        await still_open(comm)
        await comm.disconnect()
    run_async(go())
