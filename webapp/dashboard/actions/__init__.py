"""Every write that clients must hear about lives here (zulip-style "actions").

A write appends sequence-numbered rows for the run in one transaction that holds the run's row
lock, then rings the run's doorbell on the channel layer (rows.py). Views, the API, the WebSocket
consumer, the Celery tasks, the trainer's database sink and heartbeat, the alert rules, the
stale-run sweep and the management commands all go through these functions, by noun:

  rows.py         append (one handler per record kind), ring, event, set_status
  launch.py       a run's configuration, its row and its training task
  runs.py         stop / pause / resume / kill (lifecycle.py's table), notes, delete, and the
                  worker's side: rewind, heartbeat, end
  fork.py         a new run from another run's checkpoint, with other settings
  knobs.py        validating and queueing a person's knob change
  pilot.py        the marker of a change made from the pilot's advice; dismissing advice
  alert_state.py  a run's active alerts; a run whose worker was lost
  imports.py      a run directory the CLI wrote, imported as a run (read by files/run_files.py)
  estimate.py     a run's time and price asked for before its launch, and its calibration

The package sits low in the import graph: it imports the models, lifecycle.py, errors.py,
access/validation.py and access/policy.py (which never import it), rows/samples.py,
rows/timeline.py, doorbell.py, files/ and the Celery app, and none of the modules that call
it; worker/alerts.py and worker/sweep.py hand it what it needs as arguments.
Callers use `from webapp.dashboard import actions; actions.launch_run(...)`.
"""
from webapp.dashboard.actions.alert_state import change_alerts, clear_alert, interrupt_lost_run
from webapp.dashboard.actions.estimate import (
    ESTIMATE_TASK,
    claim_estimate,
    estimate_config,
    fail_stale_estimates,
    finish_estimate,
    record_estimate,
)
from webapp.dashboard.actions.fork import checkpoint_steps, fork_run
from webapp.dashboard.actions.imports import Imported, import_archive, import_run_dir
from webapp.dashboard.actions.knobs import request_knobs, validate_knobs
from webapp.dashboard.actions.launch import (
    TRAIN_TASK,
    build_config,
    launch_run,
    run_dir,
    shipped_preset,
    validate_queue,
)
from webapp.dashboard.actions.pilot import advice_marker, dismiss_advice, dismissed_keys
from webapp.dashboard.actions.rows import (
    KEY_FIGURES,
    Record,
    append,
    clean_json,
    event,
    ring,
    set_status,
    status_record,
)
from webapp.dashboard.actions.runs import annotate_run, control, delete_run, end_run, heartbeat, rewind
from webapp.dashboard.doorbell import group_name
from webapp.dashboard.errors import ActionError, Conflict, Forbidden, Invalid

__all__ = [
    "ActionError", "Conflict", "ESTIMATE_TASK", "Forbidden", "Imported", "Invalid", "KEY_FIGURES", "Record",
    "TRAIN_TASK", "claim_estimate", "estimate_config", "fail_stale_estimates", "finish_estimate",
    "record_estimate",
    "advice_marker", "annotate_run", "append", "build_config", "change_alerts",
    "checkpoint_steps", "clean_json", "clear_alert", "control", "delete_run", "dismiss_advice",
    "dismissed_keys", "end_run", "event", "fork_run", "group_name", "heartbeat", "import_archive",
    "import_run_dir", "interrupt_lost_run", "launch_run", "request_knobs", "rewind", "ring",
    "run_dir", "set_status", "shipped_preset", "status_record", "validate_knobs", "validate_queue",
]
