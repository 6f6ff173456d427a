"""Forking a run: a new run, owned by the person forking, that starts from the parent's
checkpoint at a chosen step with the parent's config plus overrides (any parameter), linked to
its parent (Run.parent, Run.fork_step) and queued through the normal launch path.

The child's run folder is made here, before the task is queued (trainer/run/fork.py: the checkpoint
hard-linked or copied, state.json rewritten with the overrides, fork.json): a live parent keeps
only its newest run.keep_checkpoints, so waiting for a worker could lose the checkpoint. The
worker then resumes the child like any run. The parent's row and folder are only read.
"""
from __future__ import annotations

import json
import shutil
from typing import Any

from django.db import transaction

from trainer import config as config_mod
from trainer.run import fork as fork_mod
from webapp.dashboard import lifecycle
from webapp.dashboard.access import policy, validation
from webapp.dashboard.actions.launch import config_problems, enqueue, run_dir
from webapp.dashboard.actions.rows import Record, append
from webapp.dashboard.errors import Forbidden, Invalid
from webapp.dashboard.models import Run


def checkpoint_steps(run: Run) -> list[int]:
    """The steps a run can be forked from: its complete checkpoints on disk."""
    return fork_mod.checkpoint_steps(run_dir(run.pk))


def fork_run(parent: Run, user, step: Any, overrides: Any = None, name: Any = None) -> Run:
    """Validate and queue a fork of `parent` from its checkpoint at `step`. Raises Forbidden
    (only someone who may control the parent may take its checkpoints, as for "new run from
    here"), Invalid (400: per-field errors: the step, each override, what the checkpoint cannot
    carry) or TooManyRuns (429)."""
    if not parent.can_control(user):
        raise Forbidden("only the run's owner or staff can fork it (its checkpoints are theirs)")
    errors: dict[str, str] = {}
    if name in (None, "") and isinstance(step, int):
        name = f"{parent.name} fork@{step}"[:validation.MAX_NAME_LEN]
    problem = validation.check_name(name)
    if problem:
        errors["name"] = problem
    if overrides in (None, ""):
        overrides = {}
    if not isinstance(overrides, dict):
        errors["overrides"] = 'expected an object of dotted keys to values, e.g. {"optim.lr": 3e-5}'
        overrides = {}
    base = config_mod.from_dict(parent.config)
    source = None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        errors["step"] = "expected a checkpoint step (a non-negative integer)"
    else:
        try:
            source = fork_mod.find_checkpoint(run_dir(parent.pk), step)
        except config_mod.ConfigError:
            steps = checkpoint_steps(parent)
            errors["step"] = f"run {parent.pk} has no checkpoint at step {step}; " + (
                "its checkpoints are at steps " + ", ".join(map(str, steps)) if steps
                else "it has no checkpoint on disk")
    cfg = None
    try:
        if source is not None:
            cfg, _ = fork_mod.child_config(base, overrides, source, step)
        else:   # still say what is wrong with the overrides
            cfg = config_mod.apply_overrides(base, overrides)
    except config_mod.ConfigError as e:
        errors.update(e.errors)
        cfg = None
    if cfg is not None:
        errors.update(config_problems(user, cfg))
    if errors:
        raise Invalid("the run was not forked", validation.clip_errors(errors))
    with transaction.atomic():
        policy.check_active_runs(user)
        run = Run.objects.create(owner=user, name=name.strip(), preset=parent.preset,
                                 config=cfg.to_dict(), knobs=cfg.knob_values(),
                                 max_steps=cfg.run.max_steps, status=lifecycle.QUEUED,
                                 desired=lifecycle.RUN, queue=parent.queue, parent=parent,
                                 fork_step=step, step=step)
        directory = run_dir(run.pk)
        try:
            fork_mod.fork_run_dir(run_dir(parent.pk), step, directory, overrides, base=base,
                                  overwrite=True, extra={"parent_run": parent.pk, "run": run.pk})
            applied = fork_mod.read_fork(directory)["overrides"]
            append(run.pk, [
                Record("event", step, "status", {"status": lifecycle.QUEUED, "previous": None,
                                                 "desired": lifecycle.RUN}),
                Record("event", step, "forked", {"parent": parent.pk, "step": step,
                                                 "requested_by": user.get_username(),
                                                 "overrides": applied}),
            ], {"knobs": _saved_knobs(directory, step)}, ring_bell=False)
        except BaseException as e:   # the row goes with the transaction: its folder goes too
            shutil.rmtree(directory, ignore_errors=True)
            if isinstance(e, (config_mod.ConfigError, OSError)):   # e.g. the live parent rotated it
                errors = ({("step" if k == "--from-step" else k): v for k, v in e.errors.items()}
                          if isinstance(e, config_mod.ConfigError) else {"step": str(e)})
                raise Invalid("the run was not forked", validation.clip_errors(errors)) from None
            raise
        enqueue(run, resume=True)
    run.refresh_from_db()
    return run


def _saved_knobs(directory, step: int) -> dict:
    """The child's knob values at the fork: the parent's at that step, with the overrides."""
    state = fork_mod.find_checkpoint(directory, step) / "state.json"
    return json.loads(state.read_text()).get("knobs") or {}
