"""A run is a row; everything the browser shows about it is rows too.

MetricPoint, HistogramSnapshot, RunEvent, RolloutSample and TimelineSlice share one per-run sequence
(`Run.last_seq`): a scalar batch (one step), a histogram snapshot, an event, a step's batch of
rollout samples and a step's timeline each take one sequence number, and
a client's cursor is the last sequence number it has seen. Sequence numbers are allocated and
their rows inserted in one transaction holding the run's row lock, so they commit in order and
a reader that asks for `seq > cursor` never misses nor repeats a row.
"""
from __future__ import annotations

import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone

from trainer.cluster.launch import layout_text
from webapp.dashboard import lifecycle


class Status(models.TextChoices):
    QUEUED = lifecycle.QUEUED
    RUNNING = lifecycle.RUNNING
    PAUSED = lifecycle.PAUSED
    STOPPING = lifecycle.STOPPING
    STOPPED = lifecycle.STOPPED
    FINISHED = lifecycle.FINISHED
    FAILED = lifecycle.FAILED
    INTERRUPTED = lifecycle.INTERRUPTED


# the lifecycle's groups of statuses (webapp/dashboard/lifecycle.py), named here for the queries
ACTIVE, LIVE, RESUMABLE = lifecycle.ACTIVE, lifecycle.LIVE, lifecycle.RESUMABLE


class Desired(models.TextChoices):
    RUN = lifecycle.RUN
    PAUSE = lifecycle.PAUSE
    STOP = lifecycle.STOP


class Run(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="runs")
    name = models.CharField(max_length=200)
    preset = models.CharField(max_length=100, blank=True)
    config = models.JSONField()                       # nested {section: {key: value}}, validated
    knobs = models.JSONField(default=dict)            # current knob values (applied ones)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED,
                              db_index=True)
    desired = models.CharField(max_length=8, choices=Desired.choices, default=Desired.RUN)
    step = models.IntegerField(default=0)
    max_steps = models.IntegerField(default=0)
    last_seq = models.BigIntegerField(default=0)
    knob_version = models.IntegerField(default=0)   # bumped by every knob request (cheap polling)
    celery_task_id = models.CharField(max_length=64, blank=True)
    worker_host = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    summary = models.JSONField(default=dict, blank=True)   # latest key figures + final summary
    error = models.TextField(blank=True)
    attempts = models.IntegerField(default=0)
    queue = models.CharField(max_length=100, default="training")   # the Celery queue it runs on
    note = models.TextField(blank=True)                   # free text by the owner
    tags = models.JSONField(default=list, blank=True)     # ["april", "baseline"]
    archived = models.BooleanField(default=False, db_index=True)
    alerts = models.JSONField(default=dict, blank=True)   # {"active": {rule: {...}}, "state": {...}}
    # a run imported from a CLI run directory (actions/imports.py): that run's fingerprint, so a
    # second import of the same directory is recognised
    imported_from = models.CharField(max_length=80, blank=True)
    # a fork (actions/fork.py): the run whose checkpoint at `fork_step` it started from
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="forks")
    fork_step = models.IntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [models.UniqueConstraint(fields=["imported_from"], name="run_imported_once",
                                               condition=~models.Q(imported_from=""))]

    def __str__(self):
        return f"run {self.pk} {self.name!r} ({self.status})"

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE

    @property
    def allowed_actions(self) -> list[str]:
        """What the run accepts now (lifecycle.allowed_actions): the pages' buttons follow it."""
        return lifecycle.allowed_actions(self.status, self.desired)

    def can_control(self, user) -> bool:
        return bool(user and user.is_authenticated and (user.is_staff or user.pk == self.owner_id))

    @property
    def progress(self) -> float:
        return min(1.0, self.step / self.max_steps) if self.max_steps else 0.0

    @property
    def engine(self) -> str:
        return ((self.config or {}).get("rollout") or {}).get("engine", "embedded")

    @property
    def layout(self) -> str:
        """The processes the run trains with, in words ("2 training processes + 1 generation
        process"; the pages show it next to the engine)."""
        cluster = (self.config or {}).get("cluster") or {}
        return layout_text(int(cluster.get("train_procs", 1)), int(cluster.get("gen_procs", 0)),
                           str(cluster.get("sharding", "ddp")))


class MetricPoint(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="points")
    seq = models.BigIntegerField()
    step = models.IntegerField()
    key = models.CharField(max_length=200)
    value = models.FloatField(null=True)   # NaN / inf are stored as NULL (JSON has none)

    class Meta:
        indexes = [models.Index(fields=["run", "seq"]), models.Index(fields=["run", "key", "step"])]


