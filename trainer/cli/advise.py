"""`python -m trainer advise RUN [--window N] [--json]`: the pilot's advice for the latest window
of a run. RUN is a CLI run directory (config.toml + metrics.jsonl) or a dashboard run's JSON
export (GET /api/runs/ID/export?format=json: a dashboard run keeps its metrics in the database,
its directory holds only the config and checkpoints)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trainer import config as config_mod
from trainer.accounting import cost
from trainer.accounting.run_files import CostError, RunDirError, rates_from, read_run, read_slices
from trainer.pilot.advice import WASTE_ADDRESSED, at_stake
from trainer.pilot.rules import advise
from trainer.pilot.thresholds import DEFAULT


def _cmd_advise(args) -> int:
    if args.window is not None and args.window < 1:
        print(f"error: --window: must be at least 1 step, got {args.window}", file=sys.stderr)
        return 2
    try:
        cfg, rows = read_run(args.run_dir)
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    window = args.window or DEFAULT.window
    advice = advise(rows, cfg, window=window)
    steps = [r["step"] for r in rows[-window:]]
    stakes = _stakes(Path(args.run_dir), cfg, rows[-window:], {a.rule for a in advice})   # the rules' window
    if args.json:
        print(json.dumps({"run_dir": str(args.run_dir), "window": window,
                          "steps": [steps[0], steps[-1]] if steps else None,
                          "advice": [{**a.as_json(), "cost_per_100_steps": stakes.get(a.rule)} for a in advice]},
                         indent=2))
        return 0
    span = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps yet"
    if not advice:
        print(f"no advice over {span} (window {window})")
        return 0
    print(f"advice over {span} (window {window}):")
    for a in advice:
        move = f"{a.knob}: {a.current!r} -> {a.proposed!r}" if a.knob else "not a knob"
        print(f"\n[{a.rule}] {move}  ({a.confidence} confidence)\n  {a.message}\n"
              f"  expected: {a.expected}")
        if a.rule in stakes:
            c = stakes[a.rule]
            price = f" (price {c['price']:.4g})" if c["price"] is not None else ""
            print(f"  at stake: the {', '.join(c['reasons'])} drops cost {c['device_s'] / 3600:.4g} "
                  f"device-hours per 100 steps at the present pace{price}")
        for f in a.evidence:
            print(f"  - {f.name} {f.stat} = {f.value:.4g} (steps {f.first_step}-{f.last_step})")
    return 0


def _stakes(run_dir: Path, cfg: config_mod.Config, rows: list[dict], rules_: set[str]) -> dict[str, dict]:
    """What the drops each rule's advice is about cost per 100 steps over the advice's window
    (`rows`; pilot/advice.py `at_stake`), from a run directory's timeline, priced as `python -m
    trainer cost` prices it (hours only, with a warning, when a rate setting is malformed). A JSON
    export (no timeline file) or a run recorded before the account: none."""
    if not run_dir.is_dir() or not rows or not rules_ & set(WASTE_ADDRESSED):
        return {}
    try:
        slices, _ = read_slices(run_dir)
    except CostError:
        return {}
    try:
        rates = rates_from([], os.environ, cost.run_rates(cfg.cost.gpu_hour, cfg.cost.cpu_core_hour))
    except CostError as e:
        print(f"warning: the advice's cost in hours only: {e}", file=sys.stderr)
        rates = {}
    first = rows[0]["step"]
    return at_stake(rules_, rows, [x for x in slices if x[0] >= first], rates)


def add_parser(sub) -> None:
    s = sub.add_parser("advise", help="the pilot's advice for a run's latest steps")
    s.add_argument("run_dir", metavar="RUN", help="a run directory, or a dashboard run's JSON export")
    s.add_argument("--window", type=int, help=f"steps to read (default {DEFAULT.window})")
    s.add_argument("--json", action="store_true", help="the advice as JSON")
    s.set_defaults(func=_cmd_advise)
