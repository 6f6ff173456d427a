"""WebSocket /ws/runs/<id>/?after=<cursor>: backlog after the cursor, then live rows.

The database is the source of truth: the consumer always reads rows after its cursor from the
database, so a reconnect or a late viewer loses and duplicates nothing. It reads when the run's
doorbell rings on the channel layer (Redis) and, as a safety net, every poll interval -- which
is how it learns about rows in embedded mode, where the in-memory channel layer does not cross
processes (~200 ms).
"""
from __future__ import annotations

import asyncio
import bisect
import json
import logging
import time
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from webapp.dashboard import actions, streams
from webapp.dashboard.models import Run

log = logging.getLogger(__name__)


class RunFeed:
    """The recent messages of one run, shared by every consumer of that run in this process:
    a wake-up (doorbell or poll tick) costs one database read per process, not one per viewer,
    and each message is serialised once. A consumer whose cursor is older than the feed's window
    reads its backlog from the database itself."""

    WINDOW = 4000      # messages kept
    feeds: dict[tuple[int, int], "RunFeed"] = {}

    def __init__(self, run_id: int):
        self.run_id = run_id
        self.msgs: list[tuple[int, str]] = []   # (seq, json text), ascending; cover (base, cursor]
        self.base = self.cursor = None
        self.known = 0            # highest seq announced by a doorbell
        self.last_read = 0.0
        self.users = 0
        self.lock = asyncio.Lock()

    @classmethod
    def get(cls, run_id: int) -> "RunFeed":
        key = (id(asyncio.get_running_loop()), run_id)
        feed = cls.feeds.get(key)
        if feed is None:
            feed = cls.feeds[key] = RunFeed(run_id)
        feed.users += 1
        return feed

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.feeds.pop((id(asyncio.get_running_loop()), self.run_id), None)

    async def refresh(self, min_age: float) -> None:
        async with self.lock:
            if (self.cursor is not None and self.known <= self.cursor
                    and time.monotonic() - self.last_read < min_age):
                return   # another viewer just read everything this wake-up is about
            if self.cursor is None:
                self.base = self.cursor = await database_sync_to_async(_last_seq)(self.run_id)
            more = True
            while more:
                msgs, self.cursor, more = await database_sync_to_async(_read)(self.run_id, self.cursor)
                self.last_read = time.monotonic()
                self.msgs.extend((m["cursor"], json.dumps(m)) for m in msgs)
            if len(self.msgs) > self.WINDOW:
                cut = len(self.msgs) - self.WINDOW
                self.base = self.msgs[cut - 1][0]
                del self.msgs[:cut]

    def after(self, cursor: int) -> tuple[list[str], int] | None:
        """Messages after `cursor` from the window, or None when the window starts later."""
        if self.base is None or cursor < self.base:
            return None
        lo = bisect.bisect_right(self.msgs, (cursor, "\uffff"))
        return [text for _, text in self.msgs[lo:]], max(cursor, self.cursor)


def _last_seq(run_id: int) -> int:
    return Run.objects.filter(pk=run_id).values_list("last_seq", flat=True).first() or 0


def _read(run_id: int, cursor: int):
    """(messages, new cursor, whether more rows are waiting)."""
    actions.mark_stale_runs()
    upto = _last_seq(run_id)
    msgs, new = streams.messages_after(run_id, cursor, upto)
    return msgs, new, new < upto


class RunConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        self.user = self.scope.get("user")
        self.run_id = int(self.scope["url_route"]["kwargs"]["run_id"])
        self.cursor = 0
        self.wake = asyncio.Event()
        self.pump_task = None
        self.joined = False
        self.feed = None
        if not self.user or not self.user.is_authenticated:
            await self.close(code=4401)
            return
        exists = await database_sync_to_async(Run.objects.filter(pk=self.run_id).exists)()
        if not exists:
            await self.close(code=4404)
            return
        qs = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        try:
            self.cursor = max(0, int(qs.get("after", ["0"])[-1] or 0))
        except ValueError:
            self.cursor = 0
        if self.channel_layer is not None:
            await self.channel_layer.group_add(actions.group_name(self.run_id), self.channel_name)
            self.joined = True
        await self.accept()
        self.feed = RunFeed.get(self.run_id)
        self.pump_task = asyncio.ensure_future(self.pump())

    async def disconnect(self, code):
        if self.pump_task is not None:
            self.pump_task.cancel()
        if self.feed is not None:
            self.feed.release()
            self.feed = None
        if self.joined:
            await self.channel_layer.group_discard(actions.group_name(self.run_id), self.channel_name)

    # --- server -> client ------------------------------------------------------------------------
    async def doorbell(self, message):
        if self.feed is not None:
            self.feed.known = max(self.feed.known, int(message.get("seq") or 0))
        self.wake.set()

    async def pump(self):
        interval = settings.WS_POLL_INTERVAL_S
        try:
            while True:
                self.wake.clear()
                await self.send_new()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=interval)
                except asyncio.TimeoutError:
                    pass
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("websocket pump for run %s failed", self.run_id)
            await self.close(code=1011)

    async def send_new(self):
        # a doorbell always refreshes the shared feed; a poll tick reuses a read younger than
        # half a tick (another viewer's)
        await self.feed.refresh(settings.WS_POLL_INTERVAL_S / 2)
        # a backlog older than the shared window comes straight from the database
        while self.feed.after(self.cursor) is None:
            msgs, cursor, _ = await database_sync_to_async(_read)(self.run_id, self.cursor)
            for m in msgs:
                await self.send(text_data=json.dumps(m))
            if cursor == self.cursor:
                return
            self.cursor = cursor
        texts, cursor = self.feed.after(self.cursor)
        for text in texts:
            await self.send(text_data=text)
        self.cursor = cursor

    # --- client -> server ------------------------------------------------------------------------
    async def receive(self, text_data=None, bytes_data=None):
        try:
            msg = json.loads(text_data if text_data is not None else bytes_data.decode())
        except (ValueError, UnicodeDecodeError, AttributeError):
            await self.error("malformed message: expected a JSON object")
            return
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            await self.error('malformed message: expected {"type": ...}')
            return
        if msg["type"] == "set_knobs":
            await self.set_knobs(msg.get("knobs"), msg.get("request_id"))
        elif msg["type"] == "ping":
            await self.send(text_data=json.dumps({"type": "pong", "cursor": self.cursor}))
        else:
            await self.error(f"unknown message type {msg['type']!r}; expected set_knobs or ping")

    async def set_knobs(self, knobs, request_id=None):
        try:
            change = await database_sync_to_async(self._request_knobs)(knobs)
        except actions.ActionError as e:
            await self.error(e.message, e.errors, request_id=request_id, status=e.status)
            return
        await self.send(text_data=json.dumps({
            "type": "knob_ack", "change_id": change.change_id, "knobs": change.knobs,
            "status": "pending", "request_id": request_id}))
        self.wake.set()

    def _request_knobs(self, knobs):
        run = Run.objects.get(pk=self.run_id)
        return actions.request_knobs(run, self.user, knobs)

    async def error(self, message, errors=None, **extra):
        await self.send(text_data=json.dumps({"type": "error", "message": message,
                                              "errors": errors or {}, **extra}))
