"""`python -m trainer estimate PRESET [--set K=V ...] [--runs DIR] [--seconds S] [--rate KIND=PRICE]
[--json]`: what the configured run will take before it starts: wall time, device-hours and price
to run.max_steps, with a range (trainer/observe/forecast.py).

From history where there is some: the past runs under `--runs` (default runs/) of the same shape
(SHAPE: the model, the engine and its layout, the batch, the response limit, the techniques)
give their step times, and the estimate names them. Else from a calibration: the run itself,
started as `python -m trainer run` in a temporary directory for at most `--seconds` (its
run.time_budget_s; its first step, the warm-up, left out), then ended and removed; its process
group is killed if it overstays, so nothing is left behind. Steps only: the model's loading and
evaluations are not in the estimate."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer import config as config_mod
from trainer.cli.cost import add_rate_arguments
from trainer.cli.run_files import CostError, rates_from, read_slices
from trainer.observe import cost, forecast

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


def _account_inputs(run_dir: Path) -> tuple[list[float], dict | None]:
    """A run directory's step wall times and the devices of the layout it ran on last."""
    slices, _ = read_slices(run_dir)
    return cost.step_walls(slices), slices[-1][2] if slices else None


def history(cfg: config_mod.Config, runs_dir: Path) -> list[tuple[Path, list[float], dict]]:
    """Past runs of `cfg`'s shape under `runs_dir`: (directory, its latest step times, devices)."""
    want, found = shape(cfg), []
    for d in sorted(p for p in runs_dir.glob("*") if (p / "config.toml").is_file()):
        try:
            past = config_mod.loads_toml((d / "config.toml").read_text())
            if shape(past) != want:
                continue
            walls, devices = _account_inputs(d)
        except (OSError, ValueError, config_mod.ConfigError):
            continue   # not readable as a run: not history
        if walls and devices:
            found.append((d, walls[-HISTORY_STEPS:], devices))
    return found


def calibrate(source: str, sets: list[str], seconds: float) -> tuple[list[float], dict]:
    """Step times and devices of the configured run itself, trained for at most `seconds`."""
    with tempfile.TemporaryDirectory(prefix="rlpilot-estimate-") as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "trainer", "run", source, "--out", str(out)]
        for s in [*sets, f"run.time_budget_s={seconds:g}", "run.eval_every=0", "run.checkpoint_every=0",
                  "run.report_to=[]"]:
            cmd += ["--set", s]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=seconds + GRACE_S)
        except subprocess.TimeoutExpired:
            err = "it overstayed its time"
        finally:   # the run's whole group, whether it ended or not: torchrun, ranks, generators
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        try:
            walls, devices = _account_inputs(out)
        except (OSError, ValueError):
            walls, devices = [], None
        if len(walls) < 2 or devices is None:
            raise CostError(f"the calibration run trained {len(walls)} step(s) in {seconds:g} s, too few "
                            f"to estimate from (give it longer: --seconds, or RLPILOT_ESTIMATE_SECONDS "
                            f"on a worker){': ' + err.strip()[-600:] if err and err.strip() else ''}")
        return walls[1:], devices   # the first step warms the engine up


def estimate(source: str, sets: list[str], *, runs_dir: Path, seconds: float,
             rate_pairs: list[str] = (), environ=os.environ) -> dict:
    try:
        cfg = config_mod.load(source, sets)
    except config_mod.ConfigError as e:
        raise CostError("; ".join(f"{k}: {v}" for k, v in e.errors.items())) from None
    # the rates first: a bad one is refused before a calibration spends its time
    rates = rates_from(list(rate_pairs), environ, cost.run_rates(cfg.cost.gpu_hour, cfg.cost.cpu_core_hour))
    past = history(cfg, runs_dir) if runs_dir.is_dir() else []
    if past:
        walls = [w for _, ws, _ in past for w in ws]
        return from_steps(walls, past[-1][2], cfg.run.max_steps, rates,
                          {"source": "history", "runs": [str(d) for d, _, _ in past]})
    walls, devices = calibrate(source, sets, seconds)
    return from_steps(walls, devices, cfg.run.max_steps, rates,
                      {"source": "calibration", "steps_measured": len(walls), "calibration_s": seconds})


def from_steps(walls: list[float], devices: dict, max_steps: int, rates: dict[str, float],
               origin: dict) -> dict:
    """The estimate for `max_steps` from measured step times (history's or a calibration's,
    named in `origin`): their pooled mean and spread, every one of them (no knob change to read
    past), on `devices`, priced at `rates`."""
    f = forecast.with_price(forecast.time_left(walls, max_steps), devices, rates)
    return {**origin, "max_steps": max_steps, "devices": devices, **f}


def text(e: dict) -> str:
    where = (f"from {len(e['runs'])} past run(s) of the same shape: {', '.join(e['runs'])}"
             if e["source"] == "history" else
             f"from a calibration: {e['steps_measured']} steps of the run itself in {e['calibration_s']:g} s")
    hours = ", ".join(f"{s / 3600:.4g} {k} device-hours" for k, s in e["device_s"].items())
    price = (f"; price {e['price']:.4g} ({e['price_low']:.4g}-{e['price_high']:.4g})"
             if e["price"] is not None else "")
    return (f"{e['max_steps']} steps: about {e['seconds']:.0f} s ({e['low_s']:.0f}-{e['high_s']:.0f} s) "
            f"at {e['pace_s']:.2f} s a step; {hours}{price}\n{where}")


def _cmd_estimate(args) -> int:
    if not 0 < args.seconds <= 3600:
        print(f"estimate: --seconds: a calibration takes 0 < seconds <= 3600; got {args.seconds:g}",
              file=sys.stderr)
        return 2
    try:
        e = estimate(args.config, args.set, runs_dir=Path(args.runs), seconds=args.seconds,
                     rate_pairs=args.rate)
    except CostError as err:
        print(f"estimate: {err}", file=sys.stderr)
        return 2
    print(json.dumps(e, indent=2) if args.json else text(e))
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("estimate", help="a run's time and price before it starts")
    s.add_argument("config", help="preset name or .toml file")
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    s.add_argument("--runs", default="runs", help="where past runs are (default runs/)")
    s.add_argument("--seconds", type=float, default=30.0,
                   help="a calibration's time limit when no past run has the same shape (default 30)")
    add_rate_arguments(s)
    s.set_defaults(func=_cmd_estimate)
