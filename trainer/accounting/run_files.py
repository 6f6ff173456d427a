"""Reading a run as the CLI's commands read it (advise, cost, estimate): its config and metric
rows from a run directory or a dashboard JSON export, its timeline with the devices each start
recorded, and the rates it is priced at."""
from __future__ import annotations

import json
import os
from pathlib import Path

from trainer import config as config_mod
from trainer.accounting import cost
from trainer.observe.metrics import read_jsonl


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


RATE_ENV = {"gpu": "RLPILOT_RATE_GPU_HOUR", "cpu": "RLPILOT_RATE_CPU_CORE_HOUR"}


class CostError(ValueError):
    """A run whose cost cannot be read; the message names the file and what is wrong."""


def rates_from(pairs: list[str], environ=os.environ, run: dict[str, float] | None = None) -> dict[str, float]:
    """Rates per device-hour: the environment's defaults, then the run's own (`run`, from its
    [cost] section), then each `kind=price` pair."""
    items = [(k, environ[v], v) for k, v in RATE_ENV.items() if environ.get(v)]
    items += [(k, str(v), f"the run's cost.{'gpu_hour' if k == 'gpu' else 'cpu_core_hour'}")
              for k, v in (run or {}).items()]
    for pair in pairs:
        kind, sep, value = pair.partition("=")
        items.append((kind.strip(), value, f"--rate {pair}") if sep else ("", "", f"--rate {pair}"))
    out = {}
    for kind, value, where in items:
        if kind not in cost.KINDS:
            raise CostError(f"{where}: expected KIND=PRICE with KIND one of {', '.join(cost.KINDS)}")
        try:
            price = float(value)
        except ValueError:
            raise CostError(f"{where}: {value!r} is not a price per device-hour") from None
        if not price >= 0 or price == float("inf"):
            raise CostError(f"{where}: a price per device-hour is a finite number >= 0; got {value}")
        out[kind] = price
    return out


def read_slices(run_dir: Path) -> tuple[list[tuple[int, list[dict], dict | None]], list[dict]]:
    """A run directory's timeline as (step, spans, the devices of the start it ran after;
    None where that start recorded none: trainer/accounting/cost.py `with_layouts`), and its events."""
    try:
        timeline = read_jsonl(run_dir / "timeline.jsonl")
        events = read_jsonl(run_dir / "events.jsonl")
    except FileNotFoundError as e:
        raise CostError(f"{run_dir}: no {Path(e.filename).name}: the run has not reported a step yet") from None
    except ValueError as e:
        raise CostError(str(e)) from None
    starts = [(e.get("time", 0.0), e.get("devices") if isinstance(e.get("devices"), dict) else None)
              for e in events if e.get("kind") in ("run_started", "run_resumed")]
    return cost.with_layouts([(t["step"], t.get("spans") or []) for t in timeline], starts), events
