"""bench async: the synchronous loop against asynchronous training with eta = 1, 2, 4.

All variants train the same task from the same model and seed for the same number of steps in
one process. Reported for each: wall time, trained tokens per second (end to end), held-out
accuracy; `ratio.speedup` is the best asynchronous setting's end-to-end throughput over the
synchronous loop's, `ratio.best_eta` that setting and `ratio.accuracy_delta` its accuracy minus
the synchronous loop's (a fraction).

The synchronous loop uses every core for each phase (torch intra-op threads); the asynchronous
one gives generation and training one thread each, so both use the same cores.
"""
from __future__ import annotations

import os

from trainer.bench.common import ratio, train_variant

NAME = "async"
HELP = "synchronous loop vs asynchronous training (eta = 1, 2, 4)"


def add_arguments(p) -> None:
    p.add_argument("--preset", default="demo")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--etas", default="1,2,4", help="comma-separated staleness bounds")
    p.add_argument("--eval-size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="applied to every variant")


def run(args, log=print) -> dict:
    common = dict(steps=args.steps, eval_size=args.eval_size, seed=args.seed, log=log)
    cores = os.cpu_count() or 1
    sync = train_variant("sync", args.preset, [*args.set, "async.enabled=false",
                                               f"model.threads={cores}"], **common)
    out = {"sync": sync}
    for eta in (int(e) for e in args.etas.split(",")):
        out[f"eta_{eta}"] = train_variant(
            f"eta_{eta}", args.preset, [*args.set, "async.enabled=true", "model.threads=1",
                                        f"async.max_staleness={eta}"], **common)
    best = max((k for k in out if k != "sync"), key=lambda k: out[k]["trained_tokens_per_s"])
    delta = None
    if sync["heldout_accuracy"] is not None:
        delta = round(out[best]["heldout_accuracy"] - sync["heldout_accuracy"], 4)
    out["ratio"] = {"speedup": ratio(out[best]["trained_tokens_per_s"],
                                     sync["trained_tokens_per_s"]),
                    "best_eta": int(best.split("_")[1]), "accuracy_delta": delta,
                    **{f"speedup_{k}": ratio(out[k]["trained_tokens_per_s"],
                                             sync["trained_tokens_per_s"])
                       for k in out if k.startswith("eta_")}}
    return out
