"""The side-by-side benchmarks run end to end at toy sizes and report the promised keys.
(They measure; tests never assert their timings.)"""
import argparse

import pytest

from trainer.bench import april, asynchronous, common, greso, learn, mismatch, pilot
from trainer.rollout.ledger import REASONS

TINY = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_response_len=48", "rollout.max_slots=16", "run.reward_workers=0"]


def args(**kw):
    base = dict(steps=2, eval_size=16, seed=0, set=list(TINY), json=True, reps=1, curve_every=0)
    return argparse.Namespace(**{**base, **kw})


def test_bench_april_reports_the_ratio_and_where_the_tokens_went():
    out = april.run(args(preset="demo"), log=lambda *a: None)
    assert set(out["ratio"]) >= {"rollout_throughput", "accuracy_delta", "trained_token_share"}
    assert out["baseline"]["steps"] == out["april"]["steps"] == 2
    assert 0 <= out["april"]["heldout_accuracy"] <= 1
    for v in (out["baseline"], out["april"]):   # the ledger's parts add up to what was generated
        waste = sum(v[f"waste_{r}_tokens"] for r in REASONS)
        assert v["ledger_generated_tokens"] == (v["ledger_trained_tokens"] + waste
                                                + v["waiting_tokens_at_end"]) > 0
        assert v["ledger_trained_tokens"] == v["trained_tokens"]
    assert out["april"]["waiting_tokens_at_end"] == out["april"]["buffer_tokens_at_end"] > 0
    assert out["baseline"]["waiting_tokens_at_end"] == 0


def test_bench_greso_reports_samples_reduction():
    out = greso.run(args(preset="greso"), log=lambda *a: None)
    assert set(out["ratio"]) >= {"samples_reduction", "accuracy_delta"}
    assert out["dynamic_sampling"]["samples_generated"] > 0
    z = out["dynamic_sampling"]["zero_var_ratio_mean"]
    if z < 1:
        assert out["ratio"]["samples_reduction_ceiling"] == round((1 - 0.25) / (1 - z), 3)


def test_greso_ceiling_by_hand():
    assert greso.reduction_ceiling(0.5, 0.25) == 1.5     # the default task: about 1.5x at most
    assert greso.reduction_ceiling(0.9, 0.25) == 7.5     # the paper's regime: most groups zero-variance
    assert greso.reduction_ceiling(1.0, 0.25) is None


def test_bench_async_reports_speedup_and_best_eta():
    out = asynchronous.run(args(preset="demo", etas="0,1", sync_threads=1, trainer_threads=1),
                           log=lambda *a: None)
    assert set(out["ratio"]) >= {"speedup", "best_eta", "accuracy_delta"}
    assert out["ratio"]["best_eta"] in (0, 1)
    for eta in (0, 1):  # the counters that show whether a variant ran asynchronously at all
        v = out[f"eta_{eta}"]
        assert v["admission"]["eta"] == eta and v["staleness_max"] <= eta
        assert v["admission"]["bound"] == (eta + v["admission"]["version"] + 1) * 4
        assert v["dropped_stale_groups"] >= 0 and "staleness_mean" in v
        # where the generated tokens went: trained, still waiting, or wasted by reason
        waste = sum(v[f"waste_{r}_tokens"] for r in REASONS)
        assert v["ledger_trained_tokens"] + v["waiting_tokens_at_end"] + waste == v["ledger_generated_tokens"]
        assert v["ledger_trained_tokens"] == v["trained_tokens"]
    assert "admission" not in out["sync"]
    # --sync-threads 1: the synchronous variant itself gives the one-thread phases
    phases = out["ratio"]["one_thread_step_s"]
    sync = out["sync"]
    assert abs(phases["generation"] - sync["rollout_s"] / 2) < 1e-3
    assert abs(phases["generation"] + phases["rest"] - sync["time_per_step_s"]) < 2e-3
    assert out["ratio"]["overlap_ceiling"] == asynchronous.overlap_ceiling(
        sync["time_per_step_s"], sync["rollout_s"] / 2, sync["time_per_step_s"] - sync["rollout_s"] / 2)
    assert "sync_1_thread" not in out


