"""Asking what a run will take before it is launched: the config validated as a launch would
be, then an Estimate row, done at once from past runs of the same shape (the caller reads
them: reports/estimate.py), else pending a calibration that a worker on the run's queue runs
(ESTIMATE_TASK, registered by worker/tasks.py)."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from webapp.celery import app as celery_app
from webapp.dashboard.access import validation
from webapp.dashboard.actions.launch import checked_config
from webapp.dashboard.errors import Invalid, TooManyRuns
from webapp.dashboard.models import Estimate

ESTIMATE_TASK = "webapp.dashboard.tasks.estimate"


def estimate_config(user, preset: Any = None, overrides: Any = None, toml: Any = None, queue: Any = None):
    """(config, queue) of the run to estimate, checked as launch_run checks a launch (Invalid
    with the errors by field otherwise): an estimate is only given for a run that could start."""
    cfg, queue, errors = checked_config(user, preset, overrides, toml, queue)
    if errors:
        raise Invalid("no estimate: the run could not be launched", validation.clip_errors(errors))
    return cfg, queue


# a calibration still pending or running after this long (past its time and the run's own grace)
# was lost with its worker, or no worker takes its queue: it is failed, and says so
STALE_AFTER_S = 15 * 60


def record_estimate(user, cfg, queue: str, result: dict | None) -> Estimate:
    """The estimate's row: done with `result` (from history), else pending, its calibration
    sent to `queue` once the row is committed. One calibration per user at a time (each holds a
    training worker): TooManyRuns (429) while another of theirs is pending or running."""
    with transaction.atomic():
        fail_stale_estimates()
        if result is None:
            get_user_model().objects.select_for_update().filter(pk=user.pk).first()   # two at once: one passes
            busy = Estimate.objects.filter(owner=user, status__in=(Estimate.PENDING, Estimate.RUNNING)).first()
            if busy is not None:
                raise TooManyRuns("an estimate is still calibrating", {"estimate": (
                    f"your estimate #{busy.pk} is still {busy.status} on {busy.queue}: wait for it "
                    f"(GET /api/estimates/{busy.pk}); one calibration at a time")})
        row = Estimate.objects.create(owner=user, config=cfg.to_dict(), queue=queue,
                                      status=Estimate.DONE if result is not None else Estimate.PENDING,
                                      result=result)
        if result is None:
            transaction.on_commit(lambda: celery_app.send_task(ESTIMATE_TASK, args=[row.pk], queue=queue))
    return row


def fail_stale_estimates() -> int:
    """Fail the calibrations pending or running for longer than STALE_AFTER_S, naming why."""
    return Estimate.objects.filter(status__in=(Estimate.PENDING, Estimate.RUNNING),
                                   created_at__lt=timezone.now() - timedelta(seconds=STALE_AFTER_S)).update(
        status=Estimate.FAILED, error=f"no result after {STALE_AFTER_S // 60} minutes: no worker took its queue, "
                                      "or the worker was lost while calibrating; ask again")


def claim_estimate(estimate_id: int) -> bool:
    """The worker's side: pending -> running, once (a task delivered twice calibrates once)."""
    return Estimate.objects.filter(pk=estimate_id, status=Estimate.PENDING).update(status=Estimate.RUNNING) == 1


def finish_estimate(estimate_id: int, result: dict | None = None, error: str = "") -> None:
    """The worker's side: the calibration's result, or why there is none."""
    Estimate.objects.filter(pk=estimate_id).update(
        status=Estimate.FAILED if error else Estimate.DONE, result=result, error=error)
