"""Dispatch: each sample in flight is one `POST /generate` call (a `Ticket`), sent to the server
with the fewest outstanding tokens, made with its own retries on the pool's threads, and applied
on the caller's thread when its reply arrives (tokens, log-probabilities, the finish reason).

`Dispatch` is a mixin of `SGLangEngine` (trainer/engine/sglang/client.py): it works on the
engine's queue, tickets and finished list; the reply's parsing is `replies.Replies`, a server
that fails every retry is handed to `failover.FailOver`.
"""
from __future__ import annotations

import logging
import queue
from typing import Any

import requests

from trainer.engine.base import ABORT, LENGTH, SEGMENT, STOP, EngineError, Sample
from trainer.engine.sglang.transport import (
    HTTPStatusError,
    Server,
    ServerFailed,
    describe,
    log_body,
    snippet,
    timed_out,
)

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



class Dispatch:
    """Sending samples to the servers and applying their replies."""

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

