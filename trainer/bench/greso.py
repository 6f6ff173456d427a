"""bench greso: DAPO dynamic sampling without and with GRESO's pre-rollout filter.

Both variants train the `greso` preset's workload (dynamic sampling on) for the same number of
training steps from the same model and seed, in one process. Reported for each: samples and
tokens generated, rollout time, held-out accuracy; `ratio.samples_reduction` is
baseline samples / GRESO samples and `ratio.accuracy_delta` GRESO - baseline (a fraction).
"""
from __future__ import annotations

from trainer.bench.common import ratio, train_variant

NAME = "greso"
HELP = "dynamic sampling vs dynamic sampling + GRESO selective rollouts"


def add_arguments(p) -> None:
    p.add_argument("--preset", default="greso")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="applied to both variants")


def run(args, log=print) -> dict:
    common = dict(steps=args.steps, eval_size=args.eval_size, seed=args.seed, log=log)
    base = train_variant("dynamic_sampling", args.preset,
                         [*args.set, "rollout.dynamic_sampling=true", "greso.enabled=false"], **common)
    gre = train_variant("greso", args.preset,
                        [*args.set, "rollout.dynamic_sampling=true", "greso.enabled=true"], **common)
    delta = None
    if base["heldout_accuracy"] is not None:
        delta = round(gre["heldout_accuracy"] - base["heldout_accuracy"], 4)
    return {"dynamic_sampling": base, "greso": gre, "ratio": {
        "samples_reduction": ratio(base["samples_generated"], gre["samples_generated"]),
        "tokens_reduction": ratio(base["tokens_generated"], gre["tokens_generated"]),
        "rollout_time_speedup": ratio(base["rollout_s"], gre["rollout_s"]),
        "accuracy_delta": delta}}
