"""bench mismatch: fp32 rollouts against bf16 rollouts, uncorrected and with each rollout correction.

The trainer scores every token in its own precision (model.dtype; float32 on CPU) while the
engine samples it in `rollout.dtype`; the gap between the engine's log-probability pi_rollout and
the trainer's pi_old is the training–inference mismatch (trainer/algo/rollout_correction.py). Every
variant trains the same preset for the same number of steps from the same model and seed, in
one process, interleaved over `--repeats` rounds (fp32, bf16, bf16_truncate, ..., fp32, ...;
round r on seed + r). The default variants:

- `fp32`: the engine in float32 (`rollout.dtype=float32`), no correction: the baseline;
- `bf16`: the engine in bfloat16, no correction (pi_old is then the engine's own);
- `bf16_truncate`, `bf16_mask`, `bf16_band`: bfloat16 with `mismatch.correction` truncate (TIS),
  mask (MIS; IcePop at token level) or band (rejection without reweighting) at token level
  (pi_old is then the trainer's, and the loss is
  weighted by pi_old / pi_rollout);
- `bf16_truncate_seq`, `bf16_truncate_geo`: truncate at sequence and geometric level.

`--variants` picks others (VARIANTS below: also mask and band at sequence and geometric level,
`bf16_recompute`, pi_old recomputed by the trainer with no weight, which tells the two
halves of a correction apart, and `fp32_unmeasured`, `mismatch.measure` off: what measuring
costs). Reported per variant, medians over the rounds: held-out accuracy
after training (`--eval-size` problems, each variant evaluated through its own engine), training
accuracy over the last quarter of the steps, the mean k3 KL and mean |log pi_old - log
pi_rollout| per token, the largest |difference| of any step of any round, the mean correction
weight and the share of tokens it zeroed or truncated, trained tokens per second (end to end)
and generated tokens per second of rollout time. `ratio.<variant>` holds each variant's
throughputs over the baseline's (`fp32`, else the first listed) and its accuracies minus the
baseline's (fractions). The mismatch figures have no ratio: the baseline's are ~0.

Before the rounds the baseline trains one unrecorded step (`--no-warmup` skips it), so that the
process's start-up is not charged to the first round's baseline. With `--json OUT` the table is
printed and the result written to OUT; with `--json` alone only the result is printed.
"""
from __future__ import annotations

import argparse
import statistics

from trainer.bench.common import compare, ratio, train_variant

NAME = "mismatch"
HELP = "fp32 vs bf16 rollouts, uncorrected and with each rollout correction (TIS, MIS/IcePop, band)"

BF16 = "rollout.dtype=bfloat16"
VARIANTS: dict[str, list[str]] = {
    "fp32": ["rollout.dtype=float32", "mismatch.correction=off"],
    "bf16": [BF16, "mismatch.correction=off"],
    "bf16_recompute": [BF16, "mismatch.correction=off", "algo.recompute_old_logprobs=true"],
    # what measuring costs (mismatch.measure's forward pass), against `fp32`
    "fp32_unmeasured": ["rollout.dtype=float32", "mismatch.correction=off", "mismatch.measure=false"],
    **{f"bf16_{mode}{suffix}": [BF16, f"mismatch.correction={mode}", f"mismatch.level={level}"]
       for mode in ("truncate", "mask", "band")
       for suffix, level in (("", "token"), ("_seq", "sequence"), ("_geo", "geometric"))},
}
DEFAULT_VARIANTS = ("fp32", "bf16", "bf16_truncate", "bf16_mask", "bf16_band",
                    "bf16_truncate_seq", "bf16_truncate_geo")

# the table's columns: (heading, key in a variant's summary, format)
COLUMNS = [("held-out acc", "heldout_accuracy", "{:.3f}"),
           ("train acc (last 1/4)", "train_accuracy_last", "{:.3f}"),
           ("KL k3 (mean)", "mismatch_kl_mean", "{:.2e}"),
           ("mean abs Δlogp", "abs_logp_diff_mean", "{:.2e}"),
           ("max abs Δlogp", "abs_logp_diff_max", "{:.3g}"),
           ("weight", "correction_weight_mean", "{:.4f}"),
           ("zeroed", "correction_zeroed_ratio_mean", "{:.4f}"),
           ("truncated", "correction_truncated_ratio_mean", "{:.4f}"),
           ("trained tok/s", "trained_tokens_per_s", "{:,.0f}"),
           ("x base", "ratio_trained_tokens_per_s", "{:.3f}"),
           ("gen tok/s", "gen_tokens_per_rollout_s", "{:,.0f}"),
           ("x base", "ratio_gen_tokens_per_rollout_s", "{:.3f}"),
           ("s/step", "time_per_step_s", "{:.2f}")]


# figures too small for summarise()'s 4 decimals: their medians are taken here
SMALL = ("mismatch_kl_mean", "mismatch_kl_k1_mean", "abs_logp_diff_mean", "outside_band_ratio_mean",
         "correction_zeroed_ratio_mean", "correction_truncated_ratio_mean")


