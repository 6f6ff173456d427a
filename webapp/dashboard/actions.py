"""Every write that clients must hear about lives here (zulip-style "actions").

A write appends sequence-numbered rows for the run in one transaction that holds the run's row
lock, then rings the run's doorbell on the channel layer. Views, the WebSocket consumer, the
Celery task and its database sink all go through these functions.
"""
from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from trainer import config as config_mod
from webapp.dashboard.models import (ACTIVE, LIVE, RESUMABLE, Desired, HistogramSnapshot, KnobChange,
                                     MetricPoint, Run, RunEvent, Status)

log = logging.getLogger(__name__)

# Latest values kept on the run row for the runs list ("key figures").
KEY_FIGURES = ("reward/accuracy", "reward/mean", "rollout/response_len/mean", "actor/kl",
               "perf/gen_tokens_per_s", "timing/step_s", "eval/accuracy")


class ActionError(Exception):
    status = 400

    def __init__(self, message: str, errors: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.errors = errors or {}


class Invalid(ActionError):
    status = 400


class Forbidden(ActionError):
    status = 403


class Conflict(ActionError):
    status = 409


def run_dir(run_id: int):
    """Where the trainer keeps a run's files (config.toml, checkpoints/)."""
    return settings.RUNS_DIR / f"run-{run_id:06d}"


def group_name(run_id: int) -> str:
    return f"run-{run_id}"


# --- JSON cleaning ---------------------------------------------------------------------------------

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


# --- appending rows + the doorbell ------------------------------------------------------------------

@dataclass
class Record:
    kind: str                  # "points" | "histogram" | "event"
    step: int
    name: str = ""             # histogram name or event kind
    values: dict[str, Any] = field(default_factory=dict)  # points / event data / {edges, counts}


def append(run_id: int, records: Iterable[Record], updates: dict[str, Any] | None = None,
           *, ring_bell: bool = True) -> int:
    """Insert `records` with consecutive sequence numbers and apply `updates` to the run row,
    atomically. Returns the run's last sequence number."""
    records = list(records)
    with transaction.atomic():
        run = Run.objects.select_for_update().only("id", "last_seq", "summary", "knobs", "status").get(pk=run_id)
        seq = run.last_seq
        points, hists, events = [], [], []
        fields = dict(updates or {})
        for r in records:
            seq += 1
            if r.kind == "points":
                points.extend(MetricPoint(run_id=run_id, seq=seq, step=r.step, key=k, value=_scalar(v))
                              for k, v in r.values.items())
                latest = {k: _scalar(r.values[k]) for k in KEY_FIGURES if k in r.values}
                if latest:
                    summary = dict(fields.get("summary", run.summary) or {})
                    summary["latest"] = {**summary.get("latest", {}), **latest}
                    fields["summary"] = summary
            elif r.kind == "histogram":
                hists.append(HistogramSnapshot(run_id=run_id, seq=seq, step=r.step, name=r.name,
                                               edges=clean_json(r.values.get("edges", [])),
                                               counts=clean_json(r.values.get("counts", []))))
            else:
                events.append(RunEvent(run_id=run_id, seq=seq, step=r.step, kind=r.name,
                                       data=clean_json(r.values)))
                if r.name == "knob_applied":
                    knobs = dict(fields.get("knobs", run.knobs) or {})
                    for k, ch in (r.values.get("changes") or {}).items():
                        knobs[k] = ch.get("new")
                    fields["knobs"] = knobs
        if points:
            MetricPoint.objects.bulk_create(points)
        if hists:
            HistogramSnapshot.objects.bulk_create(hists)
        if events:
            RunEvent.objects.bulk_create(events)
        if seq != run.last_seq:
            fields["last_seq"] = seq
        if fields:
            Run.objects.filter(pk=run_id).update(**fields)
    if ring_bell and records:
        ring(run_id, seq)
    return seq


def ring(run_id: int, seq: int) -> None:
    """Tell the run's WebSocket consumers that rows up to `seq` exist (they read the database).
    Inside a transaction the bell rings once it commits."""
    transaction.on_commit(lambda: _ring(run_id, seq))


def _ring(run_id: int, seq: int) -> None:
    if settings.CROSS_PROCESS_DOORBELL:   # Redis: from a background loop, never blocking
        from webapp.dashboard.telemetry import shared_doorbell

        shared_doorbell().ring(run_id, seq)
        return
    layer = get_channel_layer()         # in-memory: reaches this process's consumers
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group_name(run_id), {"type": "doorbell", "seq": seq})
    except Exception:  # the database has the rows; a missed ring only delays a poll
        log.exception("doorbell for run %s failed", run_id)


