"""A rollout engine that drives one or more SGLang servers over their HTTP API.

It satisfies the same interface as the embedded engine (`trainer/engine/base.py`):

- every sample in flight is one `POST /generate` call with `input_ids` = prompt + response so
  far, `sampling_params` {temperature, top_p, max_new_tokens = min(remaining, what is left of
  the segment), stop_token_ids} and `return_logprob: true`. Tokens and log-probabilities are
  read from `meta_info.output_token_logprobs` ([logprob, token_id, text] per token), the finish
  reason from `meta_info.finish_reason.type` (stop | length | abort). A sample that hits its
  per-segment limit before its total budget leaves as SEGMENT, exactly as in the embedded
  engine, and continues from its last token when submitted again.
- the HTTP calls run in a small thread pool (stdlib `http.client`); `step()` applies the
  responses that have arrived, waiting up to `wait_s` when none has, so callers do not spin.
  Responses are applied on the caller's thread only: a sample changes only inside `step()`,
  `abort()` and `update_weights()`.
- `abort(ids)` posts `/abort_request` ({"rid"} per request, {"abort_all": true} for all) and
  returns the partial samples once their responses come back (bounded wait; a response that
  never comes is dropped and the sample returned as it was before that call: nothing is lost
  or duplicated, the call's tokens are simply not kept).
- `update_weights()` saves the tensors as a `save_pretrained`-style directory (safetensors +
  config.json) under `weights_dir`, then on every server: `/pause_generation` (mode "abort":
  requests in flight come back with what they generated so far), `/update_weights_from_disk`
  with `weight_version`, `/flush_cache`, `/continue_generation`. The interrupted samples are
  resubmitted by the engine itself, so every token keeps the version of the weights that
  produced it (the embedded engine's `recompute_kv=True` behaviour; `recompute_kv` is ignored).
- connection errors, timeouts and HTTP 5xx are retried with exponential backoff up to
  `retries` times; then `EngineError` names the server URL and the call. HTTP 4xx is not
  retried. Nothing waits without a timeout.

Request ids (`rid`) are "<engine nonce>-<request_id>-<call number>-<attempt>." rather than the
bare request id: SGLang's `/abort_request` aborts every request whose rid *starts with* the
given one, so rids must be prefix-free ("1" would also abort "10", "11", ...), and a resumed
sample must not reuse the rid of a call the server may still be finishing.

Per-token versions: `meta_info.weight_version` when it parses as a version this engine has
published (or the version the call was sent under), else the version at dispatch.

Only the stand-in server (`trainer/engine/sglang_standin.py`) has exercised this client; see the
README for what was and was not verified against a real SGLang server.
"""
from __future__ import annotations

import http.client
import itertools
import json
import os
import queue
import shutil
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

from trainer.engine.base import (ABORT, LENGTH, SEGMENT, STOP, EngineError, EngineStats,
                                 RolloutEngine, Sample)

__all__ = ["SGLangEngine", "EngineError", "parse_urls"]


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
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.base = parts.path.rstrip("/")
        self.inflight = 0


class _HTTPStatusError(Exception):
    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}: {_snippet(body)}")


def _snippet(body: bytes, n: int = 300) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text if len(text) <= n else text[:n] + "..."


class _Ticket:
    """One /generate call for one sample (a sample makes several over its life)."""

    __slots__ = ("sample", "server", "base_rid", "rid", "version", "user_abort", "update_abort",
                 "n_input")

    def __init__(self, sample: Sample, server: _Server, base_rid: str, version: int, n_input: int):
        self.sample, self.server, self.base_rid = sample, server, base_rid
        self.rid = base_rid + "0."
        self.version = version
        self.user_abort = False    # abort() asked for it: return the sample to abort's caller
        self.update_abort = False  # a weight update interrupted it: resubmit it ourselves
        self.n_input = n_input