def test_bench_async_with_a_schedule_compares_it_with_the_fixed_eta_of_its_last_point():
    out = asynchronous.run(args(preset="demo", etas="1", sync_threads=1, trainer_threads=1,
                                ceiling=False, schedule="0:0,1:1"), log=lambda *a: None)
    assert out["schedule"]["admission"]["eta"] == 1   # step 2 trained under the point 1:1
    assert out["schedule"]["staleness_max"] <= 1
    r = out["ratio"]
    assert r["schedule_vs_eta_1"] == asynchronous.ratio(out["schedule"]["trained_tokens_per_s"],
                                                        out["eta_1"]["trained_tokens_per_s"])
    assert r["speedup_schedule"] is not None and "schedule_accuracy_delta_vs_eta_1" in r
    assert r["best_eta"] == 1   # the schedule is no candidate for the best fixed eta


def test_overlap_ceiling_by_hand():
    # sync 1.0 s/step on two threads; one thread each: generation 0.72 s, the rest 0.9 s
    assert asynchronous.overlap_ceiling(1.0, 0.72, 0.9) == 1.111
    assert asynchronous.overlap_ceiling(1.0, 0.5, 0.5) == 2.0   # perfectly balanced, no speed-up from threads
    assert asynchronous.overlap_ceiling(1.2, 0.4, 1.2) == 1.0   # the update alone takes the whole step


def test_bench_april_reports_decode_cost_per_token():
    out = april.run(args(preset="demo", steps=1, eval_size=0), log=lambda *a: None)
    for v in (out["baseline"], out["april"]):
        assert v["decode_ms_per_token"] > 0 and v["admit_ms_per_token"] > 0
        assert 1 <= v["rows_per_decode_step"] <= 16
    assert out["ratio"]["decode_cost_per_token"] == round(
        out["baseline"]["decode_ms_per_token"] / out["april"]["decode_ms_per_token"], 3)


def test_bench_mismatch_table_shows_fp32_rollouts_agree_and_bf16_rollouts_do_not():
    out = mismatch.run(args(preset="demo", variants="bf16_truncate,fp32", eval_size=8, warmup=False),
                       log=lambda *a: None)
    rows = {r["variant"]: r for r in out["table"]}
    assert [r["variant"] for r in out["table"]] == ["fp32", "bf16_truncate"]   # the baseline first
    assert out["baseline"] == "fp32" and out["variants"]["fp32"]["steps"] == 2
    fp32, bf16 = rows["fp32"], rows["bf16_truncate"]
    # the engine and the trainer both in float32: the same log-probabilities up to rounding
    assert abs(fp32["mismatch_kl_mean"]) < 1e-8 and fp32["abs_logp_diff_max"] < 1e-3
    # a bfloat16 engine: clearly apart (|d| ~ 1e-2 per token, up to ~0.1-0.2)
    assert bf16["mismatch_kl_mean"] > 1e-6 and bf16["abs_logp_diff_mean"] > 1e-3
    assert bf16["abs_logp_diff_max"] > 1e-2
    # only the corrected variant reports a weight; the baseline's ratios are 1 and 0 by definition
    assert fp32["correction_weight_mean"] is None and 0 < bf16["correction_weight_mean"] <= 2.0
    assert 0 <= bf16["correction_zeroed_ratio_mean"] <= 1
    assert out["ratio"]["fp32"]["trained_tokens_per_s"] == 1.0
    assert out["ratio"]["fp32"]["heldout_accuracy_delta"] == 0.0
    assert out["ratio"]["bf16_truncate"]["gen_tokens_per_rollout_s"] > 0
    table = mismatch.format_table(out["table"])
    assert table.count("\n") == 3 and "| fp32 |" in table and "| bf16_truncate |" in table
    with pytest.raises(ValueError, match="unknown"):
        mismatch.run(args(preset="demo", variants="fp32,fp8"), log=lambda *a: None)


def test_bench_learn_reports_before_after_and_delta():
    out = learn.run(args(preset="demo", seconds=5.0, steps=2, eval_size=16, variant=None),
                    log=lambda *a: None)
    assert abs(out["delta"] - (out["accuracy_after"] - out["accuracy_before"])) < 1e-12
    assert out["steps"] == 2 and out["variant"] == "full"
    assert out["stderr_before"] == pytest.approx(
        (out["accuracy_before"] * (1 - out["accuracy_before"]) / 16) ** 0.5, abs=1e-4)


