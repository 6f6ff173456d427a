"""A rollout engine that drives one or more SGLang servers over their HTTP API.

It satisfies the same interface as the embedded engine (`trainer/engine/base.py`):

- every sample in flight is one `POST /generate` call with `input_ids` = prompt + response so
  far, `sampling_params` {temperature, top_p, max_new_tokens = min(remaining, what is left of
  the segment), stop_token_ids} and `return_logprob: true`. Tokens and log-probabilities are
  read from `meta_info.output_token_logprobs` ([logprob, token_id, text] per token), the finish
  reason from `meta_info.finish_reason.type` (stop | length | abort). A sample that hits its
  per-segment limit before its total budget leaves as SEGMENT, exactly as in the embedded
  engine, and continues from its last token when submitted again.
- the HTTP calls (`requests`, see `_Http`) run in a small thread pool; `step()` applies the
  responses that have arrived, waiting up to `wait_s` when none has, so callers do not spin.
  Responses are applied on the caller's thread only: a sample changes only inside `step()`,
  `abort()` and `update_weights()`.
- `abort(ids)` posts `/abort_request` ({"rid"} per request, {"abort_all": true} for all) and
  returns the partial samples once their responses come back (bounded wait; a response that
  never comes is dropped and the sample returned as it was before that call: nothing is lost
  or duplicated, the call's tokens are simply not kept).
- `update_weights()` on every server: `/pause_generation` (mode "abort": requests in flight
  come back with what they generated so far), the new weights with `weight_version`,
  `/flush_cache`, `/continue_generation`. The weights travel one of two ways (`weight_sync`):
  "distributed": a torch.distributed group of this process (rank 0) and the servers, built once
  with `/init_weights_update_group` (trainer/engine/weight_group.py), then per update
  `/begin_weight_update`, `/update_weights_from_distributed` while this process broadcasts each
  tensor, `/end_weight_update` -- no file; "disk": a `save_pretrained`-style directory
  (safetensors + config.json) under `weights_dir` and `/update_weights_from_disk`. A group that
  cannot be built or fails an update (a server gone) becomes a warning and the disk path from
  then on. The interrupted samples are resubmitted by the engine itself, so every token keeps
  the version of the weights that produced it (the embedded engine's `recompute_kv=True`
  behaviour; `recompute_kv` is ignored). `last_sync_bytes`: what the last update moved.
- connection errors, timeouts and HTTP 5xx are retried with exponential backoff (`backoff_s`,
  twice that, ... at most 10 s) up to `retries` times; then `EngineError` names the server URL
  and the call. HTTP 4xx is not retried. Control calls are retried by urllib3's `Retry`;
  `/generate` attempts are made by the engine (each needs a fresh rid, see below). Every call
  has a connect timeout (`connect_timeout_s`) and a read timeout (`timeout_s`): nothing waits
  without one. Redirects are not followed and proxy settings from the environment are ignored.
  Error messages carry the status code and the server's URL but never text from the response
  (a run's error is shown to every user of the dashboard); response bodies go to this module's
  log.
- weights folders: every `vNNNNNN` folder it writes holds a `.rlpilot-weights` marker, and it
  replaces or prunes only folders with that marker (never a folder someone else put there).

Request ids (`rid`) are "<engine nonce>-<request_id>-<call number>-<attempt>." rather than the
bare request id: SGLang's `/abort_request` aborts every request whose rid *starts with* the
given one, so rids must be prefix-free ("1" would also abort "10", "11", ...), and a resumed
sample must not reuse the rid of a call the server may still be finishing.

Per-token versions are the server's: `meta_info.weight_versions` spans ([{version, start, end}]
over the reply's tokens), else `meta_info.weight_version`, when it parses as a version this
engine has published (or the version the call was sent under); else the version at dispatch.

Several servers: requests go to the one with the fewest outstanding tokens (the budgets of its
calls in flight). A server whose /generate or weight-update
call fails every retry is taken out of service (a warning, which the runner records as an
event): its samples are resent to the others from their last returned token, and later updates
skip it. It is probed (`/health`) with back-off (1 s, 2 s, ... at most 30 s) and rejoins: at
once when no weights were published yet; else it first gets the current weights -- with the
next update while another server is generating, or at once when none is (also a server back
earlier and still waiting when the last generating one dies), from the host copy of the last
update's weights this engine keeps for that (the trainer's own may change meanwhile). With every server
out of service generation waits for one to come back (a warning) and fails with EngineError
only after `down_timeout_s`.

Tested against SGLang 0.5.23 (tests/test_sglang_real.py) and a stand-in for the faults a real
server cannot be made to produce on demand (tests/test_sglang_engine.py); see docs/engines.md.

Long because one client owns every server call (generate, abort, pause, weights, failover);
splitting it would spread the request bookkeeping those calls share.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import queue
import shutil
import socket
import threading
import time
import uuid
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3 import PoolManager
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError, ReadTimeoutError
from urllib3.util.retry import Retry

from trainer.engine.base import ABORT, LENGTH, SEGMENT, STOP, EngineError, EngineStats, RolloutEngine, Sample

__all__ = ["SGLangEngine", "EngineError", "parse_urls"]

log = logging.getLogger(__name__)
WEIGHTS_MARKER = ".rlpilot-weights"   # in every weights folder this engine wrote
_DOWN = object()   # what a control call returns when its server was taken out of service
_BACKOFF_MAX_S = 10.0


def parse_urls(urls: str | Iterable[str]) -> list[str]:
    """'http://a:30000, http://b:30000' -> ['http://a:30000', 'http://b:30000']."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip().rstrip("/") for u in items if u and u.strip()]
    for u in out:
        parts = urlsplit(u)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) server URL: {u!r} "
                             "(expected e.g. http://127.0.0.1:30000)")
    return out


