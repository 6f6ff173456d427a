"""Metrics sinks: where a run's scalars, histograms and events go.

The trainer only knows `MetricsSink`. The CLI uses a console display plus JSONL files in the
run directory; the web app plugs in a database sink. Names are declared in trainer/observe/metric_names.py
(slash-separated, verl/TRL style).

Files written by `JsonlSink` in the run directory:
  metrics.jsonl     one object per step: {"step": N, "time": unix, "<name>": value, ...}
  histograms.jsonl  {"step": N, "name": ..., "edges": [...], "counts": [...]}
  events.jsonl      {"step": N, "time": unix, "kind": ..., ...data}
  samples.jsonl     one recorded sample per line (trainer/accounting/inspector.py: the rollout inspector)
  timeline.jsonl    {"step": N, "spans": [{"lane", "phase", "start", "end", "occupancy"?}, ...]}
                    where each process's time went (trainer/observe/timeline.py)
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence


def histogram(values: Sequence[float], edges: Sequence[float]) -> dict[str, Any]:
    """Counts of `values` in the bins [edges[i], edges[i+1]); the last bin is closed, and values
    outside the edges are clamped into the first/last bin so nothing disappears."""
    counts = [0] * (len(edges) - 1)
    for v in values:
        i = 0
        lo, hi = 0, len(edges) - 1
        if v >= edges[-1]:
            i = len(counts) - 1
        elif v > edges[0]:
            while hi - lo > 1:  # binary search for edges[lo] <= v < edges[hi]
                mid = (lo + hi) // 2
                if edges[mid] <= v:
                    lo = mid
                else:
                    hi = mid
            i = lo
        counts[i] += 1
    return {"edges": list(edges), "counts": counts}


def length_edges(max_len: int, bins: int = 32) -> list[float]:
    """Fixed integer bin edges 0..max_len, so histograms of every step line up (heatmaps)."""
    width = max(1, math.ceil(max_len / bins))
    return [float(i * width) for i in range(math.ceil(max_len / width) + 1)]


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


class MetricsSink:
    def scalars(self, step: int, values: dict[str, float]) -> None: ...
    def histogram(self, step: int, name: str, hist: dict[str, Any]) -> None: ...
    def event(self, step: int, kind: str, data: dict[str, Any] | None = None) -> None: ...
    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...
    def timeline(self, step: int, spans: list[dict[str, Any]]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class MultiSink(MetricsSink):
    def __init__(self, sinks: Iterable[MetricsSink]):
        self.sinks = list(sinks)

    def scalars(self, step, values):
        for s in self.sinks:
            s.scalars(step, values)

    def histogram(self, step, name, hist):
        for s in self.sinks:
            s.histogram(step, name, hist)

    def event(self, step, kind, data=None):
        for s in self.sinks:
            s.event(step, kind, data)

    def samples(self, step, rows):
        for s in self.sinks:
            s.samples(step, rows)

    def timeline(self, step, spans):
        for s in self.sinks:
            s.timeline(step, spans)

    def flush(self):
        for s in self.sinks:
            s.flush()

    def close(self):
        for s in self.sinks:
            s.close()


class MemorySink(MetricsSink):
    """Keeps everything in lists (benchmarks and tests)."""

    def __init__(self):
        self.steps: list[dict[str, Any]] = []
        self.histograms: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.sample_rows: list[dict[str, Any]] = []
        self.timelines: list[dict[str, Any]] = []   # {"step": N, "spans": [...]}

    def scalars(self, step, values):
        self.steps.append({"step": step, **values})

    def histogram(self, step, name, hist):
        self.histograms.append({"step": step, "name": name, **hist})

    def event(self, step, kind, data=None):
        self.events.append({"step": step, "kind": kind, **(data or {})})

    def samples(self, step, rows):
        self.sample_rows.extend(rows)

    def timeline(self, step, spans):
        self.timelines.append({"step": step, "spans": list(spans)})

    def series(self, name: str) -> list[float]:
        return [row[name] for row in self.steps if name in row]


def _clean(v):
    """JSON has no NaN/inf: write them as strings so a diverging run is still readable."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, list):   # a sample's per-token log-probabilities
        return [_clean(x) for x in v]
    return v


def read_jsonl(path: str | Path) -> list[dict]:
    """The objects of one of these files, in order. A last line without its newline is a live
    (or killed) run's half-written row and is left out; any other line that is not a JSON
    object raises ValueError naming the file and line."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n"):
                continue
            raise ValueError(f"{path}, line {i}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or "step" not in row:
            raise ValueError(f"{path}, line {i}: not a row of a run (no \"step\")")
        rows.append(row)
    return rows


class JsonlSink(MetricsSink):
    def __init__(self, run_dir: str | Path):
        d = Path(run_dir)
        d.mkdir(parents=True, exist_ok=True)
        self._files = {name: open(d / f"{name}.jsonl", "a", encoding="utf-8")
                       for name in ("metrics", "histograms", "events", "samples", "timeline")}

    def _write(self, name, obj):
        self._files[name].write(json.dumps({k: _clean(v) for k, v in obj.items()}) + "\n")

    def scalars(self, step, values):
        self._write("metrics", {"step": step, "time": time.time(), **values})
        self.flush()

    def histogram(self, step, name, hist):
        self._write("histograms", {"step": step, "name": name, **hist})

    def event(self, step, kind, data=None):
        self._write("events", {"step": step, "time": time.time(), "kind": kind, **(data or {})})
        self._files["events"].flush()

    def samples(self, step, rows):
        for row in rows:
            self._write("samples", {**row, "step": step})

    def timeline(self, step, spans):
        self._write("timeline", {"step": step, "spans": list(spans)})

    def flush(self):
        for f in self._files.values():
            f.flush()

    def close(self):
        for f in self._files.values():
            f.close()


class ConsoleSink(MetricsSink):
    """A one-line progress display per step, and events as they happen."""

    SHOWN = [("reward/accuracy", "acc", "{:.3f}"), ("reward/mean", "reward", "{:.3f}"),
             ("rollout/response_len/mean", "len", "{:.1f}"),
             ("rollout/zero_var_ratio", "zero_var", "{:.2f}"), ("actor/kl", "kl", "{:.4f}"),
             ("perf/gen_tokens_per_s", "gen_tok/s", "{:.0f}"),
             ("timing/step_s", "step_s", "{:.2f}"), ("eval/accuracy", "EVAL", "{:.3f}")]

    def __init__(self, max_steps: int | None = None, stream=None):
        self.max_steps = max_steps
        self.stream = stream or sys.stdout

    def scalars(self, step, values):
        parts = [f"step {step}" + (f"/{self.max_steps}" if self.max_steps else "")]
        for key, label, fmt in self.SHOWN:
            if key in values:
                parts.append(f"{label} {fmt.format(values[key])}")
        print("  ".join(parts), file=self.stream, flush=True)

    def event(self, step, kind, data=None):
        detail = " ".join(f"{k}={v}" for k, v in (data or {}).items())
        print(f"[{kind}] step {step} {detail}".rstrip(), file=self.stream, flush=True)
