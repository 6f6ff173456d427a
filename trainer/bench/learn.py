"""bench learn: does RL make the built-in model better?

Runs the `demo` preset at a fixed seed for a fixed budget (steps and/or seconds of RL) and
measures held-out accuracy before and after on the same evaluation set (>= 1000 problems by
default). Prints {"accuracy_before", "accuracy_after", "delta", ...} (fractions).
"""
from __future__ import annotations

import tempfile
import time

from trainer import config as config_mod
from trainer.metrics import MemorySink

NAME = "learn"
HELP = "held-out accuracy before and after RL on the demo preset"


def add_arguments(p) -> None:
    p.add_argument("--preset", default="demo")
    p.add_argument("--seconds", type=float, default=600.0, help="RL time budget (default 600)")
    p.add_argument("--steps", type=int, default=100_000, help="RL step budget")
    p.add_argument("--eval-size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")


def run(args, log=print) -> dict:
    from trainer.runner import Runner

    cfg = config_mod.load(args.preset, [f"run.seed={args.seed}", f"run.max_steps={args.steps}",
                                        f"run.time_budget_s={args.seconds}", "run.eval_every=0",
                                        f"run.eval_size={args.eval_size}", "run.checkpoint_every=0",
                                        *args.set])
    with tempfile.TemporaryDirectory(prefix="rlpilot-bench-") as d:
        sink = MemorySink()
        with Runner(cfg, d, sink=sink, log=log) as runner:
            before = runner.evaluate()
            log(f"accuracy before: {before:.3f} on {args.eval_size} held-out problems")
            t0 = time.monotonic()
            runner.run()
            rl_seconds = time.monotonic() - t0
            after = runner.evaluate()
            log(f"accuracy after {runner.step} steps ({rl_seconds:.0f}s): {after:.3f}")
    return {"accuracy_before": before, "accuracy_after": after, "delta": after - before,
            "steps": runner.step, "rl_seconds": round(rl_seconds, 1), "eval_size": args.eval_size,
            "preset": args.preset, "seed": args.seed,
            "reward_mean_last10": _mean(sink.series("reward/mean")[-10:])}


def _mean(xs):
    return sum(xs) / len(xs) if xs else None
