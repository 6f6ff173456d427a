"""async.staleness_schedule: parsed strictly, applied at its steps through the knob path once
each (also across a resume), and yielding to a person's change, the autopilot's and
async.auto_staleness's until its next point (trainer/rollout/staleness_schedule.py)."""
import json

import pytest
from test_async import BASE

from trainer import config as C
from trainer.observe.metrics import JsonlSink, MemorySink, MultiSink
from trainer.rollout import staleness_schedule as S
from trainer.rollout.asynchronous import AsyncDriver
from trainer.rollout.staleness_schedule import Point
from trainer.run.controls import SET_KNOBS, Command, ControlSource
from trainer.run.runner import Runner

ETA = "async.max_staleness"


def test_parse_by_hand():
    assert S.parse("0:0, 50:2, 200:4") == (Point(0, 0), Point(50, 2), Point(200, 4))
    assert S.parse(" 10 : 3 ") == (Point(10, 3),) and S.parse("") == () and S.parse("  ") == ()
    assert S.text(S.parse("0:0,50:2")) == "0:0, 50:2"


@pytest.mark.parametrize("text, quoted, why", [
    ("0:0, 50:2, 50:4", "'50:4'", "steps must increase; step 50 comes before it"),
    ("0:0, 50:2, 40:4", "'40:4'", "steps must increase"),
    ("0:0, 5:x", "'5:x'", "expected STEP:ETA"),
    ("0:0, 5", "'5'", "expected STEP:ETA"),
    ("0:0,, 5:1", "''", "expected STEP:ETA"),
    ("-1:2", "'-1:2'", "the step must be 0 or more"),
    ("0:65", "'0:65'", "eta must be in [0, 64]"),
])
def test_a_bad_schedule_is_refused_quoting_the_bad_part(text, quoted, why):
    with pytest.raises(ValueError) as e:
        S.parse(text)
    assert str(e.value).startswith(quoted + ":") and why in str(e.value)
    # the config refuses it under the key (--set, a TOML preset, the launch form all load here)
    with pytest.raises(C.ConfigError) as e:
        C.load("async", [f"async.staleness_schedule={text}"])
    assert quoted in e.value.errors["async.staleness_schedule"]


