"""The rollout inspector's web side: the database sink's samples, the per-run cap, the samples API
(every filter, orders, cursor paging, permissions, 400s and 404s), the WebSocket frames, exports
and the offline report, deletion and rewinds."""
import asyncio
import csv
import io
import json
import math

import pytest
from helpers import NoBell, sample_row

from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import RolloutSample, Run
from webapp.dashboard.reports import exports
from webapp.dashboard.rows import samples as sample_rows
from webapp.dashboard.worker.telemetry import DbSink

pytestmark = pytest.mark.django_db

EVIL = '<script>window.__pwned = 1</script>'



def write(run, step, rows, sync=True):
    """Rows through the database sink's write path (without its thread when `sync`)."""
    sink = DbSink(run.pk, doorbell=NoBell())
    sink.samples(step, rows)
    if sync:
        with sink.lock:
            records, sink.buffer = sink.buffer, []
        sink._write(records)
    else:
        sink.close()


def fill(run, steps=10, groups=2, members=4):
    """`steps` steps of `groups` whole groups each, plus the step's longest (recorded twice,
    as a member and as 'longest') and one reward error every third step."""
    for s in range(1, steps + 1):
        rows = [sample_row(s, group=s * 10 + g, index=k, reward=float((g + k + s) % 2),
                           finish=("stop", "length", "aborted", "partial")[(g + k) % 4],
                           versions=((s - 1, 2), (s, 2 + (g * 5 + k * 3 + s) % 10)))
                for g in range(groups) for k in range(members)]
        longest = max(rows, key=lambda r: r["length"])
        rows.append({**longest, "why": "longest"})
        if s % 3 == 0:
            rows.append(sample_row(s, group=999, index=0, reward=None, score=None, reward_status="timeout",
                                   reward_error="verifier timed out after 5 s", why="error"))
        actions.append(run.pk, [Record("points", s, "", {"reward/mean": 0.5}),
                                Record("samples", s, "", {"rows": rows})], {"step": s})
    return list(RolloutSample.objects.filter(run=run).order_by("id"))


def get(client, run, **params):
    return client.get(f"/api/runs/{run.pk}/samples", params)


def all_pages(client, run, limit=7, **params):
    out, cursor, pages = [], None, 0
    while True:
        r = get(client, run, limit=limit, **params, **({"after": cursor} if cursor else {}))
        assert r.status_code == 200, r.content
        body = r.json()
        out += body["samples"]
        pages += 1
        cursor = body["cursor"]
        if cursor is None:
            return out, pages
        assert len(body["samples"]) == limit


# --- the sink and the actions layer -----------------------------------------------------------

def test_sink_writes_a_step_of_samples_under_one_sequence_number(user, make_run):
    run = make_run(user, "running")
    before = Run.objects.get(pk=run.pk).last_seq
    rows = [sample_row(3, group=7, index=k, versions=((2, 1), (3, 3)), length=4) for k in range(4)]
    rows[1].update(completion="a\x00b\ud800c", prompt="p\x00", reward=float("nan"), logprobs=[float("-inf")] * 4,
                   tokens=["\x00", "x", "y", "z"], reward_error="bad\x00", advantage="oops",
                   finish="weird", why="nope", reward_status="???")
    write(run, 3, rows)
    write(run, 4, [])                                     # nothing to write: no sequence number
    got = list(RolloutSample.objects.filter(run=run).order_by("index"))
    assert len(got) == 4 and {s.seq for s in got} == {before + 1}
    assert Run.objects.get(pk=run.pk).last_seq == before + 1
    s = got[1]
    assert s.completion == "a\ufffdb\ufffdc" and s.prompt == "p\ufffd" and s.reward_error == "bad\ufffd"
    assert s.reward is None and s.logprobs == [None] * 4 and s.tokens[0] == "\ufffd" and s.advantage is None
    assert (s.finish, s.why, s.reward_status) == ("stop", "group", "ok")   # unknown choices: defaults
    assert got[0].segments == [[2, 1], [3, 3]] and got[0].group == 7 and got[0].length == 4


@pytest.mark.django_db(transaction=True)
def test_sink_thread_writes_samples_with_the_step(user, make_run):
    run = make_run(user, "running")
    sink = DbSink(run.pk, doorbell=NoBell())
    sink.scalars(5, {"reward/mean": 1.0})
    sink.samples(5, [sample_row(5, index=k) for k in range(3)])
    sink.close()
    assert RolloutSample.objects.filter(run=run, step=5).count() == 3
    assert Run.objects.get(pk=run.pk).step == 5


