"""The cost account (trainer/accounting/cost.py, `python -m trainer cost`): device-seconds per
process from the timeline, priced per device-hour; dropped tokens priced at their step's cost
per generated token. Hand-computed on a recorded timeline and ledger, then reconciled with a
real run's own clock."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import TINY_RUN, tiny_cli_run

from trainer.accounting import cost, forecast, run_files
from trainer.accounting.run_files import read_slices
from trainer.run.device_account import DeviceAccount

ROOT = Path(__file__).resolve().parents[1]

# two steps of a layout with a training rank of 2 cores and a generation process of 1 core
DEVICES = {"rank 0": {"kind": "cpu", "count": 2}, "engine": {"kind": "cpu", "count": 1}}
SLICES = [
    (1, [{"lane": "rank 0", "phase": "generating", "start": 100.0, "end": 104.0},
         {"lane": "rank 0", "phase": "training", "start": 104.0, "end": 106.0},
         {"lane": "engine", "phase": "generating", "start": 100.0, "end": 103.0},
         {"lane": "tools", "phase": "tool", "start": 101.0, "end": 101.5}]),
    (2, [{"lane": "rank 0", "phase": "waiting", "start": 110.0, "end": 112.0},
         {"lane": "rank 0", "phase": "training", "start": 112.0, "end": 114.0},
         {"lane": "engine", "phase": "generating", "start": 110.0, "end": 112.0}]),
]
LAID = [(step, spans, DEVICES) for step, spans in SLICES]   # each step with the layout it ran on
ROWS = [
    {"step": 0, "eval/accuracy": 0.40},
    {"step": 1, "rollout/tokens/generated": 600, "rollout/tokens/trained": 300,
     "rollout/waste/zero_variance": 200, "rollout/waste/version_span": 100},
    {"step": 2, "rollout/tokens/generated": 400, "rollout/tokens/trained": 400,
     "rollout/waste/stale": 40, "eval/accuracy": 0.46},
]


def test_a_recorded_run_costs_what_its_lanes_held_by_hand():
    account = cost.run_cost(LAID, ROWS, {"cpu": 0.36})
    # the steps cover 100-106 and 110-114: 10 s; 3 cores held all that time
    assert account["wall_s"] == pytest.approx(10.0) and account["device_s"] == pytest.approx(30.0)
    lanes = {x["lane"]: x for x in account["lanes"]}
    assert set(lanes) == {"rank 0", "engine"}   # the tools lane holds no device of its own
    # rank 0: 2 cores x 10 s = 20; busy generating 4 s and training 4 s (x2); waiting is idle
    assert lanes["rank 0"]["device_s"] == pytest.approx(20.0)
    assert lanes["rank 0"]["busy_s"] == {"generating": 8.0, "training": 8.0}
    assert lanes["rank 0"]["idle_s"] == pytest.approx(4.0)
    # engine: 1 core x 10 s, generating 5 s
    assert lanes["engine"]["idle_s"] == pytest.approx(5.0)
    assert account["idle_share"] == pytest.approx(9.0 / 30.0)
    assert account["device_hours"] == {"cpu": pytest.approx(30 / 3600)}
    assert account["price"] == pytest.approx(30 / 3600 * 0.36)   # 0.003
    figures = account["device_s_figures"]
    assert figures["per_step"] == pytest.approx(15.0)
    assert figures["per_trained_token"] == pytest.approx(30 / 700)
    assert figures["per_1k_generated_tokens"] == pytest.approx(30.0)
    assert account["accuracy_points_gained"] == pytest.approx(6.0)
    assert figures["per_accuracy_point"] == pytest.approx(5.0)
    assert account["price_figures"]["per_step"] == pytest.approx(15 / 3600 * 0.36)
    # step 1: 6 s x 3 cores = 18 device-s over 600 tokens = 0.03 each; step 2: 4 s x 3 / 400 = 0.03
    waste = account["waste_device_s"]
    assert waste["zero_variance"] == pytest.approx(200 * 0.03)
    assert waste["version_span"] == pytest.approx(100 * 0.03)
    assert waste["stale"] == pytest.approx(40 * 0.03)
    assert account["waste_price"]["stale"] == pytest.approx(40 * 0.03 / 3600 * 0.36)
    assert account["waste_share"] == pytest.approx((6 + 3 + 1.2) / 30)


def test_what_an_advices_drops_cost_per_100_steps_by_hand():
    # step 1: 18 device-s for 600 tokens, step 2: 12 for 400: 0.03 device-s a token each
    per_step = {1: 18.0, 2: 12.0}
    assert cost.drops_per_100_steps(ROWS, per_step, ("version_span", "surplus")) == pytest.approx(150.0)
    assert cost.drops_per_100_steps(ROWS, per_step, ("zero_variance",)) == pytest.approx(300.0)   # 6 in 2 steps
    assert cost.drops_per_100_steps(ROWS, per_step, ("stale",)) == pytest.approx(60.0)
    assert cost.drops_per_100_steps(ROWS, {1: 18.0}, ("stale",)) == 0.0   # step 2's time unknown: not counted
    assert cost.drops_per_100_steps(ROWS, {}, ("stale",)) is None


def test_a_resumed_steps_drops_are_priced_once_at_its_last_attempt_by_hand():
    """Step 2 ran, the run died, it resumed from step 1's checkpoint and ran step 2 again: 2 s x 3
    cores = 6 device-s over 100 tokens, 10 stale. The advice prices step 2 once, at the attempt
    whose figures the run went on with (a dashboard row is that attempt's: its points win), and
    counts 2 steps: 100 x (10 x 6/100) / 2 = 30 device-s per 100 steps. Summing the attempts
    priced both rows of step 2 at 12 + 6 device-s: 100 x (40 x 18/400 + 10 x 18/100) / 3 = 120."""
    from trainer.pilot.advice import at_stake

    again = LAID + [(2, [{"lane": "rank 0", "phase": "training", "start": 200.0, "end": 202.0}], DEVICES)]
    rows = ROWS + [{"step": 2, "rollout/tokens/generated": 100, "rollout/waste/stale": 10}]
    assert cost.step_device_seconds_by_step(again) == {1: pytest.approx(18.0), 2: pytest.approx(6.0)}
    assert cost.drops_per_100_steps(rows, cost.step_device_seconds_by_step(again), ("stale",)) == pytest.approx(30.0)
    stake = at_stake({"staleness"}, rows, again, {"cpu": 0.36})["staleness"]
    assert stake["device_s"] == pytest.approx(30.0) and stake["price"] == pytest.approx(30 / 3600 * 0.36)


def test_overlapping_asynchronous_steps_are_not_billed_twice_by_hand():
    """Step 2's generation began while step 1 trained: the steps cover 100-106 and 103-110, 6 and
    7 s alone, 10 s together. 3 cores: 18 and 21 device-s alone, 30 held; each step's share is
    scaled by 30/39. Stale drops 60 of 600 and 70 of 700 tokens: 100 x (1.8 + 2.1) x 30/39 / 2 =
    150 device-s per 100 steps (195 unscaled)."""
    overlap = [(1, [{"lane": "rank 0", "phase": "training", "start": 100.0, "end": 106.0}], DEVICES),
               (2, [{"lane": "engine", "phase": "generating", "start": 103.0, "end": 108.0},
                    {"lane": "rank 0", "phase": "training", "start": 108.0, "end": 110.0}], DEVICES)]
    rows = [{"step": 1, "rollout/tokens/generated": 600, "rollout/waste/stale": 60},
            {"step": 2, "rollout/tokens/generated": 700, "rollout/waste/stale": 70}]
    per_step = cost.step_device_seconds_by_step(overlap)
    assert per_step == {1: pytest.approx(18 * 30 / 39), 2: pytest.approx(21 * 30 / 39)}
    assert sum(per_step.values()) == pytest.approx(30.0)   # what the run held over those steps
    assert cost.drops_per_100_steps(rows, per_step, ("stale",)) == pytest.approx(150.0)


def test_the_runs_device_account_counts_overlapping_steps_once_by_hand():
    """The runner's account (trainer/run/device_account.py) as the steps come: step 1 covers
    100-106, step 2 103-110 (4 s new), the pending spans 109-112 (2 s new): 3 cores hold 18, 30,
    then 36 device-s; the layout is asked once; a price only with a rate."""
    asked = []
    account = DeviceAccount(lambda: asked.append(1) or DEVICES)
    account.count([{"start": 100.0, "end": 106.0}])
    assert account.seconds == {"gpu": 0.0, "cpu": pytest.approx(18.0)}
    account.count([{"start": 103.0, "end": 108.0}, {"start": 108.0, "end": 110.0}])
    assert account.seconds["cpu"] == pytest.approx(30.0)   # 3 s of step 2 were step 1's too
    pending = [{"start": 109.0, "end": 112.0}]
    assert account.seconds_now(pending)["cpu"] == pytest.approx(36.0)
    assert account.seconds["cpu"] == pytest.approx(30.0)   # pending: read, not counted
    hours = account.figures(pending, SimpleNamespace(gpu_hour=0.0, cpu_core_hour=0.0))
    assert hours == {"cost/gpu_hours": 0.0, "cost/cpu_core_hours": pytest.approx(0.01)}
    priced = account.figures(pending, SimpleNamespace(gpu_hour=0.0, cpu_core_hour=2.0))
    assert priced["cost/price"] == pytest.approx(0.02)
    assert asked == [1]   # the layout is fixed for a start of the run: read once


def test_no_rate_means_hours_only_and_a_rate_reprices_the_whole_run():
    hours = cost.run_cost(LAID, ROWS, {})
    assert hours["price"] is None and hours["price_figures"] is None and hours["waste_price"] is None
    assert hours["device_hours"]["cpu"] > 0
    one, two = (cost.run_cost(LAID, ROWS, {"cpu": r})["price"] for r in (0.5, 1.0))
    assert two == pytest.approx(2 * one)   # the past is priced at the rate given, all of it
    # a rate for a kind the run did not use prices nothing
    assert cost.run_cost(LAID, ROWS, {"gpu": 3.0})["price"] is None


def test_a_step_recorded_twice_by_a_resume_is_paid_twice():
    again = LAID + [(2, [{"lane": "rank 0", "phase": "training", "start": 200.0, "end": 204.0}], DEVICES)]
    rows = ROWS + [{"step": 2, "rollout/tokens/generated": 100, "rollout/waste/stale": 10}]
    account = cost.run_cost(again, rows, {})
    assert account["wall_s"] == pytest.approx(14.0) and account["steps"] == 3
    # the second attempt at step 2: 4 s x 3 cores over 100 tokens = 0.12 per token
    assert account["waste_device_s"]["stale"] == pytest.approx(40 * 0.03 + 10 * 0.12)


def test_a_run_resumed_on_another_layout_pays_each_part_with_its_own_devices():
    alone = {"rank 0": {"kind": "cpu", "count": 1}}
    later = [(3, [{"lane": "rank 0", "phase": "training", "start": 300.0, "end": 305.0}])]
    starts = [(50.0, DEVICES), (250.0, alone)]   # run_started, then run_resumed on one process
    laid = cost.with_layouts(SLICES + later, starts)
    assert [x[2] for x in laid] == [DEVICES, DEVICES, alone]
    account = cost.run_cost(laid, ROWS, {})
    lanes = {x["lane"]: x for x in account["lanes"]}
    assert account["device_s"] == pytest.approx(30 + 5)   # 10 s x 3 cores, then 5 s x 1
    assert lanes["rank 0"]["device_s"] == pytest.approx(25) and lanes["engine"]["device_s"] == pytest.approx(10)
    # a part from a start that recorded no devices (before the account) is unknown, not guessed
    assert cost.with_layouts(SLICES, [(50.0, None)])[0][2] is None


def test_a_servers_time_is_held_but_never_idle():
    servers = {**DEVICES, "server 0": {"kind": "cpu", "count": 1, "recorded": False}}
    account = cost.run_cost([(s, spans, servers) for s, spans in SLICES], ROWS, {})
    lanes = {x["lane"]: x for x in account["lanes"]}
    assert lanes["server 0"]["device_s"] == pytest.approx(10) and lanes["server 0"]["idle_s"] == 0
    assert account["idle_share"] == pytest.approx(9.0 / 30.0)   # of the time recorded, as without it


def test_the_layout_says_what_each_process_holds():
    assert cost.layout_devices("cpu", 1, 2, {}, 1, 0) == {"rank 0": {"kind": "cpu", "count": 2}}
    cluster = cost.layout_devices("cuda", 2, 8, {"engine 0": 11, "engine 1": 12}, 1, 0)
    assert cluster == {"rank 0": {"kind": "gpu", "count": 1}, "rank 1": {"kind": "gpu", "count": 1},
                       "engine 0": {"kind": "gpu", "count": 1}, "engine 1": {"kind": "gpu", "count": 1}}
    servers = cost.layout_devices("cpu", 1, 1, {}, 1, 2)
    assert servers["server 0"] == servers["server 1"] == {"kind": "cpu", "count": 1, "recorded": False}
    shared = cost.layout_devices("cuda", 1, 8, {"engine": 11}, 1, 0, engine_own_gpu=False)
    assert shared["engine"] == {"kind": "gpu", "count": 0}   # on the trainer's GPU: not paid twice


@pytest.mark.parametrize("pairs, words", [
    (["tpu=3"], "KIND one of gpu, cpu"),
    (["gpu"], "expected KIND=PRICE"),
    (["gpu=cheap"], "'cheap' is not a price"),
    (["cpu=-1"], "a finite number >= 0"),
    (["cpu=inf"], "a finite number >= 0"),
])
def test_a_bad_rate_is_refused_by_name(pairs, words):
    with pytest.raises(run_files.CostError, match=words):
        run_files.rates_from(pairs, environ={})


def test_rates_come_from_the_environment_unless_given():
    env = {"RLPILOT_RATE_GPU_HOUR": "2.5", "RLPILOT_RATE_CPU_CORE_HOUR": "0.05"}
    assert run_files.rates_from([], environ=env) == {"gpu": 2.5, "cpu": 0.05}
    assert run_files.rates_from(["gpu=4"], environ=env) == {"gpu": 4.0, "cpu": 0.05}
    with pytest.raises(run_files.CostError, match="RLPILOT_RATE_GPU_HOUR"):
        run_files.rates_from([], environ={"RLPILOT_RATE_GPU_HOUR": "lots"})


@pytest.mark.timeout(300)
def test_a_real_runs_account_reconciles_with_its_clock(tmp_path):
    """A run with a generation process, from the CLI: the account's lanes are its processes, the
    device-seconds are the steps' wall time x the devices (within 5% of the run's own clock,
    run_started to run_finished), and the CLI prints it."""
    out = tmp_path / "run"
    cmd = tiny_cli_run(out, "run.eval_every=3", "run.max_steps=6", "cluster.gen_procs=1", "cost.cpu_core_hour=0.1")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = subprocess.run([sys.executable, "-m", "trainer", "cost", str(out), "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    account = json.loads(shown.stdout)
    # the run's own cost/* metrics (what its trackers mirror) say what the account says
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    hours = [r["cost/cpu_core_hours"] for r in rows if "cost/cpu_core_hours" in r]
    assert len(hours) == 6 and hours == sorted(hours) and all(r.get("cost/gpu_hours") in (None, 0.0) for r in rows)
    assert [r["cost/price"] for r in rows if "cost/price" in r] == pytest.approx([h * 0.1 for h in hours])
    # each step's row: the steps recorded before it and its own so far (its evaluation and the
    # run's end come after it): the last one is the account but for the last step's evaluation
    last = [x for x in read_slices(out)[0] if x[0] == 6]   # step 6's timeline, and the run's end
    last_wall = sum(cost.step_walls(last))
    evaluating = sum(x["end"] - x["start"] for _, spans, _ in last for x in spans if x["phase"] == "evaluating")
    assert evaluating > 0   # the guard: step 6 evaluated after its row
    total = account["device_hours"]["cpu"]
    devices = sum(x["count"] for x in account["lanes"])
    assert total - last_wall * devices / 3600 < hours[-1] < total
    lanes = {x["lane"]: x for x in account["lanes"]}
    assert set(lanes) == {"rank 0", "engine"} and lanes["engine"]["count"] == 1
    assert lanes["engine"]["busy_s"]["generating"] > 0 and lanes["rank 0"]["busy_s"]["training"] > 0
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    clock = (next(e["time"] for e in events if e["kind"] == "run_finished")
             - next(e["time"] for e in events if e["kind"] == "run_started"))
    held = sum(x["count"] for x in lanes.values())
    assert account["device_s"] == pytest.approx(account["wall_s"] * held)
    assert account["wall_s"] == pytest.approx(clock, rel=0.05)
    assert account["steps"] == 6 and account["price"] == pytest.approx(account["device_s"] / 3600 * 0.1)
    assert account["forecast"] is None   # it ended: what is left is how the forecast did
    steps = [r["step"] for r in account["replay"]]   # 25/50/75% of the recorded steps
    assert len(steps) == 3 and 1 <= steps[0] < steps[1] < steps[2]
    assert all(r["forecast_s"] > 0 and r["actual_s"] > 0 for r in account["replay"])
    text = subprocess.run([sys.executable, "-m", "trainer", "cost", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60).stdout
    assert "6 steps over" in text and "engine (1 cpu)" in text and "per trained token" in text


@pytest.mark.timeout(300)
def test_the_device_hours_metric_carries_over_a_resume(tmp_path):
    from trainer.run import checkpoint

    out = tmp_path / "run"
    done = subprocess.run(tiny_cli_run(out, "run.max_steps=2", "run.checkpoint_every=2"), cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    before = (out / "metrics.jsonl").read_text().splitlines()
    saved, _ = checkpoint.load(checkpoint.list_checkpoints(out)[-1])
    at_checkpoint = saved["device_s"]["cpu"] / 3600
    first_run = [json.loads(x)["cost/cpu_core_hours"] for x in before if "cost/cpu_core_hours" in x]
    assert len(first_run) == 2 and at_checkpoint >= first_run[-1] > 0   # saved at the end, after step 2's row
    again = subprocess.run([sys.executable, "-m", "trainer", "run", "--resume", str(out), "--set", "run.max_steps=4"],
                           cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    after = [r["cost/cpu_core_hours"] for r in rows[len(before):] if "cost/cpu_core_hours" in r]
    assert after and after[0] > at_checkpoint and after == sorted(after)   # counted on from the checkpoint's total


def test_a_directory_that_is_not_a_run_is_named(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trainer", "cost", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"{tmp_path} has no config.toml" in done.stderr


# --- the forecast (trainer/accounting/forecast.py) --------------------------------------------------

def test_the_forecast_carries_the_recent_pace_forward_with_its_range_by_hand():
    f = forecast.time_left([6.0, 4.0], 8)
    # mean 5 s a step, s = sqrt(2); spread = sqrt(8 * 2 + (8 * sqrt(2))**2 / 2) = sqrt(80)
    assert f["seconds"] == pytest.approx(40.0) and f["pace_s"] == pytest.approx(5.0)
    assert f["low_s"] == pytest.approx(40 - 2 * 80 ** 0.5) and f["high_s"] == pytest.approx(40 + 2 * 80 ** 0.5)
    priced = forecast.with_price(f, DEVICES, {"cpu": 0.36})   # 3 cores held
    assert priced["device_s"] == {"cpu": pytest.approx(120.0)}
    assert priced["price"] == pytest.approx(120 / 3600 * 0.36)
    assert priced["price_low"] < priced["price"] < priced["price_high"]
    assert forecast.with_price(f, DEVICES, {})["price"] is None   # hours only
    assert forecast.time_left([], 8) is None
    assert forecast.time_left([3.0], 0)["seconds"] == 0.0 and forecast.time_left([3.0], 0)["high_s"] == 0.0


def test_the_forecast_reads_the_pace_since_the_last_knob_change():
    walls = [1.0] * 30 + [4.0] * 5
    assert forecast.window(walls, since_change=5) == [4.0] * 5    # the new pace
    assert forecast.window(walls, since_change=2) == walls[-20:]   # too few since: the last 20
    assert forecast.window(walls) == walls[-20:]


def test_a_replayed_forecast_says_how_far_off_it_was():
    walls = [2.0] * 10 + [3.0] * 10   # the run slowed down half way
    got = forecast.replay(walls)
    assert [r["step"] for r in got] == [5, 10, 15]
    assert got[0]["forecast_s"] == pytest.approx(15 * 2.0) and got[0]["actual_s"] == pytest.approx(5 * 2 + 10 * 3)
    assert got[0]["error"] == pytest.approx(30 / 40 - 1)
    # at 75%: the last 20 steps of 15 are 10 at 2 s and 5 at 3 s; 5 steps to go at 3 s
    assert got[2]["error"] == pytest.approx(5 * (35 / 15) / 15 - 1)
    assert all(isinstance(r["in_range"], bool) for r in got)


def test_the_target_accuracy_is_forecast_from_the_evaluations_trend_by_hand():
    # slope 0.01 a step; the line at step 20 is 0.41667; residuals -1/60, 1/30, -1/60:
    # se = sqrt((1/360 + 1/900 + 1/3600 ... = 1/600) / (3 - 2) / 200) = 0.0028868
    evals = [(0, 0.2), (10, 0.35), (20, 0.4)]
    t = forecast.steps_to_target(evals, 0.5)
    assert t["points_per_100_steps"] == pytest.approx(100.0) and t["evals"] == 3
    assert (t["steps"], t["steps_low"], t["steps_high"]) == (9, 6, 20)   # 8.33, 5.28, 19.7 rounded up
    timed = forecast.with_price_range(forecast.to_target(t, [2.0, 4.0]), {"rank 0": {"kind": "gpu", "count": 2}},
                                      {"gpu": 3.6})
    assert (timed["seconds"], timed["low_s"], timed["high_s"]) == (27.0, 18.0, 60.0)   # at 3 s a step
    assert timed["price"] == pytest.approx(27 * 2 / 3600 * 3.6) and timed["device_s"] == {"gpu": 54.0}
    # exact points: no spread; two points: no range at all; the slope too flat to be sure: no late end
    assert forecast.steps_to_target([(0, 0.2), (10, 0.3), (20, 0.4)], 0.5)["steps_high"] == 10
    two = forecast.steps_to_target([(0, 0.2), (10, 0.3)], 0.5)
    assert (two["steps"], two["steps_low"], two["steps_high"]) == (20, None, None)
    assert forecast.steps_to_target([(0, 0.2), (10, 0.4), (20, 0.25)], 0.5)["steps_high"] is None


def test_a_reached_target_a_falling_trend_and_too_few_evaluations_say_so():
    assert forecast.steps_to_target([(0, 0.2), (10, 0.6)], 0.5) == {
        "reached": True, "target": 0.5, "accuracy": 0.6, "at_step": 10}
    falling = forecast.steps_to_target([(0, 0.4), (10, 0.3)], 0.5)
    assert falling["steps"] is None and falling["points_per_100_steps"] == pytest.approx(-100.0)
    assert forecast.to_target(falling, [1.0]) is falling   # no time to a target not in reach
    assert forecast.steps_to_target([(0, 0.2)], 0.5) is None
    assert forecast.steps_to_target([(5, 0.2), (5, 0.3)], 0.5) is None   # one step: no trend
    # only the latest TREND_EVALS evaluations: an old plateau does not flatten a new climb
    old = [(s, 0.1) for s in range(0, 100, 10)]
    new = [(100 + 10 * i, 0.1 + 0.02 * (i + 1)) for i in range(forecast.TREND_EVALS)]
    assert forecast.steps_to_target(old + new, 0.5)["points_per_100_steps"] == pytest.approx(20.0)


def test_the_runs_own_rate_wins_over_the_environment_and_a_given_rate_over_both():
    env = {"RLPILOT_RATE_GPU_HOUR": "2.5", "RLPILOT_RATE_CPU_CORE_HOUR": "0.05"}
    from trainer import config as C

    cfg = C.load("demo", ["cost.cpu_core_hour=0.08"])
    own = cost.run_rates(cfg.cost.gpu_hour, cfg.cost.cpu_core_hour)
    assert own == {"cpu": 0.08}   # gpu_hour 0: not set by the run
    assert run_files.rates_from([], env, own) == {"gpu": 2.5, "cpu": 0.08}
    assert run_files.rates_from(["cpu=0.1"], env, own) == {"gpu": 2.5, "cpu": 0.1}


# --- the estimate before a run starts (trainer/cli/estimate.py) ----------------------------------

def _past_run(folder, preset: str, sets: list[str], walls: list[float]):
    """A run directory as a past run leaves it: its config, its steps' timeline, its start."""
    from trainer import config as C

    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(C.to_toml(C.load(preset, sets)))
    t, lines = 1000.0, []
    for i, w in enumerate(walls, 1):
        lines.append(json.dumps({"step": i, "spans": [{"lane": "rank 0", "phase": "training",
                                                        "start": t, "end": t + w}]}))
        t += w
    (folder / "timeline.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "events.jsonl").write_text(json.dumps(
        {"step": 0, "time": 999.0, "kind": "run_started", "devices": {"rank 0": {"kind": "cpu", "count": 2}}}) + "\n")


