"""The autopilot (trainer/pilot/autopilot.py) on hand-made runs: a simulated run whose metrics
answer the knob values, stepped through the real StepBoundary, so every move is an audited knob
change. It moves inside its bounds, no more often than pilot.every, undoes a move whose guard
trips (and never makes it again), leaves a person's knob alone, stops when turned off, and
keeps its state across a checkpoint. The real trainer runs are in tests/test_autopilot_runs.py."""
from __future__ import annotations

import json

import pytest
from test_pilot_rules import STARVED, cfg_of, healthy

from trainer import config as config_mod
from trainer.observe.metrics import MetricsSink
from trainer.pilot.autopilot import Autopilot, guard_trips, inside
from trainer.pilot.live import LivePilot
from trainer.run import knob_requests
from trainer.run.boundary import StepBoundary
from trainer.run.controls import AUTO, AUTOPILOT, SCHEDULE, SET_KNOBS, Command, ControlSource

ETA = "async.max_staleness"


class Events(MetricsSink):
    def __init__(self):
        self.events = []

    def event(self, step, kind, data=None):
        self.events.append({"step": step, "kind": kind, **(data or {})})


class People(ControlSource):
    """A person's knob changes, handed to the boundary after the given steps."""

    def __init__(self, at: dict[int, dict]):
        self.at, self.step = at, 0

    def poll(self):
        knobs = self.at.pop(self.step, None)
        return [Command(SET_KNOBS, knobs=knobs, requested_by="alice")] if knobs else []


class Driver:
    def set_config(self, cfg):
        pass


def starved_row(step: int, eta: int, *, throughput: float, accuracy: float = 0.5) -> dict:
    """A step of an async run whose staleness sits at eta and whose generator idles 30%."""
    row = dict(healthy(1)[0], step=step, **{k.replace("__", "/"): (v if not isinstance(v, list) else v[0])
                                             for k, v in STARVED.items()})
    row.update({"async/max_staleness": eta, "async/staleness/max": eta, "async/generator_idle_frac": 0.3,
                "perf/trained_tokens_per_s": throughput, "reward/accuracy": accuracy,
                "reward/mean": accuracy})
    return row


def simulate(cfg, steps: int, *, throughput=lambda eta, step: 100.0 * (1 + eta),
             accuracy=lambda eta, step: 0.5, people: dict | None = None,
             schedule: dict | None = None):
    """Run `steps` steps: after each, the pilot's move goes through a real StepBoundary (with the
    person's changes of `people` {after step: knobs}, and async.staleness_schedule's points of
    `schedule` {after step: eta}, as the runner queues them). Returns (events, eta at each step, pilot)."""
    sink, pilot = Events(), LivePilot()
    source = People(dict(people or {}))
    boundary = StepBoundary(source, sink, Driver())

    # the runner's own rule for telling the autopilot what became of a change
    boundary.on_knobs = lambda cmd, applied: knob_requests.tell_autopilot(pilot, cmd, applied)
    etas = []
    for step in range(1, steps + 1):
        source.step = step - 1
        if step - 1 in (schedule or {}):
            boundary.request({ETA: schedule[step - 1]}, {"rule": "staleness_schedule"},
                             requested_by=SCHEDULE)
        cfg = boundary.cross(step - 1, cfg)
        eta = cfg.async_.max_staleness
        etas.append(eta)
        row = starved_row(step, eta, throughput=throughput(eta, step), accuracy=accuracy(eta, step))
        _, move = pilot.after_step(step, row, cfg)
        if move is not None:
            boundary.request(move.knobs, move.reason, requested_by=AUTOPILOT)
    return sink.events, etas, pilot


def moves(events):
    return [e for e in events if e["kind"] == "knob_applied" and e["requested_by"] == AUTOPILOT]


