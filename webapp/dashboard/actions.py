"""Every write that clients must hear about lives here (zulip-style "actions").

A write appends sequence-numbered rows for the run in one transaction that holds the run's row
lock, then rings the run's doorbell on the channel layer. Views, the API, the WebSocket consumer,
the Celery tasks, the trainer's database sink and heartbeat, the alert rules, the stale-run sweep
and the management commands all go through these functions.

This module sits low in the import graph: it imports the models, errors.py, limits.py (the
validation, which never imports this module), doorbell.py (the channel-layer ring) and the Celery
app, and none of the modules that call it. A run's training task is sent by name through the
Celery app (TRAIN_TASK), so this module does not import tasks.py; alert rules (alerts.py) and the
sweep (sweep.py) import this module, and hand it what it needs (e.g. the heartbeat alert) as
arguments.
"""
from __future__ import annotations

import logging
import math
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Iterable

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from trainer import config as config_mod
from webapp.celery import app as celery_app
from webapp.dashboard import doorbell, limits
from webapp.dashboard import inspector as samples  # the rollout inspector's rows
from webapp.dashboard.doorbell import group_name  # noqa: F401 (re-exported)
from webapp.dashboard.errors import ActionError, Conflict, Forbidden, Invalid  # noqa: F401 (re-exported)
from webapp.dashboard.models import (
    ACTIVE,
    LIVE,
    RESUMABLE,
    Desired,
    HistogramSnapshot,
    KnobChange,
    MetricPoint,
    RolloutSample,
    Run,
    RunEvent,
    Status,
)

log = logging.getLogger(__name__)

# The Celery task that trains a run (webapp/dashboard/tasks.py registers it under this name; it is
# sent by name, so this module never imports the task module).
TRAIN_TASK = "webapp.dashboard.tasks.train"

# Latest values kept on the run row for the runs list ("key figures").
KEY_FIGURES = ("reward/accuracy", "reward/mean", "rollout/response_len/mean", "actor/kl",
               "perf/gen_tokens_per_s", "timing/step_s", "eval/accuracy")


def run_dir(run_id: int):
    """Where the trainer keeps a run's files (config.toml, checkpoints/)."""
    return settings.RUNS_DIR / f"run-{run_id:06d}"


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
    kind: str                  # "points" | "histogram" | "event" | "samples"
    step: int
    name: str = ""             # histogram name or event kind
    # points / event data / {edges, counts} / {"rows": [sample dict, ...]}
    values: dict[str, Any] = field(default_factory=dict)


def append(run_id: int, records: Iterable[Record], updates: dict[str, Any] | None = None,
           *, ring_bell: bool = True) -> int:
    """Insert `records` with consecutive sequence numbers and apply `updates` to the run row,
    atomically. Returns the run's last sequence number. A "samples" record (a step's rollout
    samples) takes one sequence number for all its rows; past the run's cap
    (RLPILOT_SAMPLES_PER_RUN) the oldest steps' samples are thinned in the same transaction."""
    records = list(records)
    with transaction.atomic():
        run = Run.objects.select_for_update().only("id", "last_seq", "summary", "knobs", "status").get(pk=run_id)
        seq = run.last_seq
        points, hists, events, rollouts, outcomes = [], [], [], [], []
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
            elif r.kind == "samples":
                rows = r.values.get("rows") or []
                rollouts.extend(x for x in (samples.row_for(run_id, seq, r.step, row)
                                            for row in (rows if isinstance(rows, list) else [])) if x)
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
                if r.name in ("knob_applied", "knob_rejected") and r.values.get("change_id"):
                    errors = r.values.get("errors") or {}
                    outcomes.append((str(r.values["change_id"]), r.name == "knob_applied", r.step,
                                     "; ".join(map(str, errors.values())) if isinstance(errors, dict) else ""))
        if points:
            MetricPoint.objects.bulk_create(points)
        if hists:
            HistogramSnapshot.objects.bulk_create(hists)
        if events:
            RunEvent.objects.bulk_create(events)
        # the change's row turns applied/rejected with the event that says so (one transaction:
        # a page or test reading the event never finds the change still pending)
        for change_id, ok, step, message in outcomes:
            KnobChange.objects.filter(run_id=run_id, change_id=change_id).update(
                status=KnobChange.APPLIED if ok else KnobChange.REJECTED, applied_step=step,
                message=message)
        if rollouts:
            RolloutSample.objects.bulk_create(rollouts, batch_size=200)
            samples.thin(run_id)
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
    transaction.on_commit(lambda: doorbell.ring(run_id, seq))


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

