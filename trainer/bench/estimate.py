"""bench estimate: how far off the estimate before a run is, per preset, at 50 and 200 steps.

For each preset (`--presets`, default every shipped preset that runs without setup), in turn:
the estimate as `python -m trainer estimate` makes it with no history (a calibration of the run
itself for `--seconds`, trainer/accounting/estimate.py), then the run itself, `python -m trainer run`
for the largest of `--steps` steps with evaluations and checkpoints off (what the estimate
covers: steps, not loading or evaluating). Each step count's actual time is the sum of that
many steps' wall times (their timeline's cover, as the estimate counts them); the estimate for
it is made from the same calibration. Reported per preset and step count: the estimate and its
range, the actual time, the error (estimate / actual − 1) and whether the actual fell inside
the range. `--set` applies to every preset (e.g. a smaller batch for a quick look).

The machine's load while the calibration and the run go changes both: run it on a quiet
machine, and read one run's error as one draw, not a property of the preset.
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from trainer import config as config_mod
from trainer.accounting import cost
from trainer.accounting.estimate import calibrate, from_steps, steps_only_command
from trainer.accounting.run_files import CostError, read_slices

NAME = "estimate"
HELP = "the estimate before a run against the run, per preset (50 and 200 steps)"
DEFAULT_PRESETS = ("demo", "april", "greso", "async", "all", "agent")
RUN_LIMIT_S = 3600   # one preset's run; a run that hangs ends the bench with its error


def add_arguments(p) -> None:
    p.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS),
                   help=f"presets to measure (default: {' '.join(DEFAULT_PRESETS)})")
    p.add_argument("--steps", nargs="+", type=int, default=[50, 200],
                   help="step counts the estimate is checked at (default 50 200)")
    p.add_argument("--seconds", type=float, default=30.0, help="each calibration's time (default 30)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="an override for every preset")


def measure(preset: str, sets: list[str], steps: list[int], seconds: float, log=print) -> dict:
    walls, devices = calibrate(preset, sets, seconds)
    log(f"{preset}: calibrated on {len(walls)} steps in {seconds:g} s; running {max(steps)} steps")
    with tempfile.TemporaryDirectory(prefix="rlpilot-bench-estimate-") as tmp:
        out = Path(tmp) / "run"
        cmd = steps_only_command(preset, out, [*sets, f"run.max_steps={max(steps)}"])
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=RUN_LIMIT_S)
        if done.returncode:
            raise RuntimeError(f"{preset}: the run failed: {done.stderr[-2000:]}")
        # steps only, as the estimate counts them (the run's evaluations and checkpoints are off)
        actual = cost.step_walls(read_slices(out)[0], steps_only=True)
    if len(actual) < max(steps):
        raise RuntimeError(f"{preset}: the run recorded {len(actual)} steps of {max(steps)}")
    rows = []
    for n in steps:
        e = from_steps(walls, devices, n, {}, {})
        real = sum(actual[:n])
        rows.append({"steps": n, "estimate_s": e["seconds"], "low_s": e["low_s"], "high_s": e["high_s"],
                     "actual_s": real, "error": e["seconds"] / real - 1 if real else None,
                     "in_range": e["low_s"] <= real <= e["high_s"], "steps_run": len(actual)})
        outside = "" if rows[-1]["in_range"] else ", outside the range"
        log(f"  {n:>4} steps: estimate {e['seconds']:7.1f} s ({e['low_s']:.1f}-{e['high_s']:.1f}), "
            f"actual {real:7.1f} s, error {rows[-1]['error']:+.0%}{outside}")
    return {"preset": preset, "calibration_steps": len(walls), "rows": rows}


def run(args, log=print) -> dict:
    for preset in args.presets:
        if preset not in config_mod.preset_names():
            raise SystemExit(f"bench estimate: unknown preset {preset!r}; presets: "
                             f"{', '.join(config_mod.preset_names())}")
    if not args.steps or min(args.steps) < 1:
        raise SystemExit("bench estimate: --steps: step counts of at least 1")
    if not 0 < args.seconds <= 3600:
        raise SystemExit(f"bench estimate: --seconds: a calibration takes 0 < seconds <= 3600; got {args.seconds:g}")
    out = []
    for preset in args.presets:   # one preset that cannot run says why; the others go on
        try:
            out.append(measure(preset, args.set, sorted(args.steps), args.seconds, log))
        except (CostError, RuntimeError, subprocess.TimeoutExpired) as e:
            log(f"{preset}: no figure: {e}")
            out.append({"preset": preset, "error": str(e)})
    return {"bench": NAME, "seconds": args.seconds, "set": args.set, "presets": out}
