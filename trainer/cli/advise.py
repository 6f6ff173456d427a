"""`python -m trainer advise RUN [--window N] [--json]`: the pilot's advice for the latest window
of a run. RUN is a CLI run directory (config.toml + metrics.jsonl) or a dashboard run's JSON
export (GET /api/runs/ID/export?format=json: a dashboard run keeps its metrics in the database,
its directory holds only the config and checkpoints)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer import config as config_mod
from trainer.observe.metrics import read_jsonl
from trainer.pilot.rules import advise
from trainer.pilot.thresholds import DEFAULT


class RunDirError(ValueError):
    """A run directory the advice cannot be read from; the message says what is wrong."""


EXPORT_HINT = ("a dashboard run keeps its metrics in the database: pass its JSON export instead "
               "(the report's JSON export, or GET /api/runs/ID/export?format=json)")


def read_run(path: str | Path) -> tuple[config_mod.Config, list[dict]]:
    """The run's config (with its current knob values) and metric rows, from a run directory or
    a dashboard JSON export. Raises RunDirError naming the file (and line) at fault."""
    d = Path(path)
    if d.is_file():
        return read_export(d)
    if not d.is_dir():
        raise RunDirError(f"{d}: no such directory or file")
    cfg_path, metrics_path = d / "config.toml", d / "metrics.jsonl"
    if not cfg_path.is_file():
        raise RunDirError(f"{d} has no config.toml: not a run directory")
    if not metrics_path.is_file():
        raise RunDirError(f"{d} has no metrics.jsonl; {EXPORT_HINT}")
    try:
        cfg = config_mod.loads_toml(cfg_path.read_text(encoding="utf-8"))
    except config_mod.ConfigError as e:
        raise RunDirError(f"{cfg_path}: {e}") from None
    except ValueError as e:   # tomllib.TOMLDecodeError
        raise RunDirError(f"{cfg_path}: not valid TOML: {e}") from None
    try:
        rows = read_jsonl(metrics_path)
    except ValueError as e:
        raise RunDirError(str(e)) from None
    return cfg, rows


def read_export(path: Path) -> tuple[config_mod.Config, list[dict]]:
    """A dashboard run's JSON export: {"config": {section: {...}}, "knobs": {key: value},
    "metrics": {name: {"steps": [...], "values": [...]}}, ...}."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunDirError(f"{path}: not a run directory, nor a JSON export ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict) \
            or not isinstance(data.get("metrics"), dict):
        raise RunDirError(f"{path}: not a dashboard JSON export (no \"config\" and \"metrics\")")
    try:
        cfg = config_mod.apply_overrides(config_mod.from_dict(data["config"]), data.get("knobs") or {})
    except config_mod.ConfigError as e:
        raise RunDirError(f"{path}: config: {e}") from None
    by_step: dict[int, dict] = {}
    for name, series in data["metrics"].items():
        try:
            pairs = list(zip(series["steps"], series["values"], strict=True))
        except (KeyError, TypeError, ValueError):
            raise RunDirError(f"{path}: metric {name!r} is not {{\"steps\": [...], \"values\": [...]}} "
                              "of the same length") from None
        for step, value in pairs:
            by_step.setdefault(step, {"step": step})[name] = value
    return cfg, [by_step[s] for s in sorted(by_step)]


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
    if args.json:
        print(json.dumps({"run_dir": str(args.run_dir), "window": window,
                          "steps": [steps[0], steps[-1]] if steps else None,
                          "advice": [a.as_json() for a in advice]}, indent=2))
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
        for f in a.evidence:
            print(f"  - {f.name} {f.stat} = {f.value:.4g} (steps {f.first_step}-{f.last_step})")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("advise", help="the pilot's advice for a run's latest steps")
    s.add_argument("run_dir", metavar="RUN", help="a run directory, or a dashboard run's JSON export")
    s.add_argument("--window", type=int, help=f"steps to read (default {DEFAULT.window})")
    s.add_argument("--json", action="store_true", help="the advice as JSON")
    s.set_defaults(func=_cmd_advise)
