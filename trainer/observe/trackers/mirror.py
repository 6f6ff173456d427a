"""TrackerMirror: a MetricsSink that hands every record to the run's trackers (TensorBoard,
W&B, MLflow adapters), each on a thread of its own.

Training never waits on a tracker: each tracker's records go into a bounded queue; when it is
full, that tracker's records are dropped and counted (one warning event says so, the close says
how many). A tracker that fails to start (package missing, credentials refused) or raises
mid-run is disabled after ONE `warning` event naming it and the error; the others go on. What
the trackers have to say (those warnings, `tracker_started` with a tracker's URL and directory)
goes to the run's own sink from the training thread, at its next call, so the run's sinks are
never written from two threads.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

from trainer.observe.metrics import MetricsSink
from trainer.observe.trackers.base import Tracker

log = logging.getLogger(__name__)

QUEUE_SIZE = 10_000     # records waiting for one tracker (a step sends a few dozen)
CLOSE_TIMEOUT_S = 60.0  # the longest a run's end waits for its trackers to flush and close

_STOP = object()


class TrackerMirror(MetricsSink):
    def __init__(self, trackers: list[Tracker], report: MetricsSink, *,
                 queue_size: int = QUEUE_SIZE, close_timeout_s: float = CLOSE_TIMEOUT_S):
        self.report = report              # the run's own sink: warnings and tracker_started
        self.close_timeout_s = close_timeout_s
        self._notices: collections.deque = collections.deque()   # appended by the lanes' threads
        self.lanes = [_Lane(t, queue_size, self._notices) for t in trackers]
        self._step = 0
        self._closed = False

    @property
    def dropped(self) -> dict[str, int]:
        return {lane.tracker.name: lane.dropped for lane in self.lanes if lane.dropped}

    # --- the training thread ----------------------------------------------------------------------
    def scalars(self, step, values):
        self._put(step, "scalars", step, dict(values))

    def histogram(self, step, name, hist):
        self._put(step, "histogram", step, name, hist)

    def event(self, step, kind, data=None):
        self._put(step, "event", step, kind, dict(data or {}))

    def flush(self):
        self._put(self._step, "flush")

    def close(self):
        """Flush and close every tracker, waiting at most close_timeout_s in all (a dead tracker
        does not hold the run's end); then report what the trackers said."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.close_timeout_s
        for lane in self.lanes:
            lane.stop(deadline)
        late = []
        for lane in self.lanes:
            if not lane.join(deadline):
                late.append(lane.tracker.name)
        if late:
            self._notices.append(("warning", {"message": (
                f"tracker {', '.join(late)} did not finish within {self.close_timeout_s:g} s; "
                "the run ends without waiting for it"), "tracker": ", ".join(late)}))
        if self.dropped:
            self._notices.append(("trackers_closed", {"dropped_records": self.dropped}))
        self._report()

    def _put(self, step: int, method: str, *args) -> None:
        if self._closed:
            return
        self._step = max(self._step, step)
        for lane in self.lanes:
            lane.put((method, args))
        self._report()

    def _report(self) -> None:
        while self._notices:
            kind, data = self._notices.popleft()
            self.report.event(self._step, kind, data)


class _Lane:
    """One tracker, its queue and its thread (started by the first record: a Runner that fails
    to build leaves nothing running)."""

    def __init__(self, tracker: Tracker, queue_size: int, notices: collections.deque):
        self.tracker = tracker
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.notices = notices
        self.dropped = 0
        self.disabled = False   # set by its thread at the tracker's first failure
        self.thread: threading.Thread | None = None

    def put(self, item) -> None:
        if self.disabled:
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name=f"tracker-{self.tracker.name}",
                                           daemon=True)
            self.thread.start()
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                self.notices.append(("warning", {"message": (
                    f"tracker {self.tracker.name} falls behind: {self.queue.maxsize} records wait "
                    "for it, further ones are dropped for it (the run's own metrics are complete; "
                    "the count comes at the end)"), "tracker": self.tracker.name}))

    def stop(self, deadline: float) -> None:
        while self.thread is not None and self.thread.is_alive() and time.monotonic() < deadline:
            try:
                self.queue.put(_STOP, timeout=0.1)
                return
            except queue.Full:
                continue

    def join(self, deadline: float) -> bool:
        if self.thread is None:
            return True
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()

    def _work(self) -> None:
        t = self.tracker
        info = self._call("start", t.start)
        if info is None:
            return
        self.notices.append(("tracker_started", {"tracker": t.name, **info}))
        while True:
            item = self.queue.get()
            if item is _STOP:
                self._call("close", t.close)
                return
            method, args = item
            if self._call(method, getattr(t, method), *args) is None:
                return

    def _call(self, what: str, fn, *args) -> Any:
        """Run one tracker call: its result ({} for None), or None when it raised: then one
        warning, the tracker closed and dropped (its queue is no longer read)."""
        try:
            out = fn(*args)
        except Exception as e:   # a third-party tracker's failure must never reach training
            log.warning("tracker %s failed in %s", self.tracker.name, what, exc_info=True)
            name = self.tracker.name
            why = (f"its package is not installed ({type(e).__name__}: {e}); install it with "
                   f"pip install 'rlpilot[{name}]'" if isinstance(e, ImportError)
                   else f"{what} failed: {type(e).__name__}: {e}")
            self.notices.append(("warning", {"message": f"tracker {name} disabled: {why}",
                                             "tracker": name}))
            if what not in ("start", "close"):
                try:
                    self.tracker.close()
                except Exception:   # already failing; its close failing too adds nothing
                    pass
            self.disabled = True
            return None
        return out if out is not None else {}
