"""Reading a run's rows as client messages (shared by the JSON API and the WebSocket)."""
from __future__ import annotations

from typing import Any, Iterable

from django.db.models import ExpressionWrapper, F, IntegerField, Max, Min

from webapp.dashboard import formatting, lifecycle
from webapp.dashboard.models import HistogramSnapshot, MetricPoint, Run, RunEvent, TimelineSlice
from webapp.dashboard.rows import samples as sample_rows
from webapp.dashboard.rows import timeline as timeline_rows

BATCH = 500   # sequence numbers per backlog chunk


def event_message(e: RunEvent) -> dict[str, Any]:
    """An event as the page reads it (the WebSocket, GET /api/runs/<id>/metrics, the exported
    report's data), with its `text`: the line the event log shows (formatting.describe_event; the
    page writes no event text of its own). A status event, or an event that records a run's new
    (status, desired) without changing its status (a pending pause or resume), carries the
    actions the run then allows (lifecycle.allowed_actions): the page's buttons follow them."""
    text = formatting.describe_event(e.kind, e.data)
    if e.kind == "status":
        return {"type": "status", "status": e.data.get("status"), "previous": e.data.get("previous"),
                "message": e.data.get("message", ""), "step": e.step, "time": e.time.timestamp(),
                "cursor": e.seq, "allowed_actions": _allowed(e.data), "text": text}
    msg = {"type": "event", "kind": e.kind, "step": e.step, "time": e.time.timestamp(),
           "data": e.data, "cursor": e.seq, "text": text}
    if isinstance(e.data, dict) and e.data.get("status") in lifecycle.STATUSES and "desired" in e.data:
        msg["allowed_actions"] = _allowed(e.data)
    if e.kind in formatting.RUN_STARTS and isinstance(e.data, dict) and "trainable_params" in e.data:
        # what the run trains, the line the live page's head shows (reports/summary.trains):
        # LoRA's rank and alpha are the run's config's (one read, once per start or resume)
        config = Run.objects.filter(pk=e.run_id).values_list("config", flat=True).first() or {}
        msg["trains"] = formatting.trains(config.get("lora"), e.data)
    return msg


def _allowed(data: Any) -> list[str]:
    data = data if isinstance(data, dict) else {}
    return lifecycle.allowed_actions(str(data.get("status")), data.get("desired"))


def messages_after(run_id: int, cursor: int, upto: int | None = None,
                   limit: int = BATCH) -> tuple[list[dict[str, Any]], int]:
    """Messages for sequence numbers in (cursor, upto], at most `limit` sequence numbers, in
    order. Returns (messages, new cursor)."""
    if upto is None:
        upto = Run.objects.filter(pk=run_id).values_list("last_seq", flat=True).first() or 0
    hi = min(upto, cursor + limit)
    if hi <= cursor:
        return [], cursor
    by_seq: dict[int, dict[str, Any]] = {}
    for seq, step, key, value in (MetricPoint.objects.filter(run_id=run_id, seq__gt=cursor, seq__lte=hi)
                                  .values_list("seq", "step", "key", "value").order_by("seq", "id")):
        msg = by_seq.get(seq)
        if msg is None:
            msg = by_seq[seq] = {"type": "metrics", "step": step, "values": {}, "cursor": seq}
        msg["values"][key] = value
    for h in HistogramSnapshot.objects.filter(run_id=run_id, seq__gt=cursor, seq__lte=hi):
        by_seq[h.seq] = {"type": "histogram", "step": h.step, "name": h.name, "edges": h.edges,
                         "counts": h.counts, "cursor": h.seq}
    for e in RunEvent.objects.filter(run_id=run_id, seq__gt=cursor, seq__lte=hi):
        by_seq[e.seq] = event_message(e)
    for t in TimelineSlice.objects.filter(run_id=run_id, seq__gt=cursor, seq__lte=hi):
        by_seq[t.seq] = timeline_rows.frame(t)   # a step's spans (webapp/dashboard/rows/timeline.py)
    # a step's rollout samples, as compact summaries (GET /api/runs/<id>/samples/<id> has the rest)
    for seq, rows in sample_rows.summary_rows(run_id, cursor, hi).items():
        by_seq[seq] = {"type": "samples", "step": rows[0]["step"], "samples": rows, "cursor": seq}
    # sequence numbers whose rows were deleted (rewound on resume) are simply skipped
    return [by_seq[s] for s in sorted(by_seq)], hi