def event(run_id: int, step: int, kind: str, data: dict | None = None, **updates) -> int:
    return append(run_id, [Record("event", step, kind, data or {})], updates)


def set_status(run: Run | int, status: str, *, only_from: Iterable[str] | None = None,
               step: int | None = None, **fields) -> bool:
    """Change a run's status (and record a `status` event). With `only_from`, do nothing unless
    the current status is one of those. Returns whether it changed."""
    run_id = run if isinstance(run, int) else run.pk
    with transaction.atomic():
        cur = Run.objects.select_for_update().only("status", "step").get(pk=run_id)
        if only_from is not None and cur.status not in set(only_from):
            return False
        if status in (Status.STOPPED, Status.FINISHED, Status.FAILED, Status.INTERRUPTED):
            fields.setdefault("finished_at", timezone.now())
        data = {"status": status, "previous": cur.status}
        if "error" in fields:
            data["message"] = fields["error"]
        seq = append(run_id, [Record("event", cur.step if step is None else step, "status", data)],
                     {"status": status, **fields}, ring_bell=False)
    if isinstance(run, Run):
        run.status = status
        for k, v in fields.items():
            setattr(run, k, v)
    ring(run_id, seq)
    return True


# --- launching --------------------------------------------------------------------------------------

def build_config(preset: str | None, overrides: Any, toml: str | None = None) -> config_mod.Config:
    """A validated config from a preset (or a full TOML text) plus dotted overrides.
    Raises Invalid with a message per key."""
    errors: dict[str, str] = {}
    cfg = None
    if toml:
        try:
            cfg = config_mod.loads_toml(toml)
        except config_mod.ConfigError as e:
            errors.update({("toml" if k == "toml" else k): v for k, v in e.errors.items()})
    elif preset:
        if not isinstance(preset, str) or preset not in config_mod.preset_names():
            errors["preset"] = (f"unknown preset {preset!r}; presets: "
                                + ", ".join(config_mod.preset_names()))
        else:
            cfg = config_mod.from_dict(config_mod.preset_dict(preset))
    else:
        cfg = config_mod.Config()
    if overrides in (None, ""):
        overrides = {}
    if not isinstance(overrides, dict):
        errors["overrides"] = 'expected an object of dotted keys to values, e.g. {"run.max_steps": 40}'
    elif cfg is not None:
        try:
            cfg = config_mod.apply_overrides(cfg, overrides)
        except config_mod.ConfigError as e:
            errors.update(e.errors)
    if cfg is not None:   # NUL characters cannot be stored (PostgreSQL text and jsonb refuse them)
        for section, values in cfg.to_dict().items():
            for k, v in values.items():
                if isinstance(v, str) and "\x00" in v:
                    errors[f"{section}.{k}"] = "must not contain NUL characters"
    if errors:
        raise Invalid("invalid configuration", errors)
    return cfg


def validate_queue(queue: Any) -> str:
    """The Celery queue a run goes to: one of settings.RLPILOT_QUEUES (default: the first)."""
    if queue in (None, ""):
        return settings.RLPILOT_QUEUES[0]
    if not isinstance(queue, str) or queue not in settings.RLPILOT_QUEUES:
        raise Invalid("unknown queue", {"queue": "one of " + ", ".join(settings.RLPILOT_QUEUES)})
    return queue


def launch_run(user, name: Any, preset: Any = None, overrides: Any = None, toml: str | None = None,
               queue: Any = None) -> Run:
    errors: dict[str, str] = {}
    try:
        queue = validate_queue(queue)
    except Invalid as e:
        errors.update(e.errors)
    if not isinstance(name, str) or not name.strip():
        errors["name"] = "required: a short name for the run"
    elif len(name) > 200:
        errors["name"] = "at most 200 characters"
    elif "\x00" in name:
        errors["name"] = "must not contain NUL characters"
    if preset is not None and not isinstance(preset, str):
        errors["preset"] = "expected a preset name"
        preset = None
    if toml is not None and not isinstance(toml, str):
        errors["toml"] = "expected TOML text"
        toml = None
    try:
        cfg = build_config(preset, overrides, toml)
    except Invalid as e:
        errors.update(e.errors)
    if errors:
        raise Invalid("the run was not launched", errors)
    with transaction.atomic():
        run = Run.objects.create(owner=user, name=name.strip(), preset=preset or "",
                                 config=cfg.to_dict(), knobs=cfg.knob_values(),
                                 max_steps=cfg.run.max_steps, status=Status.QUEUED, queue=queue)
        append(run.pk, [Record("event", 0, "status", {"status": Status.QUEUED, "previous": None})],
               ring_bell=False)
        _enqueue(run, resume=False)
    return run


