"""The embedded engine in a process of its own, behind the same engine interface.

Asynchronous training overlaps generation with training. In one Python process the two
compete for the interpreter lock on every small torch call, so on CPU the overlap is partly
lost; here the decoding runs in a child process (spawned, so it shares nothing by accident)
and the parent only exchanges samples and weights with it:

- submit / abort / finished samples travel over a pipe as plain data (ids, tokens, logprobs,
  versions), and the parent updates its own `Sample` objects in place;
- weights live in shared memory: `update_weights` copies the new tensors there and waits until
  the child has loaded them between two decode steps (so a later update never overwrites
  weights being read), then every later token carries the new version.

The child steps its engine whenever it has work, so generation never waits for the parent.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
import traceback
import weakref
from typing import Iterable

import torch

from trainer.engine.base import EngineError, EngineStats, RolloutEngine, Sample, SamplingParams


def _state(s: Sample) -> dict:
    return {"request_id": s.request_id, "response_ids": s.response_ids, "logprobs": s.logprobs,
            "versions": s.versions, "finish_reason": s.finish_reason,
            "segment_tokens": s.segment_tokens}


def _serve(conn, config, shared: dict, kwargs: dict, threads: int) -> None:
    """The child: build the engine from the shared weights, then serve the pipe."""
    try:
        torch.set_num_threads(threads)
        from transformers import AutoModelForCausalLM

        from trainer.engine.embedded import EmbeddedEngine

        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(shared, strict=False)
        engine = EmbeddedEngine(model, **kwargs)
        del model
        conn.send(("ready",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    live: dict[int, Sample] = {}
    while True:
        try:
            while conn.poll(0 if engine.num_pending else 0.05):
                msg = conn.recv()
                kind = msg[0]
                if kind == "submit":
                    batch = []
                    for d in msg[1]:
                        s = Sample(prompt_ids=d["prompt_ids"], params=SamplingParams(**d["params"]),
                                   response_ids=d["response_ids"], logprobs=d["logprobs"],
                                   versions=d["versions"], request_id=d["request_id"])
                        live[s.request_id] = s
                        batch.append(s)
                    engine.submit(batch)
                elif kind == "abort":
                    parts = engine.abort(msg[1], keep_cache=msg[2])
                    for s in parts:
                        live.pop(s.request_id, None)
                    conn.send(("aborted", [_state(s) for s in parts], engine.stats.astuple()))
                elif kind == "weights":
                    engine.update_weights(shared, msg[1], recompute_kv=msg[2])
                    conn.send(("weights_loaded", msg[1]))
                elif kind == "close":
                    conn.send(("closed",))
                    return
            if engine.num_pending:
                done = engine.step()
                for s in done:
                    live.pop(s.request_id, None)
                if done:
                    conn.send(("finished", [_state(s) for s in done], engine.stats.astuple()))
        except (EOFError, BrokenPipeError):
            return  # the parent is gone
        except BaseException:
            try:
                conn.send(("error", traceback.format_exc()))
            except (EOFError, BrokenPipeError):
                pass
            return


class ProcessEngine(RolloutEngine):
    def __init__(self, model, *, eos_token_ids: Iterable[int], max_slots: int = 64,
                 max_seq_len: int = 512, seed: int = 0, threads: int = 1,
                 start_timeout_s: float = 120.0):
        self.max_seq_len = max_seq_len
        self.version = 0
        self.stats = EngineStats()
        self.generator = None  # the sampling RNG lives in the child
        self.shared = {k: v.detach().to("cpu", copy=True).share_memory_()
                       for k, v in model.state_dict().items()}
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        kwargs = dict(eos_token_ids=list(eos_token_ids), max_slots=max_slots,
                      max_seq_len=max_seq_len, seed=seed, device=torch.device("cpu"),
                      dtype=next(model.parameters()).dtype)
        self.proc = ctx.Process(target=_serve, name="rlpilot-engine", daemon=True,
                                args=(child, model.config, self.shared, kwargs, threads))
        self.proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.conn)
        self.live: dict[int, Sample] = {}   # submitted, not yet returned
        self._done: list[Sample] = []       # finished samples not yet handed out by step()
        self._replies: list[tuple] = []     # answers to abort / weights / ready
        # the async worker thread and the trainer thread both talk to the child
        self._recv_lock, self._send_lock = threading.Lock(), threading.Lock()
        self._expect("ready", start_timeout_s)

    # --- plumbing -------------------------------------------------------------------------------
    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            if not self.proc.is_alive():
                raise EngineError(f"the engine process exited (code {self.proc.exitcode})")
            return None
        msg = self.conn.recv()
        if msg[0] == "error":
            raise EngineError("the engine process failed:\n" + msg[1])
        if msg[0] in ("finished", "aborted"):
            self.stats = EngineStats(*msg[2])
            out = []
            for st in msg[1]:
                s = self.live.pop(st["request_id"], None)
                if s is None:
                    continue
                s.response_ids[:] = st["response_ids"]
                s.logprobs[:] = st["logprobs"]
                s.versions[:] = st["versions"]
                s.finish_reason, s.segment_tokens = st["finish_reason"], st["segment_tokens"]
                out.append(s)
            return msg[0], out
        return msg

    def _pump(self, timeout: float) -> None:
        """Read what the child sent (waiting up to `timeout` for the first message) and file
        it: finished samples for step(), replies for _expect()."""
        with self._recv_lock:
            msg = self._recv(timeout)
            while msg is not None:
                if msg[0] == "finished":
                    self._done.extend(msg[1])
                else:
                    self._replies.append(msg)
                msg = self._recv(0)

    def _expect(self, kind: str, timeout: float):
        """Wait for the child's reply of `kind`."""
        deadline = time.monotonic() + timeout
        while True:
            for i, msg in enumerate(self._replies):
                if msg[0] == kind:
                    return self._replies.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"the engine process did not answer {kind!r} in {timeout:.0f} s")
            self._pump(min(left, 0.05))

    def _send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    # --- the engine interface ---------------------------------------------------------------------
    def submit(self, samples: Iterable[Sample]) -> None:
        batch = []
        for s in samples:
            s.check()
            if len(s.prompt_ids) + s.params.max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt ({len(s.prompt_ids)} tokens) + max_new_tokens "
                                 f"({s.params.max_new_tokens}) exceeds the engine's "
                                 f"max_seq_len {self.max_seq_len}")
            s.finish_reason = None
            self.live[s.request_id] = s
            batch.append({"prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                          "logprobs": s.logprobs, "versions": s.versions,
                          "request_id": s.request_id, "params": vars(s.params)})
        if batch:
            self._send(("submit", batch))

    @property
    def num_pending(self) -> int:
        return len(self.live)

    def step(self) -> list[Sample]:
        if not self._done and self.live:
            self._pump(0.02)  # generation runs in the child: wait a little for results
        with self._recv_lock:
            out, self._done = self._done, []
        return out

    def abort(self, request_ids: Iterable[int] | None = None,
              keep_cache: bool = False) -> list[Sample]:
        ids = None if request_ids is None else list(request_ids)
        self._send(("abort", ids, keep_cache))
        _, parts = self._expect("aborted", 60)
        return parts

    def update_weights(self, named_tensors, version: int, recompute_kv: bool = False) -> None:
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        with torch.no_grad():
            for name, t in items:
                if name in self.shared:
                    self.shared[name].copy_(t.detach())
        self._send(("weights", version, recompute_kv))
        self._expect("weights_loaded", 60)
        self.version = version

    def close(self) -> None:
        self._finalizer()


def _shutdown(proc, conn) -> None:
    """Ask the child to exit; kill it if it doesn't. Never leaves a process behind."""
    try:
        conn.send(("close",))
    except (OSError, EOFError, BrokenPipeError):
        pass
    proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)
    conn.close()