def test_the_autopilot_raises_eta_within_its_bounds_at_its_pace_each_change_audited():
    cfg = cfg_of("async", async__max_staleness=0, pilot__autopilot=["staleness"], pilot__every=4,
                 pilot__bounds=["async.max_staleness=0..3"])
    events, etas, _ = simulate(cfg, 40)
    made = moves(events)
    assert [(m["changes"][ETA]["old"], m["changes"][ETA]["new"]) for m in made] == [(0, 1), (1, 2), (2, 3)]
    steps = [m["step"] for m in made]
    assert all(b - a >= 4 for a, b in zip(steps, steps[1:])), steps
    assert max(etas) == 3 and etas[-1] == 3          # at the bound: the advice is passed over
    first = made[0]["reason"]
    assert (first["rule"], first["reason"]) == ("staleness", "eta_starves_generation")
    assert first["bounds"] == [0, 3] and first["advised"] == 1 and first["evidence_key"]
    share = next(f for f in first["evidence"] if f["name"] == "async/staleness/max")
    assert share["value"] == 1.0 and share["stat"] == "share of steps at eta"
    # guard: the figures were computed on the simulated run, not copied from the advice
    assert not [e for e in events if e["kind"] == "knob_rejected"]


def test_a_move_that_costs_throughput_is_undone_and_not_made_again():
    # raising eta halves the throughput: the guard undoes the raise after pilot.every steps
    cfg = cfg_of("async", async__max_staleness=1, pilot__autopilot=["staleness"], pilot__every=3)
    events, etas, pilot = simulate(cfg, 30, throughput=lambda eta, step: 100.0 if eta <= 1 else 40.0)
    made = moves(events)
    assert [(m["changes"][ETA]["old"], m["changes"][ETA]["new"]) for m in made] == [(1, 2), (2, 1)]
    raise_, undo = made
    assert undo["reason"]["undo_of"] == raise_["reason"]["evidence_key"]
    assert undo["reason"]["guard"] == "throughput"
    assert (undo["reason"]["before"], undo["reason"]["after"]) == (100.0, 40.0)   # medians, by hand
    assert undo["step"] - raise_["step"] == 3
    assert etas[-1] == 1 and pilot.autopilot.undone == [raise_["reason"]["evidence_key"]]


def test_an_accuracy_guard_undoes_any_move():
    cfg = cfg_of("async", async__max_staleness=1, pilot__autopilot=["staleness"], pilot__every=3,
                 pilot__guard_accuracy_drop=0.05)
    events, etas, _ = simulate(cfg, 20, accuracy=lambda eta, step: 0.6 if eta <= 1 else 0.5)
    undo = moves(events)[1]
    assert undo["reason"]["guard"] == "accuracy" and undo["reason"]["metric"] == "reward/accuracy"
    assert undo["reason"]["before"] == pytest.approx(0.6) and undo["reason"]["after"] == pytest.approx(0.5)
    assert etas[-1] == 1


def test_just_under_the_guards_the_move_stays():
    cfg = cfg_of("async", async__max_staleness=1, pilot__autopilot=["staleness"], pilot__every=3,
                 pilot__bounds=["async.max_staleness=1..2"])
    events, etas, _ = simulate(cfg, 20, throughput=lambda eta, step: 100.0 if eta <= 1 else 86.0,
                               accuracy=lambda eta, step: 0.6 if eta <= 1 else 0.56)
    assert len(moves(events)) == 1 and etas[-1] == 2   # -14% < 15%, -0.04 < 0.05


def test_a_persons_change_wins_and_the_knob_stays_theirs():
    cfg = cfg_of("async", async__max_staleness=0, pilot__autopilot=["staleness"], pilot__every=3)
    # the autopilot's first raise lands after step 5; alice sets eta = 0 after step 6
    events, etas, pilot = simulate(cfg, 30, people={6: {ETA: 0}})
    made = moves(events)
    assert len(made) == 1 and made[0]["step"] == 5
    person = [e for e in events if e["kind"] == "knob_applied" and e["requested_by"] == "alice"]
    assert person[0]["step"] == 6 and etas[6:] == [0] * 24   # never moved again, never undone
    assert pilot.autopilot.persons_knobs == [ETA]


