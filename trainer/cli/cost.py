"""`python -m trainer cost RUN [--rate gpu=PRICE] [--rate cpu=PRICE] [--json]`: what a CLI run
cost (trainer/accounting/cost.py): device-hours by process and phase, the idle share, the figures
per step / trained token / 1,000 generated tokens / accuracy point, and what the dropped tokens
cost by reason; for a run still going, the time and price to run.max_steps
(trainer/accounting/forecast.py); for an ended one, how that forecast did at 25/50/75% of it.
Prices are per device-hour (a CPU device is a core); without a rate the account is in hours
only. RLPILOT_RATE_GPU_HOUR and RLPILOT_RATE_CPU_CORE_HOUR give defaults."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trainer.accounting import cost, forecast
from trainer.accounting.run_files import CostError, RunDirError, rates_from, read_run, read_slices


def read_account(run_dir: str | Path, rate_pairs: list[str] = (), environ=os.environ) -> dict:
    """The cost of run directory `run_dir` (its timeline, metrics and run_started event), priced
    at `rates_from(rate_pairs, environ, the run's own rates)`."""
    d = Path(run_dir)
    if not (d / "config.toml").is_file():
        raise CostError(f"{d} has no config.toml: not a run directory")
    try:
        cfg, rows = read_run(d)   # the config with its knob changes: run.max_steps, cost.* as they are now
    except RunDirError as e:
        raise CostError(str(e)) from None
    slices, events = read_slices(d)
    if not slices or any(x[2] is None for x in slices):
        raise CostError(f"{d}/events.jsonl: the run's start does not record its devices "
                        f"(steps from before the cost account)")
    devices = slices[-1][2]   # the layout it runs on now: the forecast's
    rates = rates_from(list(rate_pairs), environ, cost.run_rates(cfg.cost.gpu_hour, cfg.cost.cpu_core_hour))
    account = cost.run_cost(slices, rows, rates)
    ends = [e["kind"] for e in events if e.get("kind") in ("run_started", "run_resumed", "run_finished",
                                                           "run_stopped")]
    ended = bool(ends) and ends[-1] in ("run_finished", "run_stopped")   # a resume goes on
    walls = cost.step_walls(slices)
    last = slices[-1][0]   # the step it reached last (a resume records steps again)
    changed = max((e["step"] for e in events if e.get("kind") == "knob_applied"), default=None)
    since = None if changed is None else sum(1 for x in slices if x[0] > changed)
    account["forecast"] = None if ended else forecast.with_price(
        forecast.time_left(forecast.window(walls, since), cfg.run.max_steps - last), devices, rates)
    account["replay"] = forecast.replay(walls) if ended and len(walls) >= 4 else None
    return account


def _hours(seconds: float) -> str:
    """Device time for a person: seconds under ten minutes, else hours."""
    return f"{seconds:.1f} s" if seconds < 600 else f"{seconds / 3600:.3f} h"


def text(account: dict) -> str:
    """The account for a person."""
    money = account["price"] is not None
    out = [f"{account['steps']} steps over {account['wall_s']:.0f} s of steps; "
           f"idle {account['idle_share']:.0%} of the devices' time"]
    for kind, hours in account["device_hours"].items():
        rate = account["rates"].get(kind)
        out.append(f"  {kind}: {hours:.4f} device-hours" + (f" x {rate:g}/h = {hours * rate:.4g}" if rate else ""))
    if money:
        out.append(f"  price: {account['price']:.4g}")
    out.append("per process (device time; busy by phase, idle):")
    for lane in account["lanes"]:
        busy = ", ".join(f"{p} {_hours(s)}" for p, s in sorted(lane["busy_s"].items(), key=lambda x: -x[1]))
        out.append(f"  {lane['lane']} ({lane['count']} {lane['kind']}): {_hours(lane['device_s'])}; "
                   f"{busy or 'nothing recorded'}; idle {_hours(lane['idle_s'])}")
    figures = account["price_figures"] if money else account["device_s_figures"]
    unit = "" if money else " device-seconds"
    out.append("per unit" + (" (price)" if money else "") + ":")
    for name, value in figures.items():
        out.append(f"  {name.replace('_', ' ')}: " + ("-" if value is None else f"{value:.6g}{unit}"))
    waste = account["waste_price"] if money else account["waste_device_s"]
    out.append(f"dropped tokens cost {account['waste_share']:.1%} of the run"
               + (" (price by reason):" if money else " (device-seconds by reason):"))
    for reason, value in waste.items():
        if value:
            out.append(f"  {reason}: {value:.6g}")
    f = account.get("forecast")
    if f is not None:
        out.append(f"to go: {f['steps_left']} steps, {f['seconds']:.0f} s "
                   f"({f['low_s']:.0f}-{f['high_s']:.0f} s) at {f['pace_s']:.2f} s a step over the last "
                   f"{f['window']}" + (f"; price {f['price']:.4g} ({f['price_low']:.4g}-{f['price_high']:.4g})"
                                       if f["price"] is not None else ""))
    for r in account.get("replay") or []:
        out.append(f"forecast replayed at {r['at']:.0%} (step {r['step']}): {r['forecast_s']:.0f} s "
                   f"for {r['actual_s']:.0f} s actual ({r['error']:+.0%}"
                   + ("" if r["in_range"] else ", outside its range") + ")")
    return "\n".join(out)


def _cmd_cost(args) -> int:
    try:
        account = read_account(args.run_dir, args.rate)
    except CostError as e:
        print(f"cost: {e}", file=sys.stderr)
        return 2
    print(json.dumps(account, indent=2) if args.json else text(account))
    return 0


def add_rate_arguments(s) -> None:
    """--rate and --json, as `cost` and `estimate` take them."""
    s.add_argument("--rate", action="append", default=[], metavar="KIND=PRICE",
                   help="price per device-hour of a kind (gpu, cpu: per core); repeatable")
    s.add_argument("--json", action="store_true", help="print the result as JSON")


def add_parser(sub) -> None:
    s = sub.add_parser("cost", help="what a run cost: device-hours by process and phase, priced")
    s.add_argument("run_dir", metavar="RUN", help="a run directory")
    add_rate_arguments(s)
    s.set_defaults(func=_cmd_cost)
