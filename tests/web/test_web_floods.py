"""Floods are bounded: knob changes waiting for one run and asked for by one user a minute,
exports one user makes at once, sockets one user holds open. Each refusal is a 429 (or close
code 4429) that names the limit and its setting; other users are not affected."""
import json

import pytest
from django.test import override_settings

from tests.web.test_web_ws import communicator, receive_until, run_async
from webapp.dashboard.access import policy
from webapp.dashboard.models import KnobChange

pytestmark = pytest.mark.django_db(transaction=True)


def knobs(client, run, lr=1e-4):
    return client.post(f"/api/runs/{run.pk}/knobs", json.dumps({"optim.lr": lr}),
                       content_type="application/json")


@override_settings(RLPILOT_MAX_PENDING_KNOB_CHANGES=3, RLPILOT_KNOB_CHANGES_PER_MINUTE=100)
def test_knob_changes_waiting_for_one_run_are_bounded(alice, user, make_run):
    run, other = make_run(user, "running"), make_run(user, "running")
    assert [knobs(alice, run).status_code for _ in range(3)] == [202] * 3
    r = knobs(alice, run)
    assert r.status_code == 429
    assert "3 changes are waiting" in r.json()["errors"]["knobs"]
    assert "RLPILOT_MAX_PENDING_KNOB_CHANGES" in r.json()["errors"]["knobs"]
    assert KnobChange.objects.filter(run=run).count() == 3     # nothing written for the refusal
    assert knobs(alice, other).status_code == 202              # another run is not affected
    KnobChange.objects.filter(run=run).update(status=KnobChange.APPLIED)  # the trainer took them
    assert knobs(alice, run).status_code == 202


@override_settings(RLPILOT_MAX_PENDING_KNOB_CHANGES=0, RLPILOT_KNOB_CHANGES_PER_MINUTE=4)
def test_knob_changes_per_user_and_minute_are_bounded_over_the_api_and_the_socket(
        alice, bob, user, other_user, make_run):
    run, bobs = make_run(user, "running"), make_run(other_user, "running")
    assert [knobs(alice, run).status_code for _ in range(4)] == [202] * 4
    r = knobs(alice, run)
    assert r.status_code == 429 and "RLPILOT_KNOB_CHANGES_PER_MINUTE" in r.json()["errors"]["knobs"]
    assert knobs(bob, bobs).status_code == 202                 # another user is not affected

    async def over_the_socket():
        comm = communicator(alice, run.pk)
        assert (await comm.connect())[0]
        await comm.send_to(text_data=json.dumps({"type": "set_knobs", "knobs": {"optim.lr": 2e-4}}))
        err = (await receive_until(comm, lambda m: m["type"] == "error"))[-1]
        assert err["status"] == 429 and "knob changes in the last minute" in err["errors"]["knobs"]
        await comm.disconnect()
    run_async(over_the_socket())
    assert KnobChange.objects.filter(run=run).count() == 4


@override_settings(RLPILOT_MAX_EXPORTS_PER_USER=2)
def test_exports_in_progress_per_user_are_bounded(alice, bob, user, other_user, make_run):
    run = make_run(user, "finished")
    held = [policy.take_export_slot(user), policy.take_export_slot(user)]  # two exports running
    for fmt in ("html", "csv", "samples_csv"):
        r = alice.get(f"/api/runs/{run.pk}/export?format={fmt}")
        assert r.status_code == 429, fmt
        assert "RLPILOT_MAX_EXPORTS_PER_USER" in r.json()["errors"]["format"]
    assert bob.get(f"/api/runs/{run.pk}/export?format=html").status_code == 200  # bob's own slots
    held.pop()()                                                 # one export finished
    assert alice.get(f"/api/runs/{run.pk}/export?format=html").status_code == 200
    # a streamed export holds its slot until its stream is closed
    streamed = alice.get(f"/api/runs/{run.pk}/export?format=samples_csv")
    assert streamed.status_code == 200
    assert alice.get(f"/api/runs/{run.pk}/export?format=csv").status_code == 429
    b"".join(streamed.streaming_content)
    streamed.close()
    assert alice.get(f"/api/runs/{run.pk}/export?format=csv").status_code == 200
    held.pop()()


@override_settings(RLPILOT_MAX_SOCKETS_PER_USER=3)
def test_sockets_per_user_are_bounded_and_freed_on_close(alice, bob, user, make_run):
    run = make_run(user, "running")

    async def go():
        socks = [communicator(alice, run.pk) for _ in range(3)]
        for s in socks:
            assert (await s.connect())[0]
        extra = communicator(alice, run.pk)
        connected, code = await extra.connect()
        assert not connected and code == 4429
        theirs = communicator(bob, run.pk)                    # another user is not affected
        assert (await theirs.connect())[0]
        await socks[0].disconnect()
        again = communicator(alice, run.pk)
        assert (await again.connect())[0]
        for s in socks[1:] + [again, theirs]:
            await s.disconnect()
    run_async(go())
