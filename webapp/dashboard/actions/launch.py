"""Launching a run: its configuration from a preset or TOML, validated; its row; its task.

A run's training task is sent by name through the Celery app (TRAIN_TASK), so the actions layer
never imports worker/tasks.py.
"""
from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import transaction

from trainer import config as config_mod
from webapp.celery import app as celery_app
from webapp.dashboard import lifecycle
from webapp.dashboard.access import policy, validation
from webapp.dashboard.actions.rows import Record, append
from webapp.dashboard.errors import Invalid
from webapp.dashboard.models import Run

# The Celery task that trains a run (webapp/dashboard/worker/tasks.py registers it under this name).
TRAIN_TASK = "webapp.dashboard.tasks.train"


def run_dir(run_id: int):
    """Where the trainer keeps a run's files (config.toml, checkpoints/)."""
    return settings.RUNS_DIR / f"run-{run_id:06d}"


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


def config_problems(user, cfg) -> dict[str, str]:
    """What keeps `user` from running `cfg` here (the worker's limits, the model's source), by key."""
    errors = validation.config_problems(cfg)
    if "model.path" not in errors:
        problem = policy.model_source_problem(user, cfg.model.path)
        if problem:
            errors["model.path"] = problem
    return errors


def warm_start_problems(user, cfg, errors: dict[str, str]) -> dict[str, str]:
    """What is wrong with a new run's greso.warm_start (a run folder here, checked already by
    config_problems): another owner's run (its statistics are theirs, as its weights are), no
    checkpoint, problem ids that mean other problems (trainer/run/warm_start.py)."""
    if not cfg.greso.warm_start or "greso.warm_start" in errors:
        return {}
    problem = policy.model_source_problem(user, cfg.greso.warm_start)
    if problem:
        return {"greso.warm_start": problem}
    from trainer.run import warm_start  # (imported here: it reads checkpoints, with torch)

    try:
        warm_start.check(cfg)
    except config_mod.ConfigError as e:
        return dict(e.errors)
    return {}


def checked_config(user, preset: Any = None, overrides: Any = None, toml: Any = None,
                   queue: Any = None) -> tuple[config_mod.Config | None, str | None, dict[str, str]]:
    """(config, queue, errors by field) of a run as a person asked for it: the queue, the
    preset or TOML text, the overrides, and what the config may not reach on this server
    (validation.config_problems, greso.warm_start's source). The launch and the estimate both ask this."""
    errors: dict[str, str] = {}
    try:
        queue = validate_queue(queue)
    except Invalid as e:
        errors.update(e.errors)
        queue = None
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
        errors.update(warm_start_problems(user, cfg, errors))
    return cfg, queue, errors


def launch_run(user, name: Any, preset: Any = None, overrides: Any = None, toml: str | None = None,
               queue: Any = None) -> Run:
    """Validate and queue a run. Raises Invalid (400: per-field errors, including what the
    config may not reach on this server, see validation.config_problems) or errors.TooManyRuns (429)."""
    cfg, queue, errors = checked_config(user, preset, overrides, toml, queue)
    problem = validation.check_name(name)
    if problem:
        errors["name"] = problem
    if errors:
        raise Invalid("the run was not launched", validation.clip_errors(errors))
    with transaction.atomic():
        policy.check_active_runs(user)
        run = Run.objects.create(owner=user, name=name.strip(), preset=preset or "",
                                 config=cfg.to_dict(), knobs=cfg.knob_values(),
                                 max_steps=cfg.run.max_steps, status=lifecycle.QUEUED,
                                 desired=lifecycle.RUN, queue=queue)
        append(run.pk, [Record("event", 0, "status", {"status": lifecycle.QUEUED, "previous": None,
                                                      "desired": lifecycle.RUN})], ring_bell=False)
        enqueue(run, resume=False)
    return run


def enqueue(run: Run, resume: bool, resume_step: int | None = None) -> None:
    """Send the run's training task once the transaction commits, to the run's queue (only
    workers on machines with the right resources consume it)."""
    task_id = uuid.uuid4().hex
    Run.objects.filter(pk=run.pk).update(celery_task_id=task_id)
    run.celery_task_id = task_id
    queue = run.queue or settings.TRAINING_QUEUE
    kwargs = {"resume": resume}
    if resume_step is not None:
        kwargs["resume_step"] = resume_step

    def send():
        celery_app.send_task(TRAIN_TASK, args=[run.pk], kwargs=kwargs, task_id=task_id, queue=queue)

    transaction.on_commit(send)