def test_a_scheduled_point_resets_eta_and_the_autopilot_moves_it_again_after_pilot_every():
    # the autopilot raises eta 0 -> 1 after step 5 (watched); the schedule sets eta = 0 after step
    # 7: the watch ends unjudged, eta stays the autopilot's, which raises it again 3 steps later
    cfg = cfg_of("async", async__max_staleness=0, pilot__autopilot=["staleness"], pilot__every=3,
                 pilot__bounds=["async.max_staleness=0..1"])
    events, etas, pilot = simulate(cfg, 16, schedule={7: 0},
                                   throughput=lambda eta, step: 100.0 if step <= 7 else 10.0)
    made = moves(events)
    assert [(m["step"], m["changes"][ETA]["new"]) for m in made] == [(5, 1), (10, 1)]
    assert "undo_of" not in made[1]["reason"]   # throughput fell after the point: no undo
    # etas[i]: step i + 1; without the hold after the point the raise would come after step 8
    assert etas[5:7] == [1, 1] and etas[7:10] == [0, 0, 0] and etas[10:] == [1] * 6
    assert ETA not in pilot.autopilot.persons_knobs and pilot.autopilot.scheduled_step == 7


def test_at_one_boundary_the_persons_change_applies_last():
    sink = Events()
    b = StepBoundary(People({3: {ETA: 5}}), sink, Driver())
    b.controls.step = 3
    b.interrupted()   # the person's change is read first (a waiting step polls) ...
    b.request({ETA: 2}, {"rule": "staleness"}, requested_by=AUTOPILOT)   # ... the autopilot's later
    b.request({ETA: 1}, {"rule": "staleness_schedule"}, requested_by=SCHEDULE)
    b.request({ETA: 3}, {"rule": "auto_staleness"}, requested_by=AUTO)
    cfg = b.cross(3, cfg_of("async"))
    assert cfg.async_.max_staleness == 5
    # the trainer's own first, then the schedule's point (it wins over them), then the person's
    assert [e["requested_by"] for e in sink.events] == [AUTOPILOT, AUTO, SCHEDULE, "alice"]


def test_turning_it_off_leaves_the_values_and_a_refused_move_is_not_watched():
    cfg = cfg_of("async", async__max_staleness=0, pilot__autopilot=["staleness"], pilot__every=3)
    events, etas, _ = simulate(cfg, 30, people={9: {"pilot.autopilot": []}})
    made = moves(events)
    assert made and all(m["step"] < 9 for m in made) and etas[-1] == etas[9] > 0

    ap = Autopilot()
    ap.watched = object.__new__(type("W", (), {}))
    ap.watched.knob = ETA
    ap.knob_refused([ETA])
    assert ap.watched is None


def test_rules_not_enabled_and_note_advice_are_never_applied():
    cfg = cfg_of("async", async__max_staleness=0, pilot__autopilot=["april", "greso"], pilot__every=2)
    events, etas, _ = simulate(cfg, 20)
    assert moves(events) == [] and set(etas) == {0}


def test_the_autopilot_state_survives_a_checkpoint():
    cfg = cfg_of("async", async__max_staleness=1, pilot__autopilot=["staleness"], pilot__every=3)
    _, _, pilot = simulate(cfg, 6, throughput=lambda eta, step: 100.0 if eta <= 1 else 40.0)
    assert pilot.autopilot.watched is not None and pilot.autopilot.watched.confirmed
    saved = json.loads(json.dumps(pilot.state_dict(cfg)))
    again = LivePilot()
    again.load_state_dict(saved)
    assert again.autopilot.state_dict() == pilot.autopilot.state_dict()
    assert list(again.rows) == list(pilot.rows)[-max(20, 6):] and again.announced == pilot.announced


def test_inside_and_the_guards_by_hand():
    assert inside(9, (1, 8)) == 8 and inside(0, (1, 8)) == 1 and isinstance(inside(9.0, (1, 8)), float)
    assert inside(True, (0, 1)) is True and inside(5, None) == 5
    def rows(tps, acc):
        return [{"step": i, "perf/trained_tokens_per_s": t, "reward/accuracy": a}
                for i, (t, a) in enumerate(zip(tps, acc))]

    before, after = rows([100, 10, 100], [0.5] * 3), rows([80, 90, 84], [0.5] * 3)
    # medians 100 -> 84: a 16% fall trips 15%, not 20%; for a change not made for throughput, never
    assert guard_trips(before, after, for_throughput=True, throughput_drop=0.15, accuracy_drop=0.05) == \
        {"guard": "throughput", "metric": "perf/trained_tokens_per_s", "before": 100, "after": 84}
    assert guard_trips(before, after, for_throughput=True, throughput_drop=0.2, accuracy_drop=0.05) is None
    assert guard_trips(before, after, for_throughput=False, throughput_drop=0.0, accuracy_drop=0.05) is None


