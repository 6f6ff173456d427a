"""bench samples: what recording samples for the rollout inspector costs the trainer.

Trains the preset for `--steps` steps with `run.log_samples` at its default, writing the rows to
samples.jsonl as the CLI does, and reports per step the time spent picking, decoding and writing
them (`timing/samples_s`, measured around the sink call) against the whole step
(`timing/step_s`): medians, the worst step, and their ratio. Also the rows per step and what a
1000-step run would keep at that rate (the web app caps a run's rows, RLPILOT_SAMPLES_PER_RUN).
"""
from __future__ import annotations

import statistics
import tempfile

from trainer import config as config_mod
from trainer.observe.metrics import JsonlSink, MemorySink, MultiSink

NAME = "samples"
HELP = "the rollout inspector's recording cost per step"


def add_arguments(p) -> None:
    p.add_argument("--preset", default="all")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")


def run(args, log=print) -> dict:
    from trainer.run.runner import Runner

    cfg = config_mod.load(args.preset, [*args.set, f"run.max_steps={args.steps}", f"run.seed={args.seed}",
                                        "run.eval_every=0", "run.checkpoint_every=0"])
    memory = MemorySink()
    with tempfile.TemporaryDirectory(prefix="rlpilot-bench-") as d:
        sink = MultiSink([memory, JsonlSink(d)])
        with Runner(cfg, d, sink=sink, system_telemetry=False) as runner:
            runner.run()
        sink.close()
    rec, step = memory.series("timing/samples_s"), memory.series("timing/step_s")
    per_step: dict[int, int] = {}
    for row in memory.sample_rows:
        per_step[row["step"]] = per_step.get(row["step"], 0) + 1
    shares = [r / s for r, s in zip(rec, step) if s > 0]
    out = {"preset": args.preset, "steps": args.steps, "log_samples": cfg.run.log_samples,
           "group_size": cfg.rollout.n_samples_per_prompt,
           "record_s_median": round(statistics.median(rec), 5), "record_s_max": round(max(rec), 5),
           "step_s_median": round(statistics.median(step), 4),
           "share_of_step_median": round(statistics.median(shares), 5),
           "share_of_step_max": round(max(shares), 5),
           "rows_per_step_max": max(per_step.values(), default=0),
           "rows_per_step_mean": round(len(memory.sample_rows) / max(len(per_step), 1), 2),
           "rows_per_1000_steps_at_max": 1000 * max(per_step.values(), default=0)}
    log(", ".join(f"{k}={v}" for k, v in out.items()))
    return out
