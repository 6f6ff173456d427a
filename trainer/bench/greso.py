"""bench greso: DAPO dynamic sampling without and with GRESO's pre-rollout filter.

Both variants train the `greso` preset's workload (dynamic sampling on) for the same number of
training steps from the same model and seed, in one process, interleaved over `--reps` rounds
(medians and spread reported). Reported for each: samples and tokens generated, rollout time,
held-out accuracy. `ratio.samples_reduction` is baseline samples / GRESO samples;
`ratio.samples_reduction_ceiling` the most GRESO could save on this workload, (1 - alpha) /
(1 - z) with z the baseline's zero-variance share; `ratio.share_of_ceiling` how much of it was
reached; `ratio.accuracy_delta` GRESO - baseline (a fraction).

`--warm-start`: GRESO cold vs GRESO warm-started (greso.warm_start) from a run of the same preset
trained first (`--source-steps`, on the round's seed: a source's problem ids must mean the same
problems), each for the first epoch's steps (data.train_size / rollout.rollout_batch_size):
`ratio.warm_samples_saving` is 1 - warm samples / cold samples in those steps.

`--drift`: the drift task (trainer/tasks/drift.py: even rows get easier at `--drift-step` under
the same ids) with GRESO never forgetting vs forgetting (`--half-life`): the wrong-skip ratio of
the skips judged after the shift (a skipped prompt whose next group had signal), the training
accuracy after it, held-out accuracy on the shifted problems.
"""
from __future__ import annotations

from trainer import config as config_mod
from trainer.bench.common import accuracy_delta, add_comparison_arguments, compare, ratio

NAME = "greso"
HELP = "dynamic sampling vs dynamic sampling + GRESO selective rollouts"


def add_arguments(p) -> None:
    add_comparison_arguments(p, preset="greso", steps=100)
    p.add_argument("--warm-start", action="store_true",
                   help="GRESO cold vs warm-started from a finished run of the same preset")
    p.add_argument("--source-steps", type=int, default=48,
                   help="--warm-start: training steps of the source run")
    p.add_argument("--drift", action="store_true",
                   help="the drift task: GRESO without and with forgetting")
    p.add_argument("--drift-step", type=int, default=10, help="--drift: the step the data shifts at")
    p.add_argument("--half-life", type=float, default=4.0,
                   help="--drift: greso.forget_half_life of the forgetting variant")


def reduction_ceiling(zero_var: float, alpha: float) -> float | None:
    """The most GRESO can save: dynamic sampling needs N groups with variance, so it rolls out
    N / (1 - z) groups when a share z of them is zero-variance; GRESO steers that share to its
    target alpha at best, N / (1 - alpha). The ratio is (1 - alpha) / (1 - z) (below 1: nothing
    to gain)."""
    if zero_var >= 1.0:
        return None
    return round((1.0 - alpha) / (1.0 - zero_var), 3)


def run(args, log=print) -> dict:
    if getattr(args, "warm_start", False):
        return run_warm_start(args, log)
    if getattr(args, "drift", False):
        return run_drift(args, log)
    res = compare([("dynamic_sampling", args.preset,
                    [*args.set, "rollout.dynamic_sampling=true", "greso.enabled=false"]),
                   ("greso", args.preset,
                    [*args.set, "rollout.dynamic_sampling=true", "greso.enabled=true"])], args, log)
    base, gre = res["dynamic_sampling"], res["greso"]
    alpha = config_mod.load(args.preset, [*args.set, "greso.enabled=true"]).greso.alpha
    reduction = ratio(base["samples_generated"], gre["samples_generated"])
    ceiling = reduction_ceiling(base["zero_var_ratio_mean"], alpha)
    return {"dynamic_sampling": base, "greso": gre, "ratio": {
        "samples_reduction": reduction,
        "samples_reduction_ceiling": ceiling,
        "share_of_ceiling": round(reduction / ceiling, 3) if reduction and ceiling else None,
        "tokens_reduction": ratio(base["tokens_generated"], gre["tokens_generated"]),
        "rollout_time_speedup": ratio(base["rollout_s"], gre["rollout_s"]),
        "accuracy_delta": accuracy_delta(gre, base)}}


