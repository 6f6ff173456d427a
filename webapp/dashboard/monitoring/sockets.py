"""How many WebSocket clients are connected, over every web process (for GET /metrics).

Each web process counts its own open sockets (consumers.OPEN_SOCKETS) and publishes the total to
the cache -- Redis when there is one, shared by every web process; else the process's memory,
which is enough for the embedded setup's single web process -- under a key of its own that
expires after TTL_S. A consumer publishes at connect and disconnect and, while sockets stay open,
at least every TTL_S / 4, so a process that dies drops out of the sum within TTL_S. An index
key names the processes that published. Writes run on a thread of their own, one at a time and
coalesced, so a slow or unreachable Redis never holds up a socket."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

from django.core.cache import cache

log = logging.getLogger(__name__)

TTL_S = 60.0
INDEX_KEY = "monitoring:ws-clients:processes"
PROCESS = f"{socket.gethostname()}:{os.getpid()}"


def _key(process: str) -> str:
    return f"monitoring:ws-clients:{process}"


class _Publisher:
    def __init__(self):
        self.lock = threading.Lock()
        self.latest = 0
        self.writing = False
        self.dirty = False
        self.published_at = float("-inf")   # time.monotonic() of the last write started
        self.failing = False

    def publish(self, total: int) -> None:
        with self.lock:
            self.latest = total
            if self.writing:
                self.dirty = True   # the running writer writes it next
                return
            self.writing = True
        threading.Thread(target=self._write_until_current, name="ws-count", daemon=True).start()

    def refresh(self, total: int) -> None:
        """Publish again if the last write is getting old (a pump tick: cheap when it is not)."""
        if time.monotonic() - self.published_at >= TTL_S / 4:
            self.publish(total)

    def _write_until_current(self) -> None:
        while True:
            with self.lock:
                total, self.dirty = self.latest, False
                self.published_at = time.monotonic()
            try:
                write(PROCESS, total)
                if self.failing:
                    log.warning("websocket client count published to the cache again")
                self.failing = False
            except Exception as e:   # the cache (Redis) is down: /metrics then lacks this process
                if not self.failing:
                    log.warning("publishing the websocket client count failed (%s: %s)", type(e).__name__, e)
                self.failing = True
            with self.lock:
                if not self.dirty:
                    self.writing = False
                    return


_publisher = _Publisher()
publish = _publisher.publish
refresh = _publisher.refresh


def write(process: str, total: int) -> None:
    """This process's count, and its name in the index (read, changed, written: two processes
    writing the index at once may drop one name, which its next refresh puts back)."""
    now = time.time()
    cache.set(_key(process), int(total), timeout=TTL_S)
    index = cache.get(INDEX_KEY) or {}
    index = {p: t for p, t in index.items() if now - t < TTL_S}
    index[process] = now
    cache.set(INDEX_KEY, index, timeout=TTL_S)


def counts() -> dict[str, int]:
    """{web process ("host:pid"): WebSocket clients connected} for the processes that published in
    the last TTL_S; raises when the cache is unreachable."""
    index = cache.get(INDEX_KEY) or {}
    found = cache.get_many([_key(p) for p in index])
    return {p: int(found[_key(p)]) for p in sorted(index) if _key(p) in found}
