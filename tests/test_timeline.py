"""Where the time goes, per process (trainer/observe/timeline.py): the recorder's merging and bounds on
hand-made spans, a generator's coalesced busy spans, and the timeline a run writes -- one
process (synchronous and asynchronous) and two training ranks on gloo."""
import json
from pathlib import Path

import pytest

from trainer import config as C
from trainer.observe.metrics import JsonlSink, MemorySink, MultiSink
from trainer.observe.timeline import (
    PHASES,
    BusyRecorder,
    Span,
    Timeline,
    bound,
    covered_seconds,
    phase_seconds,
)
from trainer.run.runner import Runner


def spans_of(lane, *triples):
    return [Span(lane, phase, start, end) for phase, start, end in triples]


# --- the recorder ------------------------------------------------------------------------------

def test_same_phase_neighbours_merge_and_other_phases_stay_apart():
    spans = spans_of("rank 0", ("training", 0.0, 1.0), ("training", 1.005, 2.0),
                     ("syncing weights", 2.0, 2.5), ("training", 2.5, 3.0))
    out = bound(spans)
    assert [(s.phase, s.start, s.end) for s in out] == [
        ("training", 0.0, 2.0), ("syncing weights", 2.0, 2.5), ("training", 2.5, 3.0)]


def test_occupancy_is_weighted_by_duration_when_spans_merge():
    out = bound([Span("engine", "generating", 0.0, 3.0, 1.0),
                 Span("engine", "generating", 3.0, 4.0, 0.2)])
    assert len(out) == 1 and out[0].occupancy == pytest.approx((3 * 1.0 + 1 * 0.2) / 4)


def test_a_lane_never_overlaps_itself_and_tiny_spans_go():
    spans = spans_of("rank 0", ("generating", 0.0, 2.0), ("training", 1.5, 3.0),
                     ("syncing weights", 2.2, 2.8), ("evaluating", 3.0, 3.0005))
    out = bound(spans)
    assert [(s.phase, s.start, s.end) for s in out] == [("generating", 0.0, 2.0), ("training", 2.0, 3.0)]


def test_a_tool_call_stays_however_short_and_parallel_calls_do_not_overlap():
    spans = spans_of("tools", ("tool", 1.0, 1.0001), ("tool", 1.00002, 1.00008), ("tool", 2.0, 2.0004))
    spans += spans_of("rank 0", ("evaluating", 3.0, 3.0005))
    out = bound(spans)
    assert [(s.lane, s.phase, s.start, s.end) for s in out] == [
        ("tools", "tool", 1.0, 1.0001), ("tools", "tool", 2.0, 2.0004)]   # the evaluating sliver goes


def test_the_bound_merges_the_closest_busy_spans_first_then_drops_the_shortest():
    busy = [Span("engine", "generating", i, i + 0.5) for i in range(40)]
    busy[10] = Span("engine", "generating", 10.0, 10.95)   # the smallest gap: 10.95 -> 11
    phases = spans_of("rank 0", *[("training" if i % 2 else "waiting", i, i + 1 - 0.001 * i)
                                  for i in range(20)])
    out = bound(busy + phases, max_spans=30)
    assert len(out) == 30
    engine = [s for s in out if s.lane == "engine"]
    rank0 = [s for s in out if s.lane == "rank 0"]
    assert any(s.start <= 10 and s.end >= 11.5 for s in engine)   # the closest pair merged
    assert max(s.seconds for s in engine) <= 4    # equal gaps: merging spreads, no snowball
    assert sum(s.seconds for s in engine) > 20    # merging keeps the busy time
    # alternating phases cannot merge: rank 0 lost its shortest spans, not its longest
    assert len(rank0) < 20 and Span("rank 0", "waiting", 0, 1) in rank0


def test_bad_spans_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown phase 'napping'"):
        Span("rank 0", "napping", 0, 1)
    with pytest.raises(ValueError, match="ends .* before it starts"):
        Span("rank 0", "training", 2, 1)
    with pytest.raises(ValueError, match="occupancy 1.5"):
        Span("engine", "generating", 0, 1, 1.5)