def test_bench_learn_side_by_side_trains_full_and_lora_each_in_its_own_process():
    lines = []
    out = learn.run(args(preset="demo", seconds=30.0, steps=2, eval_size=16, variant="both"),
                    log=lines.append)
    full, lora = out["variants"]["full"], out["variants"]["lora"]
    assert (full["variant"], full["lora_rank"]) == ("full", 0)
    assert (lora["variant"], lora["lora_rank"]) == ("lora", 8)   # learn.LORA_VARIANT["demo"]
    assert full["steps"] == lora["steps"] == 2
    assert lora["trainable_params"] < full["trainable_params"] == full["total_params"]
    # an update sends the adapted layers only, not the embeddings and norms
    assert 0 < lora["weight_sync_bytes"] < full["weight_sync_bytes"]
    assert full["peak_rss_bytes"] > 0 and lora["peak_rss_bytes"] > 0
    assert out["delta_lora"] == lora["delta"] and out["weight_sync_bytes_ratio_lora_vs_full"] < 1
    assert any(line.startswith("[lora] accuracy before") for line in lines)   # progress streamed


def test_variants_run_interleaved_and_report_medians_and_spread(monkeypatch):
    calls = []

    def fake_variant(name, preset, overrides, *, steps, eval_size, seed, curve_every, log):
        calls.append((name, seed))
        fast = {"a": [1.0, 3.0, 2.0], "b": [10.0, 30.0, 20.0]}[name][seed]
        curve = [[0.0, 0.1], [5.0 * (seed + 1), 0.5], [9.0, 0.6]] if name == "b" else [[0.0, 0.1]]
        return {"variant": name, "steps": steps, "tokens_per_s": fast, "heldout_accuracy": 0.5,
                "note": "x", "accuracy_curve": curve}

    monkeypatch.setattr(common, "train_variant", fake_variant)
    out = common.compare([("a", "demo", []), ("b", "demo", [])], args(reps=3, curve_every=1))
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]   # A B A B A B
    assert out["a"]["tokens_per_s"] == 2.0 and out["a"]["spread"]["tokens_per_s"] == [1.0, 3.0]
    assert out["b"]["tokens_per_s"] == 20.0 and out["b"]["reps"] == 3 and len(out["b"]["rounds"]) == 3
    assert "heldout_accuracy" not in out["a"]["spread"] and out["a"]["note"] == "x"
    # b reached a's final accuracy (0.5) after 5, 10, 15 s; a's own curve never did (0.1)
    assert out["b"]["time_to_baseline_accuracy_s"] == 10.0
    assert out["a"]["time_to_baseline_accuracy_s"] is None


def test_time_to_accuracy_and_the_curve_of_a_real_run():
    assert common.time_to_accuracy([[0.0, 0.2], [3.5, 0.4], [7.0, 0.6]], 0.4) == 3.5
    assert common.time_to_accuracy([[0.0, 0.2]], 0.4) is None
    run = common.train_variant("april", "demo", [*TINY, "april.enabled=true"], steps=2, eval_size=8,
                               seed=0, curve_every=1, log=lambda *a: None)
    curve = run["accuracy_curve"]
    assert [t for t, _ in curve] == sorted(t for t, _ in curve) and len(curve) >= 3   # steps 0, 1, 2
    assert curve[0][0] == 0.0 and all(0 <= acc <= 1 for _, acc in curve)
    assert run["buffer_tokens_at_end"] >= 0


def test_bench_scale_runs_each_layout_from_the_cli_and_reports_its_overhead():
    from trainer.bench import scale

    out = scale.run(argparse.Namespace(preset="demo", steps=2, seed=0, reps=1, threads=1,
                                       layouts="1_process,2_train", timeout=300.0,
                                       set=[*TINY, "run.max_steps=2"]), log=lambda *a: None)
    one, two = out["1_process"], out["2_train"]
    assert one["steps"] == two["steps"] == 2
    assert one["train_share_imbalance"] == 1.0 and two["train_share_imbalance"] >= 1.0
    assert {"weight_sync_s_per_step", "weight_sync_bytes_per_step", "gen_or_wait_s_per_step",
            "train_s_per_step", "trained_token_share"} <= set(two) and two["step_s"] > 0
    assert out["ratio"]["step_time_2_train"] == round(two["step_s"] / one["step_s"], 3)