def test_a_steps_time_is_its_slices_and_steps_only_leaves_evaluations_out():
    slices = [(1, [{"lane": "rank 0", "phase": "training", "start": 0.0, "end": 2.0},
                   {"lane": "rank 0", "phase": "evaluating", "start": 2.0, "end": 7.0}]),
              (2, [{"lane": "rank 0", "phase": "training", "start": 7.0, "end": 10.0}]),
              (2, [{"lane": "rank 0", "phase": "checkpointing", "start": 10.0, "end": 11.0}])]   # the run's end
    assert cost.step_walls(slices) == [7.0, 4.0]
    assert cost.step_walls(slices, steps_only=True) == [2.0, 3.0]
    laid = [(step, spans, DEVICES) for step, spans in slices]   # 3 devices
    assert cost.step_device_seconds_by_step(laid) == {1: 21.0, 2: 12.0}
    # counted as they come, asynchronous steps overlapping: the union, as the account has it
    seen, reach = 0.0, float("-inf")
    for spans in ([{"start": 0.0, "end": 4.0}], [{"start": 3.0, "end": 6.0}], [{"start": 8.0, "end": 9.0}]):
        add, reach = cost.new_cover(spans, reach)
        seen += add
    assert seen == 7.0 and reach == 9.0


def test_the_estimate_reads_past_runs_of_the_same_shape_and_names_them(tmp_path):
    from trainer.cli import estimate

    _past_run(tmp_path / "runs" / "same", "demo", ["run.max_steps=7"], [9.0, 2.0, 4.0])   # 9 s: the warm-up
    _past_run(tmp_path / "runs" / "other", "demo", ["rollout.max_response_len=32"], [100.0, 100.0])
    e = estimate.estimate("demo", ["run.max_steps=10", "cost.cpu_core_hour=0.36"],
                          runs_dir=tmp_path / "runs", seconds=5)
    assert e["source"] == "history" and e["runs"] == [str(tmp_path / "runs" / "same")]
    # 10 steps at 3 s (steps of 2 and 4 s), 2 cores at 0.36 an hour
    assert e["seconds"] == pytest.approx(30.0) and e["device_s"] == {"cpu": pytest.approx(60.0)}
    assert e["price"] == pytest.approx(60 / 3600 * 0.36) and e["low_s"] < 30 < e["high_s"]
    assert "from 1 past run(s) of the same shape" in estimate.text(e)


