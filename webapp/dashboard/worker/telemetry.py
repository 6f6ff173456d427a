"""The trainer's database-backed sink and control source (used by the Celery task).

DbSink buffers a step's scalars, histograms and rollout samples and hands them, at every step
boundary (the control source's poll()), on every event and on flush(), to a writer thread that
inserts them in one transaction (bulk, sequence-numbered) and then rings the run's doorbell: the
trainer never waits for the database.

DbControlSource turns pending KnobChange rows and the run's `desired` field into trainer
Commands (which command, lifecycle.trainer_command says; a change made from the pilot's advice
carries its marker as the command's reason).

Heartbeat beats for the run and evaluates the `stalled` alert. Every write here goes through the
actions layer (webapp/dashboard/actions/); the doorbell is webapp/dashboard/doorbell.py.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any, Callable

from django.conf import settings
from django.db import close_old_connections, connection

from trainer.observe.metrics import MetricsSink
from trainer.run.controls import SET_KNOBS, STOP, Command, ControlSource
from webapp.dashboard import actions, lifecycle
from webapp.dashboard.actions import Record
from webapp.dashboard.doorbell import Doorbell
from webapp.dashboard.models import KnobChange, Run
from webapp.dashboard.worker import alerts

log = logging.getLogger(__name__)


class DbSink(MetricsSink):
    """Writes a run's rows from a background thread, so the trainer only pays for a queue put.

    scalars(), histogram(), samples() and timeline() are buffered; flush() (called at every step boundary by the
    control source, and by event()) hands the buffer to the writer thread, which inserts it in
    one transaction (sequence-numbered) and then rings the doorbell. drain() waits until
    everything handed over is in the database; close() drains and stops the thread."""

    def __init__(self, run_id: int, doorbell: Doorbell | None = None):
        self.run_id = run_id
        self.doorbell = doorbell if doorbell is not None else Doorbell()
        self._own_bell = doorbell is None
        self.buffer: list[Record] = []
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue()
        self.write_seconds = 0.0     # time the writer thread spent writing
        self.errors = 0
        self.thread: threading.Thread | None = None
        self.monitor = None          # alerts.Monitor, loaded from the run row by the writer

    # --- the trainer's side --------------------------------------------------------------------
    def scalars(self, step: int, values: dict[str, float]) -> None:
        with self.lock:
            if self.buffer and self.buffer[-1].kind == "points" and self.buffer[-1].step == step:
                self.buffer[-1].values.update(values)
            else:
                self.buffer.append(Record("points", step, "", dict(values)))

    def histogram(self, step: int, name: str, hist: dict[str, Any]) -> None:
        with self.lock:
            self.buffer.append(Record("histogram", step, name, {"edges": list(hist.get("edges", [])),
                                                                "counts": list(hist.get("counts", []))}))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A step's rollout samples (the inspector): buffered like a histogram, one sequence
        number for the batch; cleaned and capped by the actions layer (rows/samples.py)."""
        rows = [dict(r) for r in (rows or []) if isinstance(r, dict)]
        if not rows:
            return
        with self.lock:
            self.buffer.append(Record("samples", step, "", {"rows": rows}))

    def timeline(self, step: int, spans: list[dict[str, Any]]) -> None:
        """A step's timeline: buffered like a histogram, one row (cleaned by the actions layer)."""
        if spans:
            with self.lock:
                self.buffer.append(Record("timeline", step, "", {"spans": list(spans)}))

    def event(self, step: int, kind: str, data: dict[str, Any] | None = None) -> None:
        with self.lock:
            self.buffer.append(Record("event", step, kind, dict(data or {})))
        self.flush()

    def flush(self) -> None:
        with self.lock:
            records, self.buffer = self.buffer, []
        if not records:
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._writer, name=f"db-sink-{self.run_id}", daemon=True)
            self.thread.start()
        self.queue.put(records)

    def drain(self) -> None:
        self.flush()
        if self.thread is not None:
            self.queue.join()

    def close(self) -> None:
        self.drain()
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(30)
            self.thread = None
        if self._own_bell:
            self.doorbell.close()

    # --- the writer thread ---------------------------------------------------------------------
    def _writer(self) -> None:
        try:
            while True:
                batch = self.queue.get()
                if batch is None:
                    self.queue.task_done()
                    return
                n = 1
                while True:   # coalesce whatever else is waiting into the same transaction
                    try:
                        more = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    n += 1
                    if more is None:
                        self.queue.put(None)
                        self.queue.task_done()
                        n -= 1
                        break
                    batch = batch + more
                try:
                    self._write(batch)
                except Exception:
                    self.errors += 1
                    log.exception("run %s: writing %d telemetry records failed", self.run_id, len(batch))
                    close_old_connections()
                finally:
                    for _ in range(n):
                        self.queue.task_done()
        finally:
            connection.close()

    def _write(self, records: list[Record]) -> None:
        t0 = time.perf_counter()
        updates: dict[str, Any] = {"heartbeat_at": datetime.now(dt_timezone.utc)}
        steps = [r.step for r in records if r.kind == "points"]
        if steps:
            updates["step"] = max(steps)
        try:   # an alert-rule bug must never cost the run its telemetry
            if self.monitor is None:
                state = Run.objects.filter(pk=self.run_id).values_list("alerts", flat=True).first()
                self.monitor = alerts.Monitor(state)
            raised = self.monitor.check(records)   # alert / alert_cleared events, same transaction
        except Exception:
            log.exception("run %s: evaluating alerts failed", self.run_id)
            raised = []
            self.monitor = self.monitor or alerts.Monitor()
        if raised:
            records = records + raised
            updates["alerts"] = self.monitor.as_json()
        elif any(r.kind == "points" for r in records) and self.monitor.mem:
            updates["alerts"] = self.monitor.as_json()   # streak counters survive a resume
        # a trainer's paused / resumed / stop_requested moves the run's status in this same
        # write (actions.rows, lifecycle.EVENT_STATUS)
        seq = actions.append(self.run_id, records, updates, ring_bell=False)
        self.doorbell.ring(self.run_id, seq)
        self.write_seconds += time.perf_counter() - t0