def shipped_preset(name: str) -> config_mod.Config:
    """A shipped preset as this server runs it: a relative model.path (var/models/...) inside
    this server's project folder and RLPILOT_VAR_DIR (config.preset_config, as the CLI)."""
    return config_mod.preset_config(name, project_dir=settings.BASE_DIR, var_dir=settings.VAR_DIR)


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
            errors["preset"] = (f"unknown preset {config_mod.short_repr(preset)}; presets: "
                                + ", ".join(config_mod.preset_names()))
        else:
            cfg = shipped_preset(preset)
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
    """Validate and queue a run. Raises Invalid (400: per-field errors, including what the
    config may not reach on this server, see limits.config_problems) or errors.TooManyRuns (429)."""
    errors: dict[str, str] = {}
    try:
        queue = validate_queue(queue)
    except Invalid as e:
        errors.update(e.errors)
    problem = limits.check_name(name)
    if problem:
        errors["name"] = problem
    if preset is not None and not isinstance(preset, str):
        errors["preset"] = "expected a preset name"
        preset = None
    if toml is not None and not isinstance(toml, str):
        errors["toml"] = "expected TOML text"
        toml = None
    elif toml is not None and limits.text_error(toml, limits.MAX_TOML_LEN):
        errors["toml"] = limits.text_error(toml, limits.MAX_TOML_LEN)
        toml = None
    try:
        cfg = build_config(preset, overrides, toml)
    except Invalid as e:
        errors.update(e.errors)
    else:
        errors.update(limits.config_problems(cfg))
    if errors:
        raise Invalid("the run was not launched", limits.clip_errors(errors))
    with transaction.atomic():
        limits.check_active_runs(user)
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
        # the run's queue: only workers on machines with the right resources consume it
        celery_app.send_task(TRAIN_TASK, args=[run.pk], kwargs=kwargs, task_id=task_id, queue=queue)

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
        raise Invalid("knob change refused", limits.clip_errors(errors))
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
    """Clear `rule` from the run's active alerts, with an alert_cleared event, if it is on."""
    state = Run.objects.filter(pk=run.pk).values_list("alerts", flat=True).first() or {}
    if rule in (state.get("active") or {}):
        change_alerts(run.pk, lambda active: active.pop(rule, None),
                      Record("event", run.step, "alert_cleared", {"rule": rule}))


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
                if not user.is_staff:   # re-queueing counts like a launch, for the run's owner
                    limits.check_active_runs(run.owner)
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
    """Set a run's note, tags and archived flag (owner or staff)."""
    if not run.can_control(user):
        raise Forbidden("only the run's owner or staff can change its note, tags or archive state")
    errors, fields = {}, {}
    if note is not None:
        problem = limits.check_note(note)
        if problem:
            errors["note"] = problem
        else:
            fields["note"] = note
    if tags is not None:
        clean, problem = limits.clean_tags(tags)
        if problem:
            errors["tags"] = problem
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
    directory = run_dir(run.pk)
    run.delete()
    shutil.rmtree(directory, ignore_errors=True)   # checkpoints and the trainer's files


# --- the worker's side: the training task, its heartbeat, knob outcomes, alert state --------------

def rewind(run_id: int, step: int, from_checkpoint: bool) -> int:
    """Resuming from the checkpoint at `step`: the points, histograms and rollout samples of later
    steps belong to steps that will be trained again, so they go; a `rewound` event tells the
    charts and the run's step goes back, in one transaction."""
    with transaction.atomic():
        MetricPoint.objects.filter(run_id=run_id, step__gt=step).delete()
        HistogramSnapshot.objects.filter(run_id=run_id, step__gt=step).delete()
        RolloutSample.objects.filter(run_id=run_id, step__gt=step).delete()
        return append(run_id, [Record("event", step, "rewound",
                                      {"step": step, "from_checkpoint": from_checkpoint})], {"step": step})


def end_run(run_id: int, status: str, *, final_summary: dict | None = None,
            error: str | None = None) -> bool:
    """The training task's last word on a live run: finished, stopped or failed (nothing when it is
    no longer live: killed or interrupted meanwhile). The trainer's final summary is merged into
    the run's summary under the row lock, after the sink's last write."""
    fields: dict[str, Any] = {}
    with transaction.atomic():
        if final_summary is not None:
            cur = Run.objects.select_for_update().filter(pk=run_id).values_list("summary", flat=True).first()
            fields["summary"] = {**(cur or {}), "final": clean_json(final_summary)}
        if error is not None:
            fields["error"] = error
        return set_status(run_id, status, only_from=LIVE, **fields)


def heartbeat(run_id: int, at: datetime | None = None) -> bool:
    """The worker is alive (its heartbeat thread, every RLPILOT_HEARTBEAT_S). No event, no ring:
    pages show the time when they next read the run. False once the run is no longer live."""
    return bool(Run.objects.filter(pk=run_id, status__in=LIVE).update(heartbeat_at=at or timezone.now()))


def change_alerts(run_id: int, change: Callable[[dict], Any], record: Record | None = None) -> int | None:
    """Apply `change` to the run's active alerts (a dict it edits in place) and append `record`
    (an alert / alert_cleared event, or None for a silent fix of the banner state), under the row
    lock: the sink writes the same row. None when the run is gone."""
    with transaction.atomic():
        state = Run.objects.select_for_update().filter(pk=run_id).values_list("alerts", flat=True).first()
        if state is None:
            return None
        state = dict(state or {})
        active = dict(state.get("active") or {})
        change(active)
        return append(run_id, [record] if record else [], {"alerts": {**state, "active": active}})


# --- lost workers ---------------------------------------------------------------------------------------

def interrupt_lost_run(run_id: int, heartbeat_before: datetime, error: str,
                       alert: Callable[[Run], tuple[Record, dict]]) -> bool:
    """A live run whose last heartbeat is older than `heartbeat_before` (its worker disappeared)
    becomes `interrupted`, and `alert(run)` (the heartbeat rule of alerts.py: a record and the
    run's new alert state, from the row as locked here) is appended with it. False when the run is
    gone, no longer live, or beat again meanwhile. Called by the stale-run sweep (sweep.py)."""
    with transaction.atomic():
        run = (Run.objects.select_for_update().only("id", "status", "step", "alerts", "heartbeat_at")
               .filter(pk=run_id).first())
        if (run is None or run.status not in LIVE or run.heartbeat_at is None
                or run.heartbeat_at >= heartbeat_before):
            return False
        set_status(run_id, Status.INTERRUPTED, only_from=LIVE, error=error)
        rec, state = alert(run)
        append(run_id, [rec], {"alerts": state})
    return True