def test_samples_are_capped_oldest_steps_thinned_first(user, make_run, settings):
    settings.SAMPLES_PER_RUN = 100
    run = make_run(user, "running")
    for s in range(1, 61):
        actions.append(run.pk, [Record("samples", s, "", {"rows": [sample_row(s, 0, k) for k in range(8)]})])
        assert RolloutSample.objects.filter(run=run).count() <= 100
    steps = sorted(set(RolloutSample.objects.filter(run=run).values_list("step", flat=True)))
    per_step = {s: RolloutSample.objects.filter(run=run, step=s).count() for s in steps}
    assert all(n == 8 for n in per_step.values())            # steps are thinned whole
    assert len(steps) == 12 and steps[-1] == 60
    assert all(s in steps for s in range(55, 61))             # the newest steps whole
    assert steps[0] <= 16 and max(b - a for a, b in zip(steps, steps[1:])) <= 16   # a spread over history
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert gaps == sorted(gaps, reverse=True)                 # sparser the older
    # a long run with the default cap: ~500 steps of 40 samples over 2000 steps, evenly spread
    from webapp.dashboard.rows.samples import _level

    kept = []
    for s in range(1, 2001):   # thin()'s rule on step numbers alone (the database is slow for this)
        kept.append(s)
        while len(kept) * 40 > 20000:
            older = kept[:len(kept) // 2]
            lowest = min(_level(x) for x in older)
            kept = [x for x in kept if x not in older or _level(x) != lowest]
    assert 250 <= len(kept) <= 500 and kept[0] <= 16 and kept[-100:] == list(range(1901, 2001))
    # one step larger than the cap keeps its last `cap` rows
    settings.SAMPLES_PER_RUN = 5
    other = make_run(user, "running")
    actions.append(other.pk, [Record("samples", 1, "", {"rows": [sample_row(1, 0, k) for k in range(9)]})])
    assert sorted(RolloutSample.objects.filter(run=other).values_list("index", flat=True)) == [4, 5, 6, 7, 8]
    settings.SAMPLES_PER_RUN = 0                              # 0: no cap
    actions.append(other.pk, [Record("samples", 2, "", {"rows": [sample_row(2, 0, k) for k in range(9)]})])
    assert RolloutSample.objects.filter(run=other).count() == 14


def test_deleting_or_rewinding_a_run_drops_its_samples(alice, user, make_run):
    run = make_run(user, "stopped")
    fill(run, steps=6)
    actions.rewind(run.pk, 4, from_checkpoint=True)
    assert set(RolloutSample.objects.filter(run=run).values_list("step", flat=True)) == {1, 2, 3, 4}
    assert alice.delete(f"/api/runs/{run.pk}").status_code == 200
    assert not RolloutSample.objects.filter(run_id=run.pk).exists()


# --- the API -----------------------------------------------------------------------------------

def test_every_filter(alice, user, make_run):
    run = make_run(user, "running")
    rows = fill(run)
    rows[5].completion = "The answer is PINEAPPLE 42"
    rows[5].save()
    rows[9].prompt = "a Prompt about pineapples"
    rows[9].save()

    def ids(**params):
        r = get(alice, run, limit=500, **params)
        assert r.status_code == 200, r.content
        return sorted(s["id"] for s in r.json()["samples"])

    def expect(pred):
        return sorted(s.id for s in rows if pred(s))

    assert ids() == expect(lambda s: True)
    assert ids(step=4) == expect(lambda s: s.step == 4)
    assert ids(min_step=3, max_step=5) == expect(lambda s: 3 <= s.step <= 5)
    assert ids(min_len=8) == expect(lambda s: s.length >= 8)
    assert ids(max_len=6, min_len=5) == expect(lambda s: 5 <= s.length <= 6)
    assert ids(min_reward=0.5) == expect(lambda s: s.reward is not None and s.reward >= 0.5)
    assert ids(max_reward="0") == expect(lambda s: s.reward is not None and s.reward <= 0)
    for f in ("stop", "length", "aborted", "partial"):
        assert ids(finish=f) == expect(lambda s, f=f: s.finish == f), f
    assert ids(reward_status="timeout") == expect(lambda s: s.reward_status == "timeout") != []
    assert ids(reward_status="ok", step=3) == expect(lambda s: s.reward_status == "ok" and s.step == 3)
    assert ids(q="pineapple") == sorted([rows[5].id, rows[9].id])      # prompt or completion, any case
    assert ids(q="100%") == [] and ids(q="_") == []                    # LIKE wildcards are literal
    assert ids(group=31) == expect(lambda s: s.group == 31) != []
    body = get(alice, run, step=3, limit=1).json()["samples"][0]
    assert {"id", "seq", "prompt", "completion", "tokens", "logprobs", "segments", "tis_weight", "why",
            "reward_error", "penalty", "score", "advantage", "staleness"} <= set(body)
    compact = get(alice, run, step=3, limit=1, fields="summary").json()["samples"][0]
    assert "tokens" not in compact and "logprobs" not in compact and "preview" in compact


@pytest.mark.parametrize("order", ["step", "-step", "length", "-length", "reward", "-reward"])
def test_orders_and_cursor_paging(alice, user, make_run, order):
    run = make_run(user, "running")
    rows = fill(run, steps=8)
    got, pages = all_pages(alice, run, limit=7, order=order)
    assert pages > 3
    assert len(got) == len(rows) and len({s["id"] for s in got}) == len(rows)   # no repeats, no gaps
    field = order.lstrip("-")
    keys = [s[field] for s in got]
    present = [k for k in keys if k is not None]
    assert present == sorted(present, reverse=order.startswith("-"))
    if field == "reward":   # samples without a reward come last
        assert keys.index(None) == len(present) and all(k is None for k in keys[len(present):])
    if order == "step":
        assert [(s["step"], s["group"], s["index"]) for s in got] == sorted(
            (s["step"], s["group"], s["index"]) for s in got)
    # with a filter, paging walks exactly the filtered set
    got, _ = all_pages(alice, run, limit=3, order=order, min_len=7)
    assert sorted(s["id"] for s in got) == sorted(s.id for s in rows if s.length >= 7)


def test_paging_sees_new_samples_without_repeats(alice, user, make_run):
    run = make_run(user, "running")
    fill(run, steps=3)
    first = get(alice, run, limit=5).json()
    fill_more = [sample_row(9, group=1, index=k) for k in range(3)]
    actions.append(run.pk, [Record("samples", 9, "", {"rows": fill_more})])
    rest, cursor = [], first["cursor"]
    while cursor:
        body = get(alice, run, limit=5, after=cursor).json()
        rest += body["samples"]
        cursor = body["cursor"]
    seen = [s["id"] for s in first["samples"] + rest]
    assert len(seen) == len(set(seen)) == RolloutSample.objects.filter(run=run).count()


def test_sample_detail_with_its_group(alice, bob, user, make_run):
    run = make_run(user, "finished")
    rows = fill(run, steps=2)
    longest = RolloutSample.objects.get(run=run, step=2, why="longest")
    r = bob.get(f"/api/runs/{run.pk}/samples/{longest.pk}")   # others may read
    assert r.status_code == 200
    body = r.json()
    assert body["sample"]["id"] == longest.pk and body["sample"]["tokens"] == longest.tokens
    assert body["sample"]["segments"] == longest.segments
    # the other members of its group, each once (the 'longest' copy is not its own neighbour)
    assert sorted(m["index"] for m in body["group"]) == sorted({0, 1, 2, 3} - {longest.index})
    assert all(m["group"] == longest.group and m["step"] == 2 for m in body["group"])
    other_run = make_run(user, "finished")
    assert alice.get(f"/api/runs/{other_run.pk}/samples/{rows[0].pk}").status_code == 404
    assert alice.get(f"/api/runs/{run.pk}/samples/999999999").json()["errors"] == {"sample": "not found"}


def test_permissions_and_errors(client, alice, bob, user, make_run):
    from webapp.dashboard.models import ApiToken

    run = make_run(user, "running")
    fill(run, steps=2)
    n = RolloutSample.objects.filter(run=run).count()
    assert len(get(bob, run, limit=500).json()["samples"]) == n          # another user may read
    from django.test import Client

    anon = Client()
    assert get(anon, run).status_code == 401
    tok = ApiToken.objects.create(user=user)
    assert anon.get(f"/api/runs/{run.pk}/samples", HTTP_AUTHORIZATION=f"Token {tok.key}").status_code == 200
    assert alice.post(f"/api/runs/{run.pk}/samples", {}, content_type="application/json").status_code == 405
    r = alice.get("/api/runs/999999/samples")
    assert r.status_code == 404 and r.json()["errors"] == {"id": "not found"}
    bad = {"step": "x", "min_step": "-1", "max_step": str(2 ** 40), "min_len": "1.5", "max_len": "∞",
           "min_reward": "nan", "max_reward": "abc", "finish": "exploded", "reward_status": "fine",
           "group": "-3", "order": "random", "limit": "0", "fields": "all", "q": "x\x00y",
           "after": "not-a-cursor", "colour": "red"}
    for name, value in bad.items():
        r = get(alice, run, **{name: value})
        assert r.status_code == 400, (name, value)
        body = r.json()
        assert name in body["errors"], (name, body)
        assert "not-a-cursor" not in json.dumps(body) or name != "after"
    assert get(alice, run, limit=501).status_code == 400
    assert get(alice, run, q="x" * 201).status_code == 400
    # a cursor of another order, or a forged one, is refused
    cursor = get(alice, run, limit=1, order="length").json()["cursor"]
    assert get(alice, run, after=cursor, order="reward").json()["errors"].keys() == {"after"}
    import base64
    forged = base64.urlsafe_b64encode(json.dumps(["length", "1; drop", 3]).encode()).decode()
    assert get(alice, run, after=forged, order="length").status_code == 400
    forged = base64.urlsafe_b64encode(json.dumps(["length", 10 ** 30, 3]).encode()).decode()
    assert get(alice, run, after=forged, order="length").status_code == 400


# --- the WebSocket ---------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_samples_reach_the_socket_as_summaries(alice, user, make_run):
    from test_web_ws import communicator, receive_until, run_async

    run = make_run(user, "running")
    fill(run, steps=2)
    n2 = RolloutSample.objects.filter(run=run, step=2).count()

    async def go():
        from asgiref.sync import sync_to_async

        comm = communicator(alice, run.pk, after=0)
        ok, _ = await comm.connect()
        assert ok
        got = await receive_until(comm, lambda m: m["type"] == "samples" and m["step"] == 2)
        frames = [m for m in got if m["type"] == "samples"]
        assert [f["step"] for f in frames] == [1, 2] and len(frames[1]["samples"]) == n2
        s = frames[1]["samples"][0]
        assert set(s) == {"id", "step", "group", "index", "length", "reward", "finish", "why",
                          "reward_status", "staleness"}
        cursor = frames[1]["cursor"]
        # a live one, written like the sink writes
        await sync_to_async(write)(run, 3, [sample_row(3, group=5, index=k, completion=EVIL) for k in range(2)])
        live = await receive_until(comm, lambda m: m["type"] == "samples" and m["step"] == 3)
        assert live[-1]["cursor"] > cursor and len(live[-1]["samples"]) == 2
        assert "completion" not in live[-1]["samples"][0]
        await comm.disconnect()
        # reconnecting with the last cursor: nothing again
        comm = communicator(alice, run.pk, after=live[-1]["cursor"])
        ok, _ = await comm.connect()
        assert ok
        assert await comm.receive_nothing(timeout=1.0)
        await comm.disconnect()

    run_async(go())


@pytest.mark.django_db(transaction=True)
def test_samples_reach_the_socket_while_the_channel_layer_is_down(alice, user, make_run, settings, monkeypatch):
    """With the channel layer down the consumer polls the database (after a `stream` frame
    saying so): the samples frames come all the same, each once."""
    from asgiref.sync import sync_to_async
    from channels.layers import channel_layers
    from test_web_outage import FlakyLayer, Stream, fast_settings
    from test_web_ws import communicator, run_async

    fast_settings(settings)
    layer = FlakyLayer()
    monkeypatch.setitem(channel_layers.backends, "default", layer)
    run = make_run(user, "running")

    async def go():
        a = Stream(communicator(alice, run.pk, after=0), "a")
        ok, _ = await a.comm.connect()
        assert ok
        await asyncio.sleep(0.2)
        layer.down = True
        await a.until(lambda: a.modes() == ["polling"], 5, "polling frame")
        for step in (1, 2, 3):   # no doorbell reaches anyone: the fallback poll brings them
            await sync_to_async(actions.append)(run.pk, [Record("samples", step, "", {"rows": [
                sample_row(step, group=step, index=k) for k in range(3)]})], ring_bell=False)
        await a.until(lambda: len([f for f in a.frames if f.get("type") == "samples"]) == 3, 5,
                      "samples frames while polling")
        frames = [f for f in a.frames if f.get("type") == "samples"]
        assert [f["step"] for f in frames] == [1, 2, 3] and all(len(f["samples"]) == 3 for f in frames)
        assert len({f["cursor"] for f in frames}) == 3
        await a.close()

    run_async(go())


def test_messages_after_carries_samples_for_polling_readers(user, make_run):
    """Polling consumers (the embedded setup, and any consumer while the channel layer is down)
    read stream.messages_after: the samples frames are there, between the rows of their seq."""
    from webapp.dashboard.rows import stream

    run = make_run(user, "running")
    cur = Run.objects.get(pk=run.pk).last_seq
    fill(run, steps=3)
    msgs, new = stream.messages_after(run.pk, cur)
    kinds = [m["type"] for m in msgs]
    assert kinds == ["metrics", "samples"] * 3
    assert [m["cursor"] for m in msgs] == sorted(m["cursor"] for m in msgs) and new == msgs[-1]["cursor"]


# --- exports and the offline report ----------------------------------------------------------------------

def test_exports_round_trip_and_escape(alice, user, make_run, tmp_path):
    run = make_run(user, "finished", name="samples run")
    rows = fill(run, steps=4)
    actions.append(run.pk, [Record("samples", 5, "", {"rows": [
        sample_row(5, group=77, index=0, completion=EVIL, reward=0.25, score=0.5, tis_weight=None)]})])
    written = [sample_rows.as_json(s) for s in RolloutSample.objects.filter(run=run).order_by("seq", "id")]
    assert len(written) == len(rows) + 1

    data = alice.get(f"/api/runs/{run.pk}/export?format=json").json()
    per_token = ("tokens", "logprobs")   # in the samples CSV only
    assert data["samples"] == json.loads(json.dumps([{k: v for k, v in w.items() if k not in per_token}
                                                     for w in written]))

    r = alice.get(f"/api/runs/{run.pk}/export?format=samples_csv")
    assert r.status_code == 200 and r["Content-Type"].startswith("text/csv")
    assert "samples.csv" in r["Content-Disposition"]
    got = list(csv.DictReader(io.StringIO(b"".join(r.streaming_content).decode())))
    assert len(got) == len(written)
    for g, w in zip(got, written):
        assert int(g["id"]) == w["id"] and int(g["step"]) == w["step"] and g["completion"] == w["completion"]
        assert (float(g["reward"]) if g["reward"] else None) == w["reward"]
        assert json.loads(g["tokens"]) == w["tokens"] and json.loads(g["segments"]) == w["segments"]
        assert [x if x is None else pytest.approx(x) for x in json.loads(g["logprobs"])] == w["logprobs"]
        assert g["penalty"] and math.isclose(float(g["penalty"]), w["penalty"])

    html = alice.get(f"/api/runs/{run.pk}/export?format=html").content.decode()
    assert 'id="report-samples"' in html and EVIL not in html
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in html
    assert html.count('data-sample="') == len(written)

    from django.core.management import call_command

    out = tmp_path / "s.csv"
    call_command("export_run", str(run.pk), "--format", "samples_csv", "-o", str(out))
    assert len(list(csv.DictReader(out.open()))) == len(written)
    # a run without samples says so
    empty = make_run(user, "finished")
    assert "No sample was recorded" in exports.export_html(empty)


def test_pages_have_the_samples_panel(alice, user, make_run):
    run = make_run(user, "running", name=EVIL)
    fill(run, steps=1)
    for url in (f"/runs/{run.pk}/", f"/runs/{run.pk}/report/"):
        html = alice.get(url).content.decode()
        assert 'id="samples-panel"' in html and "dashboard/inspector.js" in html, url
        assert EVIL not in html


# --- the trainer's own samples, through a real worker ----------------------------------------------

@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_real_run_records_samples(celery_worker, alice, tiny, wait_until):
    """A tiny run of preset `all` on the real worker: the trainer's sink calls reach the table,
    and every row is one the inspector can show (segments cover the tokens, one piece per token)."""
    r = alice.post("/api/runs", json.dumps({"name": "samples", "preset": "all",
                                            "overrides": {**tiny, "run.max_steps": 3, "april.segment_max_tokens": 32}}),
                   content_type="application/json")
    assert r.status_code == 201, r.content
    rid = r.json()["id"]
    wait_until(lambda: Run.objects.filter(pk=rid, status__in=("finished", "failed")).exists(), 180,
               "the run to finish")
    run = Run.objects.get(pk=rid)
    assert run.status == "finished", run.error + celery_worker.text()[-3000:]
    got = alice.get(f"/api/runs/{rid}/samples", {"limit": 500}).json()["samples"]
    assert got and {s["step"] for s in got} <= {1, 2, 3}
    for s in got:
        assert len(s["tokens"]) == len(s["logprobs"]) == s["length"], s["id"]
        assert sum(n for _, n in s["segments"]) == s["length"], (s["id"], s["segments"])
        assert s["finish"] in ("stop", "length", "aborted", "partial") and s["why"] in (
            "group", "longest", "shortest", "error")
    one = alice.get(f"/api/runs/{rid}/samples/{got[0]['id']}").json()
    assert one["sample"]["completion"] == got[0]["completion"]
