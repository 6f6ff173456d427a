"""The side-by-side benchmarks run end to end at toy sizes and report the promised keys.
(They measure; tests never assert their timings.)"""
import argparse

from trainer.bench import april, asynchronous, greso, learn

TINY = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_response_len=48", "rollout.max_slots=16", "run.reward_workers=0"]


def args(**kw):
    base = dict(steps=2, eval_size=16, seed=0, set=list(TINY), json=True)
    return argparse.Namespace(**{**base, **kw})


def test_bench_april_reports_the_ratio():
    out = april.run(args(preset="demo"), log=lambda *a: None)
    assert set(out["ratio"]) >= {"rollout_throughput", "accuracy_delta"}
    assert out["baseline"]["steps"] == out["april"]["steps"] == 2
    assert 0 <= out["april"]["heldout_accuracy"] <= 1


def test_bench_greso_reports_samples_reduction():
    out = greso.run(args(preset="greso"), log=lambda *a: None)
    assert set(out["ratio"]) >= {"samples_reduction", "accuracy_delta"}
    assert out["dynamic_sampling"]["samples_generated"] > 0


def test_bench_async_reports_speedup_and_best_eta():
    out = asynchronous.run(args(preset="demo", etas="0,1", sync_threads=1, trainer_threads=1),
                           log=lambda *a: None)
    assert set(out["ratio"]) >= {"speedup", "best_eta", "accuracy_delta"}
    assert out["ratio"]["best_eta"] in (0, 1)


def test_bench_learn_reports_before_after_and_delta():
    out = learn.run(args(preset="demo", seconds=5.0, steps=2, eval_size=16), log=lambda *a: None)
    assert abs(out["delta"] - (out["accuracy_after"] - out["accuracy_before"])) < 1e-12
    assert out["steps"] == 2