def downsample(steps: list[int], values: list[float | None], max_points: int) -> tuple[list, list]:
    """Min/max per bucket: at most ~max_points points that keep every spike visible."""
    n = len(steps)
    if n <= max_points or max_points < 4:
        return steps, values
    buckets = max_points // 2
    out_s, out_v = [], []
    size = n / buckets
    for b in range(buckets):
        lo, hi = int(b * size), int((b + 1) * size)
        if hi <= lo:
            continue
        idx = [i for i in range(lo, hi) if values[i] is not None]
        if not idx:
            out_s.append(steps[lo]), out_v.append(None)
            continue
        i_min = min(idx, key=lambda i: values[i])
        i_max = max(idx, key=lambda i: values[i])
        for i in sorted({i_min, i_max}):
            out_s.append(steps[i]), out_v.append(values[i])
    return out_s, out_v


SQL_DOWNSAMPLE_FACTOR = 10


def sql_downsample(points_q, max_points: int) -> dict[str, dict[str, list]]:
    """Min and max per step bucket, computed by the database (one GROUP BY over the run's
    points): each bucket becomes a vertical min-max segment at its middle step, so every
    spike stays visible while the chart gets at most ~max_points points per series."""
    rng = points_q.aggregate(lo=Min("step"), hi=Max("step"))
    lo, hi = rng["lo"] or 0, rng["hi"] or 0
    buckets = max(1, max_points // 2)
    span = hi - lo + 1
    bucket = ExpressionWrapper((F("step") - lo) * buckets / span, output_field=IntegerField())
    rows = (points_q.annotate(b=bucket).values("key", "b")
            .annotate(s0=Min("step"), s1=Max("step"), v0=Min("value"), v1=Max("value"))
            .order_by("key", "b"))
    series: dict[str, dict[str, list]] = {}
    for r in rows:
        s = series.setdefault(r["key"], {"steps": [], "values": []})
        mid = (r["s0"] + r["s1"]) // 2
        if r["v0"] is None or r["v0"] == r["v1"]:
            s["steps"].append(mid)
            s["values"].append(r["v0"])
        else:
            s["steps"] += [mid, mid]
            s["values"] += [r["v0"], r["v1"]]
    return series


def metrics_snapshot(run: Run, keys: Iterable[str] | None, after: int | None, max_points: int,
                     max_histograms: int = 300, max_events: int = 500) -> dict[str, Any]:
    """The payload of GET /api/runs/<id>/metrics.

    Without `after`: every series, downsampled to `max_points` per key (min/max per bucket),
    up to `max_histograms` histogram snapshots (evenly spaced, the latest always included) and
    the latest `max_events` events. With `after`: the raw rows after that cursor (one page).
    `cursor` is where a WebSocket (or the next call) continues without loss or duplicates."""
    cursor = Run.objects.filter(pk=run.pk).values_list("last_seq", flat=True).first() or 0
    keys = [k for k in (keys or []) if k]
    points_q = MetricPoint.objects.filter(run_id=run.pk, seq__lte=cursor)
    hist_q = HistogramSnapshot.objects.filter(run_id=run.pk, seq__lte=cursor)
    event_q = RunEvent.objects.filter(run_id=run.pk, seq__lte=cursor)
    if after is not None:
        hi = min(cursor, after + BATCH * 4)
        points_q = points_q.filter(seq__gt=after, seq__lte=hi)
        hist_q = hist_q.filter(seq__gt=after, seq__lte=hi)
        event_q = event_q.filter(seq__gt=after, seq__lte=hi)
        cursor = max(hi, after)
    if keys:
        points_q = points_q.filter(key__in=keys)
    series: dict[str, dict[str, list]] = {}
    downsampled = False
    if after is None and points_q.count() > SQL_DOWNSAMPLE_FACTOR * max_points:
        series = sql_downsample(points_q, max_points)   # long runs: buckets computed in SQL
        downsampled = True
    else:
        for key, step, value in points_q.values_list("key", "step", "value").order_by("key", "step", "seq"):
            s = series.setdefault(key, {"steps": [], "values": []})
            s["steps"].append(step)
            s["values"].append(value)
        if after is None:
            for s in series.values():
                if len(s["steps"]) > max_points:
                    s["steps"], s["values"] = downsample(s["steps"], s["values"], max_points)
                    downsampled = True
    hist_ids = list(hist_q.order_by("seq").values_list("id", flat=True))
    if after is None and len(hist_ids) > max_histograms:
        stride = len(hist_ids) / max_histograms
        picked = {hist_ids[int(i * stride)] for i in range(max_histograms)} | {hist_ids[-1]}
        hist_ids = sorted(picked)
    histograms = [{"step": h.step, "name": h.name, "edges": h.edges, "counts": h.counts, "cursor": h.seq}
                  for h in HistogramSnapshot.objects.filter(id__in=hist_ids).order_by("seq")]
    events = list(event_q.order_by("-seq")[:max_events])
    events.reverse()
    return {"points": series, "histograms": histograms, "events": [event_message(e) for e in events],
            "cursor": cursor, "downsampled": downsampled}
