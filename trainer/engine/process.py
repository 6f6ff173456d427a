"""The embedded engine in a process of its own, behind the same engine interface.

Asynchronous training overlaps generation with training. In one Python process the two
compete for the interpreter lock on every small torch call, so on CPU the overlap is partly
lost; here the decoding runs in a child process and the parent only exchanges samples and
weights with it:

- submit / abort / finished samples travel over a socket pair as plain data (ids, tokens,
  logprobs, versions), and the parent updates its own `Sample` objects in place;
- weights live in one memory-mapped buffer that both processes map (`SharedWeights`):
  `update_weights` copies the new tensors there and waits until the child has loaded them
  between two decode steps (so a later update never overwrites weights being read), then every
  later token carries the new version. The child decodes on the parent's device and dtype (a
  CUDA run decodes on CUDA; the shared buffer only stages the weights).

The child is started with `subprocess.Popen`, not `multiprocessing`: a Celery prefork worker
runs tasks in daemonic processes, which multiprocessing forbids to have children. The child
exits as soon as its socket closes, so a parent killed with SIGKILL leaves nothing behind.

The child steps its engine whenever it has work, so generation never waits for the parent.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Iterable

import torch

from trainer.engine.base import EngineError, EngineStats, RolloutEngine, Sample, SamplingParams
from trainer.models.lora import merge_inputs

# the child's command line carries this module's name: `ps` (and the tests) can find it
CHILD_MODULE = "trainer.engine.process"
_ALIGN = 64  # byte alignment of each tensor in the shared buffer


class SharedWeights:
    """A model's tensors in one file-backed buffer mapped MAP_SHARED by both processes.

    Hand-written because torch's shared-memory tensors travel only through multiprocessing
    pickling, which the daemonic Celery worker cannot use (see the module docstring); a plain
    file in /dev/shm that both sides map needs no go-between. The parent unlinks the file once
    the child has mapped it, so nothing is left behind whatever happens later."""

    def __init__(self, path: str, layout: dict, nbytes: int):
        self.path, self.layout, self.nbytes = path, layout, nbytes
        flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self.tensors = {name: flat[off:off + n].view(_dtype(dt)).view(shape)
                        for name, (off, n, dt, shape) in layout.items()}

    @classmethod
    def create(cls, state: dict[str, torch.Tensor]) -> "SharedWeights":
        layout, off = {}, 0
        for name, t in state.items():
            n = t.numel() * t.element_size()
            layout[name] = (off, n, str(t.dtype).removeprefix("torch."), list(t.shape))
            off += -(-n // _ALIGN) * _ALIGN
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"rlpilot-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(path, "wb") as f:
            f.truncate(max(off, 1))
        shared = cls(path, layout, max(off, 1))
        shared.copy_from(state.items())
        return shared

    def spec(self) -> tuple:
        return self.path, self.layout, self.nbytes

    def copy_from(self, items) -> int:
        """Copy the named tensors this buffer holds into it; returns the bytes copied."""
        copied = 0
        with torch.no_grad():
            for name, t in items:
                if name in self.tensors:
                    dst = self.tensors[name]
                    dst.copy_(t.detach())
                    copied += dst.numel() * dst.element_size()
        return copied

    def unlink(self) -> None:
        Path(self.path).unlink(missing_ok=True)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _state(s: Sample) -> dict:
    return {"request_id": s.request_id, "response_ids": s.response_ids, "logprobs": s.logprobs,
            "versions": s.versions, "finish_reason": s.finish_reason,
            "segment_tokens": s.segment_tokens}


def _serve(conn: Connection) -> None:
    """The child: build the engine from the shared weights, then serve the socket."""
    try:
        _, config, spec, kwargs, threads, stops, tokenizer = conn.recv()
        torch.set_num_threads(threads)
        from transformers import AutoModelForCausalLM

        from trainer.engine.embedded import EmbeddedEngine

        shared = SharedWeights(*spec)
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(shared.tensors, strict=False)
        kwargs["device"], kwargs["dtype"] = torch.device(kwargs["device"]), _dtype(kwargs["dtype"])
        engine = EmbeddedEngine(model, **kwargs)
        if stops:   # matched here, as tokens come: the child stops where the parent would cut
            from trainer.engine.stops import StopStrings

            engine = StopStrings(engine, tokenizer, stops)
        del model
        conn.send(("ready", {"pid": os.getpid(), "device": str(engine.device),
                             "dtype": str(engine.dtype), "max_slots": engine.max_slots}))
    except (EOFError, OSError):
        return  # the parent is gone
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
                    conn.send(("aborted", [_state(s) for s in parts], engine.stats.astuple(),
                               engine.take_busy_spans()))
                elif kind == "weights":
                    engine.update_weights(shared.tensors, msg[1], recompute_kv=msg[2])
                    conn.send(("weights_loaded", msg[1]))
                elif kind == "probe":
                    conn.send(("probed", engine.probe_logprobs(msg[1])["embedded"]))
                elif kind == "version":  # a resumed run: tokens carry the restored version
                    engine.version = msg[1]
                elif kind == "rng_get":
                    conn.send(("rng", bytes(engine.generator.get_state().numpy())))
                elif kind == "rng_set":
                    engine.generator.set_state(torch.frombuffer(bytearray(msg[1]), dtype=torch.uint8))
                    conn.send(("rng_set",))
                elif kind == "rng_seed":
                    engine.generator.manual_seed(msg[1])
                    conn.send(("rng_set",))
                elif kind == "close":
                    conn.send(("closed",))
                    return
            if engine.num_pending:
                done = engine.step()
                for s in done:
                    live.pop(s.request_id, None)
                if done:
                    conn.send(("finished", [_state(s) for s in done], engine.stats.astuple(),
                               engine.take_busy_spans()))
        except (EOFError, OSError):
            return  # the parent is gone (or closed the socket): exit, leave nothing behind
        except BaseException:
            try:
                conn.send(("error", traceback.format_exc()))
            except (EOFError, OSError):
                pass
            return


def _child_main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {CHILD_MODULE}")
    ap.add_argument("--fd", type=int, required=True, help="the socket to serve")
    conn = Connection(ap.parse_args(argv).fd)
    try:
        _serve(conn)
    finally:
        conn.close()


class ChildGenerator:
    """The child's sampling RNG, seen from the parent through the calls checkpoints and data
    parallelism make on a torch.Generator (get_state, set_state, manual_seed): a resumed run
    continues the child's random stream instead of replaying it from the seed."""

    def __init__(self, engine: "ProcessEngine"):
        self.engine = engine

    def get_state(self) -> torch.Tensor:
        self.engine._send(("rng_get",))
        _, state = self.engine._expect("rng", 60)
        return torch.frombuffer(bytearray(state), dtype=torch.uint8)

    def set_state(self, state: torch.Tensor) -> None:
        self.engine._send(("rng_set", bytes(state.to(torch.uint8).contiguous().numpy())))
        self.engine._expect("rng_set", 60)

    def manual_seed(self, seed: int) -> "ChildGenerator":
        self.engine._send(("rng_seed", int(seed)))
        self.engine._expect("rng_set", 60)
        return self