class DbControlSource(ControlSource):
    """Turns the run's `desired` state and pending knob changes into trainer Commands.

    A watcher thread reads them every `min_interval` seconds (one small query; knob changes
    only when the run's knob_version moved), so poll() at a step boundary costs the trainer no
    database round trip. With min_interval=0 poll() reads the database itself (tests)."""

    def __init__(self, run_id: int, sink: DbSink | None = None, min_interval: float = 0.1):
        self.run_id = run_id
        self.sink = sink
        self.min_interval = min_interval
        self.seen: set[str] = set()        # knob changes already read (owned by the reader)
        self.knob_version = -1
        self.paused = False
        self.stop_sent = False
        self.orphaned_since: float | None = None
        self.lock = threading.Lock()
        self.row: dict | None = None
        self.inbox: list[Command] = []
        self.closing = threading.Event()
        self.thread: threading.Thread | None = None

    def _read(self) -> None:
        row = Run.objects.filter(pk=self.run_id).values("desired", "status", "knob_version").first()
        new = []
        if row is not None and row["knob_version"] != self.knob_version:
            self.knob_version = row["knob_version"]
            for kc in (KnobChange.objects.filter(run_id=self.run_id, status=KnobChange.PENDING)
                       .exclude(change_id__in=self.seen).select_related("requested_by")):
                self.seen.add(kc.change_id)
                # a change applied from the pilot's advice: its marker comes back in knob_applied
                new.append(Command(SET_KNOBS, knobs=dict(kc.knobs), id=kc.change_id,
                                   requested_by=kc.requested_by.get_username() if kc.requested_by else "web",
                                   requested_at=kc.requested_at.timestamp(), reason=dict(kc.advice or {})))
        with self.lock:
            self.row = row if row is not None else {"deleted": True}
            self.inbox.extend(new)

    def _watch(self) -> None:
        try:
            while not self.closing.wait(self.min_interval):
                try:
                    self._read()
                except Exception:
                    log.exception("run %s: reading controls failed", self.run_id)
                    close_old_connections()
        finally:
            connection.close()

    def poll(self) -> list[Command]:
        if self.sink is not None:
            self.sink.flush()   # a step boundary: the step's rows go out now (in the background)
        if self.min_interval <= 0 or self.row is None:
            self._read()        # synchronous mode, and the first poll
        if self.min_interval > 0 and self.thread is None:
            self.thread = threading.Thread(target=self._watch, name=f"controls-{self.run_id}", daemon=True)
            self.thread.start()
        with self.lock:
            row, cmds, self.inbox = self.row, self.inbox, []
        if row.get("deleted"):   # the run was deleted
            return [] if self.stop_sent else self._stop()
        now = time.monotonic()
        # a run marked stopped/killed while this process still trains it (the kill signal got
        # lost) is orphaned: lifecycle.trainer_command stops it after a grace period
        if row["status"] not in lifecycle.LIVE:
            self.orphaned_since = self.orphaned_since or now
        kind = lifecycle.trainer_command(
            row["status"], row["desired"], paused=self.paused, stop_sent=self.stop_sent,
            orphaned_s=None if self.orphaned_since is None else now - self.orphaned_since)
        if kind == STOP:
            cmds += self._stop()
        elif kind is not None:
            self.paused = kind == lifecycle.CMD_PAUSE
            cmds.append(Command(kind, requested_by="web"))
        return cmds

    def _stop(self) -> list[Command]:
        self.stop_sent = True
        return [Command(STOP, requested_by="web")]

    def close(self) -> None:
        self.closing.set()
        if self.thread is not None:
            self.thread.join(5)
            self.thread = None


class Heartbeat:
    """Updates the run's heartbeat every few seconds from a thread (its own DB connection), and
    evaluates the `stalled` alert there (alerts.StallWatch): this thread keeps beating while the
    trainer is stuck and writes nothing."""

    def __init__(self, run_id: int, interval: float | None = None):
        self.run_id = run_id
        self.interval = interval or settings.HEARTBEAT_S
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self.stall = alerts.StallWatch(run_id)
        # what the trainer is doing between steps (Runner.phase), for the stall watch; the
        # task sets it once the runner exists
        self.phase: Callable[[], str | None] = lambda: None

    def start(self) -> "Heartbeat":
        self.thread.start()
        return self

    def _check_stall(self) -> None:
        try:   # an alert-rule bug must never cost the run its heartbeat
            self.stall.tick(phase=self.phase())
        except Exception:
            log.exception("run %s: evaluating the stalled alert failed", self.run_id)
            close_old_connections()

    def _loop(self) -> None:
        try:
            self._check_stall()   # the step the run starts from
            while not self.stop_event.wait(self.interval):
                try:
                    actions.heartbeat(self.run_id)
                except Exception:
                    log.exception("heartbeat failed")
                    close_old_connections()
                self._check_stall()
        finally:
            connection.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(self.interval + 5)
