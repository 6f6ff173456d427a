"""bench scale: one preset on one process against the scale-out layouts (docs/scaling.md).

Variants, each the CLI in a process tree of its own (`python -m trainer run`, or under torchrun),
same preset, steps and seed, interleaved over `--reps` rounds (round r on seed + r):

- `1_process`: everything in one process (the embedded engine in it; an asynchronous preset's
  generation in a thread, `async.worker=thread`);
- `2_train`: two training ranks, rank 0 the controller with the embedded engine in it (the same);
- `1_gen_2_train`: two training ranks and one generation process (`cluster.gen_procs=1`);
- `1_gen_2_train_fsdp`: the same with the model sharded over the two ranks (`cluster.sharding=fsdp`:
  every forward gathers the weights, every update gathers them whole for the generator).

Reported per variant (medians over rounds, from the runs' metrics.jsonl, so process start-up and
model loading are left out): seconds per step and its parts (generation or waiting for groups,
the update, the weight sync), weight-sync bytes per step, trained tokens per second, the training
shares' imbalance, and where the generated tokens went. `ratio.step_time_<variant>` is the
variant's step time over `1_process`'s.

On a machine with C cores and no GPU every process competes for the same cores (each gets
`--threads` torch threads), so a layout with more processes cannot be faster here: the figures
are the layout's overhead (the extra weight copy per update, the shares' hand-off, the
controller's bookkeeping). The same command on a GPU machine (`--set model.device=cuda`, one
process per GPU) measures the speed-up.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.bench.common import ratio, summarise

NAME = "scale"
HELP = "one process vs two training ranks (replicated or sharded) vs two ranks + a generation process"
LAYOUTS = {"1_process": (1, 0, "ddp"), "2_train": (2, 0, "ddp"), "1_gen_2_train": (2, 1, "ddp"),
           "1_gen_2_train_fsdp": (2, 1, "fsdp")}
IN_PROCESS = ["async.worker=thread"]   # gen_procs=0: no engine process of its own either


def add_arguments(p) -> None:
    p.add_argument("--preset", default="all")
    p.add_argument("--steps", type=int, default=10, help="training steps per variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=3,
                   help="rounds; the variants run interleaved, round r on seed + r")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="comma-separated, from: " + ", ".join(LAYOUTS))
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant run")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="applied to every variant")


def command(preset: str, out: Path, layout: tuple[int, int, str], overrides: list[str]) -> list[str]:
    """The CLI command line of one variant (it starts torchrun itself for several ranks)."""
    train_procs, gen_procs, sharding = layout
    cmd = [sys.executable, "-m", "trainer", "run", preset, "--out", str(out)]
    for o in [*overrides, f"cluster.train_procs={train_procs}", f"cluster.gen_procs={gen_procs}",
              f"cluster.sharding={sharding}"]:
        cmd += ["--set", o]
    return cmd


def run_variant(name: str, args, seed: int, log=print) -> dict:
    gen_procs = LAYOUTS[name][1]
    overrides = [*(IN_PROCESS if gen_procs == 0 else []), *args.set,
                 f"run.max_steps={args.steps}", f"run.seed={seed}",
                 f"model.threads={args.threads}", f"async.worker_threads={args.threads}",
                 "run.eval_every=0", "run.checkpoint_every=0"]
    with tempfile.TemporaryDirectory(prefix="rlpilot-bench-scale-") as d:
        out = Path(d) / "run"
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(command(args.preset, out, LAYOUTS[name], overrides),
                              env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    figures = step_figures(name, rows)
    log(f"{name}: " + ", ".join(f"{k}={v}" for k, v in figures.items() if k != "variant"))
    return figures


def step_figures(name: str, rows: list[dict]) -> dict:
    """A run's per-step figures from its metrics rows (steps only: evaluation rows have none)."""
    steps = [r for r in rows if "timing/step_s" in r]

    def total(key):
        return sum(r.get(key, 0.0) for r in steps)

    n = max(len(steps), 1)
    step_s = total("timing/step_s")
    trained = total("rollout/trained_tokens")
    generated = total("rollout/gen_tokens")

    def mean(key, default=None):
        values = [r[key] for r in steps if key in r]
        return round(statistics.mean(values), 3) if values else default

    return {
        "variant": name, "steps": len(steps),
        "step_s": round(statistics.median([r["timing/step_s"] for r in steps]), 3) if steps else None,
        "gen_or_wait_s_per_step": round(total("timing/gen_s") / n, 3),
        "train_s_per_step": round(total("timing/train_s") / n, 3),
        "weight_sync_s_per_step": round(total("timing/weight_sync_s") / n, 4),
        "weight_sync_bytes_per_step": int(total("perf/weight_sync_bytes") / n),
        "trained_tokens_per_s": round(trained / max(step_s, 1e-9), 1),
        "trained_token_share": round(trained / max(generated, 1), 4),
        "train_share_imbalance": mean("dist/train_share_imbalance", 1.0),
        "trainer_idle_frac": mean("async/trainer_idle_frac"),
        "generator_idle_frac": mean("async/generator_idle_frac"),
    }


def run(args, log=print) -> dict:
    names = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = [x for x in names if x not in LAYOUTS]
    if unknown or not names:
        raise ValueError(f"--layouts: unknown {unknown or names}; choose from {', '.join(LAYOUTS)}")
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(max(args.reps, 1)):
        for name in names:
            rounds[name].append(run_variant(name, args, args.seed + rep, log))
    out = {name: summarise(rs) for name, rs in rounds.items()}
    base = out[names[0]]
    out["ratio"] = {f"step_time_{name}": ratio(out[name]["step_s"], base["step_s"])
                    for name in names[1:]}
    out["machine"] = {"cpu_count": os.cpu_count(), "threads_per_process": args.threads}
    return out
