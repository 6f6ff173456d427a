"""A run's timeline on the web side: cleaning the trainer's spans, and reading them back.

The trainer sends one TimelineSlice per step (trainer/observe/timeline.py: a few dozen spans of
{"lane", "phase", "start", "end", "occupancy"?}, wall-clock seconds). The live page asks for the
last `last` steps and follows the socket's `timeline` frames; the report asks for the whole run,
thinned to at most `max_slices` slices (evenly spaced steps, the last always kept), with
every lane's seconds per phase over all of it (`totals`, never thinned) and the seconds the
slices cover (`extent`: a lane's time outside its spans is idle, or unrecorded).
"""
from __future__ import annotations

import math
from typing import Any

from trainer.observe.timeline import covered_seconds, phase_seconds
from webapp.dashboard.models import TimelineSlice

MAX_SPANS = 200        # per slice: the trainer sends at most a few dozen
MAX_NAME = 64


def clean_spans(raw: Any) -> list[dict[str, Any]]:
    """The well-formed spans of `raw` (anything else is left out): a lane and a phase (short
    strings), finite start <= end, occupancy in [0, 1] when given."""
    out = []
    for s in raw if isinstance(raw, list) else []:
        if not isinstance(s, dict):
            continue
        lane, phase = s.get("lane"), s.get("phase")
        try:
            start, end = float(s.get("start")), float(s.get("end"))
        except (TypeError, ValueError):
            continue
        if not (isinstance(lane, str) and isinstance(phase, str) and lane and phase
                and math.isfinite(start) and math.isfinite(end) and start <= end):
            continue
        span = {"lane": lane[:MAX_NAME], "phase": phase[:MAX_NAME], "start": start, "end": end}
        occ = s.get("occupancy")
        if isinstance(occ, (int, float)) and math.isfinite(occ):
            span["occupancy"] = min(1.0, max(0.0, float(occ)))
        out.append(span)
        if len(out) >= MAX_SPANS:
            break
    return out


def frame(t: TimelineSlice) -> dict[str, Any]:
    """A slice as the socket sends it."""
    return {"type": "timeline", "step": t.step, "spans": t.spans, "cursor": t.seq}


def snapshot(run_id: int, *, last: int | None = None, max_slices: int | None = None) -> dict[str, Any]:
    """The run's timeline: its last `last` steps, or the whole run thinned to `max_slices`
    slices with `totals` ({lane: {phase: seconds}}, every slice counted). `cursor` is the last
    sequence number read (the socket sends later slices)."""
    q = TimelineSlice.objects.filter(run_id=run_id)
    top = q.order_by("-step").values_list("step", flat=True).first()
    out: dict[str, Any] = {"slices": [], "totals": None, "extent": None, "stride": 1}
    if top is None:
        return out
    if last is not None:
        rows = list(q.filter(step__gt=top - last).order_by("seq"))
    else:
        rows = list(q.order_by("seq"))
        out["totals"] = phase_seconds(r.spans for r in rows)
        out["extent"] = round(covered_seconds(r.spans for r in rows), 3)
        if max_slices is not None and len(rows) > max_slices:
            stride = len(rows) / max_slices
            keep = {int(i * stride) for i in range(max_slices - 1)} | {len(rows) - 1}
            out["stride"] = math.ceil(stride)
            rows = [rows[i] for i in sorted(keep)]
    out["slices"] = [frame(r) for r in rows]
    return out
