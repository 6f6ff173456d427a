"""The reward pool: `RewardService` scores whole batches in worker processes, under a time limit.

Workers are kept alive between batches and score each item with `dispatch.score_item`
(trainer/rewards/worker.py is their main loop). A reward that raises, a worker that dies and a
batch that runs out of time all give 0 for the items concerned (counted in `RewardBatch.errors`
/ `.timeouts`) and never raise into the trainer; stuck workers are killed with their subprocesses
and replaced. With `workers=0` the items are scored in this process, under the same limits.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from trainer.rewards.dispatch import is_known, resolve_reward_fn, runs_code, score_item

log = logging.getLogger(__name__)

# Why the pool is hand-written (subprocess.Popen + a multiprocessing Pipe) rather than
# concurrent.futures.ProcessPoolExecutor or pebble: the trainer runs inside a Celery prefork
# worker child, a daemonic process, and multiprocessing refuses to start children there. Measured
# in a real Celery 5.7 prefork child (and in a daemonic multiprocessing.Process, fork and spawn),
# Python 3.11, pebble 5.2.3:
#   concurrent.futures.ProcessPoolExecutor (fork or spawn context), pebble.ProcessPool,
#   pebble.concurrent.process, multiprocessing.Pool
#       -> AssertionError: daemonic processes are not allowed to have children
#   subprocess.Popen -> works
# (the async engine's child, trainer/engine/process.py, is started with subprocess for the same
# reason). What the libraries would give, this pool does itself: per-batch and per-item time
# limits, killing a stuck worker with everything it started, counting errors and timeouts, and
# replacing dead workers; memory and the rest of the sandbox are limited by the sandbox itself
# (trainer/sandbox/).


@dataclass
class RewardBatch:
    scores: list[float]
    errors: int
    timeouts: int
    statuses: list[str] = field(default_factory=list)   # per item: "ok", "error", "timeout"
    notes: list[str] = field(default_factory=list)      # per item: why it failed, if known


_CHUNK_MAX = 64
_STARTUP_FAILURES = 3    # consecutive worker deaths before ready -> score in-process
_STARTUP_LIMIT_S = 120.0  # a worker not ready after this long is killed and replaced
_WORKER_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from trainer.rewards.worker import main; main(sys.argv[2:])")


class _Chunk:
    __slots__ = ("indices", "reported")

    def __init__(self, indices: list[int]):
        self.indices = indices
        self.reported = 0   # leading items whose results came back


class _Worker:
    def __init__(self, preload: Iterable[str], sandbox_dir: str, reward_fn: str):
        import multiprocessing
        parent, child = multiprocessing.Pipe(duplex=True)
        root = str(Path(__file__).resolve().parents[2])   # the directory holding trainer/
        cmd = [sys.executable, "-c", _WORKER_BOOT, root, str(child.fileno()),
               ",".join(sorted(preload)), sandbox_dir, reward_fn]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL)
        finally:
            child.close()
        self.conn = parent
        self.ready = False
        self.started = time.monotonic()
        self.chunk: _Chunk | None = None

    def kill(self) -> None:
        """Kill the worker and everything it started; reap it."""
        self.ready = False
        _kill_tree(self.proc)
        try:
            self.conn.close()
        except OSError:
            pass


def _kill_tree(proc: subprocess.Popen) -> None:
    import psutil
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 -- already gone
        kids = []
    for p in [proc, *kids]:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.error("reward worker %d did not die after SIGKILL", proc.pid)
    if kids:
        try:
            psutil.wait_procs(kids, timeout=2)
        except Exception:  # noqa: BLE001
            pass


def _shutdown(workers: list[_Worker], sandbox_dir: str, owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked copy of the trainer must not touch our workers
        return
    for w in workers:
        try:
            w.conn.close()   # EOF: an idle worker exits by itself
        except OSError:
            pass
    deadline = time.monotonic() + 1.0
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()
    workers.clear()
    shutil.rmtree(sandbox_dir, ignore_errors=True)


class RewardService:
    """Scores batches of completions, in `workers` processes kept alive between batches
    (0 = in this process), each batch within `timeout_s` seconds.

    `item_timeout_s` limits one sandboxed code run (default: `timeout_s`); `kinds` names the
    problem kinds to expect, so that workers import their verifiers while the trainer starts.
    `reward_fn` ('module:function', importable by the workers) replaces the task registry's
    verifiers for every item.
    """

    def __init__(self, workers: int = 1, timeout_s: float = 10.0, *,
                 item_timeout_s: float | None = None, kinds: Iterable[str] = (),
                 reward_fn: str = ""):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be an integer >= 0, got {workers!r}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        self.n_workers = workers
        self.timeout_s = float(timeout_s)
        self.item_timeout_s = float(item_timeout_s) if item_timeout_s else self.timeout_s
        self._kinds = {k for k in kinds if is_known(k)}
        self._reward_fn_spec = reward_fn
        self._reward_fn = resolve_reward_fn(reward_fn) if reward_fn else None
        self._lock = threading.Lock()
        self._closed = False
        self._inline = workers == 0
        self._startup_failures = 0
        self._workers: list[_Worker] = []
        self._sandbox_dir = ""
        self._finalizer = None
        if not self._inline:
            self._sandbox_dir = tempfile.mkdtemp(prefix="rlpilot-rewards-")
            self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._sandbox_dir,
                                               os.getpid())
            for _ in range(workers):
                try:
                    self._workers.append(self._spawn())
                except OSError as e:
                    log.error("cannot start a reward worker (%s); continuing with %d", e,
                              len(self._workers))
                    break
            self._inline = not self._workers

    # -- public --------------------------------------------------------------------------------

    def score_batch(self, problems: Sequence, completions: Sequence[str]) -> RewardBatch:
        """Score completions[i] against problems[i] (anything with .kind and .answer)."""
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        with self._lock:
            if self._closed:
                raise RuntimeError("score_batch() on a closed RewardService")
            items = [(p.kind, p.answer, c) for p, c in zip(problems, completions)]
            if not items:
                return RewardBatch([], 0, 0, [], [])
            self._kinds.update(k for k, _, _ in items if is_known(k))
            if self._inline:
                results = self._score_inline(items)
            else:
                results = self._score_pool(items)
        scores = [r[0] for r in results]
        statuses = [r[1] for r in results]
        notes = [r[2] for r in results]
        batch = RewardBatch(scores, statuses.count("error"), statuses.count("timeout"),
                            statuses, notes)
        if batch.errors:
            first = next(n for s, n in zip(statuses, notes) if s == "error")
            log.warning("%d of %d rewards failed (scored 0); first: %s", batch.errors,
                        len(items), first)
        return batch

    def close(self) -> None:
        """Stop the workers and everything they started. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._finalizer is not None:
                self._finalizer()

    def __enter__(self) -> "RewardService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- in-process ----------------------------------------------------------------------------

    def _score_inline(self, items) -> list[tuple[float, str, str]]:
        deadline = time.monotonic() + self.timeout_s
        out = []
        for kind, answer, completion in items:
            left = deadline - time.monotonic()
            if left <= 0:
                out.append((0.0, "timeout", "the batch ran out of time"))
                continue
            out.append(score_item(kind, answer, completion, min(self.item_timeout_s, left),
                                  self._reward_fn))
        return out

    # -- pool ----------------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        return _Worker(self._kinds, self._sandbox_dir, self._reward_fn_spec)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        i = self._workers.index(w)
        if self._startup_failures >= _STARTUP_FAILURES:
            log.error("reward workers keep dying before they start; scoring in-process from now "
                      "on (check that `%s -c 'import trainer.rewards.worker'` works)", sys.executable)
            self._workers.pop(i)
            if not self._workers:
                self._inline = True
            return
        try:
            self._workers[i] = self._spawn()
        except OSError as e:
            log.error("cannot start a reward worker: %s", e)
            self._workers.pop(i)
            if not self._workers:
                self._inline = True

    def _chunks(self, items) -> collections.deque:
        n = len(items)
        if any(runs_code(k) for k, _, _ in items):
            size = 1   # each item is a subprocess: balance the load, IPC is negligible
        else:
            size = max(1, min(_CHUNK_MAX, -(-n // max(1, len(self._workers)))))
        return collections.deque(_Chunk(list(range(i, min(n, i + size)))) for i in range(0, n, size))

    def _score_pool(self, items) -> list[tuple[float, str, str]]:
        from multiprocessing.connection import wait
        n = len(items)
        results: list[tuple[float, str, str] | None] = [None] * n
        queue = self._chunks(items)
        deadline = time.monotonic() + self.timeout_s
        pending = n

        def record(w: _Worker, part: list) -> None:
            nonlocal pending
            c = w.chunk
            for r in part:
                results[c.indices[c.reported]] = tuple(r)
                c.reported += 1
                pending -= 1

        while pending:
            if self._inline:   # every worker failed to start: finish here
                todo = [i for i in range(n) if results[i] is None]
                for i, r in zip(todo, self._score_inline([items[i] for i in todo])):
                    results[i] = r
                return results
            for w in list(self._workers):   # hand chunks to idle workers
                while w.ready and w.chunk is None and queue:
                    c = queue.popleft()
                    job = [items[i] for i in c.indices]
                    try:
                        w.conn.send(("score", job, self.item_timeout_s,
                                     deadline - time.monotonic()))
                    except (OSError, EOFError):   # it died: a new one takes the chunk later
                        queue.appendleft(c)
                        self._replace(w)
                        break
                    except Exception as e:  # noqa: BLE001 -- e.g. an answer that cannot be pickled
                        for i in c.indices:
                            results[i] = (0.0, "error", f"cannot send to a worker: {e}"[:300])
                        pending -= len(c.indices)
                    else:
                        w.chunk = c
            if not pending:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conns = {w.conn: w for w in self._workers}
            for conn in wait(list(conns), timeout=left):
                w = conns[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._worker_died(w, results, queue)
                    pending = sum(r is None for r in results)
                    continue
                self._on_message(w, msg, record)

        # Out of time: take what already arrived, then kill the workers still busy.
        for w in list(self._workers):
            while w.chunk is not None:
                try:
                    if not w.conn.poll(0):
                        break
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    break
                self._on_message(w, msg, record)
            if w.chunk is not None:
                log.warning("reward batch ran past %.1fs: killing reward worker %d",
                            self.timeout_s, w.proc.pid)
                w.chunk = None
                self._replace(w)
            elif not w.ready and time.monotonic() - w.started > _STARTUP_LIMIT_S:
                log.warning("reward worker %d is not ready after %.0fs: replacing it",
                            w.proc.pid, _STARTUP_LIMIT_S)
                self._startup_failures += 1
                self._replace(w)
        return [r if r is not None else (0.0, "timeout", f"the batch ran past {self.timeout_s:g}s")
                for r in results]

    def _on_message(self, w: _Worker, msg: tuple, record) -> None:
        """A worker's message: ("ready", pid), or ("part" | "done", results of its chunk)."""
        if msg[0] == "ready":
            w.ready = True
            self._startup_failures = 0
        elif msg[0] in ("part", "done") and w.chunk is not None:
            record(w, msg[1])
            if msg[0] == "done":
                w.chunk = None

    def _worker_died(self, w: _Worker, results: list, queue: collections.deque) -> None:
        try:
            rc = w.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            rc = None
        if not w.ready:
            self._startup_failures += 1
        c = w.chunk
        if c is not None:
            rest = c.indices[c.reported:]
            if len(rest) == 1:   # this item killed it
                results[rest[0]] = (0.0, "error", f"the reward worker died (exit code {rc})")
            else:   # one of these did: retry each alone to find which
                queue.extendleft(_Chunk([i]) for i in reversed(rest))
        w.chunk = None
        log.warning("reward worker %d died (exit code %s); starting another", w.proc.pid, rc)
        self._replace(w)


