"""HTTP to the SGLang servers: the sessions, their retries, and the errors users see.

- connection errors, timeouts and HTTP 5xx are retried with exponential backoff (`backoff_s`,
  twice that, ... at most 10 s) up to `retries` times; then `EngineError` names the server URL
  and the call. HTTP 4xx is not retried. Control calls are retried by urllib3's `Retry`;
  `/generate` attempts are made by the engine (trainer/engine/sglang/client.py: each needs a fresh
  rid). Every call has a connect timeout (`connect_timeout_s`) and a read timeout (`timeout_s`):
  nothing waits without one. Redirects are not followed and proxy settings from the environment
  are ignored.
- error messages carry the status code and the server's URL but never text from the response
  (a run's error is shown to every user of the dashboard); response bodies go to this module's
  log.

`ServerCalls` is the engine's side of it (a mixin of `SGLangEngine`: its timeouts, retries and
sessions); `Server` is one server's address and the engine's bookkeeping of it.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import weakref
from typing import Iterable

import requests
from requests.adapters import HTTPAdapter
from urllib3 import PoolManager
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError, ReadTimeoutError
from urllib3.util.retry import Retry

from trainer.engine.base import EngineError
from trainer.engine.sglang.urls import request_base

log = logging.getLogger(__name__)
BACKOFF_MAX_S = 10.0
DOWN = object()   # what a control call returns when its server was taken out of service


class Server:
    def __init__(self, url: str):
        self.url = url
        self.base = request_base(url)   # requests go to scheme://host:port/path only
        self.inflight = 0
        self.outstanding = 0   # tokens its calls in flight may still generate (their budgets)
        self.down = False   # failed every retry: no new requests, skipped by weight updates
        self.stale = False  # back in service, waiting for the current weights before requests
        self.failures = 0   # consecutive probes that found it down
        self.retry_at = 0.0  # monotonic time of the next probe while down


# --- HTTP ---------------------------------------------------------------------------------------
# requests + urllib3's Retry rather than httpx: urllib3's Retry retries exactly what this client
# must retry (connection errors, read timeouts and 5xx replies, for any method, with exponential
# backoff), while httpx's transport retries cover failed connects only, which would leave the
# 5xx and timeout retries hand-written.

def backoff_delay(backoff_s: float, retry_number: int) -> float:
    """Seconds to wait before retry `retry_number` (0 = the first retry)."""
    return min(backoff_s * (2 ** retry_number), BACKOFF_MAX_S)


class _Retry(Retry):
    """urllib3's Retry with this engine's backoff: `backoff_s` before the first retry, twice that
    before the second, ... (urllib3's own formula does not wait before the first retry)."""

    def get_backoff_time(self) -> float:
        return backoff_delay(self.backoff_factor, len(self.history) - 1) if self.history else 0.0


class _TrackingPoolManager(PoolManager):
    """urllib3's PoolManager, remembering every connection it makes, so that `Http.close()` can
    shut their sockets down: that wakes threads blocked reading a reply (closing the pools alone
    only closes the idle connections)."""

    def __init__(self, *args, **kwargs):
        self.connections: weakref.WeakSet = weakref.WeakSet()
        self.connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _new_pool(self, scheme, host, port, request_context=None):  # urllib3's override point
        pool = super()._new_pool(scheme, host, port, request_context)
        make_conn = pool.ConnectionCls

        def tracked(*args, **kwargs):
            conn = make_conn(*args, **kwargs)
            with self.connections_lock:
                self.connections.add(conn)
            return conn

        pool.ConnectionCls = tracked
        return pool


class _TrackingAdapter(HTTPAdapter):
    def init_poolmanager(self, connections, maxsize, block=False, **pool_kwargs):
        self._pool_connections, self._pool_maxsize, self._pool_block = connections, maxsize, block
        self.poolmanager = _TrackingPoolManager(num_pools=connections, maxsize=maxsize,
                                                block=block, **pool_kwargs)

    def shutdown_sockets(self) -> None:
        pm = self.poolmanager
        with pm.connections_lock:
            conns = list(pm.connections)
        for conn in conns:
            sock = getattr(conn, "sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Http:
    """Two `requests` sessions: `retrying` (urllib3 `Retry`: connection errors, read timeouts and
    5xx, `retries` times) for control calls, and `once` (no retries) for /generate, whose
    attempts the engine makes itself, and for best-effort calls. Keep-alive connections, at most
    `max_inflight` + a few per server. No proxies or .netrc from the environment and no
    redirects: requests go to the configured servers only."""

    def __init__(self, n_servers: int, max_inflight: int, retries: int, backoff_s: float):
        retry = _Retry(total=retries, connect=None, read=None, status=None, other=None,
                       allowed_methods=None,                   # POST too: SGLang's API is POST
                       status_forcelist=frozenset(range(500, 600)),
                       backoff_factor=backoff_s, backoff_max=BACKOFF_MAX_S,
                       raise_on_status=False,                  # the last 5xx reply comes back
                       respect_retry_after_header=False,       # no server-chosen waits
                       redirect=False)
        self._adapters = []
        self.retrying = self._session(retry, n_servers, max_inflight)
        self.once = self._session(Retry(0, read=False, redirect=False), n_servers, max_inflight)

    def _session(self, retry: Retry, n_servers: int, max_inflight: int) -> requests.Session:
        s = requests.Session()
        s.trust_env = False
        adapter = _TrackingAdapter(pool_connections=max(n_servers, 1),
                                   pool_maxsize=max_inflight + 8, max_retries=retry)
        self._adapters.append(adapter)
        s.mount("http://", adapter)
        s.mount("https://", adapter)
        return s

    def close(self) -> None:
        """Wake the threads blocked on a socket, then close the pools."""
        for a in self._adapters:
            a.shutdown_sockets()
        self.retrying.close()
        self.once.close()


class HTTPStatusError(Exception):
    """An HTTP error reply. Its message is the status code only: the body is the remote
    server's text, kept in `body` and logged, never copied into errors users see."""

    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}")


class ServerFailed(EngineError):
    """A /generate call failed every attempt (connection errors, timeouts, 5xx): the server
    is taken out of service when another one is left, else the run fails with this error."""


def snippet(body: bytes, n: int = 300) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text if len(text) <= n else text[:n] + "..."


class ServerCalls:
    """The engine's HTTP calls (a mixin: `self._http`, `self.retries`, `self.backoff_s`,
    `self.connect_timeout_s`, `self.timeout_s` and `self._closed` are the engine's, and so is
    `self._take_down`, which takes a server out of service)."""

    def _control(self, srv: Server, method: str, path: str, body: dict | None = None):
        """A control call of a weight update; a server that fails it every retry is taken out
        of service (returns DOWN)."""
        try:
            return self._call(srv, method, path, body)
        except ServerFailed as e:
            self._take_down(srv, e)
            return DOWN

    def _send_aborts(self, tickets: Iterable, abort_all: bool) -> None:
        tickets = list(tickets)
        if abort_all:
            servers = {id(t.server): t.server for t in tickets}.values()
            for srv in servers:
                self._abort_quietly(srv, None)
        else:
            for t in tickets:
                self._abort_quietly(t.server, t.rid)

    def _abort_quietly(self, srv: Server, rid: str | None) -> None:
        """Best effort: a server that is down fails the /generate call itself."""
        body = {"abort_all": True} if rid is None else {"rid": rid}
        try:
            self._request(srv, "POST", "/abort_request", body,
                          timeout=min(self.timeout_s, 5.0))
        except (requests.RequestException, HTTPStatusError):
            pass

    def _call(self, srv: Server, method: str, path: str, body: dict | None = None, *,
              retry: bool = True, timeout: float | None = None):
        """A control call; with `retry`, urllib3 retries connection errors, timeouts and 5xx
        `self.retries` times."""
        attempts = self.retries + 1 if retry else 1
        try:
            return self._request(srv, method, path, body, timeout=timeout, retry=retry)
        except HTTPStatusError as e:
            log_body(srv.url, f"{method} {path}", e)
            if e.status < 500:
                raise EngineError(f"SGLang server {srv.url}: {method} {path} "
                                  f"refused: {e}") from None
            err: BaseException = e   # a 5xx after the last retry
        except requests.RequestException as e:
            err = e
        raise ServerFailed(f"SGLang server {srv.url}: {method} {path} failed after "
                            f"{attempts} attempt{'s' if attempts > 1 else ''}: "
                            f"{describe(err)}") from None

    def _sleep_backoff(self, attempt: int) -> None:
        self._closed.wait(backoff_delay(self.backoff_s, attempt))

    def _request(self, srv: Server, method: str, path: str, body: dict | None = None, *,
                 timeout: float | None = None, retry: bool = False):
        """One HTTP call (`retry`: with urllib3's retries). Returns the parsed JSON body (None
        when empty or not JSON); raises HTTPStatusError on 4xx/5xx and
        requests.RequestException on transport errors."""
        session = self._http.retrying if retry else self._http.once
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        resp = session.request(method, srv.base + path, data=data, headers=headers,
                               allow_redirects=False,
                               timeout=(self.connect_timeout_s,
                                        self.timeout_s if timeout is None else timeout))
        raw = resp.content
        resp.close()
        if resp.status_code >= 400:
            raise HTTPStatusError(resp.status_code, raw)
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None


def log_body(url: str, call: str, err: "HTTPStatusError") -> None:
    if err.body:
        log.warning("SGLang server %s: %s: HTTP %s: %s", url, call, err.status, snippet(err.body))


def _causes(err: BaseException):
    """err and what it wraps: requests wraps urllib3's errors (in args, or MaxRetryError's
    `reason`), which wrap the socket's (as __cause__)."""
    seen = 0
    while err is not None and seen < 10:
        yield err
        seen += 1
        nxt = getattr(err, "reason", None)
        if not isinstance(nxt, BaseException):
            nxt = err.__cause__
        if nxt is None:
            nxt = next((a for a in err.args if isinstance(a, BaseException)), None)
        err = nxt if nxt is not None else err.__context__


def timed_out(err: BaseException) -> bool:
    # urllib3's NewConnectionError (e.g. connection refused) is a ConnectTimeoutError subclass
    return any(isinstance(e, (TimeoutError, requests.Timeout, ReadTimeoutError))
               or (isinstance(e, ConnectTimeoutError) and not isinstance(e, NewConnectionError))
               for e in _causes(err))


def describe(err: BaseException | None) -> str:
    """What went wrong, in words that never quote the remote server (e.g. a malformed status
    line it sent): the status code, "timed out", "connection refused" or the error's type,
    with the OS's text for a socket error."""
    if err is None:
        return "unknown error"
    if isinstance(err, HTTPStatusError):
        return str(err)
    causes = list(_causes(err))
    if any(isinstance(e, ConnectionRefusedError) for e in causes):
        return "connection refused (is the server running?)"
    if timed_out(err):
        return "timed out"
    root = causes[-1]
    if isinstance(root, OSError) and root.strerror:
        return f"{type(root).__name__}: {root.strerror}"
    return type(root).__name__

