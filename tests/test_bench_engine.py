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
