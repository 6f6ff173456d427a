"""The doorbell: a ring on the channel layer that tells a run's WebSocket consumers "rows up to
this sequence number exist" (they read the rows from the database; a lost ring only delays their
next poll).

Its own module, below everything that rings: the actions layer rings after a write commits
(`ring`), the trainer's database sink rings from its own `Doorbell`, and the consumer joins
`group_name(run_id)`. It imports nothing of the dashboard.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

from asgiref.sync import async_to_sync
from channels.layers import DEFAULT_CHANNEL_LAYER, channel_layers, get_channel_layer
from django.conf import settings

log = logging.getLogger(__name__)


def group_name(run_id: int) -> str:
    """The channel-layer group of a run's consumers."""
    return f"run-{run_id}"


def message(seq: int) -> dict:
    return {"type": "doorbell", "seq": seq}


class Doorbell:
    """Rings run groups on the channel layer from a background event loop, so the trainer never
    waits for the channel layer (and a Redis connection is reused across rings).

    A ring is only a hint (consumers read the database), so while the layer is unreachable rings
    are dropped: one probe every CHANNEL_LAYER_RETRY_S, one warning per outage, one line when it
    is back."""

    def __init__(self, layer=None):
        # its own layer instance: closing its pools never touches the process's shared layer
        self.layer = layer if layer is not None else (
            channel_layers.make_backend(DEFAULT_CHANNEL_LAYER) if settings.CROSS_PROCESS_DOORBELL else None)
        self.loop = None
        self.down_since: float | None = None   # the layer is unreachable since (monotonic)
        self.next_probe = 0.0
        self.probing = False
        self.dropped = 0
        if self.layer is not None:
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self._run, name="doorbell", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()   # in this thread: channels_redis closes its connections for the loop

    def ring(self, run_id: int, seq: int) -> None:
        if self.loop is None:
            return
        if self.down_since is not None:   # unreachable: drop the ring unless it is time to probe
            if self.probing or time.monotonic() < self.next_probe:
                self.dropped += 1
                return
            self.probing = True
        coro = self._send(group_name(run_id), message(seq))
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        fut.add_done_callback(_log_failure)
        self.last = fut

    last = None

    async def _send(self, group: str, msg: dict) -> None:
        try:
            await asyncio.wait_for(self.layer.group_send(group, msg), settings.CHANNEL_LAYER_TIMEOUT_S)
        except Exception as e:
            if self.down_since is None:
                self.down_since = time.monotonic()
                log.warning("doorbell: channel layer unreachable (%s: %s); rings are dropped until it "
                            "is back (viewers poll the database meanwhile)", type(e).__name__, e)
            self.next_probe = time.monotonic() + settings.CHANNEL_LAYER_RETRY_S
        else:
            if self.down_since is not None:
                log.warning("doorbell: channel layer reachable again after %.1f s (%d rings dropped)",
                            time.monotonic() - self.down_since, self.dropped)
                self.down_since, self.dropped = None, 0
        finally:
            self.probing = False

    def close(self) -> None:
        if self.loop is None:
            return
        try:
            if self.last is not None:
                self.last.result(2)   # rings are sent in order: the last one done means all done
        except Exception:
            pass
        try:
            if hasattr(self.layer, "close_pools"):
                asyncio.run_coroutine_threadsafe(self.layer.close_pools(), self.loop).result(2)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(2)
        self.loop = None


_shared: Doorbell | None = None
_shared_lock = threading.Lock()


def shared_doorbell() -> Doorbell:
    """One background doorbell per process (for rings from web requests and actions)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Doorbell()
        return _shared


def _log_failure(fut) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("doorbell failed: %s", fut.exception())


_scheduled: set = set()   # rings scheduled on a running loop, until they are sent


def ring(run_id: int, seq: int) -> None:
    """Ring now. With a cross-process layer (Redis) from the process's background doorbell, never
    blocking; with the in-memory layer to this process's own consumers (others poll)."""
    if settings.CROSS_PROCESS_DOORBELL:
        shared_doorbell().ring(run_id, seq)
        return
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    try:
        if running is not None:   # a sync write from inside an event loop's thread: schedule it
            task = running.create_task(layer.group_send(group_name(run_id), message(seq)))
            _scheduled.add(task)   # the loop keeps only a weak reference to a task
            task.add_done_callback(_scheduled.discard)
        else:
            async_to_sync(layer.group_send)(group_name(run_id), message(seq))
    except Exception:  # the database has the rows; a missed ring only delays a poll
        log.exception("doorbell for run %s failed", run_id)
