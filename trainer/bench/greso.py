"""bench greso: DAPO dynamic sampling without and with GRESO's pre-rollout filter.

Both variants train the `greso` preset's workload (dynamic sampling on) for the same number of
training steps from the same model and seed, in one process, interleaved over `--reps` rounds
(medians and spread reported). Reported for each: samples and tokens generated, rollout time,
held-out accuracy. `ratio.samples_reduction` is baseline samples / GRESO samples;
`ratio.samples_reduction_ceiling` the most GRESO could save on this workload, (1 - alpha) /
(1 - z) with z the baseline's zero-variance share; `ratio.share_of_ceiling` how much of it was
reached; `ratio.accuracy_delta` GRESO - baseline (a fraction).
"""
from __future__ import annotations

from trainer import config as config_mod
from trainer.bench.common import accuracy_delta, add_comparison_arguments, compare, ratio

NAME = "greso"
HELP = "dynamic sampling vs dynamic sampling + GRESO selective rollouts"


def add_arguments(p) -> None:
    add_comparison_arguments(p, preset="greso", steps=100)


def reduction_ceiling(zero_var: float, alpha: float) -> float | None:
    """The most GRESO can save: dynamic sampling needs N groups with variance, so it rolls out
    N / (1 - z) groups when a share z of them is zero-variance; GRESO steers that share to its
    target alpha at best, N / (1 - alpha). The ratio is (1 - alpha) / (1 - z) (below 1: nothing
    to gain)."""
    if zero_var >= 1.0:
        return None
    return round((1.0 - alpha) / (1.0 - zero_var), 3)


def run(args, log=print) -> dict:
    res = compare([("dynamic_sampling", args.preset,
                    [*args.set, "rollout.dynamic_sampling=true", "greso.enabled=false"]),
                   ("greso", args.preset,
                    [*args.set, "rollout.dynamic_sampling=true", "greso.enabled=true"])], args, log)
    base, gre = res["dynamic_sampling"], res["greso"]
    alpha = config_mod.load(args.preset, [*args.set, "greso.enabled=true"]).greso.alpha
    reduction = ratio(base["samples_generated"], gre["samples_generated"])
    ceiling = reduction_ceiling(base["zero_var_ratio_mean"], alpha)
    return {"dynamic_sampling": base, "greso": gre, "ratio": {
        "samples_reduction": reduction,
        "samples_reduction_ceiling": ceiling,
        "share_of_ceiling": round(reduction / ceiling, 3) if reduction and ceiling else None,
        "tokens_reduction": ratio(base["tokens_generated"], gre["tokens_generated"]),
        "rollout_time_speedup": ratio(base["rollout_s"], gre["rollout_s"]),
        "accuracy_delta": accuracy_delta(gre, base)}}
