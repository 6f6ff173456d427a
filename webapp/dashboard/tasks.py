"""The Celery tasks: `train` trains one run (its run's queue, e.g. `training`; one run per worker
process) and `sweep_stale_runs` is Celery beat's periodic stale-run sweep (RLPILOT_SWEEP_QUEUE,
consumed by a small worker on the web machine, never by a training worker).

Every write goes through the actions layer, which sends `train` by name (TRAIN_TASK) and never
imports this module.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import socket

from celery import shared_task
from django.db import close_old_connections
from django.utils import timezone

from trainer import checkpoint
from trainer import config as config_mod
from trainer.runner import Runner  # imported in the worker's parent: forked children start fast
from webapp.dashboard import actions, lifecycle, sweep, validation
from webapp.dashboard.actions import run_dir
from webapp.dashboard.models import Desired, Run, Status
from webapp.dashboard.telemetry import DbControlSource, DbSink, Heartbeat

log = logging.getLogger(__name__)


def latest_checkpoint_step(path) -> int | None:
    try:
        ck = checkpoint.latest(path)
    except FileNotFoundError:
        return None
    m = re.search(r"(\d+)$", ck.name)
    return int(m.group(1)) if m else None


@shared_task(name=actions.TRAIN_TASK, bind=True, acks_late=False, ignore_result=True)
def train(self, run_id: int, resume: bool = False, resume_step: int | None = None) -> str:
    close_old_connections()
    try:
        run = Run.objects.get(pk=run_id)
    except Run.DoesNotExist:
        log.warning("run %s does not exist (deleted?)", run_id)
        return "missing"
    task_id = getattr(self.request, "id", None)
    if run.status != Status.QUEUED or (task_id and run.celery_task_id and task_id != run.celery_task_id):
        log.info("run %s is %s; task %s has nothing to do", run_id, run.status, task_id)
        return "skipped"
    # the Celery node name (e.g. "gpu-h200@host7"): which worker, on which machine, ran it
    node = getattr(self.request, "hostname", None) or None
    return execute(run, resume=resume, resume_step=resume_step, worker=node)


def drop_checkpoints_after(path, step: int) -> list[str]:
    """Resuming from an older checkpoint: the newer ones belong to steps that will be trained
    again (the run is rewound to `step`), so they go."""
    dropped = []
    for ck in checkpoint.list_checkpoints(path):
        m = re.search(r"(\d+)$", ck.name)
        if m and int(m.group(1)) > step:
            shutil.rmtree(ck, ignore_errors=True)
            dropped.append(ck.name)
    return dropped


def execute(run: Run, resume: bool = False, resume_step: int | None = None,
            worker: str | None = None) -> str:
    """Train `run` in this process (the Celery task's body; tests and benchmarks call it too)."""
    rid = run.pk
    refused = validation.config_problems(config_mod.from_dict(run.config))  # this worker's settings
    if refused:
        actions.set_status(rid, Status.FAILED, only_from=lifecycle.START_FROM,
                           error=validation.clip("refused by this worker's settings: " + "; ".join(
                               f"{k}: {v}" for k, v in refused.items()), 2000))
        return Status.FAILED
    directory = run_dir(rid)
    directory.mkdir(parents=True, exist_ok=True)
    if resume and resume_step is not None:
        drop_checkpoints_after(directory, resume_step)
    ck_step = latest_checkpoint_step(directory) if resume else None
    resume_from_ckpt = ck_step is not None
    attempt = run.attempts + 1
    if resume:
        # rows past the checkpoint belong to steps that will be trained again
        actions.rewind(rid, ck_step or 0, from_checkpoint=resume_from_ckpt)
    now = timezone.now()
    if not actions.set_status(rid, Status.RUNNING, only_from=lifecycle.START_FROM,
                              worker_host=f"{worker or socket.gethostname()}:{os.getpid()}"[:200], heartbeat_at=now,
                              started_at=run.started_at or now, attempts=attempt,
                              step=ck_step or 0, desired=Desired.RUN):
        return "skipped"
    cfg = config_mod.from_dict(run.config)
    sink = DbSink(rid)
    controls = DbControlSource(rid, sink)
    heartbeat = Heartbeat(rid).start()
    final, summary, error = Status.FAILED, None, None
    try:
        with Runner(cfg, directory, sink=sink, controls=controls, resume=resume_from_ckpt,
                    log=log.info) as runner:
            heartbeat.phase = lambda: runner.phase
            status = runner.run()
            summary = runner.summary()
        final = Status.FINISHED if status == "finished" else Status.STOPPED
    except BaseException as e:  # the runner has already recorded an `error` event
        log.exception("run %s failed", rid)
        summary, error = None, f"{type(e).__name__}: {e}"[:2000]
        if not isinstance(e, Exception):
            raise
    finally:
        heartbeat.stop()
        controls.close()
        try:
            sink.close()
        finally:   # after the sink's last write, so the final summary keeps its latest figures
            actions.end_run(rid, final, final_summary=summary, error=error)
            close_old_connections()
    return final


@shared_task(name="webapp.dashboard.tasks.sweep_stale_runs", ignore_result=True)
def sweep_stale_runs() -> int:
    """Celery beat's stale-run sweep (settings.CELERY_BEAT_SCHEDULE, every RLPILOT_SWEEP_S): runs
    whose worker stopped heartbeating become `interrupted`, with nobody watching. Returns how
    many."""
    return sweep.mark_stale_runs(force=True)
