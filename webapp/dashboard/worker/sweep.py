"""Lost workers: a live run whose worker stopped heartbeating for RLPILOT_HEARTBEAT_TIMEOUT_S
becomes `interrupted`, with a `heartbeat` alert (the user resumes it from its last checkpoint).

`mark_stale_runs()` is the sweep. It runs
  - periodically, with nobody watching: in production from Celery beat (the task
    `webapp.dashboard.tasks.sweep_stale_runs`, every RLPILOT_SWEEP_S on the queue
    RLPILOT_SWEEP_QUEUE, which a small worker on the web machine consumes, never a training
    worker: those are busy with their runs); locally from `manage.py serve`'s own timer, the
    `Sweeper` thread below;
  - and lazily, at most every few seconds per process, when a page, the API or a WebSocket
    consumer reads runs (so a page never shows a dead run as running for long).

It decides which runs are stale (lifecycle.END_FROM: live runs; they become lifecycle.LOST); the
write is `actions.interrupt_lost_run`, given the heartbeat rule of alerts.py.
"""
from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from webapp.dashboard import actions, lifecycle
from webapp.dashboard.models import Run
from webapp.dashboard.worker import alerts

log = logging.getLogger(__name__)

LOST = "heartbeat lost: the worker running this run disappeared"
LAZY_EVERY_S = 3.0   # the lazy calls (pages, API, sockets) sweep at most this often per process

_last_check = 0.0


def mark_stale_runs(force: bool = False) -> int:
    """Mark every live run without a heartbeat for RLPILOT_HEARTBEAT_TIMEOUT_S `interrupted` (and
    raise its heartbeat alert). Returns how many. Without `force` (the lazy calls) it does
    nothing when this process swept less than LAZY_EVERY_S ago."""
    global _last_check
    now = time.monotonic()
    if not force and now - _last_check < LAZY_EVERY_S:
        return 0
    _last_check = now
    cutoff = timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT_S)
    n = 0
    stale = list(Run.objects.filter(status__in=lifecycle.END_FROM, heartbeat_at__lt=cutoff)
                 .values_list("id", flat=True))
    for run_id in stale:
        if actions.interrupt_lost_run(run_id, cutoff, LOST,
                                      alert=lambda run: alerts.heartbeat_alert(run, run.step)):
            n += 1
    return n


class Sweeper:
    """`manage.py serve`'s timer: a daemon thread that sweeps every `interval` seconds
    (RLPILOT_SWEEP_S), with its own database connection, so a run whose worker died is marked
    interrupted within RLPILOT_HEARTBEAT_TIMEOUT_S + RLPILOT_SWEEP_S of its last heartbeat even
    when no page is open. `marked` counts the runs it marked."""

    def __init__(self, interval: float | None = None):
        self.interval = max(0.05, interval if interval is not None else settings.SWEEP_S)
        self.marked = 0
        self.sweeps = 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="stale-run-sweeper", daemon=True)

    def start(self) -> "Sweeper":
        self.thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self.stop_event.wait(self.interval):
                try:
                    n = mark_stale_runs(force=True)
                except Exception:   # the database is briefly unreachable: try again next tick
                    log.exception("stale-run sweep failed")
                    close_old_connections()
                    continue
                self.sweeps += 1
                if n:
                    self.marked += n
                    log.warning("%d run(s) lost their worker (no heartbeat for %g s): now interrupted",
                                n, settings.HEARTBEAT_TIMEOUT_S)
        finally:
            connection.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(self.interval + 10)