def test_a_toml_file_sets_the_schedule_as_a_string(tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('[async]\nenabled = true\nstaleness_schedule = "0:0, 50:2, 200:4"\n')
    bad.write_text('[async]\nenabled = true\nstaleness_schedule = "0:0, 50:2, 50:4"\n')
    assert S.parse(C.load(str(good)).async_.staleness_schedule) == (Point(0, 0), Point(50, 2), Point(200, 4))
    with pytest.raises(C.ConfigError) as e:
        C.load(str(bad))
    assert e.value.errors["async.staleness_schedule"].startswith("'50:4': steps must increase")


def test_a_schedule_needs_an_asynchronous_run():
    with pytest.raises(C.ConfigError) as e:
        C.load("demo", ["async.staleness_schedule=0:1"])
    assert "async.enabled" in e.value.errors["async.staleness_schedule"]
    assert C.load("async", ["async.staleness_schedule=0:0, 50:2"]).async_.staleness_schedule == "0:0, 50:2"


def test_due_applies_each_point_once_and_the_latest_of_those_passed():
    pts = S.parse("0:0, 50:2, 200:4")
    assert S.due(pts, -1, 0) == Point(0, 0)           # a new run's first boundary
    assert S.due(pts, 0, 49) is None and S.due(pts, 49, 50) == Point(50, 2)
    assert S.due(pts, 50, 50) is None                  # the same boundary crossed again
    assert S.due(pts, 120, 120) is None                # resumed after 120: 50:2 was applied
    assert S.due(pts, -1, 120) == Point(50, 2)         # boundaries skipped: the latest only
    assert S.ahead(pts, 50) == [Point(200, 4)] and S.ahead(pts, 49) == [Point(50, 2), Point(200, 4)]


class AtStep(ControlSource):
    """A person's knob change read at the boundary after the given step (each once)."""

    def __init__(self, plan: dict[int, dict]):
        self.plan, self.runner = dict(plan), None

    def poll(self):
        knobs = self.plan.pop(self.runner.step, None) if self.runner else None
        return [Command(SET_KNOBS, knobs=knobs, requested_by="alice")] if knobs else []


def run(tmp_path, extra, steps, people=None, resume=False):
    cfg = C.load("demo", BASE + ["async.enabled=true"] + extra + [f"run.max_steps={steps}"])
    sink, controls = MemorySink(), AtStep(people or {})
    with Runner(cfg, tmp_path, sink=MultiSink([sink, JsonlSink(tmp_path)]), controls=controls,
                resume=resume, system_telemetry=False) as r:
        controls.runner = r
        assert r.run() == "finished"
    return r, sink


def eta_changes(sink):
    return [(e["step"], e["requested_by"], e["changes"][ETA]["new"]) for e in sink.events
            if e["kind"] == "knob_applied" and ETA in e["changes"]]


def test_eta_changes_at_the_scheduled_steps_recorded_once_each(tmp_path):
    r, sink = run(tmp_path, ["async.staleness_schedule=0:0, 2:1, 4:2"], steps=6)
    assert eta_changes(sink) == [(0, "schedule", 0), (2, "schedule", 1), (4, "schedule", 2)]
    # a point applies at the boundary after its step: steps 3-4 train under 1, 5-6 under 2
    assert sink.series("async/max_staleness") == [0, 0, 1, 1, 2, 2]
    first = next(e for e in sink.events if e["kind"] == "knob_applied")
    assert first["changes"][ETA] == {"old": 2, "new": 0}   # the preset's eta before the first point
    assert first["reason"] == {"rule": "staleness_schedule", "point": "0:0",
                               "schedule": "0:0, 2:1, 4:2"}
    assert max(sink.series("async/staleness/max")[:2]) == 0


def test_before_the_first_point_async_max_staleness_holds(tmp_path):
    r, sink = run(tmp_path, ["async.max_staleness=1", "async.staleness_schedule=2:0"], steps=3)
    assert eta_changes(sink) == [(2, "schedule", 0)]
    assert sink.series("async/max_staleness") == [1, 1, 0]


def test_a_resume_applies_only_the_points_after_its_checkpoint(tmp_path):
    schedule = ["async.staleness_schedule=0:0, 2:1, 4:2"]
    first, a = run(tmp_path, schedule, steps=3)
    state = json.loads(next((tmp_path / "checkpoints").glob("step_000003/state.json")).read_text())
    assert state["schedule_through"] == 2 and state["knobs"][ETA] == 1
    resumed, b = run(tmp_path, schedule, steps=6, resume=True)
    assert eta_changes(b) == [(4, "schedule", 2)]      # 0:0 and 2:1 not again
    assert b.series("async/max_staleness") == [1, 2, 2]   # steps 4, 5, 6
    logged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    points = [e["reason"]["point"] for e in logged if e.get("requested_by") == "schedule"]
    assert points == ["0:0", "2:1", "4:2"]   # the run's whole history: each point once


def test_a_persons_change_holds_until_the_next_point_also_across_a_resume(tmp_path):
    schedule = ["async.staleness_schedule=0:0, 2:1, 5:2"]
    # alice sets eta = 3 after step 3, after the point 2:1; the run stops after step 4
    first, a = run(tmp_path, schedule, steps=4, people={3: {ETA: 3}})
    assert eta_changes(a) == [(0, "schedule", 0), (2, "schedule", 1), (3, "alice", 3)]
    assert a.series("async/max_staleness") == [0, 0, 1, 3]
    # resumed: alice's 3 stands (the checkpoint's knob values), until the point 5:2
    resumed, b = run(tmp_path, schedule, steps=7, resume=True)
    assert b.series("async/max_staleness") == [3, 2, 2]   # steps 5, 6, 7
    assert eta_changes(b) == [(5, "schedule", 2)]


def test_at_its_point_a_persons_change_at_the_same_boundary_wins(tmp_path):
    r, sink = run(tmp_path, ["async.staleness_schedule=0:0, 2:1"], steps=3, people={2: {ETA: 3}})
    assert eta_changes(sink)[1:] == [(2, "schedule", 1), (2, "alice", 3)]
    assert sink.series("async/max_staleness") == [0, 0, 3]


def test_a_schedule_changed_mid_run_applies_only_its_later_points(tmp_path):
    r, sink = run(tmp_path, ["async.staleness_schedule=0:0, 4:1"], steps=5,
                  people={1: {"async.staleness_schedule": "0:2, 1:3, 3:0"}})
    # the new schedule's 0:2 and 1:3 are behind the boundary it arrived at: only 3:0 applies
    assert eta_changes(sink) == [(0, "schedule", 0), (3, "schedule", 0)]
    assert sink.series("async/max_staleness") == [0, 0, 0, 0, 0]
    changed = [e for e in sink.events if e["kind"] == "knob_applied"
               and "async.staleness_schedule" in e["changes"]]
    assert changed[0]["requested_by"] == "alice" and changed[0]["step"] == 1


def test_with_auto_staleness_the_point_wins_at_its_step_and_auto_moves_eta_between(tmp_path,
                                                                                  monkeypatch):
    # behaviour weights far from 1 every step: auto_staleness tightens eta by one each step; the
    # point 2:2 at the boundary where auto tightens 1 -> 0 applies after it and sets 2
    real = AsyncDriver.retune
    monkeypatch.setattr(AsyncDriver, "retune",
                        lambda self, cfg, tm: real(self, cfg, {**tm, "actor/behave_imp_weight": 1.5}))
    r, sink = run(tmp_path, ["async.auto_staleness=true", "async.prox_logp=loglinear",
                             "async.staleness_schedule=0:2, 2:2"], steps=4)
    assert eta_changes(sink) == [(0, "schedule", 2), (1, "auto", 1), (2, "auto", 0),
                                 (2, "schedule", 2), (3, "auto", 1)]
    assert sink.series("async/max_staleness") == [2, 1, 2, 1]


def test_a_bad_schedule_sent_mid_run_is_refused_like_any_knob():
    cfg = C.load("async", ["async.staleness_schedule=0:0, 50:2"])
    with pytest.raises(C.ConfigError) as e:
        C.apply_knob_change(cfg, {"async.staleness_schedule": "60:1, 55:0"})
    assert e.value.errors == {"async.staleness_schedule": "'55:0': steps must increase; step 60 comes before it"}
    new, changes = C.apply_knob_change(cfg, {"async.staleness_schedule": "60:1"})
    assert changes == {"async.staleness_schedule": {"old": "0:0, 50:2", "new": "60:1"}}
