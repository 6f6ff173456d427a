"""bench greso: DAPO dynamic sampling without and with GRESO's pre-rollout filter.

Both variants train the `greso` preset's workload (dynamic sampling on) for the same number of
training steps from the same model and seed, in one process. Reported for each: samples and
tokens generated, rollout time, held-out accuracy; `ratio.samples_reduction` is
baseline samples / GRESO samples and `ratio.accuracy_delta` GRESO - baseline (a fraction).
"""
from __future__ import annotations

from trainer.bench.common import accuracy_delta, add_comparison_arguments, ratio, train_variant

NAME = "greso"
HELP = "dynamic sampling vs dynamic sampling + GRESO selective rollouts"


def add_arguments(p) -> None:
    add_comparison_arguments(p, preset="greso", steps=100)


def run(args, log=print) -> dict:
    common = dict(steps=args.steps, eval_size=args.eval_size, seed=args.seed, log=log)
    base = train_variant("dynamic_sampling", args.preset,
                         [*args.set, "rollout.dynamic_sampling=true", "greso.enabled=false"], **common)
    gre = train_variant("greso", args.preset,
                        [*args.set, "rollout.dynamic_sampling=true", "greso.enabled=true"], **common)
    return {"dynamic_sampling": base, "greso": gre, "ratio": {
        "samples_reduction": ratio(base["samples_generated"], gre["samples_generated"]),
        "tokens_reduction": ratio(base["tokens_generated"], gre["tokens_generated"]),
        "rollout_time_speedup": ratio(base["rollout_s"], gre["rollout_s"]),
        "accuracy_delta": accuracy_delta(gre, base)}}
