"""bench april: the synchronous baseline against APRIL on the same long-tailed workload.

Both variants train the demo preset for the same number of steps from the same model and seed
in one process, interleaved over `--reps` rounds (baseline, APRIL, baseline, APRIL, ...; round r
on seed + r). Reported for each, as medians with their spread: trained tokens per second of
rollout time, time per step, idle decode slots, held-out accuracy after training, and for APRIL
the tokens left untrained in its buffer at the end (their rollout time is in its denominator,
so they count against it), and for both where every generated token went (`trained_token_share`,
`waiting_tokens_at_end`, `waste_<reason>_tokens`: version span, zero variance, surplus, ...);
`ratio.rollout_throughput` is APRIL / baseline (medians), `ratio.trained_token_share` likewise, and
`ratio.accuracy_delta` APRIL - baseline (a fraction). With --curve-every, also the training
seconds each needed to reach the baseline's final accuracy.

What APRIL can win is bounded by the hardware: it fills idle decode slots, which pays only as
far as a decode step costs less per row when it holds more rows. Each variant reports its mean
rows per decode step and the engine's decode (and admission: prefill, cache moves)
milliseconds per generated token; `ratio.decode_cost_per_token` is the baseline's decode cost
per token over APRIL's, the gain APRIL's full batches bought in decoding alone.

`--kv both` runs APRIL twice beside the baseline: keeping its parked samples' KV caches across
the weight update (`april`, engine.kv_on_update = keep) and prefilling them again under the new
weights (`april_recompute`), with `ratio_recompute` for the latter; each variant reports its
prefill, resumed-prefill and kept-cache tokens, and `admission_cost_per_token` is APRIL's
admission milliseconds per generated token over the baseline's.
"""
from __future__ import annotations

from trainer.bench.common import accuracy_delta, add_comparison_arguments, compare, ratio

NAME = "april"
HELP = "synchronous baseline vs APRIL partial rollouts"


def add_arguments(p) -> None:
    add_comparison_arguments(p, preset="demo", steps=40)
    p.add_argument("--kv", choices=["default", "both"], default="default",
                   help="both: APRIL twice, keeping parked samples' KV caches across the "
                   "update (april, engine.kv_on_update=keep) and prefilling them again "
                   "(april_recompute), interleaved with the baseline")


def run(args, log=print) -> dict:
    variants = [("baseline", args.preset, [*args.set, "april.enabled=false"]),
                ("april", args.preset, [*args.set, "april.enabled=true"])]
    both = getattr(args, "kv", "default") == "both"
    if both:
        variants[1][2].append("engine.kv_on_update=keep")
        variants.append(("april_recompute", args.preset,
                         [*args.set, "april.enabled=true", "engine.kv_on_update=recompute"]))
    res = compare(variants, args, log)
    base, apr = res["baseline"], res["april"]
    out = {"baseline": base, "april": apr, "ratio": ratios(apr, base)}
    if both:
        out["april_recompute"] = res["april_recompute"]
        out["ratio_recompute"] = ratios(res["april_recompute"], base)
    return out


def ratios(apr: dict, base: dict) -> dict:
    """APRIL's figures over the baseline's; `admission_cost_per_token`: its admission
    milliseconds per generated token over the baseline's (resumed samples' prefill against
    fresh prompts' alone)."""
    return {
        "admission_cost_per_token": ratio(apr["admit_ms_per_token"], base["admit_ms_per_token"]),
        "rollout_throughput": ratio(apr["trained_tokens_per_rollout_s"],
                                    base["trained_tokens_per_rollout_s"]),
        "time_per_step": ratio(apr["time_per_step_s"], base["time_per_step_s"]),
        "end_to_end_trained_tokens_per_s": ratio(apr["trained_tokens_per_s"],
                                                 base["trained_tokens_per_s"]),
        "decode_cost_per_token": ratio(base["decode_ms_per_token"], apr["decode_ms_per_token"]),
        "trained_token_share": ratio(apr["trained_token_share"], base["trained_token_share"]),
        "accuracy_delta": accuracy_delta(apr, base)}
