"""A rollout engine that drives one or more SGLang servers over their HTTP API.

It satisfies the same interface as the embedded engine (`trainer/engine/base.py`):

- every sample in flight is one `POST /generate` call with `input_ids` = prompt + response so
  far, `sampling_params` {temperature, top_p, max_new_tokens = min(remaining, what is left of
  the segment), stop_token_ids} and `return_logprob: true`. Tokens and log-probabilities are
  read from `meta_info.output_token_logprobs` ([logprob, token_id, text] per token), the finish
  reason from `meta_info.finish_reason.type` (stop | length | abort). A sample that hits its
  per-segment limit before its total budget leaves as SEGMENT, exactly as in the embedded
  engine, and continues from its last token when submitted again.
- the HTTP calls (`requests`, see `transport.Http`) run in a small thread pool; `step()` applies the
  responses that have arrived, waiting up to `wait_s` when none has, so callers do not spin.
  Responses are applied on the caller's thread only: a sample changes only inside `step()`,
  `abort()` and `update_weights()`.
- `abort(ids)` posts `/abort_request` ({"rid"} per request, {"abort_all": true} for all) and
  returns the partial samples once their responses come back (bounded wait; a response that
  never comes is dropped and the sample returned as it was before that call: nothing is lost
  or duplicated, the call's tokens are simply not kept).
- `update_weights()` pauses every server, sends the new weights, flushes and continues
  (trainer/engine/sglang/weights.py); the calls it interrupted are resubmitted here.
- HTTP calls, their retries and timeouts, and error messages that never quote a server:
  trainer/engine/sglang/transport.py.

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

Precision: each server's dtype (/server_info) is recorded and, with an explicit `dtype`
(rollout.dtype), must equal it (trainer/engine/sglang/precision.py).

Tested against SGLang 0.5.23 (tests/test_sglang_real.py) and a stand-in for the faults a real
server cannot be made to produce on demand (tests/test_sglang_engine.py); see docs/engines.md.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import requests

from trainer.engine.base import ABORT, LENGTH, SEGMENT, STOP, EngineError, EngineStats, RolloutEngine, Sample
from trainer.engine.sglang.precision import Precision
from trainer.engine.sglang.transport import (
    Http,
    HTTPStatusError,
    Server,
    ServerCalls,
    ServerFailed,
    describe,
    log_body,
    snippet,
    timed_out,
)
from trainer.engine.sglang.urls import parse_urls
from trainer.engine.sglang.weights import WeightPublisher

__all__ = ["SGLangEngine", "EngineError", "parse_urls"]

log = logging.getLogger(__name__)


class Ticket:
    """One /generate call for one sample (a sample makes several over its life)."""

    __slots__ = ("sample", "server", "base_rid", "rid", "version", "user_abort", "update_abort",
                 "n_input", "budget")

    def __init__(self, sample: Sample, server: Server, base_rid: str, version: int, n_input: int):
        self.sample, self.server, self.base_rid = sample, server, base_rid
        self.rid = base_rid + "0."
        self.version = version
        self.user_abort = False    # abort() asked for it: return the sample to abort's caller
        self.update_abort = False  # a weight update interrupted it: resubmit it ourselves
        self.n_input = n_input
        self.budget = 0            # max_new_tokens of the call (the server's outstanding tokens)


class SGLangEngine(WeightPublisher, Precision, ServerCalls, RolloutEngine):
    def __init__(self, urls: str | Iterable[str], *, eos_token_ids: Iterable[int] = (),
                 model_config=None, weights_dir: str | os.PathLike | None = None,
                 timeout_s: float = 300.0, connect_timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.2, max_inflight: int = 256, abort_timeout_s: float = 10.0,
                 wait_s: float = 0.05, keep_weight_versions: int = 2, check_health: bool = True,
                 max_unrequested_aborts: int = 3, weight_sync: str = "disk",
                 down_timeout_s: float = 600.0, rejoin_backoff_s: float = 1.0, dtype: str = "auto"):
        self.servers = [Server(u) for u in parse_urls(urls)]
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
        self.want_dtype = dtype   # rollout.dtype: "auto" or what every server must serve (precision.py)
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
        self._tickets: dict[int, Ticket] = {}      # request_id -> the call in flight
        self._finished: list[Sample] = []           # left the engine, not yet returned by step()
        self._results: queue.Queue = queue.Queue()  # (ticket, response | None, error | None)
        self._unrequested_aborts: dict[int, int] = {}
        self._http = Http(len(self.servers), self.max_inflight, self.retries, self.backoff_s)
        self._pool = ThreadPoolExecutor(max_workers=self.max_inflight,
                                        thread_name_prefix="rlpilot-sglang")
        if check_health:
            for srv in self.servers:
                self._call(srv, "GET", "/health")
            self._learn_dtypes()

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

    def _live_servers(self) -> list[Server]:
        """In service (a stale one too: weight updates are what bring it up to date)."""
        return [srv for srv in self.servers if not srv.down]

    def _usable_servers(self) -> list[Server]:
        """In service and holding the current weights: the ones requests go to."""
        return [srv for srv in self.servers if not srv.down and not srv.stale]

    def _pick_server(self) -> Server:
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
            t = Ticket(s, srv, base, self.version, len(ids))
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

    def _generate_worker(self, t: Ticket, payload: dict) -> None:
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
                except HTTPStatusError as e:
                    if t.user_abort or t.update_abort:
                        break  # an aborted call may come back as an error: treat it as aborted
                    log_body(t.server.url, "POST /generate", e)
                    if e.status < 500:
                        raise EngineError(f"SGLang server {t.server.url}: POST /generate "
                                          f"refused the request: {e}") from None
                    err = e
                except requests.RequestException as e:
                    if t.user_abort or t.update_abort:
                        break
                    err = e
                    if timed_out(e):  # the server may still be working on it
                        self._abort_quietly(t.server, t.rid)
                if attempt == self.retries:
                    raise ServerFailed(f"SGLang server {t.server.url}: POST /generate failed "
                                        f"after {attempt + 1} attempts: {describe(err)}") from None
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

    def _apply(self, t: Ticket, res: dict | None, err: BaseException | None,
               aborted_into: list[Sample] | None) -> None:
        t.server.inflight -= 1
        t.server.outstanding -= t.budget
        s = t.sample
        if self._tickets.get(s.request_id) is not t:
            return  # orphaned by an abort that gave up waiting: the sample moved on
        del self._tickets[s.request_id]
        if err is not None:
            if isinstance(err, ServerFailed) and not t.user_abort and self._fail_over(t, err):
                return
            if not (t.user_abort or t.update_abort):
                raise err if isinstance(err, EngineError) else EngineError(
                    f"SGLang server {t.server.url}: POST /generate: {describe(err)}") from err
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
                log.warning("SGLang server %s aborted a request: %s", t.server.url, snippet(
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

    def _fail_over(self, t: Ticket, err: EngineError) -> bool:
        """Take t's server out of service and resend its sample to the others (or, with none
        left, to the first that comes back), from the tokens it had before this call (the
        failed call returned none)."""
        if not self._take_down(t.server, err):
            return False
        self.requeued += 1
        self._queue.appendleft(t.sample)
        return True

    def _take_down(self, srv: Server, err: EngineError) -> bool:
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
                back = self._dtype_still_ok(srv)   # not if restarted at another dtype
            except EngineError:
                back = False
            if not back:
                srv.failures += 1
                srv.retry_at = time.monotonic() + self._rejoin_delay(srv.failures)
                continue
            self._rejoin(srv)

    def _rejoin_delay(self, failures: int) -> float:
        """Back-off between probes: rejoin_backoff_s, twice that, ... at most 30 s. A server
        that answers /health but fails its requests again keeps its count (reset only by a
        request that succeeds), so a flapping server is probed ever less often."""
        return min(self.rejoin_backoff_s * 2 ** min(failures, 16), 30.0)

    def _rejoin(self, srv: Server) -> None:
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
            self._publish(self._last_tensors, self.version, stale, broadcast=False)
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

    def _warn(self, message: str) -> None:
        log.warning("%s", message)
        self.warnings.append(message)

    def take_warnings(self) -> list[str]:
        """The non-fatal problems since the last call (a server taken out of service, a refused
        /flush_cache): the runner records each as a warning event."""
        with self.lock:
            out, self.warnings = self.warnings, []
            return out

    def _parse(self, t: Ticket, res: dict | None):
        """-> token ids, logprobs, finish type, finish message, weight_version."""
        if res is None:
            return [], [], "abort", "aborted", []
        if not isinstance(res, dict) or "meta_info" not in res:
            if t.user_abort or t.update_abort:
                return [], [], "abort", "aborted", []
            log.warning("SGLang server %s: /generate reply without meta_info: %s",
                        t.server.url, snippet(json.dumps(res).encode()))
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
