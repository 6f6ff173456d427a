"""Several generation processes behind one engine, and losing one costs nothing.

The pool holds N members, each the embedded engine in a process of its own
(`process.ProcessEngine`), built by a factory so that a dead one can be built again.

Balance: a submitted sample goes to the live member with the least outstanding tokens,

    load(m) = sum over the samples m holds of  min(max_new_tokens - generated, segment_max_tokens)

(the tokens each may still generate in this submission; ties: fewer samples, then the lower
index).

Losing one: a member whose child dies or fails (end of file or a broken pipe on its socket, an
`EngineError` from it, its process gone) is killed for good and marked dead. Its samples that
had already come back (filed, not yet handed out) are handed out; the others are submitted to
the live members as the parent last saw them: the tokens, logprobs and versions delivered so
far, which are exact (a ProcessEngine changes a parent's sample only when the child returns it,
all at once). The tokens the child generated after the sample's last submission never reached
the parent and are generated again: no sample is lost or returned twice. One warning per death
(`take_warnings`). The member is rebuilt after a back-off (0.5 s, 1 s, 2 s ... 8 s) from the
weights the live members hold (or the last ones pushed), brought to the current policy version
before it takes work, and used again. With every member dead, step() waits for a restart
(a warning says generation is paused); a member that fails `max_failures` times in a row (a
restart that fails, or a death before it delivered anything) is given up, and when none is left
the pool raises GenerationGaveUp: which process, how it last ended (its signal or exit status),
how many restarts it had, and why it was given up (the runner adds the step and where a resume
continues: trainer/run/runner.py).

Tokens: `stats.generated_tokens` counts the tokens delivered to the parent only, those in the
parent's samples (the token ledger, trainer/rollout/ledger.py, balances: every delivered token
is trained, waiting or dropped for a reason). The tokens a dead child generated and never delivered are not part of
the rollout; `lost_tokens` counts them as far as the child reported (its counter travels with
each reply, so the last few are unseen). The other counters (decode steps, slots, prefill,
seconds) are the members' sums, dead members' included: none ever goes down.
"""
from __future__ import annotations

import concurrent.futures
import logging
import signal
import subprocess
import threading
import time
from multiprocessing.connection import wait as wait_for_connections
from typing import Callable, Iterable

import torch

from trainer.engine.base import ABORT, EngineError, EngineStats, GenerationGaveUp, RolloutEngine, Sample

log = logging.getLogger(__name__)

# what a member's death looks like from the parent
FAILURES = (EOFError, OSError, EngineError)
_POLL_S = 0.02     # how long step() waits for a result from any member
_PAUSED_S = 0.05   # ... and for a restart, with every member down
_LOST = ()         # what a call on a member that died returns


def budget(s: Sample) -> int:
    """The tokens `s` may still generate in this submission."""
    seg = s.params.segment_max_tokens
    return max(0, min(s.remaining, seg) if seg else s.remaining)


def _place(m: "_Member", s: Sample) -> None:
    cost = budget(s)
    m.held[s.request_id] = (s, len(s.response_ids), cost)
    m.load += cost


def derived_seed(seed: int, index: int, start: int) -> int:
    """Member `index`'s sampling seed at its `start`-th start: `seed` itself for member 0's
    first (a pool of one samples as one ProcessEngine does), distinct streams otherwise."""
    if index == 0 and start == 0:
        return seed
    return hash((seed, index, start)) & 0x7FFF_FFFF


class _Member:
    def __init__(self, index: int):
        self.index = index
        self.engine = None                       # None while dead
        # request id -> (sample, its tokens when submitted, its budget then)
        self.held: dict[int, tuple[Sample, int, int]] = {}
        self.load = 0                            # outstanding tokens (module docstring)
        self.delivered = 0                       # tokens this engine instance handed back
        self.starts = 0
        self.failures = 0                        # failed restarts or early deaths in a row
        self.retry_at = 0.0
        self.restarting = False
        self.retired = False
        self.last_error = ""
        self.pid: int | None = None              # of its last process
        self.ended = ""                          # how it last ended, in words ("was killed by ...")


