"""Asking what a run will take before it is launched: the config validated as a launch would
be, then an Estimate row, done at once from past runs of the same shape (the caller reads
them: reports/estimate.py), else pending a calibration that a worker on the run's queue runs
(ESTIMATE_TASK, registered by worker/tasks.py)."""
from __future__ import annotations

from typing import Any

from django.db import transaction

from webapp.celery import app as celery_app
from webapp.dashboard.access import validation
from webapp.dashboard.actions.launch import build_config, config_problems, validate_queue
from webapp.dashboard.errors import Invalid
from webapp.dashboard.models import Estimate

ESTIMATE_TASK = "webapp.dashboard.tasks.estimate"


def estimate_config(user, preset: Any = None, overrides: Any = None, toml: Any = None, queue: Any = None):
    """(config, queue) of the run to estimate, checked as launch_run checks a launch (Invalid
    with the errors by field otherwise): an estimate is only given for a run that could start."""
    errors: dict[str, str] = {}
    try:
        queue = validate_queue(queue)
    except Invalid as e:
        errors.update(e.errors)
    if preset is not None and not isinstance(preset, str):
        errors["preset"] = "expected a preset name"
        preset = None
    if toml is not None and not isinstance(toml, str):
        errors["toml"] = "expected TOML text"
        toml = None
    elif toml is not None and validation.text_error(toml, validation.MAX_TOML_LEN):
        errors["toml"] = validation.text_error(toml, validation.MAX_TOML_LEN)
        toml = None
    cfg = None
    try:
        cfg = build_config(preset or None, overrides, toml if toml and toml.strip() else None)
    except Invalid as e:
        errors.update(e.errors)
    else:
        errors.update(config_problems(user, cfg))
    if errors:
        raise Invalid("no estimate: the run could not be launched", validation.clip_errors(errors))
    return cfg, queue


def record_estimate(user, cfg, queue: str, result: dict | None) -> Estimate:
    """The estimate's row: done with `result` (from history), else pending, its calibration
    sent to `queue` once the row is committed."""
    with transaction.atomic():
        row = Estimate.objects.create(owner=user, config=cfg.to_dict(), queue=queue,
                                      status=Estimate.DONE if result is not None else Estimate.PENDING,
                                      result=result)
        if result is None:
            transaction.on_commit(lambda: celery_app.send_task(ESTIMATE_TASK, args=[row.pk], queue=queue))
    return row


def finish_estimate(estimate_id: int, result: dict | None = None, error: str = "") -> None:
    """The worker's side: the calibration's result, or why there is none."""
    Estimate.objects.filter(pk=estimate_id).update(
        status=Estimate.FAILED if error else Estimate.DONE, result=result, error=error)
