"""WebSocket /ws/runs/<id>/?after=<cursor>: backlog after the cursor, then live rows.

The database is the source of truth: the consumer always reads rows after its cursor from the
database, so a reconnect or a late viewer loses and duplicates nothing. It reads when the run's
doorbell rings on the channel layer (Redis) and, as a safety net, every poll interval -- which
is how it learns about rows in embedded mode, where the in-memory channel layer does not cross
processes (~200 ms).

The channel layer is only a doorbell, so its outage must not cost the page its stream: when
joining the run's group or receiving from the layer fails, the socket stays open, the consumer
polls the database every RLPILOT_WS_FALLBACK_POLL_S and tells the client
`{"type": "stream", "mode": "polling", "message": ...}`; it retries the group every
RLPILOT_CHANNEL_LAYER_RETRY_S and, once back, sends `{"type": "stream", "mode": "live", ...}`.
Those frames carry no cursor (they are not rows).

One user may hold at most RLPILOT_MAX_SOCKETS_PER_USER sockets open on one web process (counted
in the process: each holds a database poller); one more is closed with code 4429.
"""
from __future__ import annotations

import asyncio
import bisect
import json
import logging
import time
from importlib import import_module
from urllib.parse import parse_qs

from channels.auth import get_user
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from trainer.config import short_repr
from webapp.dashboard import actions
from webapp.dashboard.doorbell import group_name
from webapp.dashboard.models import Run
from webapp.dashboard.monitoring import sockets
from webapp.dashboard.rows import stream
from webapp.dashboard.worker import sweep

log = logging.getLogger(__name__)

OPEN_SOCKETS: dict[int, int] = {}   # user id -> sockets open on this process (one event loop)


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
    sweep.mark_stale_runs()
    upto = _last_seq(run_id)
    msgs, new = stream.messages_after(run_id, cursor, upto)
    return msgs, new, new < upto


class LayerLog:
    """At most one warning per process and outage (50 viewers, one line), and a line when the
    channel layer is back."""
    down_since: float | None = None

    @classmethod
    def down(cls, run_id: int, error: BaseException) -> None:
        if cls.down_since is None:
            cls.down_since = time.monotonic()
            log.warning("channel layer unreachable (%s: %s); websocket consumers poll the database "
                        "every %g s until it is back (run %s noticed first)", type(error).__name__,
                        error, settings.WS_FALLBACK_POLL_S, run_id)

    @classmethod
    def up(cls) -> None:
        if cls.down_since is not None:
            log.warning("channel layer reachable again after %.1f s; websocket consumers are live",
                        time.monotonic() - cls.down_since)
            cls.down_since = None


