"""`bench engine` runs on CPU with tiny sizes and reports what it promises (no timing asserts)."""
import argparse

from trainer.bench import engine as bench_engine


def test_bench_engine_runs_on_cpu_and_reports_its_keys():
    p = argparse.ArgumentParser()
    bench_engine.add_arguments(p)
    args = p.parse_args(["--model", "builtin", "--device", "cpu", "--prompts", "6", "--slots", "3",
                         "--max-new-tokens", "24"])
    res = bench_engine.run(args, log=lambda *a, **k: None)
    assert res["model"] == "builtin" and res["device"] == "cpu" and res["lengths"] == "natural"
    for variant in ("engine", "static_generate"):
        r = res[variant]
        assert {"useful_tokens", "useful_tokens_per_s", "idle_slot_frac", "gpu_util",
                "seconds"} <= set(r)
        assert r["gpu_util"] is None and 0.0 <= r["idle_slot_frac"] < 1.0
    assert res["engine"]["useful_tokens"] == res["static_generate"]["useful_tokens"]  # greedy
    assert res["outputs_agree"] == 1.0
    assert res["ratio"]["useful_throughput"] > 0
    cost = res["decode_cost"]
    assert set(cost["per_token_ms"]) == {"8", "32", "128"} and cost["batching_gain_batches"] == [8, 128]
    med = {b: cost["per_token_ms"][b]["median"] for b in ("8", "128")}
    assert abs(cost["batching_gain"] - med["8"] / med["128"]) < 0.01 * cost["batching_gain"] + 0.01


def test_heavy_tail_lengths_by_hand():
    args = argparse.Namespace(seed=0, tail_alpha=0.7, tail_min=8, max_new_tokens=1536)
    # random.Random(0).random() = 0.8444...; 8 * (1 - 0.8444)^(-1/0.7) = 114.2 -> 115
    assert bench_engine.heavy_tail_lengths(1, args)[0] == 115
    lens = bench_engine.heavy_tail_lengths(256, args)
    assert min(lens) >= 8 and max(lens) == 1536  # the cap is reached: about 2.5% lie beyond it
    assert max(lens) / sorted(lens)[128] >= 50   # max / median: the rollout-dominated regime


def test_the_43m_model_runs_with_heavy_tailed_lengths():
    p = argparse.ArgumentParser()
    bench_engine.add_arguments(p)
    args = p.parse_args(["--model", "builtin-43m-random", "--device", "cpu", "--prompts", "4",
                         "--slots", "2", "--max-new-tokens", "40", "--lengths", "heavy",
                         "--reps", "1", "--step-batch", "4", "--step-steps", "2",
                         "--cost-batches", "2,4"])
    res = bench_engine.run(args, log=lambda *a, **k: None)
    assert res["lengths"] == "heavy"
    # every response forced to its drawn length, by both the engine and generate
    want = bench_engine.heavy_tail_lengths(4, args)
    assert res["engine"]["useful_tokens"] == res["static_generate"]["useful_tokens"] == sum(want)
    assert res["response_len"]["max"] == max(want)
    assert set(res["decode_cost"]["per_token_ms"]) == {"2", "4"}