class _Server:
    def __init__(self, url: str):
        self.url = url
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if ":" in host:  # IPv6
            host = f"[{host}]"
        # requests are sent to scheme://host:port/path only: no user:password@, no ?query
        self.base = f"{parts.scheme}://{host}:{port}{parts.path.rstrip('/')}"
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

def _backoff_delay(backoff_s: float, retry_number: int) -> float:
    """Seconds to wait before retry `retry_number` (0 = the first retry)."""
    return min(backoff_s * (2 ** retry_number), _BACKOFF_MAX_S)


class _Retry(Retry):
    """urllib3's Retry with this engine's backoff: `backoff_s` before the first retry, twice that
    before the second, ... (urllib3's own formula does not wait before the first retry)."""

    def get_backoff_time(self) -> float:
        return _backoff_delay(self.backoff_factor, len(self.history) - 1) if self.history else 0.0


class _TrackingPoolManager(PoolManager):
    """urllib3's PoolManager, remembering every connection it makes, so that `_Http.close()` can
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


class _Http:
    """Two `requests` sessions: `retrying` (urllib3 `Retry`: connection errors, read timeouts and
    5xx, `retries` times) for control calls, and `once` (no retries) for /generate, whose
    attempts the engine makes itself, and for best-effort calls. Keep-alive connections, at most
    `max_inflight` + a few per server. No proxies or .netrc from the environment and no
    redirects: requests go to the configured servers only."""

    def __init__(self, n_servers: int, max_inflight: int, retries: int, backoff_s: float):
        retry = _Retry(total=retries, connect=None, read=None, status=None, other=None,
                       allowed_methods=None,                   # POST too: SGLang's API is POST
                       status_forcelist=frozenset(range(500, 600)),
                       backoff_factor=backoff_s, backoff_max=_BACKOFF_MAX_S,
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


class _HTTPStatusError(Exception):
    """An HTTP error reply. Its message is the status code only: the body is the remote
    server's text, kept in `body` and logged, never copied into errors users see."""

    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}")


class _ServerFailed(EngineError):
    """A /generate call failed every attempt (connection errors, timeouts, 5xx): the server
    is taken out of service when another one is left, else the run fails with this error."""


def _snippet(body: bytes, n: int = 300) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text if len(text) <= n else text[:n] + "..."


class _Ticket:
    """One /generate call for one sample (a sample makes several over its life)."""

    __slots__ = ("sample", "server", "base_rid", "rid", "version", "user_abort", "update_abort",
                 "n_input", "budget")

    def __init__(self, sample: Sample, server: _Server, base_rid: str, version: int, n_input: int):
        self.sample, self.server, self.base_rid = sample, server, base_rid
        self.rid = base_rid + "0."
        self.version = version
        self.user_abort = False    # abort() asked for it: return the sample to abort's caller
        self.update_abort = False  # a weight update interrupted it: resubmit it ourselves
        self.n_input = n_input
        self.budget = 0            # max_new_tokens of the call (the server's outstanding tokens)


