"""A run's rows and its doorbell: the one write path under every other action.

`append` inserts a run's records with consecutive sequence numbers and updates the run row in one
transaction that holds the run's row lock (so sequence numbers commit in order), then rings the
run's doorbell once it commits. What a record does besides inserting its row -- a scalar batch
updates the key figures, a knob outcome its change row, a trainer's pause the run's status --
is one small handler per record kind (HANDLERS) and per event kind (EVENT_HANDLERS), inside that
same transaction: a page never reads the one without the other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any, Callable, Iterable

from django.db import transaction
from django.utils import timezone

from webapp.dashboard import doorbell, lifecycle
from webapp.dashboard.models import (
    HistogramSnapshot,
    KnobChange,
    MetricPoint,
    RolloutSample,
    Run,
    RunEvent,
    TimelineSlice,
)
from webapp.dashboard.rows import samples as sample_rows
from webapp.dashboard.rows import timeline as timeline_rows

# Latest values kept on the run row for the runs list ("key figures").
KEY_FIGURES = ("reward/accuracy", "reward/mean", "rollout/response_len/mean", "actor/kl",
               "perf/gen_tokens_per_s", "timing/step_s", "eval/accuracy",
               "cost/gpu_hours", "cost/cpu_core_hours")   # the runs list's cost columns


def clean_json(v: Any) -> Any:
    """JSON has no NaN/inf: write them as strings; make tuples lists; keep the rest."""
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, dict):
        return {str(k): clean_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean_json(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return str(v)


def _scalar(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


@dataclass
class Record:
    kind: str                  # "points" | "histogram" | "event" | "samples" | "timeline" | "status"
    step: int
    name: str = ""             # histogram name or event kind
    # points / event data / {edges, counts} / {"rows": [sample dict, ...]} / {"spans": [...]}
    # / {"status", "message"?}
    values: dict[str, Any] = field(default_factory=dict)
    # when an event or status change happened (unix seconds), when not now: an imported run's
    # file times (actions/imports.py)
    time: float | None = None


class Batch:
    """One append: the locked run row, the rows to insert and the run row's new values."""

    def __init__(self, run: Run, updates: dict[str, Any] | None):
        self.run = run
        self.seq = run.last_seq
        self.fields = dict(updates or {})
        self.points: list[MetricPoint] = []
        self.hists: list[HistogramSnapshot] = []
        self.events: list[RunEvent] = []
        self.rollouts: list[RolloutSample] = []
        self.slices: list[TimelineSlice] = []
        self.outcomes: list[tuple[str, bool, int, str]] = []   # knob changes applied / rejected

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def current(self, name: str) -> Any:
        """The run row's value of `name` as this append leaves it so far."""
        return self.fields[name] if name in self.fields else getattr(self.run, name)

    def add_event(self, step: int, kind: str, data: dict[str, Any], at: float | None = None) -> None:
        when = timezone.now() if at is None else datetime.fromtimestamp(at, dt_timezone.utc)
        self.events.append(RunEvent(run_id=self.run.pk, seq=self.next_seq(), step=step, kind=kind,
                                    data=clean_json(data), time=when))


# --- one handler per record kind ----------------------------------------------------------------------

def _points(b: Batch, r: Record) -> None:
    seq = b.next_seq()
    b.points.extend(MetricPoint(run_id=b.run.pk, seq=seq, step=r.step, key=k, value=_scalar(v))
                    for k, v in r.values.items())
    latest = {k: _scalar(r.values[k]) for k in KEY_FIGURES if k in r.values}
    if latest:
        summary = dict(b.current("summary") or {})
        summary["latest"] = {**summary.get("latest", {}), **latest}
        b.fields["summary"] = summary


def _histogram(b: Batch, r: Record) -> None:
    b.hists.append(HistogramSnapshot(run_id=b.run.pk, seq=b.next_seq(), step=r.step, name=r.name,
                                     edges=clean_json(r.values.get("edges", [])),
                                     counts=clean_json(r.values.get("counts", []))))


def _samples(b: Batch, r: Record) -> None:
    """A step's rollout samples: one sequence number for the batch (thinned past the run's cap)."""
    seq = b.next_seq()
    rows = r.values.get("rows") or []
    b.rollouts.extend(x for x in (sample_rows.row_for(b.run.pk, seq, r.step, row)
                                  for row in (rows if isinstance(rows, list) else [])) if x)


def _timeline(b: Batch, r: Record) -> None:
    """A step's timeline (webapp/dashboard/rows/timeline.py): its well-formed spans, one row."""
    b.slices.append(TimelineSlice(run_id=b.run.pk, seq=b.next_seq(), step=r.step,
                                  spans=timeline_rows.clean_spans(r.values.get("spans"))))


def _event(b: Batch, r: Record) -> None:
    b.add_event(r.step, r.name, r.values, r.time)
    handler = EVENT_HANDLERS.get(r.name)
    if handler is not None:
        handler(b, r)


def _status(b: Batch, r: Record) -> None:
    """A status change: a `status` event (with the previous status and the desired state it
    leaves, from which pages compute the allowed actions) and the run row's status."""
    new, previous = r.values["status"], b.current("status")
    data = {"status": new, "previous": previous, "desired": b.current("desired")}
    if "message" in r.values:
        data["message"] = r.values["message"]
    b.add_event(r.step, "status", data, r.time)
    b.fields["status"] = new
    if new in lifecycle.ENDED:
        b.fields.setdefault("finished_at", timezone.now() if r.time is None
                            else datetime.fromtimestamp(r.time, dt_timezone.utc))


