"""A running sandboxed job seen from the caller: its stdin, its stdout read with a hard byte cap,
its deadline, and killing all of it. Both local backends (bwrap.py, process.py) hand their
command line to `ProcessSession`; what differs is what the job can reach, not how it is driven.

Stdout is read by a thread as it comes: the first `cap` bytes are kept and the rest is read and
thrown away, so a job that floods its output neither blocks on a full pipe nor grows the caller
(`subprocess.communicate` would buffer all of it).
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import threading
import time
from typing import Callable

from trainer.sandbox.base import Limits, Outcome

_CHUNK = 1 << 16


def killed_by(sig: int) -> str:
    """How a job killed by signal `sig` ended, in words (SIGXCPU: its CPU time limit)."""
    if sig == getattr(signal, "SIGXCPU", None):
        return "CPU time limit exceeded"
    try:
        return f"the process was killed by {signal.Signals(sig).name}"
    except ValueError:
        return f"the process was killed by signal {sig}"


class _BoundedReader(threading.Thread):
    def __init__(self, fd: int, cap: int):
        super().__init__(daemon=True, name="sandbox-stdout")
        self.fd, self.cap = fd, cap
        self.buf = bytearray()
        self.pos = 0              # where read_line goes on from
        self.truncated = False
        self.eof = False
        self.cond = threading.Condition()

    def run(self) -> None:
        try:
            while True:
                try:
                    chunk = os.read(self.fd, _CHUNK)
                except OSError:
                    break
                if not chunk:
                    break
                with self.cond:
                    room = self.cap - len(self.buf)
                    if room > 0:
                        self.buf += chunk[:room]
                    if len(chunk) > room:
                        self.truncated = True
                    self.cond.notify_all()
        finally:
            with self.cond:
                self.eof = True
                self.cond.notify_all()

    def read_line(self, deadline: float) -> bytes | None:
        with self.cond:
            while True:
                i = self.buf.find(b"\n", self.pos)
                if i >= 0:
                    line = bytes(self.buf[self.pos:i])
                    self.pos = i + 1
                    return line
                left = deadline - time.monotonic()
                if self.eof or self.truncated or left <= 0:
                    return None
                self.cond.wait(left)


_PRLIMIT_FLAGS = {"RLIMIT_AS": "--as", "RLIMIT_CPU": "--cpu", "RLIMIT_FSIZE": "--fsize",
                  "RLIMIT_CORE": "--core", "RLIMIT_NOFILE": "--nofile", "RLIMIT_NPROC": "--nproc"}


def with_rlimits(argv: list[str], limits: Limits, extra: dict[str, int] | None = None) -> list[str]:
    """`argv` started under the job's per-process limits, set by util-linux's prlimit before the
    job's first process runs (so no code of the job ever runs without them). The programs set
    them again (trainer/sandbox/programs.py) where prlimit is missing."""
    prlimit = shutil.which("prlimit")
    if not prlimit:
        return argv
    flags = [f"{_PRLIMIT_FLAGS[k]}={v}" for k, v in {**limits.rlimits(), **(extra or {})}.items()]
    return [prlimit, *flags, "--", *argv]


def _wait_exit(proc: subprocess.Popen, timeout: float) -> None:
    """Wait up to `timeout` s for `proc` to end, woken the moment it does: a pidfd polled
    (`Popen.wait(timeout)` polls with sleeps growing to 50 ms, which a call ending after ~60 ms
    paid as ~25 ms more on average); `Popen.wait` where pidfds are missing."""
    if timeout > 0 and proc.poll() is None:
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            return
        try:
            select.select([fd], [], [], timeout)
        finally:
            os.close(fd)
    proc.poll()


class ProcessSession:
    """`argv` started in a session of its own, stdin and stdout piped, stderr discarded.
    `on_close` runs once after the job is killed and reaped (the backend's clean-up)."""

    def __init__(self, argv: list[str], *, env: dict[str, str], cwd: str, limits: Limits,
                 pass_fds: tuple[int, ...] = (), on_close: Callable[[], None] | None = None,
                 describe_end=None):
        self.started = time.monotonic()
        self.deadline = self.started + limits.wall_s
        self.wall_s = limits.wall_s
        self._on_close = on_close
        self._describe_end = describe_end
        self._outcome: Outcome | None = None
        self._killed = False
        self.proc = subprocess.Popen(with_rlimits(argv, limits), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, cwd=cwd,
                                     pass_fds=pass_fds, start_new_session=True, close_fds=True)
        self._reader = _BoundedReader(self.proc.stdout.fileno(), limits.output_bytes)
        self._reader.start()

    def send(self, data: bytes) -> None:
        if self.proc.stdin is None or self.proc.stdin.closed:
            raise ValueError("the job's stdin is closed")
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def close_stdin(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def read_line(self, deadline: float) -> bytes | None:
        return self._reader.read_line(min(deadline, self.deadline))

    def close(self, deadline: float | None = None) -> Outcome:
        if self._outcome is not None:
            return self._outcome
        wait_until = min(deadline, self.deadline) if deadline is not None else time.monotonic()
        _wait_exit(self.proc, max(0.0, wait_until - time.monotonic()))
        rc = self.proc.poll()
        timed_out = rc is None and time.monotonic() >= self.deadline - 1e-3
        self._kill()
        self._reader.join(timeout=5)
        try:
            self.proc.stdout.close()
        except OSError:
            pass
        self.close_stdin()
        if self._on_close is not None:
            self._on_close()
        seconds = time.monotonic() - self.started
        sig = -rc if rc is not None and rc < 0 else None
        why = ""
        if timed_out:
            why = f"timed out after {self.wall_s:g}s"
        elif rc is None:
            why = "stopped before it finished"
        elif self._describe_end is not None:
            why = self._describe_end(rc)
        if sig == getattr(signal, "SIGXCPU", None) or "CPU time" in why:
            timed_out, why = True, "CPU time limit exceeded"
        with self._reader.cond:
            out, truncated = bytes(self._reader.buf), self._reader.truncated
        self._outcome = Outcome(rc, sig, timed_out, out, truncated, seconds, why)
        return self._outcome

    def _kill(self) -> None:
        if self._killed:
            return
        self._killed = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _wait_exit(self.proc, 5.0)

    def __del__(self):
        if self._outcome is None and getattr(self, "proc", None) is not None:
            try:
                self._kill()
            except Exception:  # noqa: BLE001 -- interpreter shutdown
                pass