def _enqueue(run: Run, resume: bool, resume_step: int | None = None) -> None:
    task_id = uuid.uuid4().hex
    Run.objects.filter(pk=run.pk).update(celery_task_id=task_id)
    run.celery_task_id = task_id
    queue = run.queue or settings.TRAINING_QUEUE
    kwargs = {"resume": resume}
    if resume_step is not None:
        kwargs["resume_step"] = resume_step

    def send():
        from webapp.dashboard.tasks import train
        # the run's queue: only workers on machines with the right resources consume it
        train.apply_async(args=[run.pk], kwargs=kwargs, task_id=task_id, queue=queue)

    transaction.on_commit(send)


# --- knobs -------------------------------------------------------------------------------------------

def validate_knobs(run: Run, knobs: Any) -> dict[str, Any]:
    """Coerce a {dotted key: value} change against the schema and the run's current config."""
    if not isinstance(knobs, dict) or not knobs:
        raise Invalid("expected an object of knob names to values", {"knobs": "expected a non-empty "
                      'object of dotted keys to values, e.g. {"optim.lr": 5e-5}'})
    errors, out = {}, {}
    for key, value in knobs.items():
        try:
            spec = config_mod.param_spec(key)
            if not spec.tunable:
                raise config_mod.ConfigError({key: "cannot change during a run (not a knob)"})
            out[key] = spec.coerce(value)
        except config_mod.ConfigError as e:
            errors.update(e.errors)
    if not errors:
        try:
            cfg = config_mod.from_dict(run.config)
            cfg = config_mod.apply_overrides(cfg, {**(run.knobs or {}), **out})
        except config_mod.ConfigError as e:
            errors.update(e.errors)
    if errors:
        raise Invalid("knob change refused", errors)
    return out


def request_knobs(run: Run, user, knobs: Any) -> KnobChange:
    if not run.can_control(user):
        raise Forbidden("only the run's owner or staff can change its knobs")
    if run.status not in (Status.QUEUED, Status.RUNNING, Status.PAUSED):
        raise Conflict(f"the run is {run.status}; knobs can change only while it is queued, "
                       "running or paused")
    values = validate_knobs(run, knobs)
    with transaction.atomic():
        change = KnobChange.objects.create(run=run, change_id=uuid.uuid4().hex[:12], knobs=values,
                                           requested_by=user)
        Run.objects.filter(pk=run.pk).update(knob_version=F("knob_version") + 1)
    event(run.pk, run.step, "knob_requested", {"change_id": change.change_id, "knobs": values,
                                               "requested_by": user.get_username()})
    return change


# --- stop / pause / resume / kill / delete --------------------------------------------------------------

def _clear_alert(run: Run, rule: str) -> None:
    state = Run.objects.filter(pk=run.pk).values_list("alerts", flat=True).first() or {}
    active = dict(state.get("active") or {})
    if rule in active:
        del active[rule]
        append(run.pk, [Record("event", run.step, "alert_cleared", {"rule": rule})],
               {"alerts": {**state, "active": active}})