HANDLERS: dict[str, Callable[[Batch, Record], None]] = {
    "points": _points, "histogram": _histogram, "samples": _samples, "timeline": _timeline,
    "event": _event, "status": _status,
}


# --- what some events do besides being recorded --------------------------------------------------------

def _knob_outcome(b: Batch, r: Record) -> None:
    """A knob change's row turns applied / rejected with the event that says so."""
    if not r.values.get("change_id"):
        return
    errors = r.values.get("errors") or {}
    b.outcomes.append((str(r.values["change_id"]), r.name == "knob_applied", r.step,
                       "; ".join(map(str, errors.values())) if isinstance(errors, dict) else ""))


def _knob_applied(b: Batch, r: Record) -> None:
    """The run's current knobs take the new values, whoever asked (a person, the CLI, the trainer)."""
    knobs = dict(b.current("knobs") or {})
    for k, ch in (r.values.get("changes") or {}).items():
        knobs[k] = ch.get("new")
    b.fields["knobs"] = knobs
    _knob_outcome(b, r)


def _trainer_moves_status(b: Batch, r: Record) -> None:
    """The trainer paused, resumed or began stopping: the status follows (lifecycle.EVENT_STATUS)."""
    new = lifecycle.status_after_event(r.name, b.current("status"))
    if new is not None:
        _status(b, Record("status", r.step, values={"status": new}))


EVENT_HANDLERS: dict[str, Callable[[Batch, Record], None]] = {
    "knob_applied": _knob_applied,
    "knob_rejected": _knob_outcome,
    **{kind: _trainer_moves_status for kind in lifecycle.EVENT_STATUS},
}


# --- the write ------------------------------------------------------------------------------------------

def append(run_id: int, records: Iterable[Record], updates: dict[str, Any] | None = None,
           *, ring_bell: bool = True) -> int:
    """Insert `records` with consecutive sequence numbers and apply `updates` to the run row,
    atomically. Returns the run's last sequence number. A "samples" record (a step's rollout
    samples) takes one sequence number for all its rows; past the run's cap
    (RLPILOT_SAMPLES_PER_RUN) the oldest steps' samples are thinned in the same transaction."""
    records = list(records)
    for r in records:
        if r.kind not in HANDLERS:
            raise ValueError(f"unknown record kind {r.kind!r}; expected one of {', '.join(HANDLERS)}")
    with transaction.atomic():
        run = (Run.objects.select_for_update()
               .only("id", "last_seq", "summary", "knobs", "status", "desired").get(pk=run_id))
        b = Batch(run, updates)
        for r in records:
            HANDLERS[r.kind](b, r)
        _insert(b)
        if b.seq != run.last_seq:
            b.fields["last_seq"] = b.seq
        if b.fields:
            Run.objects.filter(pk=run_id).update(**b.fields)
    if ring_bell and records:
        ring(run_id, b.seq)
    return b.seq


def _insert(b: Batch) -> None:
    if b.points:
        MetricPoint.objects.bulk_create(b.points)
    if b.hists:
        HistogramSnapshot.objects.bulk_create(b.hists)
    if b.events:
        RunEvent.objects.bulk_create(b.events)
    if b.slices:
        TimelineSlice.objects.bulk_create(b.slices)
    for change_id, ok, step, message in b.outcomes:
        KnobChange.objects.filter(run_id=b.run.pk, change_id=change_id).update(
            status=KnobChange.APPLIED if ok else KnobChange.REJECTED, applied_step=step,
            message=message)
    if b.rollouts:
        RolloutSample.objects.bulk_create(b.rollouts, batch_size=200)
        sample_rows.thin(b.run.pk)


def ring(run_id: int, seq: int) -> None:
    """Tell the run's WebSocket consumers that rows up to `seq` exist (they read the database).
    Inside a transaction the bell rings once it commits."""
    transaction.on_commit(lambda: doorbell.ring(run_id, seq))


def event(run_id: int, step: int, kind: str, data: dict | None = None, **updates) -> int:
    return append(run_id, [Record("event", step, kind, data or {})], updates)


def status_record(status: str, step: int, error: str | None = None, at: float | None = None) -> Record:
    """The record of a status change (`error`, when given, is the status event's message; `at`,
    when given, the unix time it happened)."""
    return Record("status", step, values={"status": status} if error is None
                  else {"status": status, "message": error}, time=at)


def set_status(run: Run | int, status: str, *, only_from: Iterable[str] | None = None,
               step: int | None = None, at: float | None = None, **fields) -> bool:
    """Change a run's status (and record a `status` event), with `fields` on the run row. With
    `only_from`, do nothing unless the current status is one of those; `at`: when it happened
    (unix seconds; default now). Returns whether it changed."""
    run_id = run if isinstance(run, int) else run.pk
    with transaction.atomic():
        cur = Run.objects.select_for_update().only("status", "step").get(pk=run_id)
        if only_from is not None and cur.status not in set(only_from):
            return False
        if status in lifecycle.ENDED:
            fields.setdefault("finished_at", timezone.now() if at is None
                              else datetime.fromtimestamp(at, dt_timezone.utc))
        append(run_id, [status_record(status, cur.step if step is None else step, fields.get("error"), at)],
               fields)
    if isinstance(run, Run):
        run.status = status
        for k, v in fields.items():
            setattr(run, k, v)
    return True
