"""bench pilot: the autopilot started from a poor setting, against the same run left alone and
against a small grid of hand-picked settings.

Two starting points (`--cases`): `async_eta0` (the `async` preset at eta = 0, the synchronous
loop; autopilot rule `staleness`, eta bounded to [0, 4]; grid eta = 1, 2, 4) and `april_no_oversample`
(the `april` preset with N' = the batch, no over-sampling; autopilot rule `april`; grid N' = 48,
64, 96; every variant with 512 decode slots: with the preset's 128, fewer than one batch's 256
samples, the over-sampled groups would wait for a slot until the step ended and every N' would
generate the same tokens). Every variant of a case trains the same steps from the same model and seed, interleaved
over `--reps` rounds. Reported per case: each variant's medians (trained tokens/s, held-out
accuracy, ...), the autopilot's knob changes (`autopilot_changes`), and `ratio`: the autopilot's
and the poor setting's throughput over the best grid setting's (`throughput_vs_best`) and their
held-out accuracy minus its (`accuracy_delta`). Target: the autopilot >= 0.9 of the best grid
setting's throughput with accuracy within 0.02, where the poor setting alone is not.
"""
from __future__ import annotations

from trainer.bench.common import accuracy_delta, add_comparison_arguments, compare, ratio

NAME = "pilot"
HELP = "the autopilot from a poor setting vs left alone vs a grid of settings"

# case: (preset, every variant's overrides, the poor setting, autopilot rule, its bounds, the grid)
CASES = {
    "async_eta0": ("async", [], ["async.max_staleness=0"], "staleness", "async.max_staleness=0..4",
                   [("eta_1", ["async.max_staleness=1"]), ("eta_2", ["async.max_staleness=2"]),
                    ("eta_4", ["async.max_staleness=4"])]),
    "april_no_oversample": ("april", ["rollout.max_slots=512"], ["april.over_sampling_batch_size=32"], "april",
                            "april.over_sampling_batch_size=32..128",
                            [("n_48", ["april.over_sampling_batch_size=48"]),
                             ("n_64", ["april.over_sampling_batch_size=64"]),
                             ("n_96", ["april.over_sampling_batch_size=96"])]),
}


def add_arguments(p) -> None:
    add_comparison_arguments(p, preset="(per case)", steps=60)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--every", type=int, default=10, help="pilot.every of the autopilot variant")


def run(args, log=print) -> dict:
    out = {}
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; cases: {', '.join(CASES)}")
        preset, base, poor, rule, bounds, grid = CASES[case]
        base = [*base, *args.set]   # what the command line sets wins
        variants = [("poor", preset, [*base, *poor]),
                    ("autopilot", preset, [*base, *poor, f"pilot.autopilot={rule}",
                                           f"pilot.bounds={bounds}", f"pilot.every={args.every}"]),
                    *[(name, preset, [*base, *knobs]) for name, knobs in grid]]
        res = compare(variants, args, log)
        best = max((name for name, _ in grid), key=lambda k: res[k]["trained_tokens_per_s"])
        res["ratio"] = {"best_grid": best, **{
            f"{v}_{what}": f(res[v], res[best]) for v in ("autopilot", "poor")
            for what, f in (("throughput_vs_best", lambda a, b: ratio(a["trained_tokens_per_s"],
                                                                     b["trained_tokens_per_s"])),
                            ("accuracy_delta", accuracy_delta))}}
        out[case] = res
    return out
