"""The Celery task that trains one run (queue `training`, one run per worker process)."""
from __future__ import annotations

import logging
import os
import re
import socket

from celery import shared_task
from django.db import close_old_connections
from django.utils import timezone

from trainer import checkpoint
from trainer import config as config_mod
from trainer.runner import Runner  # imported in the worker's parent: forked children start fast
from webapp.dashboard import actions
from webapp.dashboard.actions import run_dir
from webapp.dashboard.models import LIVE, Desired, HistogramSnapshot, MetricPoint, Run, Status
from webapp.dashboard.telemetry import DbControlSource, DbSink, Heartbeat

log = logging.getLogger(__name__)


def latest_checkpoint_step(path) -> int | None:
    try:
        ck = checkpoint.latest(path)
    except FileNotFoundError:
        return None
    m = re.search(r"(\d+)$", ck.name)
    return int(m.group(1)) if m else None


@shared_task(name="webapp.dashboard.tasks.train", bind=True, acks_late=False, ignore_result=True)
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
    import shutil

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
    directory = run_dir(rid)
    directory.mkdir(parents=True, exist_ok=True)
    if resume and resume_step is not None:
        drop_checkpoints_after(directory, resume_step)
    ck_step = latest_checkpoint_step(directory) if resume else None
    resume_from_ckpt = ck_step is not None
    attempt = run.attempts + 1
    if resume:
        # rows past the checkpoint belong to steps that will be trained again
        MetricPoint.objects.filter(run_id=rid, step__gt=ck_step or 0).delete()
        HistogramSnapshot.objects.filter(run_id=rid, step__gt=ck_step or 0).delete()
        actions.event(rid, ck_step or 0, "rewound", {"step": ck_step or 0,
                                                     "from_checkpoint": resume_from_ckpt})
        Run.objects.filter(pk=rid).update(step=ck_step or 0)
    now = timezone.now()
    if not actions.set_status(rid, Status.RUNNING, only_from=[Status.QUEUED],
                              worker_host=f"{worker or socket.gethostname()}:{os.getpid()}"[:200], heartbeat_at=now,
                              started_at=run.started_at or now, attempts=attempt,
                              step=ck_step or 0, desired=Desired.RUN):
        return "skipped"
    cfg = config_mod.from_dict(run.config)
    sink = DbSink(rid)
    controls = DbControlSource(rid, sink)
    heartbeat = Heartbeat(rid).start()
    final, fields = Status.FAILED, {}
    try:
        with Runner(cfg, directory, sink=sink, controls=controls, resume=resume_from_ckpt,
                    log=log.info) as runner:
            status = runner.run()
            summary = runner.summary()
        final = Status.FINISHED if status == "finished" else Status.STOPPED
        cur = Run.objects.filter(pk=rid).values_list("summary", flat=True).first() or {}
        fields = {"summary": {**cur, "final": actions.clean_json(summary)}}
    except BaseException as e:  # the runner has already recorded an `error` event
        log.exception("run %s failed", rid)
        fields = {"error": f"{type(e).__name__}: {e}"[:2000]}
        if not isinstance(e, Exception):
            raise
    finally:
        heartbeat.stop()
        controls.close()
        try:
            sink.close()
        finally:
            actions.set_status(rid, final, only_from=LIVE, **fields)
            close_old_connections()
    return final