class HistogramSnapshot(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="histograms")
    seq = models.BigIntegerField()
    step = models.IntegerField()
    name = models.CharField(max_length=200)
    edges = models.JSONField()
    counts = models.JSONField()

    class Meta:
        indexes = [models.Index(fields=["run", "seq"]), models.Index(fields=["run", "name", "step"])]


class RunEvent(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    seq = models.BigIntegerField()
    step = models.IntegerField()
    kind = models.CharField(max_length=64)
    data = models.JSONField(default=dict)
    # when it happened: now, or the time an imported run's files record (actions/imports.py)
    time = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["run", "seq"])]


class RolloutSample(models.Model):
    """One sample (prompt + completion) the trainer recorded at a step, for the rollout inspector.
    A step's batch shares one sequence number; a run keeps at most RLPILOT_SAMPLES_PER_RUN of them
    (older steps thinned first, see samples.thin)."""
    FINISH = ("stop", "length", "aborted", "partial")
    REWARD_STATUS = ("ok", "error", "timeout")
    WHY = ("group", "longest", "shortest", "error")

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="samples")
    seq = models.BigIntegerField()
    step = models.IntegerField()
    group = models.BigIntegerField()      # the prompt draw index: identifies the group
    index = models.IntegerField()         # member k of the group
    prompt = models.TextField(blank=True)
    completion = models.TextField(blank=True)
    reward = models.FloatField(null=True)        # what the loss used, penalties included
    score = models.FloatField(null=True)         # the verifier's raw score
    penalty = models.FloatField(default=0.0)     # reward - score
    advantage = models.FloatField(null=True)
    length = models.IntegerField(default=0)      # response tokens
    finish = models.CharField(max_length=16, blank=True)
    segments = models.JSONField(default=list)    # [[policy version, tokens], ...]
    staleness = models.IntegerField(default=0)
    tis_weight = models.FloatField(null=True)
    reward_status = models.CharField(max_length=16, default="ok")
    reward_error = models.TextField(blank=True)
    why = models.CharField(max_length=16, blank=True)
    tokens = models.JSONField(default=list)      # the response's token pieces
    logprobs = models.JSONField(default=list)    # per response token
    # a multi-turn episode (trainer/accounting/inspector.py): its turns, [{"role": "model" | "tool",
    # "start", "end", "trained"}] over token positions, and its counters {"turns", "tool_calls",
    # "tool_errors", "tool_s", "end"}; empty for a single-turn sample
    turns = models.JSONField(default=list, blank=True)
    episode = models.JSONField(default=dict, blank=True)

    class Meta:
        indexes = [models.Index(fields=["run", "seq"]), models.Index(fields=["run", "step"]),
                   models.Index(fields=["run", "length"]), models.Index(fields=["run", "reward"])]


class TimelineSlice(models.Model):
    """Where each process's time went during one step (trainer/observe/timeline.py): `spans` is a list
    of {"lane", "phase", "start", "end", "occupancy"?} in wall-clock seconds, a few dozen at most."""
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="timeline")
    seq = models.BigIntegerField()
    step = models.IntegerField()
    spans = models.JSONField(default=list)

    class Meta:
        indexes = [models.Index(fields=["run", "seq"]), models.Index(fields=["run", "step"])]


class KnobChange(models.Model):
    PENDING, APPLIED, REJECTED = "pending", "applied", "rejected"
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="knob_changes")
    change_id = models.CharField(max_length=32, unique=True)
    knobs = models.JSONField()
    status = models.CharField(max_length=10, default=PENDING,
                              choices=[(s, s) for s in (PENDING, APPLIED, REJECTED)])
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    requested_at = models.DateTimeField(auto_now_add=True)
    applied_step = models.IntegerField(null=True, blank=True)
    message = models.TextField(blank=True)
    # a change made from the pilot's advice (the live page's Apply): {rule, reason, evidence_key},
    # handed to the trainer as the command's reason so its knob_applied event names the advice
    advice = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["id"]


def _new_key() -> str:
    return secrets.token_hex(20)


class ApiToken(models.Model):
    key = models.CharField(max_length=40, unique=True, default=_new_key)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)


class Estimate(models.Model):
    """A run's time and price asked for before it is launched (the launch form's Estimate, POST
    /api/estimates): from past runs of the same shape at once, else from a calibration a worker
    runs (webapp/dashboard/worker/tasks.py); docs/cost.md."""
    PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="estimates")
    created_at = models.DateTimeField(auto_now_add=True)
    config = models.JSONField()                 # the validated config it estimates
    queue = models.CharField(max_length=100)    # where its calibration runs (the run's queue)
    status = models.CharField(max_length=10, default=PENDING,
                              choices=[(s, s) for s in (PENDING, RUNNING, DONE, FAILED)])
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-id"]
