"""bench learn: does RL make the model better?

Runs a preset (default `demo`, the built-in model) at a fixed seed for a fixed budget (steps
and/or seconds of RL) and measures held-out accuracy before and after on the same evaluation set
(>= 1000 problems by default). Prints {"accuracy_before", "accuracy_after", "delta", ...}
(fractions) and the wall time.

`--preset agent` (multi-turn episodes with a calculator, the built-in tools model) also reports
the share of held-out episodes that called the tool, before and after ("tool_use_rate_before",
"tool_use_rate_after"), and their mean model turns.

`--preset smollm2-math` (SmolLM2-135M-Instruct, created with `python -m trainer import-gguf
smollm2`) has CPU-sized defaults: 4 prompts x 4 samples per step, responses of at most 96
tokens, 900 s of RL, 200 held-out problems scored greedily. Options and --set override them.
On a real model's preset it trains twice, for the same wall time each, full fine-tuning and
LoRA (`--variant both`, its default there; `full` or `lora` runs one), each in a process of its
own (so each one's peak memory is its own), and reports each one's accuracy before and after
with the evaluation's standard error, peak resident memory, median step time, weight-sync
bytes per update and trainable parameters.
"""
from __future__ import annotations

import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainer import config as config_mod
from trainer.observe.metrics import MemorySink

NAME = "learn"
HELP = "held-out accuracy before and after RL on the demo preset"


# presets whose model is too slow on 2 CPU cores for the defaults: (seconds, eval size, overrides)
PRESET_DEFAULTS = {
    "smollm2-math": (900.0, 200, ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                                  "rollout.max_response_len=96", "rollout.max_slots=16"]),
    "reasoning-gym": (900.0, 200, ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                                   "rollout.max_response_len=48", "rollout.max_slots=16"]),
}
# the LoRA variant's settings (an adapter's learning rate is about 10x full fine-tuning's); on a
# real model's preset `--variant both` is the default
LORA_VARIANT = {"smollm2-math": ["lora.rank=16", "lora.alpha=32", "optim.lr=1e-4"],
                "demo": ["lora.rank=8", "lora.alpha=16", "optim.lr=2e-3"]}
REAL_MODEL_PRESETS = ("smollm2-math",)


def add_arguments(p) -> None:
    p.add_argument("--preset", default="demo")
    slow = "; ".join(f"{s:g} for {name}" for name, (s, _, _) in PRESET_DEFAULTS.items())
    p.add_argument("--seconds", type=float, default=None, help=f"RL time budget (default 600; {slow})")
    p.add_argument("--steps", type=int, default=100_000, help="RL step budget")
    small = "; ".join(f"{n} for {name}" for name, (_, n, _) in PRESET_DEFAULTS.items())
    p.add_argument("--eval-size", type=int, default=None,
                   help=f"held-out problems (default 1000; {small})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--variant", choices=["full", "lora", "both"], default=None,
                   help="full fine-tuning, LoRA, or both side by side (default: both on a real "
                   "model's preset, else the preset as it is)")


def run(args, log=print) -> dict:
    variant = args.variant or ("both" if args.preset in REAL_MODEL_PRESETS else "full")
    if variant == "both":
        return _side_by_side(args, log)
    extra = LORA_VARIANT.get(args.preset, ["lora.rank=16", "lora.alpha=32"]) if variant == "lora" else []
    result = _one(args, extra, log)
    result["variant"] = variant
    return result


def _side_by_side(args, log) -> dict:
    """Each variant in a child process (`--variant full|lora`), one after the other."""
    out = {}
    for variant in ("full", "lora"):
        with tempfile.TemporaryDirectory(prefix="rlpilot-bench-") as d:
            path = Path(d) / "result.json"
            cmd = [sys.executable, "-m", "trainer", "bench", "learn", "--preset", args.preset,
                   "--variant", variant, "--json", str(path), "--steps", str(args.steps),
                   "--seed", str(args.seed)]
            cmd += [] if args.seconds is None else ["--seconds", str(args.seconds)]
            cmd += [] if args.eval_size is None else ["--eval-size", str(args.eval_size)]
            for s in args.set:
                cmd += ["--set", s]
            log(f"--- {variant} ---")
            err_path = Path(d) / "stderr.txt"
            with open(err_path, "w") as err, subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=err, text=True) as child:
                for line in child.stdout:   # its progress as it comes
                    if line.strip() and not line.startswith("wrote "):
                        log(f"[{variant}] {line.rstrip()}")
            errors = err_path.read_text(errors="replace")
            if child.returncode != 0:
                raise RuntimeError(f"bench learn --variant {variant} failed "
                                   f"(exit {child.returncode}):\n{errors[-2000:]}")
            out[variant] = json.loads(path.read_text())
    full, lora = out["full"], out["lora"]
    return {"preset": args.preset, "variants": out,
            "delta_full": full["delta"], "delta_lora": lora["delta"],
            "peak_rss_ratio_lora_vs_full": _ratio(lora["peak_rss_bytes"], full["peak_rss_bytes"]),
            "step_s_ratio_lora_vs_full": _ratio(lora["step_s_median"], full["step_s_median"]),
            "weight_sync_bytes_ratio_lora_vs_full": _ratio(lora["weight_sync_bytes"],
                                                            full["weight_sync_bytes"])}


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def stderr(p: float, n: int) -> float:
    """The standard error of an accuracy p measured on n problems (binomial)."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else 0.0


def _one(args, extra: list[str], log) -> dict:
    from trainer.models import lora as adapters
    from trainer.models.loading import require_model_dir
    from trainer.run.runner import Runner

    seconds, eval_size, shrink = PRESET_DEFAULTS.get(args.preset, (600.0, 1000, []))
    seconds = seconds if args.seconds is None else args.seconds
    eval_size = eval_size if args.eval_size is None else args.eval_size
    cfg = config_mod.load(args.preset, [*shrink, f"run.seed={args.seed}", f"run.max_steps={args.steps}",
                                        f"run.time_budget_s={seconds}", "run.eval_every=0",
                                        f"run.eval_size={eval_size}", "run.checkpoint_every=0",
                                        *extra, *args.set])
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
            sizes = adapters.sizes(runner.model)
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
            "stderr_before": round(stderr(before, eval_size), 4),
            "stderr_after": round(stderr(after, eval_size), 4),
            # what the variants differ in (a process of its own: ru_maxrss is its peak)
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_s_median": _median(sink.series("timing/step_s")),
            "weight_sync_bytes": _median(sink.series("perf/weight_sync_bytes")),
            "trainable_params": sizes["trainable_params"],
            "total_params": sizes["total_params"],
            "lora_rank": cfg.lora.rank, "lr": cfg.optim.lr,
            **tools_before, **tools_after}


def _median(xs):
    return statistics.median(xs) if xs else None


def _episode_figures(result: dict | None, when: str) -> dict:
    """An evaluation's episode figures (multi-turn presets), named for `when`."""
    if not result or "tool_use_rate" not in result:
        return {}
    return {f"tool_use_rate_{when}": result["tool_use_rate"], f"turns_mean_{when}": result["turns_mean"]}


def _mean(xs):
    return sum(xs) / len(xs) if xs else None