def test_span_context_add_after_wait_and_take():
    now = iter([10.0, 12.0])
    tl = Timeline(clock=lambda: next(now))
    with tl.span("rank 0", "training"):
        pass
    tl.add_after_wait("rank 1", "training", 10.5, 11.0)
    tl.add_after_wait("rank 1", "training", 11.5, 11.9)
    got = tl.take()
    assert got == [{"lane": "rank 0", "phase": "training", "start": 10.0, "end": 12.0},
                   {"lane": "rank 1", "phase": "training", "start": 10.5, "end": 11.0},
                   {"lane": "rank 1", "phase": "waiting", "start": 11.0, "end": 11.5},
                   {"lane": "rank 1", "phase": "training", "start": 11.5, "end": 11.9}]
    assert tl.take() == []


def test_a_filled_lane_has_no_gaps():
    tl = Timeline(fill={"rank 0": "bookkeeping"})
    tl.add("rank 0", "generating", 0.0, 1.0)
    tl.add("rank 0", "training", 1.5, 2.0)
    tl.add("engine", "generating", 0.0, 0.5)
    tl.add("engine", "generating", 1.5, 2.0)        # other lanes keep their gaps
    assert sorted(tl.take(), key=lambda s: (s["lane"] != "rank 0", s["start"])) == [
        {"lane": "rank 0", "phase": "generating", "start": 0.0, "end": 1.0},
        {"lane": "rank 0", "phase": "bookkeeping", "start": 1.0, "end": 1.5},
        {"lane": "rank 0", "phase": "training", "start": 1.5, "end": 2.0},
        {"lane": "engine", "phase": "generating", "start": 0.0, "end": 0.5},
        {"lane": "engine", "phase": "generating", "start": 1.5, "end": 2.0}]
    tl.add("rank 0", "syncing weights", 3.0, 3.5)   # the gap since the last take too
    assert [s["phase"] for s in tl.take()] == ["bookkeeping", "syncing weights"]


def test_a_timeline_nobody_takes_stays_bounded():
    tl = Timeline(max_spans=10)
    for i in range(1000):
        tl.add("rank 0", "training" if i % 2 else "waiting", i, i + 0.5)
    assert len(tl._spans) <= 80 and len(tl.take()) == 10


def test_seconds_per_phase_and_covered_seconds_read_a_run_back():
    steps = [[{"lane": "rank 0", "phase": "training", "start": 0, "end": 4},
              {"lane": "engine", "phase": "generating", "start": 1, "end": 3}],
             [{"lane": "rank 0", "phase": "training", "start": 3, "end": 5}],   # overlaps the first
             [{"lane": "rank 0", "phase": "waiting", "start": 10, "end": 11}], []]
    assert phase_seconds(steps) == {"rank 0": {"training": 6.0, "waiting": 1.0},
                                    "engine": {"generating": 2.0}}
    assert covered_seconds(steps) == pytest.approx(6.0)   # [0, 5] and [10, 11]


def test_busy_steps_coalesce_into_spans_with_their_occupancy():
    busy = BusyRecorder("engine", gap_s=0.05, max_spans=4)
    for k in range(10):                       # ten decode steps back to back: one span
        busy.record(k * 0.1, k * 0.1 + 0.1, used=4, capacity=16)
    busy.record(2.0, 2.5, used=16, capacity=16)   # after an idle second: a new span
    assert busy.take() == [("engine", 0.0, pytest.approx(1.0), 0.25), ("engine", 2.0, 2.5, 1.0)]
    for k in range(10):                       # idle gaps everywhere: bounded by merging
        busy.record(k, k + 0.5)
    spans = busy.take()
    assert len(spans) == 4 and spans[0][1] == 0 and spans[-1][2] == 9.5
    assert all(occ is None for *_, occ in spans)   # no decode step: no occupancy


# --- a run's timeline ------------------------------------------------------------------------------

