"""A run's controls and its life after launch: stop / pause / resume / kill (as the lifecycle
table says), notes and tags, deletion, and the worker's side: rewinding to a checkpoint, the
heartbeat and the run's end."""
from __future__ import annotations

import logging
import shutil
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from webapp.celery import app as celery_app
from webapp.dashboard import lifecycle
from webapp.dashboard.access import policy, validation
from webapp.dashboard.actions.alert_state import clear_alert
from webapp.dashboard.actions.launch import enqueue, run_dir
from webapp.dashboard.actions.rows import Record, append, clean_json, set_status, status_record
from webapp.dashboard.errors import Conflict, Forbidden, Invalid
from webapp.dashboard.models import HistogramSnapshot, KnobChange, MetricPoint, RolloutSample, Run, TimelineSlice

log = logging.getLogger(__name__)


# --- a person's controls --------------------------------------------------------------------------------

def control(run: Run, user, action: str, resume_step: int | None = None) -> Run:
    """Stop, pause, resume or kill `run` as lifecycle.TRANSITIONS says; the new status and
    desired state and the events that record them are one write. Raises Forbidden, Invalid (an
    unknown action), Conflict (the run's state refuses it) or TooManyRuns (re-queueing an ended
    run past its owner's quota)."""
    if not run.can_control(user):
        raise Forbidden(f"only the run's owner or staff can {action} it")
    if action not in lifecycle.ACTIONS:
        raise Invalid(f"unknown action {action!r}", {"action": "one of " + ", ".join(lifecycle.ACTIONS)})
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run.pk)
        t = lifecycle.transition(run.status, run.desired, action)
        if t is None:
            raise Conflict(lifecycle.refusal(run.status, run.desired, action))
        fields: dict[str, Any] = {"desired": t.desired}
        records = []
        if t.status != run.status:
            if t.effect == lifecycle.REQUEUE:
                fields.update(error="", finished_at=None, heartbeat_at=None)
            records.append(status_record(t.status, run.step, fields.get("error")))
        if t.event:
            data = {"requested_by": user.get_username()}
            if t.status == run.status:   # no status frame carries the new state: this event does
                data.update(status=t.status, desired=t.desired)
            records.append(Record("event", run.step, t.event, data))
        if t.effect == lifecycle.REQUEUE:
            if not user.is_staff:   # re-queueing counts like a launch, for the run's owner
                policy.check_active_runs(run.owner)
            KnobChange.objects.filter(run=run, status=KnobChange.PENDING).update(
                status=KnobChange.REJECTED, message="the run ended before this change was applied")
        elif t.effect in (lifecycle.REVOKE, lifecycle.TERMINATE):
            _revoke(run, terminate=t.effect == lifecycle.TERMINATE)
        append(run.pk, records, fields)
        if t.effect == lifecycle.REQUEUE:
            clear_alert(run, "heartbeat")
            enqueue(run, resume=True, resume_step=resume_step)
    run.refresh_from_db()
    return run


def _revoke(run: Run, terminate: bool) -> None:
    if not run.celery_task_id:
        return
    task_id = run.celery_task_id

    def send():
        try:
            if terminate:
                celery_app.control.revoke(task_id, terminate=True, signal="SIGKILL")
            else:
                celery_app.control.revoke(task_id)
        except Exception:
            log.exception("revoke %s failed", task_id)

    transaction.on_commit(send)


def annotate_run(run: Run, user, note: Any = None, tags: Any = None, archived: Any = None) -> Run:
    """Set a run's note, tags and archived flag (owner or staff), with an `annotated` event, in
    one write."""
    if not run.can_control(user):
        raise Forbidden("only the run's owner or staff can change its note, tags or archive state")
    errors, fields = {}, {}
    if note is not None:
        problem = validation.check_note(note)
        if problem:
            errors["note"] = problem
        else:
            fields["note"] = note
    if tags is not None:
        clean, problem = validation.clean_tags(tags)
        if problem:
            errors["tags"] = problem
        else:
            fields["tags"] = clean
    if archived is not None:
        if not isinstance(archived, bool):
            errors["archived"] = "expected true or false"
        elif archived and run.status in lifecycle.ACTIVE:
            errors["archived"] = f"the run is {run.status}: stop it before archiving"
        else:
            fields["archived"] = archived
    if errors:
        raise Invalid("not saved", errors)
    if fields:
        append(run.pk, [Record("event", run.step, "annotated",
                               {"by": user.get_username(), "fields": sorted(fields)})], fields)
        run.refresh_from_db()
    return run


def delete_run(run: Run, user) -> None:
    if not run.can_control(user):
        raise Forbidden("only the run's owner or staff can delete it")
    if run.status in lifecycle.ACTIVE:
        raise Conflict(f"the run is {run.status}: stop or kill it first")
    directory = run_dir(run.pk)
    run.delete()
    shutil.rmtree(directory, ignore_errors=True)   # checkpoints and the trainer's files


# --- the worker's side ------------------------------------------------------------------------------------

def rewind(run_id: int, step: int, from_checkpoint: bool) -> int:
    """Resuming from the checkpoint at `step`: the points, histograms and rollout samples of later
    steps belong to steps that will be trained again, so they go; a `rewound` event tells the
    charts and the run's step goes back, in one transaction."""
    with transaction.atomic():
        MetricPoint.objects.filter(run_id=run_id, step__gt=step).delete()
        HistogramSnapshot.objects.filter(run_id=run_id, step__gt=step).delete()
        RolloutSample.objects.filter(run_id=run_id, step__gt=step).delete()
        TimelineSlice.objects.filter(run_id=run_id, step__gt=step).delete()
        return append(run_id, [Record("event", step, "rewound",
                                      {"step": step, "from_checkpoint": from_checkpoint})], {"step": step})


def end_run(run_id: int, status: str, *, final_summary: dict | None = None,
            error: str | None = None, at: float | None = None) -> bool:
    """The training task's last word on a live run: finished, stopped or failed (nothing when it is
    no longer live: killed or interrupted meanwhile). The trainer's final summary is merged into
    the run's summary under the row lock, after the sink's last write. `at`: when the run ended
    (unix seconds; default now: an imported run's end is its files' time)."""
    if status not in lifecycle.WORKER_ENDS:
        raise ValueError(f"a run ends {', '.join(lifecycle.WORKER_ENDS)}; got {status!r}")
    fields: dict[str, Any] = {}
    with transaction.atomic():
        if final_summary is not None:
            cur = Run.objects.select_for_update().filter(pk=run_id).values_list("summary", flat=True).first()
            fields["summary"] = {**(cur or {}), "final": clean_json(final_summary)}
        if error is not None:
            fields["error"] = error
        return set_status(run_id, status, only_from=lifecycle.END_FROM, at=at, **fields)


def heartbeat(run_id: int, at: datetime | None = None) -> bool:
    """The worker is alive (its heartbeat thread, every RLPILOT_HEARTBEAT_S). No event, no ring:
    pages show the time when they next read the run. False once the run is no longer live."""
    return bool(Run.objects.filter(pk=run_id, status__in=lifecycle.LIVE)
                .update(heartbeat_at=at or timezone.now()))