class ProcessEngine(RolloutEngine):
    def __init__(self, model, *, eos_token_ids: Iterable[int], max_slots: int | str = 64,
                 max_seq_len: int = 512, seed: int = 0, threads: int = 1,
                 device: torch.device | None = None, dtype: torch.dtype | None = None,
                 slots_cap: int = 1024, start_timeout_s: float = 120.0,
                 weights: dict[str, torch.Tensor] | None = None, stops: Iterable[str] = (),
                 tokenizer=None, park_tokens: int = -1, prompt_cache_tokens: int = -1):
        """`weights`: the tensors to start from instead of `model`'s (a generation process
        restarted mid-run starts from the policy the others hold, not from a model the trainer
        may be updating at that moment); `model` still gives the architecture. `stops`: stop
        strings the child matches itself (decoded with `tokenizer`), so it generates nothing
        past one (a StopStrings in the parent would only cut what it had generated)."""
        params = next(model.parameters())
        device = torch.device(device) if device is not None else params.device
        dtype = dtype or params.dtype
        self.max_seq_len = max_seq_len
        self._version = 0
        self.stats = EngineStats()
        self.last_sync_bytes = 0            # bytes copied into the shared buffer by the last update
        self.generator = ChildGenerator(self)  # the sampling RNG lives in the child
        self.live: dict[int, Sample] = {}   # submitted, not yet returned
        self._done: list[Sample] = []       # finished samples not yet handed out by step()
        self._replies: list[tuple] = []     # answers to abort / weights / ready
        self._busy: list[tuple] = []        # the child's busy spans, for take_busy_spans()
        # the async worker thread and the trainer thread both talk to the child
        self._recv_lock, self._send_lock = threading.Lock(), threading.Lock()
        state = model.state_dict() if weights is None else weights
        # LoRA: the base of each adapted layer and the factors stay at the trainer's precision,
        # which the child merges from (trainer/models/lora.py `merge_inputs`)
        own = merge_inputs(state)
        self.weights = SharedWeights.create({k: v.detach().to(dtype) if v.is_floating_point() and k not in own
                                             else v.detach() for k, v in state.items()})
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, "--fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            self.weights.unlink()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.conn, self.weights)
        kwargs = dict(eos_token_ids=list(eos_token_ids), max_slots=max_slots, slots_cap=slots_cap,
                      max_seq_len=max_seq_len, seed=seed, device=str(device),
                      dtype=str(dtype).removeprefix("torch."), park_tokens=park_tokens,
                      prompt_cache_tokens=prompt_cache_tokens)
        try:
            self._send(("start", model.config, self.weights.spec(), kwargs, threads,
                        list(stops), tokenizer if stops else None))
            _, self.child_info = self._expect("ready", start_timeout_s)
        except BaseException:
            self.close()
            raise
        finally:
            self.weights.unlink()  # both sides have it mapped; no file outlives the engine

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        """Set the version later tokens carry, in the child too (a resumed run)."""
        self._version = int(value)
        self._send(("version", self._version))

    # --- plumbing -------------------------------------------------------------------------------
    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            if self.proc.poll() is not None:
                raise EngineError(f"the engine process exited (code {self.proc.returncode})")
            return None
        msg = self.conn.recv()
        if msg[0] == "error":
            raise EngineError("the engine process failed:\n" + msg[1])
        if msg[0] in ("finished", "aborted"):
            self.stats = EngineStats(*msg[2])
            self._busy.extend(msg[3])   # the child's engine steps (the run's timeline)
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
            s.check_fits(self.max_seq_len)
            s.finish_reason = None
            self.live[s.request_id] = s
            batch.append({"prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                          "logprobs": s.logprobs, "versions": s.versions,
                          "request_id": s.request_id, "params": vars(s.params)})
        if batch:
            self._send(("submit", batch))

    @property
    def num_pending(self) -> int:
        # finished samples filed while waiting for another reply (an abort, new weights) are
        # still owed to step(): a caller that steps only while something is pending must see them
        return len(self.live) + len(self._done)

    def step(self, wait_s: float = 0.02) -> list[Sample]:
        """`wait_s`: how long to wait for a result when none is there yet (generation runs in
        the child; an EnginePool waits on all its children at once and passes 0)."""
        if not self._done and self.live:
            self._pump(wait_s)
        with self._recv_lock:
            out, self._done = self._done, []
        return out

    def abort(self, request_ids: Iterable[int] | None = None,
              keep_cache: bool = False) -> list[Sample]:
        ids = None if request_ids is None else list(request_ids)
        self._send(("abort", ids, keep_cache))
        _, parts = self._expect("aborted", 60)
        return parts

    def lane_pids(self) -> dict[str, int]:
        """{timeline lane: pid} of the process that generates (per-process CPU and memory)."""
        return {"engine": self.proc.pid}

    def take_busy_spans(self) -> list[tuple[str, float, float, float | None]]:
        """The child's busy spans (lane, start, end, occupancy) it reported since the last call:
        they come with its finished samples."""
        with self._recv_lock:
            spans, self._busy = self._busy, []
        return spans

    def update_weights(self, named_tensors, version: int, recompute_kv: bool = False) -> None:
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        self.last_sync_bytes = self.weights.copy_from(items)
        self._send(("weights", version, recompute_kv))
        self._expect("weights_loaded", 60)
        self._version = version

    def probe_logprobs(self, token_ids: list[int]) -> dict[str, list[float]]:
        """The child's engine scores `token_ids` with the weights it decodes with (between two
        of its decode steps)."""
        self._send(("probe", list(token_ids)))
        _, logprobs = self._expect("probed", 60)
        return {f"process {self.proc.pid}": logprobs}

    def loaded_weights(self) -> dict[str, torch.Tensor]:
        """The weights last handed to the child (views of the shared buffer, which holds exactly
        the policy of `version` once update_weights returned)."""
        return self.weights.tensors

    def kill(self) -> None:
        """SIGKILL the child (one that failed or stopped answering) and release everything."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.close()

    def close(self) -> None:
        self._finalizer()


def _shutdown(proc: subprocess.Popen, conn: Connection, weights: SharedWeights) -> None:
    """Ask the child to exit; kill it if it doesn't. Never leaves a process (or file) behind."""
    try:
        conn.send(("close",))
    except (OSError, EOFError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    conn.close()
    weights.unlink()


if __name__ == "__main__":
    _child_main()
