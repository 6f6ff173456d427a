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

The engine's jobs, one module each: dispatch and replies applied (`dispatch.py`), replies read
(`replies.py`), fail-over and rejoin (`failover.py`), weight publishing (`weights.py`), precision
(`precision.py`), HTTP (`transport.py`). This module holds the public interface.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from trainer.engine.base import ABORT, LENGTH, EngineError, EngineStats, RolloutEngine, Sample
from trainer.engine.sglang.dispatch import Dispatch, Ticket
from trainer.engine.sglang.failover import FailOver
from trainer.engine.sglang.precision import Precision
from trainer.engine.sglang.replies import Replies, input_logprobs
from trainer.engine.sglang.transport import Http, Server, ServerCalls
from trainer.engine.sglang.urls import parse_urls
from trainer.engine.sglang.weights import WeightPublisher

__all__ = ["SGLangEngine", "EngineError", "parse_urls"]


class SGLangEngine(Dispatch, Replies, FailOver, WeightPublisher, Precision, ServerCalls, RolloutEngine):
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

    def probe_logprobs(self, token_ids: list[int]) -> dict[str, list[float]]:
        """Each server in service scores `token_ids` (one /generate with return_logprob and
        logprob_start_len 0, one new token at temperature 1: `input_token_logprobs`), by URL; a
        server whose probe call fails is left out with a warning (its /generate calls decide
        whether it stays in service)."""
        with self.lock:
            self._check_open()
            servers = self._live_servers()
        ids = [int(t) for t in token_ids]
        body = {"input_ids": ids, "sampling_params": {"temperature": 1.0, "max_new_tokens": 1},
                "return_logprob": True, "logprob_start_len": 0, "stream": False}
        out = {}
        for srv in servers:
            try:
                res = self._call(srv, "POST", "/generate",
                                 {**body, "rid": f"{self._nonce}-probe-{next(self._calls)}."})
                out[srv.url] = input_logprobs(res, len(ids), srv.url)
            except EngineError as e:   # generation's own calls take a failing server out
                self._warn(f"the weight probe left {srv.url} out: {e}")
        return out

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

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise EngineError("the SGLang engine is closed")

