"""A pool's members, and losing and restarting them.

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

`MemberLife` is a mixin of `EnginePool` (trainer/engine/pool.py).
"""
from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time

from trainer.engine.base import EngineError, EngineStats, GenerationGaveUp, Sample

log = logging.getLogger(__name__)

# what a member's death looks like from the parent
FAILURES = (EOFError, OSError, EngineError)
LOST = ()         # what a call on a member that died returns


def derived_seed(seed: int, index: int, start: int) -> int:
    """Member `index`'s sampling seed at its `start`-th start: `seed` itself for member 0's
    first (a pool of one samples as one ProcessEngine does), distinct streams otherwise."""
    if index == 0 and start == 0:
        return seed
    return hash((seed, index, start)) & 0x7FFF_FFFF


class Member:
    """One generation process of the pool, alive or not, and what it holds."""

    def __init__(self, index: int):
        self.index = index
        self.engine = None                       # None while dead
        # request id -> (sample, its tokens when submitted, its budget then)
        self.held: dict[int, tuple[Sample, int, int]] = {}
        self.load = 0                            # outstanding tokens (pool_placement.py)
        self.delivered = 0                       # tokens this engine instance handed back
        self.starts = 0
        self.failures = 0                        # failed restarts or early deaths in a row
        self.retry_at = 0.0
        self.restarting = False
        self.retired = False
        self.last_error = ""
        self.pid: int | None = None              # of its last process
        self.ended = ""                          # how it last ended, in words ("was killed by ...")


class MemberLife:
    """Calls on members that may die; a dead member's samples moved on, the member restarted."""

    def _live(self) -> list[Member]:
        return [m for m in self.members if m.engine is not None]

    def _guard(self, m: Member, method: str, *args):
        """m.engine.<method>(*args); a failure of the child loses m and returns LOST."""
        try:
            return getattr(m.engine, method)(*args)
        except FAILURES as e:
            self._lose(m, e)
            return LOST

    def _lose(self, m: Member, err: BaseException) -> None:
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

    def _restart(self, m: Member, weights: dict, version: int) -> None:
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

    def _restart_failed(self, m: Member, err: BaseException) -> None:
        m.restarting = False
        m.failures += 1
        m.retry_at = time.monotonic() + self._backoff(m.failures)
        m.last_error = _describe(err)
        m.ended = f"could not be restarted ({m.last_error})"
        self._warn(f"generation process {m.index} could not be restarted: {m.last_error}")
        self._wake.set()

    def _join(self, m: Member, engine) -> None:
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


