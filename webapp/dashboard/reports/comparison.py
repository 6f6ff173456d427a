"""The comparison of runs (the compare page): where their launch configs differ, their key figures
side by side with each one's ratio to the first run's, and one headline per run. Reads only."""
from __future__ import annotations

import json
from typing import Any

from webapp.dashboard import formatting
from webapp.dashboard.models import Run
from webapp.dashboard.reports.summary import LABELS, SUMMARY


def flatten(config: dict) -> dict[str, Any]:
    return {f"{sec}.{k}": v for sec, values in (config or {}).items() if isinstance(values, dict)
            for k, v in values.items()}


def config_diff(runs: list[Run]) -> list[dict[str, Any]]:
    """Only the keys whose values differ between the runs (the launch config)."""
    flats = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    missing = object()
    out = []
    for k in keys:
        vals = [f.get(k, missing) for f in flats]
        if len({json.dumps(v, sort_keys=True, default=str) if v is not missing else "\0" for v in vals}) > 1:
            out.append({"key": k, "values": ["(absent)" if v is missing else v for v in vals]})
    return out


def ratio_text(v: Any, base: Any) -> str:
    if not isinstance(v, (int, float)) or not isinstance(base, (int, float)) or not base:
        return ""
    return f"{v / base:.2f}x"


def compare_rows(runs: list[Run], summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for key, label, better in SUMMARY:
        vals = [s.get(key) for s in summaries]
        if all(v is None for v in vals):
            continue
        base = vals[0]
        rows.append({"key": key, "label": label, "better": better,
                     "cells": [{"text": formatting.figure(v), "ratio": ratio_text(v, base) if i else ""}
                               for i, v in enumerate(vals)]})
    return rows


HEADLINE_KEYS = ("trained_tokens_per_s", "gen_tokens_per_s", "accuracy_best", "wall_time_s")


def headlines(runs: list[Run], summaries: list[dict[str, Any]]) -> list[str]:
    """e.g. 'april vs sync: 1.42x trained tokens/s (mean)'"""
    out = []
    base = summaries[0]
    for r, s in zip(runs[1:], summaries[1:]):
        parts = [f"{ratio_text(s.get(k), base.get(k))} {LABELS[k]}" for k in HEADLINE_KEYS
                 if ratio_text(s.get(k), base.get(k))]
        if parts:
            out.append(f"{r.name} vs {runs[0].name}: " + ", ".join(parts))
    return out