def control(run: Run, user, action: str, resume_step: int | None = None) -> Run:
    if not run.can_control(user):
        raise Forbidden(f"only the run's owner or staff can {action} it")
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run.pk)
        st = run.status
        who = user.get_username()
        if action == "stop":
            if st == Status.QUEUED:
                _revoke(run, terminate=False)
                set_status(run, Status.STOPPED, desired=Desired.STOP)
            elif st in (Status.RUNNING, Status.PAUSED):
                set_status(run, Status.STOPPING, desired=Desired.STOP)
            else:
                raise Conflict(f"cannot stop a run that is {st}")
        elif action == "pause":
            if st != Status.RUNNING or run.desired != Desired.RUN:
                raise Conflict(f"cannot pause a run that is {st}"
                               + (" (a pause or stop is already pending)" if st == Status.RUNNING else ""))
            Run.objects.filter(pk=run.pk).update(desired=Desired.PAUSE)
            event(run.pk, run.step, "pause_requested", {"requested_by": who})
        elif action == "resume":
            if st == Status.PAUSED or (st == Status.RUNNING and run.desired == Desired.PAUSE):
                Run.objects.filter(pk=run.pk).update(desired=Desired.RUN)
                event(run.pk, run.step, "resume_requested", {"requested_by": who})
            elif st in RESUMABLE:
                KnobChange.objects.filter(run=run, status=KnobChange.PENDING).update(
                    status=KnobChange.REJECTED, message="the run ended before this change was applied")
                set_status(run, Status.QUEUED, desired=Desired.RUN, error="", finished_at=None,
                           heartbeat_at=None)
                _clear_alert(run, "heartbeat")
                _enqueue(run, resume=True, resume_step=resume_step)
            else:
                raise Conflict(f"cannot resume a run that is {st}")
        elif action == "kill":
            if st not in ACTIVE:
                raise Conflict(f"cannot kill a run that is {st}")
            _revoke(run, terminate=st != Status.QUEUED)
            set_status(run, Status.STOPPED, desired=Desired.STOP)
            event(run.pk, run.step, "killed", {"requested_by": who})
        else:
            raise Invalid(f"unknown action {action!r}", {"action": "one of stop, pause, resume, kill"})
    run.refresh_from_db()
    return run


def _revoke(run: Run, terminate: bool) -> None:
    if not run.celery_task_id:
        return
    from webapp.celery import app

    task_id = run.celery_task_id

    def send():
        try:
            if terminate:
                app.control.revoke(task_id, terminate=True, signal="SIGKILL")
            else:
                app.control.revoke(task_id)
        except Exception:
            log.exception("revoke %s failed", task_id)

    transaction.on_commit(send)


def annotate_run(run: Run, user, note: Any = None, tags: Any = None, archived: Any = None) -> Run:
    """Set a run's note, tags and archived flag (owner or staff)."""
    if not run.can_control(user):
        raise Forbidden("only the run's owner or staff can change its note, tags or archive state")
    errors, fields = {}, {}
    if note is not None:
        if not isinstance(note, str) or len(note) > 20_000 or "\x00" in note:
            errors["note"] = "expected text (at most 20000 characters)"
        else:
            fields["note"] = note
    if tags is not None:
        if isinstance(tags, str):
            tags = tags.split(",")
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            errors["tags"] = 'expected a list of short strings, or "a, b"'
        else:
            clean = []
            for t in (t.strip() for t in tags):
                if t and t not in clean:
                    clean.append(t)
            if len(clean) > 20 or any(len(t) > 40 or "\x00" in t for t in clean):
                errors["tags"] = "at most 20 tags of at most 40 characters"
            else:
                fields["tags"] = clean
    if archived is not None:
        if not isinstance(archived, bool):
            errors["archived"] = "expected true or false"
        elif archived and run.status in ACTIVE:
            errors["archived"] = f"the run is {run.status}: stop it before archiving"
        else:
            fields["archived"] = archived
    if errors:
        raise Invalid("not saved", errors)
    if fields:
        Run.objects.filter(pk=run.pk).update(**fields)
        event(run.pk, run.step, "annotated", {"by": user.get_username(), "fields": sorted(fields)})
        run.refresh_from_db()
    return run


def delete_run(run: Run, user) -> None:
    if not run.can_control(user):
        raise Forbidden("only the run's owner or staff can delete it")
    if run.status in ACTIVE:
        raise Conflict(f"the run is {run.status}: stop or kill it first")
    import shutil

    directory = run_dir(run.pk)
    run.delete()
    shutil.rmtree(directory, ignore_errors=True)   # checkpoints and the trainer's files


# --- lost workers ---------------------------------------------------------------------------------------

_last_check = 0.0


def mark_stale_runs(force: bool = False) -> int:
    """Runs whose worker stopped heartbeating become `interrupted` (lazy: called by views and
    consumers at most every few seconds)."""
    global _last_check
    now = time.monotonic()
    if not force and now - _last_check < 3.0:
        return 0
    _last_check = now
    cutoff = timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT_S)
    n = 0
    from webapp.dashboard import alerts

    for run in Run.objects.filter(status__in=LIVE, heartbeat_at__lt=cutoff).only("id", "status", "step",
                                                                                 "alerts"):
        with transaction.atomic():
            if set_status(run.pk, Status.INTERRUPTED, only_from=LIVE,
                          error="heartbeat lost: the worker running this run disappeared"):
                rec, state = alerts.heartbeat_alert(run, run.step)
                append(run.pk, [rec], {"alerts": state})
                n += 1
    return n