class SGLangEngine(RolloutEngine):
    def __init__(self, urls: str | Iterable[str], *, eos_token_ids: Iterable[int] = (),
                 model_config=None, weights_dir: str | os.PathLike | None = None,
                 timeout_s: float = 300.0, connect_timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.2, max_inflight: int = 256, abort_timeout_s: float = 10.0,
                 wait_s: float = 0.05, keep_weight_versions: int = 2, check_health: bool = True,
                 max_unrequested_aborts: int = 3, weight_sync: str = "disk",
                 down_timeout_s: float = 600.0, rejoin_backoff_s: float = 1.0):
        self.servers = [_Server(u) for u in parse_urls(urls)]
        if not self.servers:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.eos = sorted(set(int(t) for t in eos_token_ids))
        self.model_config = model_config
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self.retries, self.backoff_s = int(retries), float(backoff_s)
        self.max_inflight = max(1, int(max_inflight))
        self.abort_timeout_s, self.wait_s = float(abort_timeout_s), float(wait_s)
        self.keep_weight_versions = max(1, int(keep_weight_versions))
        self.max_unrequested_aborts = int(max_unrequested_aborts)
        if weight_sync not in ("distributed", "disk"):
            raise ValueError(f"weight_sync: 'distributed' or 'disk', not {weight_sync!r}")
        self.weight_sync = weight_sync
        self.down_timeout_s = float(down_timeout_s)
        self.rejoin_backoff_s = float(rejoin_backoff_s)
        # since when no /generate has succeeded with every server out of service, and why
        self._all_down_since: float | None = None
        self._last_down_error = ""
        self._last_tensors: dict | None = None       # host copy of `version`'s weights (rejoins)
        self._weight_group = None
        self._weight_group_urls: list[str] = []
        self.last_sync_bytes = 0

        self.version = 0
        self.generator = None  # no local sampling RNG (checkpoints store None)
        self.stats = EngineStats()
        self.orphaned = 0            # calls whose response never came back after an abort
        self.requeued = 0            # samples resubmitted after a weight update / server abort
        self.warnings: list[str] = []  # non-fatal problems (e.g. a /flush_cache refused)
        self.lock = threading.RLock()
        self._closed = threading.Event()
        self._nonce = uuid.uuid4().hex[:8]
        self._calls = itertools.count()
        self._rr = itertools.count()
        self._published: set[int] = set()
        self._queue: deque[Sample] = deque()       # submitted, not yet sent
        self._tickets: dict[int, _Ticket] = {}      # request_id -> the call in flight
        self._finished: list[Sample] = []           # left the engine, not yet returned by step()
        self._results: queue.Queue = queue.Queue()  # (ticket, response | None, error | None)
        self._unrequested_aborts: dict[int, int] = {}
        self._http = _Http(len(self.servers), self.max_inflight, self.retries, self.backoff_s)
        self._pool = ThreadPoolExecutor(max_workers=self.max_inflight,
                                        thread_name_prefix="rlpilot-sglang")
        if check_health:
            for srv in self.servers:
                self._call(srv, "GET", "/health")

    # --- public interface -----------------------------------------------------------------------
    def submit(self, samples: Iterable[Sample]) -> None:
        with self.lock:
            self._check_open()
            for s in samples:
                s.check()
                if not s.prompt_ids:
                    raise ValueError("empty prompt")
                if s.request_id in self._tickets:
                    raise ValueError(f"sample {s.request_id} is already in the engine")
                s.finish_reason = None
                s.segment_tokens = 0
                self._unrequested_aborts.pop(s.request_id, None)
                if s.remaining <= 0:  # nothing left to generate: finished already
                    s.finish_reason = LENGTH
                    self._finished.append(s)
                else:
                    self._queue.append(s)
            self._dispatch()

    @property
    def num_pending(self) -> int:
        return len(self._queue) + len(self._tickets) + len(self._finished)

    @property
    def num_running(self) -> int:
        return len(self._tickets)

    def step(self) -> list[Sample]:
        with self.lock:
            self._check_open()
            self._probe_down_servers()
            self._dispatch()
            if not self._finished and self._tickets:
                self._drain(self.wait_s)
            else:
                self._drain(0.0)
                if self._queue and not self._usable_servers():   # waiting for a server
                    self._closed.wait(self.wait_s)
            self._dispatch()
            out, self._finished = self._finished, []
            return out

    def abort(self, request_ids: Iterable[int] | None = None,
              keep_cache: bool = False) -> list[Sample]:
        with self.lock:
            wanted = None if request_ids is None else set(request_ids)

            def hit(s: Sample) -> bool:
                return wanted is None or s.request_id in wanted

            out: list[Sample] = []
            keep: deque[Sample] = deque()
            for s in self._queue:
                if hit(s):
                    s.finish_reason = ABORT
                    out.append(s)
                else:
                    keep.append(s)
            self._queue = keep
            # samples that already left the engine (finished during an earlier wait) come back
            # as they are: a finished sample keeps its real finish reason
            still = []
            for s in self._finished:
                (out if hit(s) else still).append(s)
            self._finished = still
            targets = {rid: t for rid, t in self._tickets.items() if hit(t.sample)}
            if not targets:
                return out
            for t in targets.values():
                t.user_abort = True
            self._send_aborts(targets.values(), abort_all=wanted is None)
            deadline = time.monotonic() + self.abort_timeout_s
            resend = time.monotonic() + 0.5
            collected: list[Sample] = []
            while any(self._tickets.get(r) is t for r, t in targets.items()):
                now = time.monotonic()
                if now >= deadline:
                    break
                if now >= resend:  # a call that reached the server after the abort did
                    self._send_aborts([t for r, t in targets.items()
                                       if self._tickets.get(r) is t], abort_all=False)
                    resend = now + 0.5
                self._drain(min(0.05, deadline - now), aborted_into=collected)
            for r, t in targets.items():
                if self._tickets.get(r) is t:  # never came back: drop the call, keep the sample
                    del self._tickets[r]
                    t.sample.finish_reason = ABORT
                    collected.append(t.sample)
                    self.orphaned += 1
            return out + collected

    def update_weights(self, named_tensors, version: int, recompute_kv: bool = False) -> None:
        """Pause -> the new weights (broadcast, or from disk) -> flush -> continue on every
        server. Calls in flight are interrupted and resubmitted under the new weights, so their
        tokens keep exact versions (`recompute_kv` is implied)."""
        with self.lock:
            self._check_open()
            tensors = self._tensors_to_send(named_tensors)
            # a host copy of this version for a server that rejoins when none holds it: the
            # trainer's own tensors change with its next update, maybe while that happens
            self._last_tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
            for t in self._tickets.values():
                t.update_abort = True
            paused: list[_Server] = []
            ok = False
            try:
                for srv in self._live_servers():
                    if self._control(srv, "POST", "/pause_generation", {"mode": "abort"}) is not _DOWN:
                        paused.append(srv)
                if self._live_servers() and not (self.weight_sync == "distributed"
                                                 and self._broadcast(tensors, version)):
                    self._load_from_disk(tensors, version)
                for srv in self._live_servers():
                    srv.stale = False
                self._published.add(int(version))
                self.version = version
                for srv in self._live_servers():
                    try:
                        self._call(srv, "POST", "/flush_cache", retry=False)
                    except EngineError as e:  # busy servers may refuse; the update flushed anyway
                        self._warn(str(e))
                ok = True
            finally:
                errors = []
                for srv in paused:  # never leave a server paused, even when the update failed
                    try:
                        if not srv.down:
                            self._control(srv, "POST", "/continue_generation", {})
                    except EngineError as e:
                        errors.append(e)
                if ok and errors:
                    raise errors[0]
            self._dispatch()

    def _load_from_disk(self, tensors: dict, version: int, servers: list | None = None) -> None:
        path = self._save_weights(tensors, version)
        servers = self._live_servers() if servers is None else servers
        for srv in servers:
            res = self._control(srv, "POST", "/update_weights_from_disk",
                                {"model_path": str(path), "weight_version": str(version),
                                 "flush_cache": True})
            if isinstance(res, dict) and res.get("success") is False:
                log.warning("SGLang server %s refused /update_weights_from_disk: %s",
                            srv.url, _snippet(json.dumps(res).encode()))
                raise EngineError(f"SGLang server {srv.url}: POST "
                                  f"/update_weights_from_disk refused {path} "
                                  "(its reply is in the worker's log)")
        self.last_sync_bytes = sum(t.numel() * t.element_size() for t in tensors.values()) * len(
            servers)

    def _broadcast(self, tensors: dict, version: int) -> bool:
        """The weights to every live server over the weight group; False (after a warning, and
        with the disk path from now on) when the group cannot be built or the update fails."""
        servers = self._live_servers()
        try:
            group = self._group_for(servers, next(iter(tensors.values())).device)
            names = list(tensors)
            body = {"names": names, "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
                    "shapes": [list(tensors[n].shape) for n in names], "group_name": group.name,
                    "weight_version": str(version), "flush_cache": True}
            for srv in servers:
                self._call(srv, "POST", "/begin_weight_update", {}, retry=False)
            replies: dict[str, object] = {}

            def receive(srv):
                try:
                    replies[srv.url] = self._call(srv, "POST", "/update_weights_from_distributed",
                                                  body, retry=False)
                except EngineError as e:
                    replies[srv.url] = e

            threads = [threading.Thread(target=receive, args=(srv,), daemon=True) for srv in servers]
            for t in threads:
                t.start()
            for n in names:
                group.broadcast(tensors[n])
            for t in threads:
                t.join(self.timeout_s)
            for srv in servers:
                self._call(srv, "POST", "/end_weight_update", {}, retry=False)
            for url, reply in replies.items():
                if isinstance(reply, EngineError):
                    raise reply
                if isinstance(reply, dict) and reply.get("success") is False:
                    raise EngineError(f"SGLang server {url} refused /update_weights_from_distributed")
            if len(replies) < len(servers):
                raise EngineError("a server did not answer /update_weights_from_distributed in time")
        except (EngineError, RuntimeError, OSError) as e:
            self._close_group()
            self.weight_sync = "disk"
            self._warn(f"weights over torch.distributed failed ({e}); "
                       "/update_weights_from_disk from now on")
            return False
        self.last_sync_bytes = sum(t.numel() * t.element_size() for t in tensors.values()) * len(servers)
        return True

    def _group_for(self, servers: list[_Server], device):
        """The weight group with exactly these servers, built on first use."""
        from trainer.engine.weight_group import WeightGroup

        urls = [srv.url for srv in servers]
        if self._weight_group is not None and self._weight_group_urls == urls:
            return self._weight_group
        self._close_group()   # a server left: a new group with those still in service
        tp = []
        for srv in servers:
            info = self._call(srv, "GET", "/server_info")
            tp.append(int(info.get("tp_size", 1)) if isinstance(info, dict) else 1)
        by_url = {srv.url: srv for srv in servers}
        self._weight_group = WeightGroup(
            urls, tp, name=f"rlpilot-{self._nonce}-{next(self._calls)}", timeout_s=self.timeout_s,
            backend="nccl" if getattr(device, "type", "cpu") == "cuda" else "gloo",
            join=lambda url, body: self._call(by_url[url], "POST", "/init_weights_update_group",
                                              body, retry=False))
        self._weight_group_urls = urls
        return self._weight_group

    def _close_group(self) -> None:
        group, self._weight_group = self._weight_group, None
        if group is None:
            return
        group.close()
        for srv in self.servers:   # the servers still up let go of their end
            if not srv.down and srv.url in self._weight_group_urls:
                try:
                    self._call(srv, "POST", "/destroy_weights_update_group",
                               {"group_name": group.name}, retry=False, timeout=5.0)
                except EngineError:
                    pass

    def _tensors_to_send(self, named_tensors) -> dict:
        """The servers' weights: rotary caches left out, and the head when it is the (tied)
        embedding; contiguous, on the trainer's device."""
        tied = bool(getattr(self.model_config, "tie_word_embeddings", False))
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        return {name: t.detach().contiguous() for name, t in items
                if not name.endswith("inv_freq") and not (tied and name == "lm_head.weight")}

    def close(self) -> None:
        with self.lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self._tickets:
                for srv in {id(t.server): t.server for t in self._tickets.values()}.values():
                    try:
                        self._call(srv, "POST", "/abort_request", {"abort_all": True},
                                   retry=False, timeout=2.0)
                    except EngineError:
                        pass
            self._close_group()
            self._queue.clear()
            self._tickets.clear()
            self._finished.clear()
            self._http.close()  # wakes the pool's threads blocked on a socket
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --- dispatch and responses -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed.is_set():
            raise EngineError("the SGLang engine is closed")

    def _live_servers(self) -> list[_Server]:
        """In service (a stale one too: weight updates are what bring it up to date)."""
        return [srv for srv in self.servers if not srv.down]

    def _usable_servers(self) -> list[_Server]:
        """In service and holding the current weights: the ones requests go to."""
        return [srv for srv in self.servers if not srv.down and not srv.stale]

    def _pick_server(self) -> _Server:
        live = self._usable_servers()
        start = next(self._rr) % len(live)
        order = live[start:] + live[:start]
        # least outstanding tokens (a long answer weighs what it may still cost), then fewest
        # calls; round-robin among equals
        return min(order, key=lambda s: (s.outstanding, s.inflight))

    def _dispatch(self) -> None:
        if not self._usable_servers():
            self._refresh_stale()
            if not self._usable_servers():
                self._check_down_timeout()
                return
        while self._queue and len(self._tickets) < self.max_inflight:
            s = self._queue.popleft()
            srv = self._pick_server()
            seg = s.params.segment_max_tokens
            max_new = s.remaining if seg is None else min(s.remaining, seg - s.segment_tokens)
            ids = s.prompt_ids + s.response_ids
            base = f"{self._nonce}-{s.request_id}-{next(self._calls)}-"
            t = _Ticket(s, srv, base, self.version, len(ids))
            sp: dict[str, Any] = {"temperature": float(s.params.temperature),
                                  "top_p": float(s.params.top_p),
                                  "max_new_tokens": int(max(max_new, 1))}
            if self.eos:
                sp["stop_token_ids"] = list(self.eos)
            payload = {"input_ids": ids, "sampling_params": sp, "return_logprob": True,
                       "stream": False}
            srv.inflight += 1
            t.budget = int(max(max_new, 1))
            srv.outstanding += t.budget
            self._tickets[s.request_id] = t
            self.stats.prefill_tokens += len(ids)
            self._pool.submit(self._generate_worker, t, payload)

    def _generate_worker(self, t: _Ticket, payload: dict) -> None:
        """Runs in the pool: one /generate call with retries; the result goes to the queue.

        The attempts are made here, not by urllib3's Retry: each one carries a fresh rid (the
        server may still be finishing the previous one), a timed-out attempt is aborted on the
        server before the next, and an abort() stops further attempts. A transport-level retry
        resends the same body and cannot do any of that."""
        try:
            res = None
            for attempt in range(self.retries + 1):
                if t.user_abort or self._closed.is_set():
                    break  # aborted before it was (re)sent: no tokens
                t.rid = f"{t.base_rid}{attempt}."
                payload["rid"] = t.rid
                try:
                    res = self._request(t.server, "POST", "/generate", payload)
                    break
                except _HTTPStatusError as e:
                    if t.user_abort or t.update_abort:
                        break  # an aborted call may come back as an error: treat it as aborted
                    _log_body(t.server.url, "POST /generate", e)
                    if e.status < 500:
                        raise EngineError(f"SGLang server {t.server.url}: POST /generate "
                                          f"refused the request: {e}") from None
                    err = e
                except requests.RequestException as e:
                    if t.user_abort or t.update_abort:
                        break
                    err = e
                    if _timed_out(e):  # the server may still be working on it
                        self._abort_quietly(t.server, t.rid)
                if attempt == self.retries:
                    raise _ServerFailed(f"SGLang server {t.server.url}: POST /generate failed "
                                        f"after {attempt + 1} attempts: {_describe(err)}") from None
                self._sleep_backoff(attempt)
            self._results.put((t, res, None))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self._results.put((t, None, e))

    def _drain(self, wait_s: float, aborted_into: list[Sample] | None = None) -> None:
        """Apply the responses that have arrived (waiting up to wait_s for the first)."""
        first = True
        while True:
            try:
                item = self._results.get(timeout=wait_s) if first and wait_s > 0 \
                    else self._results.get_nowait()
            except queue.Empty:
                return
            first = False
            self._apply(*item, aborted_into=aborted_into)

    def _apply(self, t: _Ticket, res: dict | None, err: BaseException | None,
               aborted_into: list[Sample] | None) -> None:
        t.server.inflight -= 1
        t.server.outstanding -= t.budget
        s = t.sample
        if self._tickets.get(s.request_id) is not t:
            return  # orphaned by an abort that gave up waiting: the sample moved on
        del self._tickets[s.request_id]
        if err is not None:
            if isinstance(err, _ServerFailed) and not t.user_abort and self._fail_over(t, err):
                return
            if not (t.user_abort or t.update_abort):
                raise err if isinstance(err, EngineError) else EngineError(
                    f"SGLang server {t.server.url}: POST /generate: {_describe(err)}") from err
            res = None
        if res is not None:   # a server answered: the outage (if any) is over
            self._all_down_since, t.server.failures = None, 0
        ids, lps, ftype, fmsg, versions = self._parse(t, res)
        for tok, lp, v in zip(ids, lps, versions):
            s.response_ids.append(tok)
            s.logprobs.append(lp)
            s.versions.append(v)
        s.segment_tokens += len(ids)
        self.stats.generated_tokens += len(ids)
        seg = s.params.segment_max_tokens
        if ids and ids[-1] in self.eos:
            reason = STOP
        elif s.remaining <= 0:
            reason = LENGTH
        elif seg is not None and s.segment_tokens >= seg:
            reason = SEGMENT
        elif ftype == "abort":
            reason = ABORT
        elif ftype == "stop":
            reason = STOP
        else:  # "length" short of our budget: the server capped it (context length)
            reason = LENGTH
        if reason == ABORT and not t.user_abort:
            if t.update_abort:
                self.requeued += 1
                self._queue.appendleft(s)
                return
            # aborted by the server or someone else: resubmit a few times, then give up loudly
            n = self._unrequested_aborts.get(s.request_id, 0) + (0 if ids else 1)
            self._unrequested_aborts[s.request_id] = n
            if n > self.max_unrequested_aborts:
                log.warning("SGLang server %s aborted a request: %s", t.server.url, _snippet(
                    str(fmsg).encode()))
                raise EngineError(f"SGLang server {t.server.url}: POST /generate was aborted by "
                                  f"the server {n} times without progress")
            self.requeued += 1
            self._queue.appendleft(s)
            return
        if t.user_abort and reason == SEGMENT:  # not finished: abort's caller parks it
            reason = ABORT
        s.finish_reason = reason
        self._unrequested_aborts.pop(s.request_id, None)
        if t.user_abort and aborted_into is not None:
            aborted_into.append(s)
        else:
            self._finished.append(s)

    def _fail_over(self, t: _Ticket, err: EngineError) -> bool:
        """Take t's server out of service and resend its sample to the others (or, with none
        left, to the first that comes back), from the tokens it had before this call (the
        failed call returned none)."""
        if not self._take_down(t.server, err):
            return False
        self.requeued += 1
        self._queue.appendleft(t.sample)
        return True

    def _take_down(self, srv: _Server, err: EngineError) -> bool:
        """Mark srv out of service after it failed every retry (a warning) and schedule its
        first probe. Always True: with no server left, generation waits for one to come back
        (see `_check_down_timeout`)."""
        if srv.down:
            return True
        srv.down, srv.stale = True, False
        srv.retry_at = time.monotonic() + self._rejoin_delay(srv.failures)
        self._last_down_error = str(err)
        left = [x.url for x in self.servers if not x.down]
        if left:
            self._warn(f"{err}; taken out of service, its requests go to {', '.join(left)}; "
                       "it rejoins when it answers again")
        else:
            self._warn(f"{err}; every SGLang server is out of service: generation waits for one "
                       f"to come back (at most {self.down_timeout_s:g} s)")
        return True

    def _probe_down_servers(self) -> None:
        """Ask each server out of service whose back-off has passed whether it is back."""
        now = time.monotonic()
        for srv in self.servers:
            if not srv.down or srv.retry_at > now:
                continue
            try:
                self._call(srv, "GET", "/health", retry=False, timeout=2.0)
            except EngineError:
                srv.failures += 1
                srv.retry_at = time.monotonic() + self._rejoin_delay(srv.failures)
                continue
            self._rejoin(srv)

    def _rejoin_delay(self, failures: int) -> float:
        """Back-off between probes: rejoin_backoff_s, twice that, ... at most 30 s. A server
        that answers /health but fails its requests again keeps its count (reset only by a
        request that succeeds), so a flapping server is probed ever less often."""
        return min(self.rejoin_backoff_s * 2 ** min(failures, 16), 30.0)

    def _rejoin(self, srv: _Server) -> None:
        """A server back in service, with the current weights before it gets a request."""
        srv.down = False
        if not self._published:
            self._warn(f"SGLang server {srv.url} is back in service")
            return
        srv.stale = True
        if self._usable_servers():   # the next update brings it up to date
            self._warn(f"SGLang server {srv.url} is back; it takes requests after the next "
                       "weight update")
        else:
            self._refresh_stale()

    def _refresh_stale(self) -> None:
        """No server holds the current weights (the others died since): the servers back in
        service get them now, from the host copy of the last update, rather than waiting for an
        update that cannot come while nothing generates."""
        stale = [srv for srv in self.servers if srv.stale and not srv.down]
        if not stale or self._last_tensors is None:
            return
        try:
            self._load_from_disk(self._last_tensors, self.version, stale)
        except EngineError as e:
            for srv in stale:
                srv.down, srv.failures = True, srv.failures + 1
                srv.retry_at = time.monotonic() + self._rejoin_delay(srv.failures)
            self._warn(f"servers back in service did not take the weights: {e}")
            return
        for srv in stale:
            if srv.down:   # failed the load itself (taken out again)
                continue
            with contextlib.suppress(EngineError):
                self._call(srv, "POST", "/flush_cache", retry=False)
            srv.stale = False
            self._warn(f"SGLang server {srv.url} is back in service with weights version {self.version}")

    def _check_down_timeout(self) -> None:
        if self._all_down_since is None:
            self._all_down_since = time.monotonic()
        elif time.monotonic() - self._all_down_since > self.down_timeout_s:
            raise EngineError(f"no SGLang server has answered for more than {self.down_timeout_s:g} s "
                              f"(last: {self._last_down_error})")

    def _control(self, srv: _Server, method: str, path: str, body: dict | None = None):
        """A control call of a weight update; a server that fails it every retry is taken out
        of service (returns _DOWN)."""
        try:
            return self._call(srv, method, path, body)
        except _ServerFailed as e:
            self._take_down(srv, e)
            return _DOWN

    def _warn(self, message: str) -> None:
        log.warning("%s", message)
        self.warnings.append(message)

    def take_warnings(self) -> list[str]:
        """The non-fatal problems since the last call (a server taken out of service, a refused
        /flush_cache): the runner records each as a warning event."""
        with self.lock:
            out, self.warnings = self.warnings, []
            return out

    def _parse(self, t: _Ticket, res: dict | None):
        """-> token ids, logprobs, finish type, finish message, weight_version."""
        if res is None:
            return [], [], "abort", "aborted", []
        if not isinstance(res, dict) or "meta_info" not in res:
            if t.user_abort or t.update_abort:
                return [], [], "abort", "aborted", []
            log.warning("SGLang server %s: /generate reply without meta_info: %s",
                        t.server.url, _snippet(json.dumps(res).encode()))
            raise EngineError(f"SGLang server {t.server.url}: POST /generate returned no "
                              "meta_info (the reply is in the worker's log)")
        meta = res["meta_info"] or {}
        fr = meta.get("finish_reason")
        ftype = fr.get("type") if isinstance(fr, dict) else (fr or "")
        fmsg = fr.get("message", "") if isinstance(fr, dict) else ""
        entries = meta.get("output_token_logprobs")
        out_ids = res.get("output_ids")
        if entries is None:
            if out_ids:
                raise EngineError(f"SGLang server {t.server.url}: POST /generate returned "
                                  "tokens without meta_info.output_token_logprobs "
                                  "(return_logprob ignored?)")
            entries = []
        lps = [float(e[0]) for e in entries]
        ids = [int(e[1]) for e in entries]
        if out_ids is not None and list(map(int, out_ids)) != ids:
            raise EngineError(f"SGLang server {t.server.url}: POST /generate: output_ids and "
                              f"output_token_logprobs disagree ({len(out_ids)} vs {len(ids)} "
                              "tokens)")
        return ids, lps, ftype, fmsg, self._token_versions(meta, len(ids), t.version)

    def _token_versions(self, meta: dict, n: int, dispatch_version: int) -> list[int]:
        """The policy version of each of the n tokens, as the server reports it:
        `meta_info.weight_versions` spans ([{version, start, end}], SGLang >= 0.5.2x, present
        when the weights changed under a running request), else `meta_info.weight_version` for
        all of them. A version this engine never published (e.g. the server's "default" before
        the first update) reads as the version the call was sent under."""
        out = [self._token_version(meta.get("weight_version"), dispatch_version)] * n
        spans = meta.get("weight_versions")
        if isinstance(spans, list):
            for span in spans:
                if isinstance(span, dict):
                    v = self._token_version(span.get("version"), dispatch_version)
                    start, end = int(span.get("start", 0)), int(span.get("end", n))
                    out[max(start, 0):min(end, n)] = [v] * max(0, min(end, n) - max(start, 0))
        return out

    def _token_version(self, wv, dispatch_version: int) -> int:
        try:
            v = int(str(wv))
        except (TypeError, ValueError):
            return dispatch_version
        return v if v == dispatch_version or v in self._published else dispatch_version

    # --- control calls ----------------------------------------------------------------------------
    def _send_aborts(self, tickets: Iterable[_Ticket], abort_all: bool) -> None:
        tickets = list(tickets)
        if abort_all:
            servers = {id(t.server): t.server for t in tickets}.values()
            for srv in servers:
                self._abort_quietly(srv, None)
        else:
            for t in tickets:
                self._abort_quietly(t.server, t.rid)

    def _abort_quietly(self, srv: _Server, rid: str | None) -> None:
        """Best effort: a server that is down fails the /generate call itself."""
        body = {"abort_all": True} if rid is None else {"rid": rid}
        try:
            self._request(srv, "POST", "/abort_request", body,
                          timeout=min(self.timeout_s, 5.0))
        except (requests.RequestException, _HTTPStatusError):
            pass

    def _call(self, srv: _Server, method: str, path: str, body: dict | None = None, *,
              retry: bool = True, timeout: float | None = None):
        """A control call; with `retry`, urllib3 retries connection errors, timeouts and 5xx
        `self.retries` times."""
        attempts = self.retries + 1 if retry else 1
        try:
            return self._request(srv, method, path, body, timeout=timeout, retry=retry)
        except _HTTPStatusError as e:
            _log_body(srv.url, f"{method} {path}", e)
            if e.status < 500:
                raise EngineError(f"SGLang server {srv.url}: {method} {path} "
                                  f"refused: {e}") from None
            err: BaseException = e   # a 5xx after the last retry
        except requests.RequestException as e:
            err = e
        raise _ServerFailed(f"SGLang server {srv.url}: {method} {path} failed after "
                            f"{attempts} attempt{'s' if attempts > 1 else ''}: "
                            f"{_describe(err)}") from None

    def _sleep_backoff(self, attempt: int) -> None:
        self._closed.wait(_backoff_delay(self.backoff_s, attempt))

    def _request(self, srv: _Server, method: str, path: str, body: dict | None = None, *,
                 timeout: float | None = None, retry: bool = False):
        """One HTTP call (`retry`: with urllib3's retries). Returns the parsed JSON body (None
        when empty or not JSON); raises _HTTPStatusError on 4xx/5xx and
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
            raise _HTTPStatusError(resp.status_code, raw)
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    # --- weights ----------------------------------------------------------------------------------
    def _save_weights(self, named_tensors, version: int) -> Path:
        """A save_pretrained-style directory the servers load with /update_weights_from_disk."""
        import tempfile

        import torch
        from safetensors.torch import save_file

        if self.weights_dir is None:
            self.weights_dir = Path(tempfile.mkdtemp(prefix="rlpilot-sglang-weights-"))
        root = self.weights_dir.resolve()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"v{int(version):06d}"
        tmp = root / f".tmp-v{int(version):06d}"
        for p in (final, tmp):   # replace only what this engine wrote
            if p.exists() and not (p / WEIGHTS_MARKER).is_file():
                raise EngineError(f"{p} exists and was not written by rlpilot: not replacing it "
                                  "(choose an empty folder for the engine weights)")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        (tmp / WEIGHTS_MARKER).write_text(f"written by rlpilot's SGLang engine, version {int(version)}\n")
        tensors: dict[str, Any] = {}
        seen: set[int] = set()
        with torch.no_grad():
            for name, t in named_tensors.items():
                t = t.detach().to("cpu").contiguous()
                ptr = t.untyped_storage().data_ptr()
                if ptr in seen:  # safetensors refuses shared storage
                    t = t.clone()
                seen.add(ptr)
                tensors[name] = t
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if self.model_config is not None:
            self.model_config.save_pretrained(str(tmp))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        old = sorted(p for p in root.glob("v*")
                     if p.is_dir() and p != final and (p / WEIGHTS_MARKER).is_file())
        for p in old[:max(0, len(old) - (self.keep_weight_versions - 1))]:
            shutil.rmtree(p, ignore_errors=True)
        return final


def _log_body(url: str, call: str, err: "_HTTPStatusError") -> None:
    if err.body:
        log.warning("SGLang server %s: %s: HTTP %s: %s", url, call, err.status, _snippet(err.body))


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


def _timed_out(err: BaseException) -> bool:
    # urllib3's NewConnectionError (e.g. connection refused) is a ConnectTimeoutError subclass
    return any(isinstance(e, (TimeoutError, requests.Timeout, ReadTimeoutError))
               or (isinstance(e, ConnectTimeoutError) and not isinstance(e, NewConnectionError))
               for e in _causes(err))


def _describe(err: BaseException | None) -> str:
    """What went wrong, in words that never quote the remote server (e.g. a malformed status
    line it sent): the status code, "timed out", "connection refused" or the error's type,
    with the OS's text for a socket error."""
    if err is None:
        return "unknown error"
    if isinstance(err, _HTTPStatusError):
        return str(err)
    causes = list(_causes(err))
    if any(isinstance(e, ConnectionRefusedError) for e in causes):
        return "connection refused (is the server running?)"
    if _timed_out(err):
        return "timed out"
    root = causes[-1]
    if isinstance(root, OSError) and root.strerror:
        return f"{type(root).__name__}: {root.strerror}"
    return type(root).__name__