def test_the_accuracy_guard_trips_past_the_threshold_and_past_the_steps_noise():
    def rows(acc):
        return [{"step": i, "reward/accuracy": a} for i, a in enumerate(acc)]

    def trips(before, after, drop=0.05):
        return guard_trips(rows(before), rows(after), for_throughput=False, throughput_drop=0.15,
                           accuracy_drop=drop)

    # means 0.6 -> 0.5, steps 0.1 off their mean: sample variances 4 x 0.01 / 3 = 0.01333 a side,
    # Welch's standard error sqrt(2 x 0.01333 / 4) = 0.0816, two of it 0.163 > the 0.1 fall: noise
    noisy_before, noisy_after = [0.5, 0.7, 0.5, 0.7], [0.4, 0.6, 0.4, 0.6]
    assert trips(noisy_before, noisy_after) is None
    # the same fall with a tenth of the spread: two standard errors 0.0163, the 0.05 threshold decides
    calm = trips([0.59, 0.61, 0.59, 0.61], [0.49, 0.51, 0.49, 0.51])
    assert calm["guard"] == "accuracy" and calm["before"] == pytest.approx(0.6)
    assert calm["after"] == pytest.approx(0.5) and calm["noise"] == pytest.approx(0.01633, abs=1e-5)
    # a fall past the noise: 0.6 -> 0.3 (> 0.163) trips even with the wide spread
    assert trips(noisy_before, [0.2, 0.4, 0.2, 0.4])["guard"] == "accuracy"
    # one step a side gives no spread: the threshold alone (0.1 > 0.05 trips, 0.04 does not)
    assert trips([0.6], [0.5])["noise"] == 0.0 and trips([0.6], [0.56]) is None


def test_bounds_are_checked_where_a_person_sets_them():
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load("async", ["pilot.bounds=async.max_staleness=9..1"])
    assert "low end 9 is above the high end 1" in e.value.errors["pilot.bounds"]
    for bad, says in [("x", "expected 'key=lo..hi'"), ("async.enabled=0..1", "not a numeric knob"),
                      ("async.max_staleness=0..100", "an integer in [0, 64]"),
                      ("model.path=1..2", "not a numeric knob")]:
        with pytest.raises(config_mod.ConfigError) as e:
            config_mod.load("async", [f"pilot.bounds={bad}"])
        assert says in e.value.errors["pilot.bounds"], bad
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load("async", ["pilot.autopilot=staleness,steering"])
    assert "unknown name 'steering'" in e.value.errors["pilot.autopilot"]


def test_a_persons_change_to_another_knob_ends_the_watch_without_a_judgement():
    # alice's lr change lands while the raise is watched; accuracy then falls: not the raise's doing
    cfg = cfg_of("async", async__max_staleness=1, pilot__autopilot=["staleness"], pilot__every=3,
                 pilot__bounds=["async.max_staleness=1..2"])
    events, etas, _ = simulate(cfg, 30, people={6: {"optim.lr": 0.05}},
                               accuracy=lambda eta, step: 0.6 if step <= 6 else 0.0)
    made = moves(events)
    # no guard undo at step 8; the next move waits pilot.every steps after alice's change, and is
    # the staleness rule's own reading (accuracy fell after the raise); then no see-saw back up
    assert [(m["changes"][ETA]["old"], m["changes"][ETA]["new"]) for m in made] == [(1, 2), (2, 1)]
    assert "undo_of" not in made[1]["reason"] and made[1]["reason"]["reason"] == "accuracy_fell_after_raise"
    assert made[1]["step"] >= 6 + 3 and etas[-1] == 1