class SGLangEngine(RolloutEngine):
    def __init__(self, urls: str | Iterable[str], *, eos_token_ids: Iterable[int] = (),
                 model_config=None, weights_dir: str | os.PathLike | None = None,
                 timeout_s: float = 300.0, connect_timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.2, max_inflight: int = 256, abort_timeout_s: float = 10.0,
                 wait_s: float = 0.05, keep_weight_versions: int = 2, check_health: bool = True,
                 max_unrequested_aborts: int = 3):
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
        self._conns: set = set()                    # open HTTP connections (closed by close())
        self._conns_lock = threading.Lock()
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
            self._dispatch()
            if not self._finished and self._tickets:
                self._drain(self.wait_s)
            else:
                self._drain(0.0)
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
        """Save the weights, then pause -> update_weights_from_disk -> flush -> continue on every
        server. Calls in flight are interrupted and resubmitted under the new weights, so their
        tokens keep exact versions (`recompute_kv` is implied)."""
        with self.lock:
            self._check_open()
            path = self._save_weights(named_tensors, version)
            for t in self._tickets.values():
                t.update_abort = True
            paused: list[_Server] = []
            ok = False
            try:
                for srv in self.servers:
                    self._call(srv, "POST", "/pause_generation", {"mode": "abort"})
                    paused.append(srv)
                for srv in self.servers:
                    res = self._call(srv, "POST", "/update_weights_from_disk",
                                     {"model_path": str(path), "weight_version": str(version),
                                      "flush_cache": True})
                    if isinstance(res, dict) and res.get("success") is False:
                        raise EngineError(f"SGLang server {srv.url}: POST "
                                          f"/update_weights_from_disk refused {path}: "
                                          f"{res.get('message', res)}")
                self._published.add(int(version))
                self.version = version
                for srv in self.servers:
                    try:
                        self._call(srv, "POST", "/flush_cache", retries=0)
                    except EngineError as e:  # busy servers may refuse; the update flushed anyway
                        self.warnings.append(str(e))
                ok = True
            finally:
                errors = []
                for srv in paused:  # never leave a server paused, even when the update failed
                    try:
                        self._call(srv, "POST", "/continue_generation", {})
                    except EngineError as e:
                        errors.append(e)
                if ok and errors:
                    raise errors[0]
            self._dispatch()

    def close(self) -> None:
        with self.lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self._tickets:
                for srv in {id(t.server): t.server for t in self._tickets.values()}.values():
                    try:
                        self._call(srv, "POST", "/abort_request", {"abort_all": True},
                                   retries=0, timeout=2.0)
                    except EngineError:
                        pass
            self._queue.clear()
            self._tickets.clear()
            self._finished.clear()
            with self._conns_lock:  # wake the pool's threads blocked on a socket
                conns, self._conns = list(self._conns), set()
            for conn in conns:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except (OSError, AttributeError):
                    pass
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --- dispatch and responses -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed.is_set():
            raise EngineError("the SGLang engine is closed")

    def _pick_server(self) -> _Server:
        start = next(self._rr) % len(self.servers)
        order = self.servers[start:] + self.servers[:start]
        return min(order, key=lambda s: s.inflight)  # least loaded, round-robin among equals

    def _dispatch(self) -> None:
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
            self._tickets[s.request_id] = t
            self.stats.prefill_tokens += len(ids)
            self._pool.submit(self._generate_worker, t, payload)

    def _generate_worker(self, t: _Ticket, payload: dict) -> None:
        """Runs in the pool: one /generate call with retries; the result goes to the queue."""
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
                    if e.status < 500:
                        raise EngineError(f"SGLang server {t.server.url}: POST /generate "
                                          f"refused the request: {e}") from None
                    err = e
                except (OSError, http.client.HTTPException) as e:
                    if t.user_abort or t.update_abort:
                        break
                    err = e
                    if isinstance(e, TimeoutError):  # the server may still be working on it
                        self._abort_quietly(t.server, t.rid)
                if attempt == self.retries:
                    raise EngineError(f"SGLang server {t.server.url}: POST /generate failed after "
                                      f"{attempt + 1} attempts: {_describe(err)}") from None
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
        s = t.sample
        if self._tickets.get(s.request_id) is not t:
            return  # orphaned by an abort that gave up waiting: the sample moved on
        del self._tickets[s.request_id]
        if err is not None:
            if not (t.user_abort or t.update_abort):
                raise err if isinstance(err, EngineError) else EngineError(
                    f"SGLang server {t.server.url}: POST /generate: {_describe(err)}") from err
            res = None
        ids, lps, ftype, fmsg, wv = self._parse(t, res)
        version = self._token_version(wv, t.version)
        for tok, lp in zip(ids, lps):
            s.response_ids.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
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
                raise EngineError(f"SGLang server {t.server.url}: POST /generate was aborted by "
                                  f"the server {n} times without progress: {fmsg}")
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

    def _parse(self, t: _Ticket, res: dict | None):
        """-> token ids, logprobs, finish type, finish message, weight_version."""
        if res is None:
            return [], [], "abort", "aborted", None
        if not isinstance(res, dict) or "meta_info" not in res:
            if t.user_abort or t.update_abort:
                return [], [], "abort", "aborted", None
            raise EngineError(f"SGLang server {t.server.url}: POST /generate returned no "
                              f"meta_info: {_snippet(json.dumps(res).encode())}")
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
        return ids, lps, ftype, fmsg, meta.get("weight_version")

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
        except (OSError, http.client.HTTPException, _HTTPStatusError):
            pass

    def _call(self, srv: _Server, method: str, path: str, body: dict | None = None, *,
              retries: int | None = None, timeout: float | None = None):
        """A control call with retries on connection errors, timeouts and 5xx."""
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return self._request(srv, method, path, body, timeout=timeout)
            except _HTTPStatusError as e:
                if e.status < 500:
                    raise EngineError(f"SGLang server {srv.url}: {method} {path} "
                                      f"refused: {e}") from None
                err: BaseException = e
            except (OSError, http.client.HTTPException) as e:
                err = e
            if attempt == retries:
                raise EngineError(f"SGLang server {srv.url}: {method} {path} failed after "
                                  f"{attempt + 1} attempt{'s' if attempt else ''}: "
                                  f"{_describe(err)}") from None
            self._sleep_backoff(attempt)

    def _sleep_backoff(self, attempt: int) -> None:
        self._closed.wait(min(self.backoff_s * (2 ** attempt), 10.0))

    def _request(self, srv: _Server, method: str, path: str, body: dict | None = None,
                 timeout: float | None = None):
        """One HTTP request. Returns the parsed JSON body (None when empty or not JSON);
        raises _HTTPStatusError on 4xx/5xx and OSError/HTTPException on transport errors."""
        cls = http.client.HTTPSConnection if srv.https else http.client.HTTPConnection
        conn = cls(srv.host, srv.port, timeout=self.connect_timeout_s)
        with self._conns_lock:
            self._conns.add(conn)
        try:
            conn.connect()
            conn.sock.settimeout(self.timeout_s if timeout is None else timeout)
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, srv.base + path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            if resp.status >= 400:
                raise _HTTPStatusError(resp.status, raw)
            if not raw.strip():
                return None
            try:
                return json.loads(raw)
            except ValueError:
                return None
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

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
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tied = bool(getattr(self.model_config, "tie_word_embeddings", False))
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        tensors: dict[str, Any] = {}
        seen: set[int] = set()
        with torch.no_grad():
            for name, t in items:
                if name.endswith("inv_freq") or (tied and name == "lm_head.weight"):
                    continue
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
        old = sorted(p for p in root.glob("v*") if p.is_dir() and p != final)
        for p in old[:max(0, len(old) - (self.keep_weight_versions - 1))]:
            shutil.rmtree(p, ignore_errors=True)
        return final


def _describe(err: BaseException | None) -> str:
    if err is None:
        return "unknown error"
    if isinstance(err, TimeoutError):
        return "timed out"
    if isinstance(err, ConnectionRefusedError):
        return "connection refused (is the server running?)"
    text = str(err) or type(err).__name__
    return f"{type(err).__name__}: {text}" if not isinstance(err, _HTTPStatusError) else text