def add_arguments(p) -> None:
    p.add_argument("--preset", default="demo")
    p.add_argument("--steps", type=int, default=20, help="training steps per variant")
    p.add_argument("--repeats", "--reps", dest="reps", type=int, default=2,
                   help="rounds; the variants run interleaved, round r on seed + r")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated, from: " + ", ".join(VARIANTS)
                   + " (the baseline: fp32 if listed, else the first)")
    p.add_argument("--eval-size", type=int, default=500,
                   help="held-out problems for the accuracy after training (0 = skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="first train the baseline one step, unrecorded, so that the process's "
                   "start-up (imports, thread pools, first allocations) is not charged to the "
                   "first round's baseline")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="applied to every variant (before the variant's own settings)")


def figures(sink) -> dict:
    """A run's mismatch and accuracy figures from its metrics (train_variant's `extra`)."""
    s = sink.series
    acc = s("reward/accuracy")
    gen_s = sum(s("timing/gen_s"))
    return {
        "train_accuracy_last": _round(_mean(acc[-max(len(acc) // 4, 1):])),
        "mismatch_kl_mean": _mean(s("mismatch/kl")),
        "mismatch_kl_k1_mean": _mean(s("mismatch/kl_k1")),
        "abs_logp_diff_mean": _mean(s("mismatch/abs_logp_diff")),
        "abs_logp_diff_max": max(s("mismatch/abs_logp_diff_max"), default=None),
        "outside_band_ratio_mean": _mean(s("mismatch/outside_band_ratio")),
        # absent where no correction ran: the weight is then 1 everywhere, nothing zeroed
        "correction_weight_mean": _round(_mean(s("mismatch/correction_weight")), 6),
        "correction_zeroed_ratio_mean": _mean(s("mismatch/correction_zeroed_ratio")),
        "correction_truncated_ratio_mean": _mean(s("mismatch/correction_truncated_ratio")),
        "gen_tokens_per_rollout_s": round(sum(s("rollout/gen_tokens")) / max(gen_s, 1e-9), 1),
    }


def run(args, log=print) -> dict:
    names = [x.strip() for x in args.variants.split(",") if x.strip()]
    unknown = [x for x in names if x not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"--variants: unknown {unknown or names}; choose from {', '.join(VARIANTS)}")
    base = "fp32" if "fp32" in names else names[0]
    names = [base, *(n for n in names if n != base)]   # compare() takes the first as its baseline
    if getattr(args, "warmup", True):
        train_variant("warmup", args.preset, [*args.set, *VARIANTS[base]], steps=1, eval_size=0,
                      seed=args.seed, log=lambda *a, **k: None)
    out = compare([(n, args.preset, [*args.set, *VARIANTS[n]]) for n in names], args, log,
                  extra=figures)
    for name in names:
        rounds = out[name]["rounds"]
        for key in SMALL:   # summarise() rounds to 4 decimals: a KL of 5e-5 would read 0.0001
            values = [r[key] for r in rounds if r[key] is not None]
            out[name][key] = _significant(statistics.median(values)) if values else None
        # the largest difference of any step of any round, not the median
        maxima = [r["abs_logp_diff_max"] for r in rounds if r["abs_logp_diff_max"] is not None]
        out[name]["abs_logp_diff_max"] = max(maxima) if maxima else None
    b = out[base]
    ratios = {}
    for name in names:
        v = out[name]
        ratios[name] = {
            "trained_tokens_per_s": ratio(v["trained_tokens_per_s"], b["trained_tokens_per_s"]),
            "gen_tokens_per_rollout_s": ratio(v["gen_tokens_per_rollout_s"],
                                              b["gen_tokens_per_rollout_s"]),
            "heldout_accuracy_delta": _delta(v["heldout_accuracy"], b["heldout_accuracy"]),
            "train_accuracy_last_delta": _delta(v["train_accuracy_last"], b["train_accuracy_last"]),
        }
    rows = table_rows(out, ratios, names)
    log(format_table(rows))
    return {"variants": {n: out[n] for n in names}, "ratio": ratios, "baseline": base,
            "table": rows, "preset": args.preset, "steps": args.steps, "reps": args.reps,
            "eval_size": args.eval_size, "seed": args.seed, "set": list(args.set)}


def table_rows(out: dict, ratios: dict, names: list[str]) -> list[dict]:
    """One row per variant: the table's figures (medians over the rounds)."""
    rows = []
    for name in names:
        v = out[name]
        row = {"variant": name}
        for _, key, _ in COLUMNS:
            if key.startswith("ratio_"):
                row[key] = ratios[name][key[len("ratio_"):]]
            else:
                row[key] = v.get(key)
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as a Markdown table ("—" where a figure does not apply)."""
    head = ["variant", *(h for h, _, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["variant"]]
        for _, key, fmt in COLUMNS:
            value = row.get(key)
            cells.append("—" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def _round(x, digits: int = 4):
    return None if x is None else round(x, digits)


def _significant(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _delta(a, b):
    return None if a is None or b is None else round(a - b, 4)