class EnginePool(RolloutEngine):
    """`factory(index, seed, weights)` builds member `index` (a ProcessEngine) with that
    sampling seed, from `weights` (None: the model's own, at the first start)."""

    def __init__(self, factory: Callable[[int, int, dict | None], RolloutEngine], size: int, *,
                 seed: int = 0, backoff_s: float = 0.5, backoff_max_s: float = 8.0,
                 max_failures: int = 6):
        if size < 1:
            raise ValueError(f"an engine pool needs at least one member, not {size}")
        self.factory, self.seed = factory, seed
        self.backoff_s, self.backoff_max_s, self.max_failures = backoff_s, backoff_max_s, max_failures
        self.members = [_Member(i) for i in range(size)]
        self.generator = PoolGenerator(self)
        self.processes = []             # every child process started (close() checks them all)
        self.last_sync_bytes = 0        # bytes copied to the generators by the last update
        self.lost_tokens = 0            # generated by a child that died, never delivered
        self.warnings: list[str] = []
        self._version = 0
        self._lock = threading.RLock()  # the async worker steps, the trainer pushes weights
        self._wake = threading.Event()  # a member (re)joined
        self._queue: list[Sample] = []  # submitted, waiting for a live member
        self._ready: list[Sample] = []  # returned by a member that died before handing them out
        self._delivered = 0
        self._dead_stats = EngineStats()
        self._paused = False
        self._closed = False
        self._threads: list[threading.Thread] = []
        with concurrent.futures.ThreadPoolExecutor(size) as ex:  # children start side by side
            futures = [ex.submit(factory, i, derived_seed(seed, i, 0), None) for i in range(size)]
            engines = [_result(f) for f in futures]
        failed = [e for e in engines if isinstance(e, BaseException)]
        for m, engine in zip(self.members, engines):
            if not isinstance(engine, BaseException):
                self._join(m, engine)
        if failed:
            self.close()
            raise failed[0]
        self.max_seq_len = self.members[0].engine.max_seq_len
        self._reference = self.members[0].engine.loaded_weights()

    # --- what the runner reads ----------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        """A resumed run's policy version, on every member (a restarted one gets it too)."""
        with self._lock:
            self._version = int(value)
            for m in self._live():
                self._guard(m, "__setattr__", "version", self._version)
            self._dispatch()

    @property
    def generators_alive(self) -> int:
        with self._lock:
            return len(self._live())

    def report(self) -> dict[str, float]:
        """The runner's per-step metrics of the pool (trainer/observe/metric_names.py)."""
        with self._lock:
            return {"perf/weight_sync_bytes": self.last_sync_bytes,
                    "engine/generators_alive": len(self._live()),
                    "engine/lost_tokens": self.lost_tokens}

    def _lane(self, m: _Member) -> str:
        """The timeline lane of a member (trainer/observe/timeline.py): "engine" for a pool of one."""
        return "engine" if len(self.members) == 1 else f"engine {m.index}"

    def lane_pids(self) -> dict[str, int]:
        """{timeline lane: pid} of each live generation process (per-process CPU and memory)."""
        with self._lock:
            return {self._lane(m): m.engine.proc.pid for m in self._live()}

    def take_busy_spans(self) -> list[tuple[str, float, float, float | None]]:
        """Every live process's busy spans since the last call, each on its own lane."""
        with self._lock:
            return [(self._lane(m), start, end, occupancy) for m in self._live()
                    for _, start, end, occupancy in m.engine.take_busy_spans()]

    def pids(self) -> dict[int, int]:
        """Member index -> pid of its child, for the live members."""
        with self._lock:
            return {m.index: m.engine.proc.pid for m in self._live()}

    @property
    def stats(self) -> EngineStats:
        with self._lock:
            total = list(self._dead_stats.astuple())
            for m in self._live():
                total = [a + b for a, b in zip(total, m.engine.stats.astuple())]
            out = EngineStats(*total)
            # tokens in the parent's samples: handed out, or filed by a member (a finished
            # sample a ProcessEngine updated in place and step() has not yet returned)
            out.generated_tokens = self._delivered + sum(
                len(s.response_ids) - tokens_then for m in self._live()
                for s, tokens_then, _ in m.held.values() if s.finish_reason is not None)
            return out

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._queue) + len(self._ready) + sum(len(m.held) for m in self.members)

    def take_warnings(self) -> list[str]:
        """A generation process lost, generation paused, a process back: the runner records
        each as a warning event."""
        with self._lock:
            out, self.warnings = self.warnings, []
            return out

    # --- the engine interface -------------------------------------------------------------------
    def submit(self, samples: Iterable[Sample]) -> None:
        batch = list(samples)
        for s in batch:
            s.check()
            s.check_fits(self.max_seq_len)
            s.finish_reason, s.segment_tokens = None, 0
        with self._lock:
            self._check_alive()
            self._schedule_restarts()
            self._queue.extend(batch)
            self._dispatch()

    def step(self) -> list[Sample]:
        with self._lock:
            self._check_alive()
            self._schedule_restarts()
            out = self._ready_now()
            self._dispatch()  # the samples of a member lost just now go to the others
            busy = [m.engine.conn for m in self._live() if m.held]
            paused = not self._live() and bool(self._queue)
            if paused:
                self._wake.clear()
        if out:
            return out
        if paused:  # every member down: wait for a restart without spinning
            self._wake.wait(_PAUSED_S)
            return []
        if busy:    # wait for the first result from any child
            try:
                wait_for_connections(busy, _POLL_S)
            except (OSError, ValueError):  # a child lost meanwhile (another thread saw it)
                pass
        with self._lock:
            out = self._ready_now()
            self._dispatch()
            return out

    def abort(self, request_ids: Iterable[int] | None = None,
              keep_cache: bool = False) -> list[Sample]:
        want = None if request_ids is None else set(request_ids)

        def wanted(rid: int) -> bool:
            return want is None or rid in want

        with self._lock:
            out: list[Sample] = []
            for m in self._live():
                mine = [rid for rid in m.held if wanted(rid)]
                if not mine:
                    continue
                parts = self._guard(m, "abort", None if want is None else mine, keep_cache)
                for s in parts:
                    if self._release(m, s):
                        out.append(s)
            # queued ones, with those of a member lost meanwhile
            out += [s for s in self._queue if wanted(s.request_id)]
            self._queue = [s for s in self._queue if not wanted(s.request_id)]
            for s in out:
                s.finish_reason = ABORT
            self._dispatch()
            return out

    def update_weights(self, named_tensors, version: int, recompute_kv: bool = False) -> None:
        tensors = dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        with self._lock:
            copied = 0
            for m in self._live():
                if self._guard(m, "update_weights", tensors, version, recompute_kv) is not _LOST:
                    copied += m.engine.last_sync_bytes
            live = self._live()
            if live:
                self._reference = live[0].engine.loaded_weights()
            else:  # nobody to take them: keep them where a restarted member starts from
                with torch.no_grad():
                    for name, t in self._reference.items():
                        if name in tensors:
                            t.copy_(tensors[name].detach())
            self._version = version
            self.last_sync_bytes = copied
            self._dispatch()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=30)
        with self._lock:
            for m in self.members:
                if m.engine is not None:
                    m.engine.close()
                    m.engine = None
            self._wake.set()

    # --- placing samples ----------------------------------------------------------------------------
    def _live(self) -> list[_Member]:
        return [m for m in self.members if m.engine is not None]

    def _dispatch(self) -> None:
        """Give the queued samples to the live members, least outstanding tokens first."""
        while self._queue:
            live = self._live()
            if not live:
                return
            batches: dict[int, list[Sample]] = {}
            for s in self._queue:
                m = min(live, key=lambda m: (m.load, len(m.held), m.index))
                _place(m, s)
                batches.setdefault(m.index, []).append(s)
            self._queue = []
            for index, batch in batches.items():
                m = self.members[index]
                if m.engine is not None:  # else lost meanwhile: its samples are queued again
                    self._guard(m, "submit", batch)

    def _collect(self, members: list[_Member], wait_s: float) -> list[Sample]:
        out = []
        for m in members:
            if m.engine is None or not m.held:
                continue
            for s in self._guard(m, "step", wait_s):
                if self._release(m, s):
                    out.append(s)
        return out

    def _ready_now(self) -> list[Sample]:
        out, self._ready = self._ready, []
        return out + self._collect(self._live(), 0.0)

    def _release(self, m: _Member, s: Sample) -> bool:
        """A sample came back from m: count its new tokens; False if m did not hold it."""
        entry = m.held.pop(s.request_id, None)
        if entry is None:
            return False
        _, tokens_then, cost = entry
        new = len(s.response_ids) - tokens_then
        self._delivered += new
        m.delivered += new
        m.load -= cost
        m.failures = 0  # it works
        return True

    # --- losing and restarting members ------------------------------------------------------------
    def _guard(self, m: _Member, method: str, *args):
        """m.engine.<method>(*args); a failure of the child loses m and returns _LOST."""
        try:
            return getattr(m.engine, method)(*args)
        except FAILURES as e:
            self._lose(m, e)
            return _LOST

    def _lose(self, m: _Member, err: BaseException) -> None:
        engine, m.engine = m.engine, None
        pid = engine.proc.pid
        self._dead_stats = EngineStats(*(a + b for a, b in zip(self._dead_stats.astuple(),
                                                                 engine.stats.astuple())))
        lost = max(0, engine.stats.generated_tokens - m.delivered)
        self.lost_tokens += lost
        code = _exit_code(engine.proc)
        m.last_error = _describe(err, code)
        m.ended = _ended(code) or f"died ({_describe(err)})"
        try:
            engine.kill()
        except Exception as e:  # already gone: nothing more to release
            log.debug("killing generation process %d: %s", m.index, e)
        held, m.held, m.load, m.delivered = list(m.held.values()), {}, 0, 0
        resubmitted = []
        for s, base, _ in held:
            if s.finish_reason is not None:   # the child returned it; step() had not yet
                self._delivered += len(s.response_ids) - base
                self._ready.append(s)
            else:                             # as the parent last saw it: exact, continue it
                resubmitted.append(s)
        self._queue = resubmitted + self._queue
        m.failures += 1
        m.retry_at = time.monotonic() + self._backoff(m.failures)
        self._warn(f"generation process {m.index} (pid {pid}) died: {m.last_error}; "
                   f"{len(resubmitted)} samples resubmitted"
                   + (f", {lost} undelivered tokens lost" if lost else ""))
        if not self._live() and not self._paused:
            self._paused = True
            self._warn("generation paused: every generation process is down; waiting for a "
                       "restart")

    def _backoff(self, failures: int) -> float:
        return min(self.backoff_s * 2 ** max(failures - 1, 0), self.backoff_max_s)

    def _schedule_restarts(self) -> None:
        if self._closed:
            return
        now = time.monotonic()
        for m in self.members:
            if m.engine is not None or m.restarting or m.retired or now < m.retry_at:
                continue
            if m.failures >= self.max_failures:
                m.retired = True
                left = len(self._live())
                self._warn(f"generation process {m.index} given up after {m.failures} failures "
                           f"in a row (last: {m.last_error}); {left} left")
                continue
            m.restarting = True
            m.starts += 1
            t = threading.Thread(target=self._restart, name=f"rlpilot-gen-restart-{m.index}",
                                 args=(m, self._reference, self._version), daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _restart(self, m: _Member, weights: dict, version: int) -> None:
        """Build m again (a thread: starting a process takes seconds), then let it join."""
        try:
            engine = self.factory(m.index, derived_seed(self.seed, m.index, m.starts), weights)
        except BaseException as e:  # noqa: BLE001 - any failure to start counts against m
            with self._lock:
                self._restart_failed(m, e)
            return
        with self._lock:
            m.restarting = False
            if self._closed:
                engine.close()
                return
            try:
                # the weights it started from moved on meanwhile (an update came, or was being
                # copied while it read them): bring it to the current version before any work
                if version != self._version:
                    engine.update_weights(self._reference, self._version)
                else:
                    engine.version = self._version
            except FAILURES as e:
                engine.kill()
                self._restart_failed(m, e)
                return
            self._join(m, engine)
            self._warn(f"generation process {m.index} restarted (pid {engine.proc.pid}), "
                       f"weights at policy version {self._version}")
            self._paused = False
            self._dispatch()
            self._wake.set()

    def _restart_failed(self, m: _Member, err: BaseException) -> None:
        m.restarting = False
        m.failures += 1
        m.retry_at = time.monotonic() + self._backoff(m.failures)
        m.last_error = _describe(err)
        m.ended = f"could not be restarted ({m.last_error})"
        self._warn(f"generation process {m.index} could not be restarted: {m.last_error}")
        self._wake.set()

    def _join(self, m: _Member, engine) -> None:
        m.engine, m.pid = engine, engine.proc.pid
        self.processes.append(engine.proc)

    def _check_alive(self) -> None:
        if all(m.retired for m in self.members):
            raise GenerationGaveUp(
                " and ".join(f"generation process {m.index} (pid {m.pid}, {m.starts} "
                             f"restart{'s' if m.starts != 1 else ''}) {m.ended}" for m in self.members),
                f"{self.max_failures} failures in a row (deaths before it delivered a token, or "
                "failed restarts) give a generation process up, and none is left",
                len(self.members))

    def _warn(self, message: str) -> None:
        log.warning("%s", message)
        self.warnings.append(message)


def _ended(code: int | None) -> str | None:
    """How a process with exit code `code` ended, in words (None: unknown)."""
    if code is None:
        return None
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (signal {-code})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _exit_code(proc) -> int | None:
    """The child's exit code; it is on its way out once its socket closed: wait a moment."""
    try:
        return proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        return None


def _describe(err: BaseException, code: int | None = None) -> str:
    """How a member failed, in one line: how its process ended, and the error's last line
    (an EngineError carries the child's traceback)."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[-1]}" if lines else type(err).__name__
    if code is None:
        return text
    if code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"{how} ({text})"


def _result(future):
    try:
        return future.result()
    except BaseException as e:  # noqa: BLE001 - reported after the others are closed
        return e


class PoolGenerator:
    """The members' sampling RNGs as one torch.Generator-like object for checkpoints: the
    state is the members' states end to end. A state saved by k engines goes to the first k
    members (a run without a pool counts as one) and the others draw fresh streams from the seed.
    A member that fails meanwhile is lost as in any other call (its restart draws a fresh
    stream)."""

    def __init__(self, pool: EnginePool):
        self.pool = pool

    def _on(self, m: _Member, method: str, *args):
        try:
            return getattr(m.engine.generator, method)(*args)
        except FAILURES as e:
            self.pool._lose(m, e)
            return _LOST

    def get_state(self) -> torch.Tensor:
        pool = self.pool
        with pool._lock:
            states = []
            for m in pool.members:
                state = self._on(m, "get_state") if m.engine is not None else _LOST
                if state is _LOST:  # a dead member's stream is gone: the one it restarts with
                    state = _fresh_state(states, derived_seed(pool.seed, m.index, m.starts + 1))
                states.append(state)
            pool._dispatch()
            return torch.cat(states)

    def set_state(self, state: torch.Tensor) -> None:
        pool = self.pool
        with pool._lock:
            live = pool._live()
            if not live:
                return
            mine = self._on(live[0], "get_state")
            if mine is _LOST:
                return
            one, n = mine.numel(), len(pool.members)
            if state.numel() % one:
                raise ValueError(f"engine RNG state of {state.numel()} bytes is not a whole number "
                                 f"of generation processes' ({one} bytes each)")
            # saved by k processes: the first min(k, n) streams go on, the others start fresh
            parts = list(state.split(one))[:n]
            parts += [None] * (n - len(parts))
            for m, part in zip(pool.members, parts):
                if m.engine is None:
                    continue
                if part is None:
                    self._on(m, "manual_seed", derived_seed(pool.seed, m.index, 0))
                else:
                    self._on(m, "set_state", part)
            pool._dispatch()

    def manual_seed(self, seed: int) -> "PoolGenerator":
        with self.pool._lock:
            for m in self.pool._live():
                self._on(m, "manual_seed", derived_seed(seed, m.index, 0))
            self.pool._dispatch()
        return self


def _fresh_state(like: list[torch.Tensor], seed: int) -> torch.Tensor:
    """A generator state for `seed`, the size of the others (a CPU generator's by default)."""
    g = torch.Generator().manual_seed(seed)
    state = g.get_state()
    if like and like[0].numel() != state.numel():   # another device's generator: same size
        state = like[0].clone()
    return state
