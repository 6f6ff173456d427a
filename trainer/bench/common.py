"""What the side-by-side benchmarks share: train one variant for a fixed number of steps from
the same starting model and seed, then measure held-out accuracy on the same problems."""
from __future__ import annotations

import tempfile
import time

from trainer import config as config_mod
from trainer.metrics import MemorySink


def add_comparison_arguments(p, *, preset: str, steps: int) -> None:
    """The options every side-by-side training benchmark takes."""
    p.add_argument("--preset", default=preset)
    p.add_argument("--steps", type=int, default=steps, help="training steps per variant")
    p.add_argument("--eval-size", type=int, default=1000,
                   help="held-out problems for the accuracy after training (0 = skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="applied to every variant")


def accuracy_delta(a: dict, b: dict) -> float | None:
    """a's held-out accuracy minus b's (a fraction), when both were measured."""
    if a["heldout_accuracy"] is None or b["heldout_accuracy"] is None:
        return None
    return round(a["heldout_accuracy"] - b["heldout_accuracy"], 4)


def train_variant(name: str, preset: str, overrides: list[str], *, steps: int, eval_size: int,
                  seed: int, log=print) -> dict:
    """Train `steps` steps and return the summed/averaged figures a comparison needs."""
    from trainer.runner import Runner

    cfg = config_mod.load(preset, [*overrides, f"run.max_steps={steps}", f"run.seed={seed}",
                                   "run.eval_every=0", "run.checkpoint_every=0",
                                   *([f"run.eval_size={eval_size}"] if eval_size else [])])
    sink = MemorySink()
    with tempfile.TemporaryDirectory(prefix="rlpilot-bench-") as d:
        with Runner(cfg, d, sink=sink, system_telemetry=False) as runner:
            runner.save_checkpoint = lambda: None  # benchmarks keep nothing on disk
            t0 = time.monotonic()
            runner.run()
            wall = time.monotonic() - t0
            accuracy = runner.evaluate() if eval_size else None
    s = sink.series
    gen_s = sum(s("timing/gen_s"))
    trained = sum(s("rollout/trained_tokens"))
    out = {
        "variant": name, "steps": steps, "wall_s": round(wall, 2),
        "rollout_s": round(gen_s, 2),
        "time_per_step_s": round(wall / steps, 3),
        "samples_generated": int(sum(s("rollout/samples"))),
        "tokens_generated": int(runner.totals["gen_tokens"]),
        "trained_tokens": int(trained),
        "trained_tokens_per_rollout_s": round(trained / max(gen_s, 1e-9), 1),
        "trained_tokens_per_s": round(trained / max(wall, 1e-9), 1),
        "idle_slot_frac_mean": round(_mean(s("rollout/idle_slot_frac")), 3),
        "reward_mean": round(_mean(s("reward/mean")), 4),
        "heldout_accuracy": accuracy,
    }
    log(f"{name}: " + ", ".join(f"{k}={v}" for k, v in out.items() if k != "variant"))
    return out


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)
