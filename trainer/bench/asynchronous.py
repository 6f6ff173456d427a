"""bench async: the synchronous loop against asynchronous training with eta = 1, 2, 4.

All variants train the same task from the same model and seed for the same number of steps in
one process, interleaved over `--reps` rounds (sync, eta 1, eta 2, eta 4, sync, ...; round r on
seed + r). Reported for each, as medians with their spread: wall time, trained tokens per second
(end to end), held-out accuracy, staleness and stale drops, and where the generated tokens went
(`waste_<reason>_tokens`: `stale` for groups too old when taken, `zero_variance` for those
dynamic sampling filters; `waiting_tokens_at_end`: queued or generating). Every eta is reported
(`ratio.speedup_eta_K`); `ratio.speedup` is the best one's, picked on the same rounds it is
reported from (so it is optimistic: read every eta), `ratio.best_eta` that setting and
`ratio.accuracy_delta` its accuracy minus the synchronous loop's (a fraction).

`--schedule "0:0, 10:1, 20:2"` adds a variant whose eta follows that async.staleness_schedule
(AReaL's curriculum: small first, wider later): `ratio.speedup_schedule` against the synchronous
loop, and against the fixed eta of its last point when --etas has it
(`ratio.schedule_vs_eta_K`: trained tokens/s, `ratio.schedule_accuracy_delta_vs_eta_K`).

The synchronous loop uses every core for each phase (torch intra-op threads); the asynchronous
one gives generation (its own process) and training one thread each by default, so both use
the same cores. That bounds what overlapping can win: with one thread each, a step takes at
least the longer of the two sides, so the synchronous loop is also run on one thread
(`sync_1_thread`, unless --sync-threads is 1 already) and `ratio.overlap_ceiling` is the
synchronous step time over the longer of its one-thread generation and the rest of its step
(update, rewards, weight sync). Where the cores speed each phase up almost linearly, the
ceiling is near 1 whatever the engine does; separate devices for the two sides (as AReaL
has) lift it. The asynchronous variants use the log-linear pi_prox (no extra forward pass per
step) unless --set says otherwise.
"""
from __future__ import annotations

import argparse
import os

from trainer.bench.common import accuracy_delta, add_comparison_arguments, compare, ratio
from trainer.rollout import staleness_schedule

NAME = "async"
HELP = "synchronous loop vs asynchronous training (eta = 1, 2, 4)"


def add_arguments(p) -> None:
    add_comparison_arguments(p, preset="demo", steps=40)
    p.add_argument("--etas", default="1,2,4", help="comma-separated staleness bounds")
    p.add_argument("--sync-threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the synchronous loop (default: every core)")
    p.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the synchronous loop on one thread for ratio.overlap_ceiling")
    p.add_argument("--schedule", default="",
                   help="also a variant whose eta follows this async.staleness_schedule, "
                   "e.g. '0:0, 10:1, 20:2'")
    p.add_argument("--trainer-threads", type=int, default=1,
                   help="torch threads of the asynchronous trainer (its engine process has "
                   "async.worker_threads, default 1)")


def run(args, log=print) -> dict:
    variants = [("sync", args.preset, [*args.set, "async.enabled=false",
                                       f"model.threads={args.sync_threads}"])]
    one_thread = "sync" if args.sync_threads == 1 else "sync_1_thread"
    if getattr(args, "ceiling", True) and one_thread != "sync":
        variants.append((one_thread, args.preset,
                         [*args.set, "async.enabled=false", "model.threads=1"]))
    for eta in (int(e) for e in args.etas.split(",")):
        variants.append((f"eta_{eta}", args.preset, [
            "async.prox_logp=loglinear", *args.set, "async.enabled=true",
            f"model.threads={args.trainer_threads}", f"async.max_staleness={eta}"]))
    schedule = staleness_schedule.parse(getattr(args, "schedule", "") or "")
    if schedule:
        variants.append(("schedule", args.preset, [
            "async.prox_logp=loglinear", *args.set, "async.enabled=true",
            f"model.threads={args.trainer_threads}",
            f"async.staleness_schedule={staleness_schedule.text(schedule)}"]))
    out = compare(variants, args, log)
    sync = out["sync"]
    best = max((k for k in out if k.startswith("eta_")),   # the schedule is reported apart
               key=lambda k: out[k]["trained_tokens_per_s"])
    out["ratio"] = {"speedup": ratio(out[best]["trained_tokens_per_s"],
                                     sync["trained_tokens_per_s"]),
                    "best_eta": int(best.split("_")[1]),
                    "accuracy_delta": accuracy_delta(out[best], sync),
                    **{f"speedup_{k}": ratio(out[k]["trained_tokens_per_s"],
                                             sync["trained_tokens_per_s"])
                       for k in out if k.startswith("eta_")}}
    if schedule:
        out["ratio"]["speedup_schedule"] = ratio(out["schedule"]["trained_tokens_per_s"],
                                                 sync["trained_tokens_per_s"])
        fixed = f"eta_{schedule[-1].eta}"
        if fixed in out:
            out["ratio"][f"schedule_vs_{fixed}"] = ratio(out["schedule"]["trained_tokens_per_s"],
                                                         out[fixed]["trained_tokens_per_s"])
            out["ratio"][f"schedule_accuracy_delta_vs_{fixed}"] = accuracy_delta(out["schedule"],
                                                                                 out[fixed])
    if one_thread in out:
        one = out[one_thread]
        gen = one["rollout_s"] / one["steps"]
        rest = one["time_per_step_s"] - gen
        out["ratio"]["overlap_ceiling"] = overlap_ceiling(sync["time_per_step_s"], gen, rest)
        out["ratio"]["one_thread_step_s"] = {"generation": round(gen, 3), "rest": round(rest, 3)}
    return out


def overlap_ceiling(sync_step_s: float, gen_s: float, rest_s: float) -> float | None:
    """The most an asynchronous step can gain over a synchronous one of `sync_step_s` when
    generation (`gen_s` per step) and the rest of the step (`rest_s`) run side by side, one
    thread each: the step cannot be shorter than the longer side."""
    return ratio(sync_step_s, max(gen_s, rest_s))
