"""The estimate before a run starts (the CLI's `estimate`, the dashboard's Estimate): the
configured run's time, device-hours and price to run.max_steps (trainer/accounting/forecast.py's
formula over every step measured), from past runs of the same SHAPE, or from a bounded
calibration of the run itself (a `python -m trainer run` in a temporary directory, its process
group killed if it overstays and when its parent dies, its directory removed). Steps only: the
model's loading, evaluations and checkpoints are not in it, nor each past run's first step (the
warm-up)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer import config as config_mod
from trainer.accounting import cost, forecast
from trainer.accounting.run_files import CostError, read_slices
from trainer.cluster.launch import set_parent_death_signal

# what makes two runs' steps comparable
SHAPE = ("model.path", "model.device", "rollout.engine", "rollout.rollout_batch_size",
         "rollout.n_samples_per_prompt", "rollout.max_response_len", "cluster.train_procs",
         "cluster.gen_procs", "april.enabled", "greso.enabled", "async.enabled", "lora.rank",
         "data.task", "episode.max_turns")
HISTORY_STEPS = 50   # the latest steps of each past run the pace is read from
GRACE_S = 60.0       # a calibration's time past --seconds (model loading, the first step) before it is killed


def shape(cfg: config_mod.Config) -> dict:
    return shape_of(cfg.to_dict())


def shape_of(d: dict) -> dict:
    """The SHAPE keys of a config as nested {section: {key: value}} (a key it lacks: None)."""
    return {key: (d.get(key.split(".")[0]) or {}).get(key.split(".")[1]) for key in SHAPE}


def step_times(run_dir: Path) -> tuple[list[float], dict | None]:
    """A run directory's step times, steps only (cost.step_walls), its first step (the warm-up)
    left out, and the devices of the layout it ran on last."""
    slices, _ = read_slices(run_dir)
    return cost.step_walls([x for x in slices if x[0] > 1], steps_only=True), slices[-1][2] if slices else None


def history(cfg: config_mod.Config, runs_dir: Path) -> list[tuple[Path, list[float], dict]]:
    """Past runs of `cfg`'s shape under `runs_dir`: (directory, its latest step times, devices)."""
    want, found = shape(cfg), []
    for d in sorted(p for p in runs_dir.glob("*") if (p / "config.toml").is_file()):
        try:
            past = config_mod.loads_toml((d / "config.toml").read_text())
            if shape(past) != want:
                continue
            walls, devices = step_times(d)
        except (OSError, ValueError, config_mod.ConfigError):
            continue   # not readable as a run: not history
        if walls and devices:
            found.append((d, walls[-HISTORY_STEPS:], devices))
    return found


def steps_only_command(source: str, out: Path, sets: list[str]) -> list[str]:
    """`python -m trainer run SOURCE --out OUT` with `sets`, its evaluations, checkpoints and
    trackers off: the steps the estimate is about, and nothing else."""
    cmd = [sys.executable, "-m", "trainer", "run", source, "--out", str(out)]
    # (no target accuracy either: it needs evaluations)
    for s in [*sets, "run.eval_every=0", "run.target_accuracy=0", "run.checkpoint_every=0", "run.report_to=[]"]:
        cmd += ["--set", s]
    return cmd


def calibrate(source: str, sets: list[str], seconds: float) -> tuple[list[float], dict]:
    """Step times and devices of the configured run itself, trained for at most `seconds`."""
    with tempfile.TemporaryDirectory(prefix="rlpilot-estimate-") as tmp:
        out = Path(tmp) / "run"
        cmd = steps_only_command(source, out, [*sets, f"run.time_budget_s={seconds:g}"])
        # its own process group (killed whole below), and killed with the process that started it
        # (a worker killed mid-calibration leaves nothing behind)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,
                                preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL))
        failed = None   # the run's own exit status when it ended by itself, unsuccessfully
        try:
            _, err = proc.communicate(timeout=seconds + GRACE_S)
            failed = proc.returncode or None
        except subprocess.TimeoutExpired:
            err = "it overstayed its time"
        finally:   # the run's whole group, whether it ended or not: torchrun, ranks, generators
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        try:
            walls, devices = step_times(out)
        except (OSError, ValueError):
            walls, devices = [], None
        if failed and not walls:   # it could not run: say why, not "too short"
            raise CostError(f"the calibration run failed (exit status {failed}): {(err or '').strip()[-600:]}")
        if not walls or devices is None:
            raise CostError(f"the calibration run trained {len(walls)} step(s) past its first in {seconds:g} s, "
                            f"too few to estimate from (give it longer: --seconds, or RLPILOT_ESTIMATE_SECONDS "
                            f"on a worker){': ' + err.strip()[-600:] if err and err.strip() else ''}")
        return walls, devices


def from_steps(walls: list[float], devices: dict, max_steps: int, rates: dict[str, float],
               origin: dict) -> dict:
    """The estimate for `max_steps` from measured step times (history's or a calibration's,
    named in `origin`): their pooled mean and spread, every one of them (no knob change to read
    past), on `devices`, priced at `rates`."""
    f = forecast.with_price(forecast.time_left(walls, max_steps), devices, rates)
    return {**origin, "max_steps": max_steps, "devices": devices, **f}