def epoch_steps(cfg) -> int:
    """Training steps of one epoch without skipping: data.train_size / rollout_batch_size."""
    return max(1, cfg.data.train_size // cfg.rollout.rollout_batch_size)


def train_source(preset: str, overrides: list[str], steps: int, seed: int, out) -> None:
    """A GRESO run of `preset` for `steps` steps into `out`, its final checkpoint kept."""
    from trainer.observe.metrics import MemorySink
    from trainer.run.runner import Runner

    cfg = config_mod.load(preset, [*overrides, "greso.enabled=true", f"run.max_steps={steps}",
                                   f"run.seed={seed}", "run.eval_every=0", "run.checkpoint_every=0"])
    with Runner(cfg, out, sink=MemorySink(), system_telemetry=False) as runner:
        runner.run()


def run_warm_start(args, log=print) -> dict:
    import tempfile

    from trainer.bench.common import summarise, train_variant

    base = [*args.set, "greso.enabled=true"]
    steps = epoch_steps(config_mod.load(args.preset, base))
    rounds: dict[str, list[dict]] = {"cold": [], "warm": []}
    for rep in range(max(args.reps, 1)):
        seed = args.seed + rep
        with tempfile.TemporaryDirectory(prefix="rlpilot-bench-source-") as d:
            log(f"source run: {args.source_steps} steps on seed {seed}")
            train_source(args.preset, args.set, args.source_steps, seed, d)
            for name, extra in (("cold", []), ("warm", [f"greso.warm_start={d}"])):
                rounds[name].append(train_variant(
                    name, args.preset, [*base, *extra], steps=steps, eval_size=args.eval_size,
                    seed=seed, log=log, extra=_skips))
    cold, warm = summarise(rounds["cold"]), summarise(rounds["warm"])
    saving = (1 - warm["samples_generated"] / cold["samples_generated"]
              if cold["samples_generated"] else None)
    return {"cold": cold, "warm": warm, "ratio": {
        "first_epoch_steps": steps, "source_steps": args.source_steps,
        "warm_samples_saving": round(saving, 3) if saving is not None else None,
        "samples_reduction": ratio(cold["samples_generated"], warm["samples_generated"]),
        "tokens_reduction": ratio(cold["tokens_generated"], warm["tokens_generated"]),
        "accuracy_delta": accuracy_delta(warm, cold)}}


def run_drift(args, log=print) -> dict:
    drift = [*args.set, "data.task=drift", f"data.drift_step={args.drift_step}",
             "greso.enabled=true"]
    res = compare([("never_forgets", args.preset, drift),
                   ("forgets", args.preset, [*drift, f"greso.forget_half_life={args.half_life}"])],
                  args, log, extra=lambda sink: _after_shift(sink, args.drift_step))
    off, on = res["never_forgets"], res["forgets"]
    return {"never_forgets": off, "forgets": on, "ratio": {
        "drift_step": args.drift_step, "half_life": args.half_life,
        "wrong_skip_ratio_delta": (round(on["wrong_skip_ratio_after_shift"]
                                         - off["wrong_skip_ratio_after_shift"], 4)
                                   if None not in (on["wrong_skip_ratio_after_shift"],
                                                   off["wrong_skip_ratio_after_shift"]) else None),
        "accuracy_delta": accuracy_delta(on, off)}}


def judged_skips(rows, first_step: int = 0) -> tuple[int, int]:
    """(wrong, right) skips judged in the metric rows of steps >= first_step."""
    wrong = right = 0
    for row in rows:
        n = int(row.get("greso/skips_judged") or 0)
        if n and row["step"] >= first_step:
            w = round(n * row.get("greso/wrong_skip_ratio", 0.0))
            wrong, right = wrong + w, right + n - w
    return wrong, right


def _skips(sink) -> dict:
    prompts = sum(r.get("greso/prompts_sampled", 0) * r.get("greso/skip_rate", 0) for r in sink.steps)
    return {"prompts_skipped": round(prompts)}


def _after_shift(sink, drift_step: int) -> dict:
    """The wrong-skip ratio of the skips judged from the shift on, the mean training accuracy
    then, and the skipped prompts."""
    wrong, right = judged_skips(sink.steps, drift_step)
    accuracy = [r["reward/accuracy"] for r in sink.steps
                if r["step"] >= drift_step and "reward/accuracy" in r]
    return {"skips_judged_after_shift": wrong + right, "wrong_skips_after_shift": wrong,
            "wrong_skip_ratio_after_shift": round(wrong / (wrong + right), 4) if wrong + right else None,
            "train_accuracy_after_shift": round(sum(accuracy) / len(accuracy), 4) if accuracy else None,
            **_skips(sink)}
