"""The Celery tasks: `train` trains one run (its run's queue, e.g. `training`; one run per worker
process: in that process, or under torchrun when the run asks for several training processes),
`estimate` calibrates a run not yet launched on the worker that would train it (a bounded
`python -m trainer run` of its config, trainer/accounting/estimate.py) and `sweep_stale_runs` is Celery
beat's periodic stale-run sweep (RLPILOT_SWEEP_QUEUE, consumed by a small worker on the web
machine, never by a training worker).

Every write goes through the actions layer, which sends `train` by name (TRAIN_TASK) and never
imports this module. The task names are stable (a queued task carries its name): they keep the
form `webapp.dashboard.tasks.<task>` from before this module moved into worker/.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from celery import shared_task
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from trainer import config as config_mod
from trainer.cluster import launch
from trainer.run import checkpoint
from trainer.run.runner import RunFailed, Runner  # imported in the worker's parent: forked children start fast
from webapp.dashboard import actions, lifecycle
from webapp.dashboard.access import validation
from webapp.dashboard.actions import run_dir
from webapp.dashboard.models import ApiToken, Desired, Run, Status
from webapp.dashboard.worker import sweep
from webapp.dashboard.worker.telemetry import DbControlSource, DbSink, Heartbeat

log = logging.getLogger(__name__)


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
        if (checkpoint.step_of(ck) or 0) > step:
            shutil.rmtree(ck, ignore_errors=True)
            dropped.append(ck.name)
    return dropped


def execute(run: Run, resume: bool = False, resume_step: int | None = None,
            worker: str | None = None) -> str:
    """Train `run` (the Celery task's body; tests and benchmarks call it too): in this process,
    or, with cluster.train_procs > 1, in that many torchrun processes started from here
    (train_under_torchrun). Returns the run's status at the end."""
    rid = run.pk
    cfg = config_mod.from_dict(run.config)
    refused = validation.config_problems(cfg, on_worker=True)   # this worker's settings
    if refused:
        actions.set_status(rid, Status.FAILED, only_from=lifecycle.START_FROM,
                           error=validation.clip("refused by this worker's settings: " + "; ".join(
                               f"{k}: {v}" for k, v in refused.items()), 2000))
        return Status.FAILED
    directory = run_dir(rid)
    directory.mkdir(parents=True, exist_ok=True)
    if resume and resume_step is not None:
        drop_checkpoints_after(directory, resume_step)
    ck_step = checkpoint.latest_step(directory) if resume else None
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
    if cfg.cluster.train_procs > 1:
        return train_under_torchrun(rid, cfg.cluster.train_procs, resume_from_ckpt)
    return train_here(rid, cfg, directory, resume_from_ckpt)


def train_here(rid: int, cfg: config_mod.Config, directory, resume_from_ckpt: bool) -> str:
    """Run the trainer in this process for the live run `rid`, reporting to the database, and
    end the run with its summary or its error. A one-process run does this in the Celery
    worker; a multi-process run does it on rank 0 (`manage.py train_rank`), the controller: it
    alone reads the controls, and each step's config reaches the other ranks with their share."""
    sink = DbSink(rid)
    controls = DbControlSource(rid, sink)
    heartbeat = Heartbeat(rid).start()
    final, summary, error = Status.FAILED, None, None
    try:
        with Runner(cfg, directory, sink=sink, controls=controls, resume=resume_from_ckpt,
                    log=log.info, agent_token=agent_token(rid, cfg)) as runner:
            heartbeat.phase = lambda: runner.phase
            status = runner.run()
            summary = runner.summary()
        final = Status.FINISHED if status == "finished" else Status.STOPPED
    except BaseException as e:  # the runner has already recorded an `error` event
        log.exception("run %s failed", rid)
        # a RunFailed says its cause whole, as the CLI prints it (e.g. generation given up)
        summary, error = None, (str(e) if isinstance(e, RunFailed) else f"{type(e).__name__}: {e}")[:2000]
        if not isinstance(e, Exception):   # the worker is shutting down (SystemExit, Ctrl-C)
            final = Status.INTERRUPTED
            error = f"the worker was shut down mid-run ({error}); resume continues from the last checkpoint"
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


def agent_token(rid: int, cfg: config_mod.Config) -> str | None:
    """An agents run's endpoint token (`episode.agents`, docs/agents.md): its owner's API token,
    one made for them when they have none, so that their agents, and no one else's, call it."""
    if not cfg.episode.agents:
        return None
    owner = Run.objects.get(pk=rid).owner
    token = ApiToken.objects.filter(user=owner).order_by("id").first()
    return (token or ApiToken.objects.create(user=owner)).key


def train_rank_argv(rid: int, resume_from_ckpt: bool) -> list[str]:
    """What torchrun runs on every rank (webapp/dashboard/management/commands/train_rank.py)."""
    return [str(settings.BASE_DIR / "manage.py"), "train_rank", str(rid)] + (
        ["--resume"] if resume_from_ckpt else [])


def train_under_torchrun(rid: int, procs: int, resume_from_ckpt: bool) -> str:
    """Train the live run `rid` in `procs` torchrun processes on this machine and wait for them.

    Rank 0 reports and ends the run (train_here); this process beats the run's heartbeat while
    torchrun lives and ends the run `failed` with torchrun's last stderr lines when it exits
    non-zero before the run ended. A kill (SIGKILL of this worker child) reaches torchrun as
    SIGTERM (trainer/cluster/launch.py), which ends the ranks."""
    proc = launch.TorchrunProcess(launch.torchrun_argv(train_rank_argv(rid, resume_from_ckpt), procs),
                                  cwd=str(settings.BASE_DIR)).start()
    log.info("run %s: torchrun (pid %s) started %d training processes", rid, proc.pid, procs)
    try:
        while True:
            try:
                rc = proc.wait(settings.HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                actions.heartbeat(rid)   # this worker and its torchrun are alive
    finally:
        proc.stop()   # nothing left behind if this process is interrupted
    if rc != 0:   # which rank, how, in which step, and where a resume continues
        last_step = Run.objects.filter(pk=rid).values_list("step", flat=True).first()
        actions.end_run(rid, Status.FAILED, error=validation.clip(proc.failure(
            last_step=last_step, checkpoint_step=checkpoint.latest_step(run_dir(rid))), 2000))
    return Run.objects.filter(pk=rid).values_list("status", flat=True).first() or "missing"


@shared_task(name=settings.SWEEP_TASK, ignore_result=True)
def sweep_stale_runs() -> int:
    """Celery beat's stale-run sweep (settings.CELERY_BEAT_SCHEDULE, every RLPILOT_SWEEP_S): runs
    whose worker stopped heartbeating become `interrupted`, with nobody watching. Returns how
    many."""
    return sweep.mark_stale_runs(force=True)


@shared_task(name=actions.ESTIMATE_TASK, ignore_result=True)
def estimate(estimate_id: int) -> str:
    close_old_connections()
    return calibrate_estimate(estimate_id)


def calibrate_estimate(estimate_id: int) -> str:
    """Calibrate the estimate's run on this worker for at most RLPILOT_ESTIMATE_SECONDS (its
    process group killed past that and a grace, its directory removed) and record the estimate,
    or why there is none (the `estimate` task's body; tests call it). Returns its status."""
    from trainer.accounting import estimate as estimate_rule
    from trainer.accounting.run_files import CostError
    from webapp.dashboard.models import Estimate
    from webapp.dashboard.reports.cost import rates_of

    if not actions.claim_estimate(estimate_id):
        return "skipped"
    row = Estimate.objects.get(pk=estimate_id)
    seconds = settings.RLPILOT_ESTIMATE_SECONDS
    try:
        cfg = config_mod.from_dict(row.config)
        refused = validation.config_problems(cfg, on_worker=True)   # this worker's settings, as a run's
        if refused:
            actions.finish_estimate(row.pk, error=validation.clip("refused by this worker's settings: " + "; ".join(
                f"{k}: {v}" for k, v in refused.items()), 2000))
            return Estimate.FAILED
        with tempfile.TemporaryDirectory(prefix="rlpilot-estimate-config-") as tmp:
            toml = Path(tmp) / "config.toml"
            toml.write_text(config_mod.to_toml(cfg))
            walls, held = estimate_rule.calibrate(str(toml), [], seconds)
        result = estimate_rule.from_steps(walls, held, cfg.run.max_steps, rates_of(row.config), {
            "source": "calibration", "steps_measured": len(walls), "calibration_s": seconds})
    except (CostError, config_mod.ConfigError) as e:
        actions.finish_estimate(row.pk, error=validation.clip(str(e), 2000))
        return Estimate.FAILED
    except Exception as e:   # the worker goes on; the person reads why
        log.exception("estimate %s failed", row.pk)
        actions.finish_estimate(row.pk, error=validation.clip(f"the calibration failed: {e!r}", 2000))
        return Estimate.FAILED
    actions.finish_estimate(row.pk, result=result)
    return Estimate.DONE
