"""`python -m trainer estimate PRESET [--set K=V ...] [--runs DIR] [--seconds S] [--rate KIND=PRICE]
[--json]`: what the configured run will take before it starts: wall time, device-hours and price
to run.max_steps, with a range (trainer/accounting/forecast.py).

From history where there is some: the past runs under `--runs` (default runs/) of the same shape
give their step times, and the estimate names them; else from a calibration of the run itself
for at most `--seconds` (the rule: trainer/accounting/estimate.py)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trainer import config as config_mod
from trainer.accounting import cost
from trainer.accounting.estimate import calibrate, from_steps, history
from trainer.accounting.run_files import CostError, rates_from
from trainer.cli.cost import add_rate_arguments


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