# --- the mismatch rule -------------------------------------------------------------------------
MISMATCH = "mismatch.correction"


def simulate_mismatch(cfg, steps: int, *, kl: float = 2e-3, accuracy=lambda correction, step: 0.5):
    """A synchronous run whose engine disagrees with the trainer by `kl` every step; the steps
    with the correction on report its weight. Returns (events, the correction at each step)."""
    sink, pilot = Events(), LivePilot()
    boundary = StepBoundary(People({}), sink, Driver())

    def changed(cmd, applied):
        if cmd.requested_by != AUTOPILOT:
            return
        if applied:
            pilot.autopilot.knob_applied(list(cmd.knobs), True)
        else:
            pilot.autopilot.knob_refused(list(cmd.knobs))

    boundary.on_knobs = changed
    seen = []
    for step in range(1, steps + 1):
        cfg = boundary.cross(step - 1, cfg)
        fix = cfg.mismatch.correction
        seen.append(fix)
        row = dict(healthy(1)[0], step=step, **{"mismatch/kl": kl, "mismatch/outside_band_ratio": 0.0,
                                                "reward/accuracy": accuracy(fix, step),
                                                "reward/mean": accuracy(fix, step)})
        if fix != "off":
            row.update({"mismatch/correction_weight": 1.0, "mismatch/correction_zeroed_ratio": 0.0})
        _, move = pilot.after_step(step, row, cfg)
        if move is not None:
            boundary.request(move.knobs, move.reason, requested_by=AUTOPILOT)
    return sink.events, seen


def test_the_autopilot_turns_the_correction_on_once_and_leaves_the_precision_to_a_person():
    cfg = cfg_of("demo", rollout__dtype="bfloat16", pilot__autopilot=["mismatch"], pilot__every=3)
    events, seen = simulate_mismatch(cfg, 20)
    made = moves(events)
    assert [(m["step"], m["changes"][MISMATCH]["old"], m["changes"][MISMATCH]["new"]) for m in made] \
        == [(5, "off", "truncate")]                      # min_steps measured steps, then once
    assert (made[0]["reason"]["rule"], made[0]["reason"]["reason"]) == ("mismatch", "mismatch_high")
    assert seen[5:] == ["truncate"] * 15 and not [e for e in events if e["kind"] == "knob_rejected"]
    # still high with it on: the precision advice is a note (a fork), announced, never applied
    on = cfg_of("demo", rollout__dtype="bfloat16", mismatch__correction="truncate",
                pilot__autopilot=["mismatch"], pilot__every=3)
    pilot, announced = LivePilot(), []
    for s in range(1, 21):
        row = dict(healthy(1)[0], step=s, **{"mismatch/kl": 2e-3, "mismatch/correction_weight": 1.0})
        advice, move = pilot.after_step(s, row, on)
        announced += [(s, a.rule, a.reason, a.knob) for a in advice]
        assert move is None
    assert announced == [(5, "mismatch", "mismatch_high", None)]


def test_the_correction_is_undone_when_accuracy_falls_and_not_turned_on_again():
    cfg = cfg_of("demo", pilot__autopilot=["mismatch"], pilot__every=3)
    events, seen = simulate_mismatch(cfg, 20, accuracy=lambda fix, step: 0.6 if fix == "off" else 0.4)
    made = moves(events)
    assert [(m["changes"][MISMATCH]["old"], m["changes"][MISMATCH]["new"]) for m in made] == [
        ("off", "truncate"), ("truncate", "off")]
    assert made[1]["reason"]["guard"] == "accuracy" and seen[-1] == "off"


def test_an_asynchronous_run_that_interpolates_pi_prox_gets_a_note_not_a_move():
    # checks.py refuses the correction with async.prox_logp = loglinear (the async preset's)
    cfg = cfg_of("async", pilot__autopilot=["mismatch"], pilot__every=3)
    assert cfg.async_.prox_logp == "loglinear"
    events, seen = simulate_mismatch(cfg, 12)
    assert moves(events) == [] and set(seen) == {"off"}
