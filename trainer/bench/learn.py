"""bench learn: does RL make the model better?

Runs a preset (default `demo`, the built-in model) at a fixed seed for a fixed budget (steps
and/or seconds of RL) and measures held-out accuracy before and after on the same evaluation set
(>= 1000 problems by default). Prints {"accuracy_before", "accuracy_after", "delta", ...}
(fractions) and the wall time.

`--preset agent` (multi-turn episodes with a calculator, the built-in tools model) also reports
the share of held-out episodes that called the tool, before and after ("tool_use_rate_before",
"tool_use_rate_after"), and their mean model turns.

`--preset smollm2-math` (SmolLM2-135M-Instruct, created with `python -m trainer import-gguf
smollm2`) has CPU-sized defaults: 4 prompts x 4 samples per step, responses of at most 64
tokens, 120 s of RL, 64 held-out problems scored greedily. Options and --set override them.
"""
from __future__ import annotations

import tempfile
import time

from trainer import config as config_mod
from trainer.observe.metrics import MemorySink

NAME = "learn"
HELP = "held-out accuracy before and after RL on the demo preset"


# presets whose model is too slow on 2 CPU cores for the defaults: (seconds, eval size, overrides)
PRESET_DEFAULTS = {
    "smollm2-math": (120.0, 64, ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                                 "rollout.max_response_len=64", "rollout.max_slots=16"]),
}


def add_arguments(p) -> None:
    p.add_argument("--preset", default="demo")
    p.add_argument("--seconds", type=float, default=None,
                   help="RL time budget (default 600; 120 for smollm2-math)")
    p.add_argument("--steps", type=int, default=100_000, help="RL step budget")
    p.add_argument("--eval-size", type=int, default=None, help="held-out problems (default 1000; "
                   "64 for smollm2-math)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")


def run(args, log=print) -> dict:
    from trainer.models.loading import require_model_dir
    from trainer.run.runner import Runner

    seconds, eval_size, shrink = PRESET_DEFAULTS.get(args.preset, (600.0, 1000, []))
    seconds = seconds if args.seconds is None else args.seconds
    eval_size = eval_size if args.eval_size is None else args.eval_size
    cfg = config_mod.load(args.preset, [*shrink, f"run.seed={args.seed}", f"run.max_steps={args.steps}",
                                        f"run.time_budget_s={seconds}", "run.eval_every=0",
                                        f"run.eval_size={eval_size}", "run.checkpoint_every=0",
                                        *args.set])
    require_model_dir(cfg.model.path, engine=cfg.rollout.engine)
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlpilot-bench-") as d:
        sink = MemorySink()
        with Runner(cfg, d, sink=sink, log=log) as runner:
            runner.save_checkpoint = lambda: None  # a benchmark keeps nothing on disk
            t0 = time.monotonic()
            before = runner.evaluate()
            tools_before = _episode_figures(runner.last_eval_result, "before")
            eval_seconds = time.monotonic() - t0
            log(f"accuracy before: {before:.3f} on {eval_size} held-out problems ({eval_seconds:.0f}s)")
            t0 = time.monotonic()
            runner.run()
            rl_seconds = time.monotonic() - t0
            after = runner.evaluate()
            tools_after = _episode_figures(runner.last_eval_result, "after")
            log(f"accuracy after {runner.step} steps ({rl_seconds:.0f}s): {after:.3f}")
            if tools_after:
                log(f"tool use: {tools_before['tool_use_rate_before']:.3f} -> "
                    f"{tools_after['tool_use_rate_after']:.3f} of held-out episodes")
    return {"accuracy_before": before, "accuracy_after": after, "delta": after - before,
            "steps": runner.step, "rl_seconds": round(rl_seconds, 1),
            "eval_seconds": round(eval_seconds, 1), "wall_s": round(time.monotonic() - t_all, 1),
            "eval_size": eval_size, "preset": args.preset, "seed": args.seed,
            "samples_per_step": cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt,
            "reward_mean_last10": _mean(sink.series("reward/mean")[-10:]),
            "reward_mean_first": _mean(sink.series("reward/mean")[:1]),
            **tools_before, **tools_after}


def _episode_figures(result: dict | None, when: str) -> dict:
    """An evaluation's episode figures (multi-turn presets), named for `when`."""
    if not result or "tool_use_rate" not in result:
        return {}
    return {f"tool_use_rate_{when}": result["tool_use_rate"], f"turns_mean_{when}": result["turns_mean"]}


def _mean(xs):
    return sum(xs) / len(xs) if xs else None