class RunConsumer(AsyncWebsocketConsumer):
    # Channels' AsyncConsumer.__call__ assigns the layer's raw receive to `channel_receive` and
    # then awaits it next to the socket's receive; a raw receive that raises (Redis down) would
    # end the consumer and close the socket. The property hands Channels a receive that survives
    # an outage instead (_layer_receive).
    @property
    def channel_receive(self):
        return self._layer_receive

    @channel_receive.setter
    def channel_receive(self, raw):
        self._raw_receive = raw

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.run_id = 0
        self.joined = False                   # in the run's group, receiving its doorbells
        self.joined_event = asyncio.Event()
        self.layer_broken = asyncio.Event()   # a receive failed: re-join
        self.mode = "live"                    # what the client was last told
        self.pump_task = self.keeper_task = None
        self.feed = None
        self.counted_user: int | None = None  # whose OPEN_SOCKETS count this socket holds

    async def connect(self):
        self.user = self.scope.get("user")
        self.run_id = int(self.scope["url_route"]["kwargs"]["run_id"])
        self.cursor = 0
        self.wake = asyncio.Event()
        if not self.user or not self.user.is_authenticated:
            await self.close(code=4401)
            return
        self.rights = (self.user.is_active, self.user.is_staff, self.user.is_superuser)
        self.checked_at = time.monotonic()
        exists = await database_sync_to_async(Run.objects.filter(pk=self.run_id).exists)()
        if not exists:
            await self.close(code=4404)
            return
        limit = settings.RLPILOT_MAX_SOCKETS_PER_USER
        if limit > 0 and OPEN_SOCKETS.get(self.user.pk, 0) >= limit:
            await self.close(code=4429)   # RLPILOT_MAX_SOCKETS_PER_USER reached
            return
        self.counted_user = self.user.pk
        OPEN_SOCKETS[self.user.pk] = OPEN_SOCKETS.get(self.user.pk, 0) + 1
        sockets.publish(sum(OPEN_SOCKETS.values()))   # GET /metrics counts the clients
        qs = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        try:
            self.cursor = max(0, int(qs.get("after", ["0"])[-1] or 0))
        except ValueError:
            self.cursor = 0
        # the group is joined in the background (keep_joined): the database, not the channel
        # layer, decides whether a connect succeeds
        await self.accept()
        self.feed = RunFeed.get(self.run_id)
        self.pump_task = asyncio.ensure_future(self.pump())
        if self.channel_layer is not None:
            self.keeper_task = asyncio.ensure_future(self.keep_joined())

    async def disconnect(self, code):
        if self.counted_user is not None:
            left = OPEN_SOCKETS.get(self.counted_user, 1) - 1
            if left > 0:
                OPEN_SOCKETS[self.counted_user] = left
            else:
                OPEN_SOCKETS.pop(self.counted_user, None)
            self.counted_user = None
            sockets.publish(sum(OPEN_SOCKETS.values()))
        for task in (self.pump_task, self.keeper_task):
            if task is not None:
                task.cancel()
        if self.feed is not None:
            self.feed.release()
            self.feed = None
        if self.joined:
            self.joined = False
            try:
                await asyncio.wait_for(
                    self.channel_layer.group_discard(group_name(self.run_id), self.channel_name),
                    settings.CHANNEL_LAYER_TIMEOUT_S)
            except Exception:   # the layer is down: the membership expires with the group
                pass

    # --- the channel layer (the doorbell) ------------------------------------------------------------
    async def keep_joined(self):
        """Join the run's group; after a failure poll the database and retry until it works."""
        group = group_name(self.run_id)
        try:
            while True:
                if not self.joined:
                    try:
                        await asyncio.wait_for(self.channel_layer.group_add(group, self.channel_name),
                                               settings.CHANNEL_LAYER_TIMEOUT_S)
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:
                        LayerLog.down(self.run_id, e)
                        await self.set_mode("polling")
                        await asyncio.sleep(settings.CHANNEL_LAYER_RETRY_S)
                        continue
                    self.joined = True
                    self.layer_broken.clear()
                    self.joined_event.set()   # _layer_receive may receive again
                    self.wake.set()           # rows committed before we were in the group
                    LayerLog.up()
                    await self.set_mode("live")
                await self.layer_broken.wait()
                self.layer_broken.clear()
                self.joined = False
                self.joined_event.clear()
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("websocket layer keeper for run %s failed", self.run_id)

    async def _layer_receive(self):
        """The channel layer's receive, waiting out an outage instead of raising."""
        while True:
            try:
                return await self._raw_receive()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                LayerLog.down(self.run_id, e)
                self.joined = False
                self.joined_event.clear()
                self.layer_broken.set()   # keep_joined polls, re-joins, then we receive again
                await asyncio.sleep(settings.CHANNEL_LAYER_RETRY_S)
                await self.joined_event.wait()

    async def set_mode(self, mode: str) -> None:
        """Tell the client how it gets its rows, once per change."""
        if mode == self.mode:
            return
        self.mode = mode
        if mode == "polling":
            self.wake.set()   # poll at the fallback pace from now on
            text = ("Live updates degraded (channel layer unreachable): polling the database "
                    f"every {self.poll_interval():g} s")
        else:
            text = "Live updates restored: the channel layer is reachable again"
        await self.send(text_data=json.dumps({"type": "stream", "mode": mode, "message": text}))

    def poll_interval(self) -> float:
        if self.joined or self.channel_layer is None:
            return settings.WS_POLL_INTERVAL_S
        return min(settings.WS_POLL_INTERVAL_S, settings.WS_FALLBACK_POLL_S)

    # --- server -> client ------------------------------------------------------------------------
    async def doorbell(self, message):
        if self.feed is not None:
            self.feed.known = max(self.feed.known, int(message.get("seq") or 0))
        self.wake.set()

    async def pump(self):
        try:
            while True:
                self.wake.clear()
                sockets.refresh(sum(OPEN_SOCKETS.values()))   # keeps the published count alive
                if time.monotonic() - self.checked_at >= settings.WS_USER_RECHECK_S:
                    if not await self.user_still_valid():
                        return
                await self.send_new()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=self.poll_interval())
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
        await self.feed.refresh(self.poll_interval() / 2)
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
        """Whatever a client sends gets an answer frame; nothing it sends closes the socket."""
        try:
            await self.handle(text_data, bytes_data)
        except Exception:
            log.exception("websocket message for run %s failed", self.run_id)
            await self.error("the server could not handle this message")

    async def handle(self, text_data, bytes_data):
        try:
            msg = json.loads(text_data if text_data is not None else bytes_data.decode())
        except (ValueError, UnicodeDecodeError, AttributeError):
            await self.error("malformed message: expected a JSON object")
            return
        except RecursionError:
            await self.error("malformed message: nested too deeply")
            return
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            await self.error('malformed message: expected {"type": ...}')
            return
        request_id = msg.get("request_id")
        if not (request_id is None or isinstance(request_id, (int, str))
                and len(str(request_id)) <= 64):
            await self.error("request_id: expected a string or an integer (at most 64 characters)")
            return
        if msg["type"] == "set_knobs":
            await self.set_knobs(msg.get("knobs"), request_id, msg.get("advice"))
        elif msg["type"] == "ping":
            await self.send(text_data=json.dumps({"type": "pong", "cursor": self.cursor}))
        else:
            await self.error(f"unknown message type {short_repr(msg['type'])}; "
                             "expected set_knobs or ping")

    async def set_knobs(self, knobs, request_id=None, advice=None):
        """A knob change (`advice`: the marker of the pilot's advice it applies, or None)."""
        if not await self.user_still_valid():   # a control message always re-checks the user
            return
        try:
            change = await database_sync_to_async(self._request_knobs)(knobs, advice)
        except actions.ActionError as e:
            await self.error(e.message, e.errors, request_id=request_id, status=e.status)
            return
        if change is None:
            await self.error(f"run {self.run_id} no longer exists", {"run": "deleted"},
                             request_id=request_id, status=404)
            return
        await self.send(text_data=json.dumps({
            "type": "knob_ack", "change_id": change.change_id, "knobs": change.knobs,
            "advice": change.advice, "status": "pending", "request_id": request_id}))
        self.wake.set()

    def _request_knobs(self, knobs, advice=None):
        run = Run.objects.filter(pk=self.run_id).first()
        return None if run is None else actions.request_knobs(run, self.user, knobs, advice=advice)

    async def user_still_valid(self) -> bool:
        """Read the session and the user again: logged out, deactivated, password changed
        (channels' get_user checks the session hash) or staff rights changed -> the socket
        closes, so it never outlives what it was opened with."""
        self.checked_at = time.monotonic()
        session = self.scope.get("session")
        key = getattr(session, "session_key", None)
        fresh = import_module(settings.SESSION_ENGINE).SessionStore(key) if key else None
        user = await get_user({"session": fresh}) if fresh is not None else None
        if (user is not None and user.is_authenticated and user.pk == self.user.pk
                and (user.is_active, user.is_staff, user.is_superuser) == self.rights):
            self.user = user
            return True
        await self.error("your session ended or your permissions changed: log in again",
                         status=401)
        await self.close(code=4401)
        return False

    async def error(self, message, errors=None, **extra):
        await self.send(text_data=json.dumps({"type": "error", "message": message,
                                              "errors": errors or {}, **extra}))
