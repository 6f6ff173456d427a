"""bench april: the synchronous baseline against APRIL on the same long-tailed workload.

Both variants train the demo preset for the same number of steps from the same model and seed
in one process. Reported for each: trained tokens per second of rollout time, time per step,
idle decode slots, and held-out accuracy after training; `ratio.rollout_throughput` is
APRIL / baseline and `ratio.accuracy_delta` APRIL - baseline (a fraction).
"""
from __future__ import annotations

from trainer.bench.common import accuracy_delta, add_comparison_arguments, ratio, train_variant

NAME = "april"
HELP = "synchronous baseline vs APRIL partial rollouts"


def add_arguments(p) -> None:
    add_comparison_arguments(p, preset="demo", steps=40)


def run(args, log=print) -> dict:
    common = dict(steps=args.steps, eval_size=args.eval_size, seed=args.seed, log=log)
    base = train_variant("baseline", args.preset, [*args.set, "april.enabled=false"], **common)
    apr = train_variant("april", args.preset, [*args.set, "april.enabled=true"], **common)
    return {"baseline": base, "april": apr, "ratio": {
        "rollout_throughput": ratio(apr["trained_tokens_per_rollout_s"],
                                    base["trained_tokens_per_rollout_s"]),
        "time_per_step": ratio(apr["time_per_step_s"], base["time_per_step_s"]),
        "end_to_end_trained_tokens_per_s": ratio(apr["trained_tokens_per_s"],
                                                 base["trained_tokens_per_s"]),
        "accuracy_delta": accuracy_delta(apr, base)}}