@pytest.mark.slow
def test_bench_pilot_compares_the_autopilot_with_the_poor_setting_and_the_grid():
    out = pilot.run(args(cases="async_eta0,april_no_oversample", every=1, steps=8,
                         set=[*TINY, "april.segment_max_tokens=16"]), log=lambda *a: None)
    for case, (_, _, _, _, bounds, grid) in pilot.CASES.items():
        res = out[case]
        assert set(res) == {"poor", "autopilot", *(name for name, _ in grid), "ratio"}
        assert res["ratio"]["best_grid"] in {name for name, _ in grid}
        assert set(res["ratio"]) >= {"autopilot_throughput_vs_best", "autopilot_accuracy_delta",
                                     "poor_throughput_vs_best", "poor_accuracy_delta"}
        key, lo_hi = bounds.split("=")
        lo, hi = (int(x) for x in lo_hi.split(".."))
        changes = res["autopilot"]["autopilot_changes"]
        for _step, knob, _old, new, _undone in changes:   # only the bounded knob's moves stay in range
            assert knob != key or lo <= new <= hi, changes
        assert len({step for step, *_ in changes}) == len(changes)   # one change a step at most (every=1)
        assert "autopilot_changes" not in res["poor"] or not res["poor"]["autopilot_changes"]
    # guard: at eta = 0 the trainer waits on generation from the first steps, so the autopilot moved
    # eta (the bound checks above saw a change)
    assert any(knob == "async.max_staleness" for _, knob, *_ in out["async_eta0"]["autopilot"]["autopilot_changes"])


def test_bench_greso_warm_start_compares_the_first_epoch_cold_and_warm():
    out = greso.run(args(preset="greso", warm_start=True, source_steps=2, eval_size=0,
                         set=[*TINY, "data.train_size=8"]), log=lambda *a: None)
    assert out["ratio"]["first_epoch_steps"] == 2 == out["cold"]["steps"] == out["warm"]["steps"]
    assert out["cold"]["samples_generated"] > 0
    assert out["ratio"]["warm_samples_saving"] == round(
        1 - out["warm"]["samples_generated"] / out["cold"]["samples_generated"], 3)


def test_bench_greso_drift_reports_the_wrong_skip_ratio_after_the_shift():
    out = greso.run(args(preset="greso", drift=True, drift_step=2, half_life=2.0, steps=3,
                         eval_size=0, set=[*TINY, "data.train_size=8"]), log=lambda *a: None)
    for v in (out["never_forgets"], out["forgets"]):
        assert {"wrong_skip_ratio_after_shift", "train_accuracy_after_shift", "prompts_skipped"} <= set(v)
    assert out["ratio"]["drift_step"] == 2


def test_judged_skips_by_hand():
    rows = [{"step": 1, "greso/skips_judged": 4, "greso/wrong_skip_ratio": 0.25},
            {"step": 2, "greso/skips_judged": 0},
            {"step": 3, "greso/skips_judged": 5, "greso/wrong_skip_ratio": 0.6}]
    assert greso.judged_skips(rows) == (4, 5)
    assert greso.judged_skips(rows, first_step=2) == (3, 2)


def test_bench_sandbox_interleaves_both_isolations_and_says_the_load():
    from trainer import sandbox
    from trainer.bench import sandbox as bench_sandbox
    if sandbox.unavailable("bwrap") is not None:
        pytest.skip(f"no isolation boundary here: {sandbox.unavailable('bwrap')}")
    before = sandbox.current()
    try:
        out = bench_sandbox.run(argparse.Namespace(reps=2, calls=1, asserts=3, batch=4, workers=1),
                                log=lambda *a: None)
    finally:
        sandbox.use(before)
    assert out["isolations"] == ["bwrap", "process"]
    assert set(out["ratio"]) == {"tool_ms", "reward_ms", "batch_samples_per_s"}
    assert len(out["batch_ratio_by_round"]) == 2 and len(out["loadavg"]) == 2
    for iso in out["isolations"]:
        assert out[iso]["batch_samples_per_s"] > 0 and out[iso]["tool_ms_min"] <= out[iso]["tool_ms"]