@pytest.mark.timeout(300)
def test_the_estimate_calibrates_on_the_run_itself_within_its_time_and_leaves_nothing(tmp_path):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    dirs_before = set(Path(__import__("tempfile").gettempdir()).glob("rlpilot-estimate-*"))   # another's
    t0 = __import__("time").monotonic()
    tiny = [a for s in TINY_RUN for a in ("--set", s)]   # steps short enough to measure a few under load
    done = subprocess.run([sys.executable, "-m", "trainer", "estimate", "demo", *tiny, "--set", "run.max_steps=500",
                           "--set", "cluster.gen_procs=1", "--runs", str(tmp_path / "none"),
                           "--seconds", "8", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=200)
    took = __import__("time").monotonic() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    e = json.loads(done.stdout)
    assert e["source"] == "calibration" and e["steps_measured"] >= 1 and e["calibration_s"] == 8
    assert e["max_steps"] == 500 and e["seconds"] > 0 and set(e["devices"]) == {"rank 0", "engine"}
    assert took < 8 + 60 + 30   # its time, the start's grace, Python's own start
    leftover = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not leftover, leftover
    assert not set(Path(__import__("tempfile").gettempdir()).glob("rlpilot-estimate-*")) - dirs_before


def test_a_calibration_that_cannot_run_says_why_not_that_it_was_short(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trainer", "estimate", "demo", "--set", "model.path=/nowhere/m",
                           "--runs", str(tmp_path), "--seconds", "5"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "the calibration run failed (exit status 2): error: model.path: no model directory at /nowhere/m" \
        in done.stderr, done.stderr


def test_a_bad_estimate_request_is_refused_by_name(tmp_path):
    for args, words in ((["--seconds", "0"], "--seconds"), (["--set", "run.max_steps=-3"], "run.max_steps"),
                        (["--rate", "tpu=1"], "KIND one of gpu, cpu")):
        done = subprocess.run([sys.executable, "-m", "trainer", "estimate", "demo", "--runs", str(tmp_path),
                               *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and words in done.stderr, (args, done.stderr)


def test_the_cli_advice_prices_what_its_drops_cost(tmp_path, capsys):
    from trainer import config as C
    from trainer.cli import advise

    _past_run(tmp_path / "run", "april", ["cost.cpu_core_hour=0.36"], [2.0, 4.0])   # 2 cores: 4 and 8 device-s
    rows = [{"step": 1, "rollout/tokens/generated": 400, "rollout/waste/version_span": 100},
            {"step": 2, "rollout/tokens/generated": 800, "rollout/waste/surplus": 200, "rollout/waste/stale": 80}]
    cfg = C.loads_toml((tmp_path / "run" / "config.toml").read_text())
    stakes = advise._stakes(tmp_path / "run", cfg, rows, {"april", "staleness", "health"})
    # april: 100 x 4/400 + 200 x 8/800 = 3 device-s over 2 steps; staleness: 80 x 8/800 = 0.8
    assert stakes == {"april": {"reasons": ["version_span", "surplus", "aborted"], "device_s": pytest.approx(150.0),
                                "price": pytest.approx(150 / 3600 * 0.36)},
                      "staleness": {"reasons": ["stale"], "device_s": pytest.approx(40.0),
                                    "price": pytest.approx(40 / 3600 * 0.36)}}
    assert advise._stakes(tmp_path / "nowhere.json", cfg, rows, {"april"}) == {}   # a JSON export: no timeline
    # the run's end writes step 2's final checkpoint apart (1 s more): that step cost 10 device-s
    with (tmp_path / "run" / "timeline.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "spans": [{"lane": "rank 0", "phase": "checkpointing",
                                                   "start": 1015.0, "end": 1016.0}]}) + "\n")
    assert advise._stakes(tmp_path / "run", cfg, rows, {"april"})["april"]["device_s"] == pytest.approx(
        100 * (100 * 4 / 400 + 200 * 10 / 800) / 2)
    # the window alone: step 2's row
    assert advise._stakes(tmp_path / "run", cfg, rows[1:], {"april"})["april"]["device_s"] == pytest.approx(
        100 * 200 * 10 / 800)