def check_lanes(timelines: list[dict], steps: int) -> dict[str, set[str]]:
    """Every step has spans; per lane none overlaps the next; times are sane. Returns the phases
    seen per lane."""
    assert [t["step"] for t in timelines][:steps] == list(range(1, steps + 1))
    lanes: dict[str, list[dict]] = {}
    for t in timelines:
        assert 0 < len(t["spans"]) <= 48
        for s in t["spans"]:
            assert s["phase"] in PHASES and s["end"] >= s["start"] > 1.6e9, s
            assert 0 <= s.get("occupancy", 0) <= 1
            lanes.setdefault(s["lane"], []).append(s)
    for lane, spans in lanes.items():
        spans.sort(key=lambda s: s["start"])
        for a, b in zip(spans, spans[1:]):
            assert b["start"] >= a["end"] - 1e-3, (lane, a, b)   # rounded to 0.1 ms
    first = min(s["start"] for v in lanes.values() for s in v)
    last = max(s["end"] for v in lanes.values() for s in v)
    assert last - first < 600
    return {lane: {s["phase"] for s in spans} for lane, spans in lanes.items()}


@pytest.mark.parametrize("preset", ["demo", "async"])
def test_a_one_process_run_has_the_controller_and_the_engine_lanes(tmp_path, tiny_overrides, preset):
    cfg = C.load(preset, tiny_overrides + ["run.max_steps=3", "run.eval_every=2",
                                           "run.checkpoint_every=2", "run.log_samples=2"])
    memory = MemorySink()
    with Runner(cfg, tmp_path, sink=MultiSink([memory, JsonlSink(tmp_path)])) as runner:
        assert runner.run() == "finished"
    phases = check_lanes(memory.timelines, 3)
    assert set(phases) == {"rank 0", "engine"}
    # the in-process engine takes new weights in place (well under MIN_SPAN_S); the asynchronous
    # preset's engine process copies them
    expected = ({"waiting", "syncing weights"} if preset == "async" else {"generating"})
    # ("recording samples" too, when it lasts the 1 ms a span must last: not on every machine)
    assert expected | {"training", "evaluating", "checkpointing"} <= phases["rank 0"]
    assert phases["engine"] == {"generating"}
    occupancy = [s["occupancy"] for t in memory.timelines for s in t["spans"] if "occupancy" in s]
    assert occupancy and all(0 < o <= 1 for o in occupancy)
    written = [json.loads(x) for x in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert written == memory.timelines
    # CPU and memory per process: the asynchronous preset's engine has its own
    lanes = ["rank0", "engine"] if preset == "async" else ["rank0"]
    steps = [row for row in memory.steps if "train/policy_version" in row]
    for row in steps:   # CPU shares need a window over 50 ms: a very short step may have none
        assert all(0 < row[f"proc/{lane}/rss_gb"] < 64 and row.get(f"proc/{lane}/cpu_pct", 0) >= 0
                   for lane in lanes), row
        assert not any(k.startswith("proc/") and k.split("/")[1] not in lanes for k in row), row
    assert all(any(f"proc/{lane}/cpu_pct" in row for row in steps) for lane in lanes)


def test_a_pause_is_a_span_on_the_controller_lane(tmp_path, tiny_overrides):
    from test_runner import ScriptedControls

    from trainer.run.controls import PAUSE, RESUME, Command

    # paused before step 2 for three polls (PAUSED_POLL_S apart), then resumed
    controls = ScriptedControls([[], [Command(PAUSE)], [], [], [Command(RESUME)]])
    memory = MemorySink()
    cfg = C.load("demo", tiny_overrides + ["run.max_steps=3"])
    with Runner(cfg, tmp_path, sink=memory, controls=controls, system_telemetry=False) as runner:
        assert runner.run() == "finished"
    phases = check_lanes(memory.timelines, 3)
    paused = [(t["step"], s) for t in memory.timelines for s in t["spans"] if s["phase"] == "paused"]
    assert len(paused) == 1 and paused[0][0] == 2 and paused[0][1]["lane"] == "rank 0"
    assert paused[0][1]["end"] - paused[0][1]["start"] >= 0.4   # two sleeps of PAUSED_POLL_S
    assert "paused" in phases["rank 0"]


def _two_rank_worker(rank, port, run_dir):
    from ranks import finish, join
    from test_distributed import _mode_config

    join(rank, 2, port)
    with Runner(_mode_config("sync"), run_dir, sink=JsonlSink(Path(run_dir) / f"sink{rank}")) as runner:
        status = runner.run()
    (Path(run_dir) / f"status{rank}").write_text(status)
    finish()


def test_two_training_ranks_each_have_a_lane(tmp_path):
    from ranks import free_port, spawn

    spawn(_two_rank_worker, free_port(), str(tmp_path))
    assert (tmp_path / "status0").read_text() == (tmp_path / "status1").read_text() == "finished"
    rows = [json.loads(x) for x in Path(tmp_path / "sink0" / "timeline.jsonl").read_text().splitlines()]
    phases = check_lanes(rows, 3)
    assert set(phases) == {"rank 0", "rank 1", "engine"}
    assert phases["rank 1"] == {"training", "waiting"}
    assert {"generating", "training", "checkpointing"} <= phases["rank 0"]
    # rank 1 trains while rank 0 does (its share of the same update), never while it generates
    spans = [s for r in rows for s in r["spans"]]
    gen = [s for s in spans if s["lane"] == "rank 0" and s["phase"] == "generating"]
    for s in spans:
        if s["lane"] == "rank 1" and s["phase"] == "training":
            assert not any(g["start"] < s["start"] < g["end"] for g in gen), s
    assert not (tmp_path / "sink1" / "timeline.jsonl").read_text()   # only rank 0 reports
    # each process's CPU and memory, rank 1's measured by itself and sent with its report
    metrics = [json.loads(x) for x in Path(tmp_path / "sink0" / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if "train/policy_version" in m][-1]
    for lane in ("rank0", "rank1"):
        assert 0 < last[f"proc/{lane}/rss_gb"] < 64 and 0 <= last[f"proc/{lane}/cpu_pct"] <= 400, last


def test_a_wall_clock_step_mid_step_lands_in_no_duration(tmp_path, tiny_overrides, monkeypatch):
    """The machine's wall clock jumps 44 s forward in the middle of step 2's generation (NTP):
    `timing/step_s` (monotonic) never saw it, and now neither do the timeline's spans nor the cost
    account and the forecast's step walls that read them (the timeline drew a 47.6 s bar)."""
    import time

    from trainer.accounting import cost

    real_time, jump = time.time, [0.0]
    monkeypatch.setattr(time, "time", lambda: real_time() + jump[0])
    cfg = C.load("demo", tiny_overrides + ["run.max_steps=3"])
    memory = MemorySink()
    with Runner(cfg, tmp_path, sink=memory, system_telemetry=False) as runner:
        collect = runner.rollout.collect

        def jumping(cfg, version):   # the clock steps while the step generates
            real_sleep = time.sleep
            if version == 1:
                real_sleep(0.01)
                jump[0] = 44.0
            return collect(cfg, version)

        runner.rollout.collect = jumping
        assert runner.run() == "finished"
    assert jump[0] == 44.0
    steps = [r for r in memory.steps if "timing/step_s" in r]
    longest = max(r["timing/step_s"] for r in steps)
    assert longest < 40   # the premise: no step really lasts near 44 s
    spans = [s for t in memory.timelines for s in t["spans"]]
    assert max(s["end"] - s["start"] for s in spans) <= longest + 0.5
    slices = [(t["step"], t["spans"], {"rank 0": {"kind": "cpu", "count": 1}})
              for t in memory.timelines]
    walls = cost.step_walls(slices)
    assert max(walls) <= longest + 0.5 and sum(walls) < 40
    account = cost.run_cost(slices, memory.steps, {})
    assert account["wall_s"] < 40 and account["device_s"] < 40
