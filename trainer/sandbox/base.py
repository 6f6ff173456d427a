"""The sandbox interface: run a program on model-written input, limited, and get an outcome.

A `Sandbox` starts a `Job` (an interpreter's arguments, the files it finds in its scratch folder,
its limits) as a `Session`: the caller writes to its standard input, reads lines from its
standard output with a deadline, and closes it, which kills whatever the job started and removes
its scratch. `run` is the one-shot form (all of stdin in, all of stdout back, capped). Every
backend gives the same guarantees to the caller (bounded output, a deadline, nothing outlives
`close`); what the job can reach from inside is the backend's (trainer/sandbox/__init__.py).

A remote backend (SandboxFusion's HTTP API, E2B, ...) implements `run`; the code reward's judge
needs a `Session` (calls to the candidate's functions go back and forth), which such a backend
offers only where its service keeps a process open.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

MiB = 1 << 20


class SandboxUnavailable(RuntimeError):
    """The boundary cannot be set up here; the message names what is missing and how to get it."""


@dataclass(frozen=True)
class Limits:
    wall_s: float                        # the whole job, from start to close
    memory_bytes: int = 1 << 30          # each process's address space (and the job's total, where
                                         # a cgroup can be made)
    processes: int = 32                  # processes and threads the job may have at once
    output_bytes: int = 1 * MiB          # stdout kept; the rest is read and discarded
    file_bytes: int = 16 * MiB           # largest file it may write
    scratch_bytes: int = 64 * MiB        # its writable scratch folder, in all (bwrap: a tmpfs)

    @property
    def cpu_s(self) -> int:
        """CPU seconds per process: the wall limit rounded up, plus one (a busy loop that ignores
        SIGTERM is killed by the kernel even if the caller's timer were late)."""
        return int(-(-self.wall_s // 1)) + 1

    def rlimits(self) -> dict[str, int]:
        """The per-process limits, by `resource` name (each process of the job inherits them)."""
        return {"RLIMIT_AS": self.memory_bytes, "RLIMIT_CPU": self.cpu_s,
                "RLIMIT_FSIZE": self.file_bytes, "RLIMIT_CORE": 0, "RLIMIT_NOFILE": 256}


@dataclass(frozen=True)
class Job:
    args: tuple[str, ...]                # the interpreter's arguments: ("-c", SOURCE, ...)
    limits: Limits
    files: dict[str, bytes] = field(default_factory=dict)   # written into the scratch first
    env: dict[str, str] = field(default_factory=dict)       # on top of a minimal environment


@dataclass
class Outcome:
    exit_code: int | None                # None: killed by the caller (deadline, close)
    signal: int | None                   # the signal that ended the job's first process, if any
    timed_out: bool                      # past Limits.wall_s, or its CPU limit
    stdout: bytes                        # at most Limits.output_bytes
    truncated: bool                      # stdout had more, which was discarded
    seconds: float                       # wall time, start to close
    why: str = ""                        # how it ended, in words, when not by a plain exit


class Session(Protocol):
    def send(self, data: bytes) -> None:
        """Write to the job's stdin (BrokenPipeError, ValueError once it is gone)."""

    def close_stdin(self) -> None: ...

    def read_line(self, deadline: float) -> bytes | None:
        """The next line of stdout (without its newline), or None: the job ended, the stream was
        cut at the byte cap, or `deadline` (time.monotonic()) passed."""

    def close(self, deadline: float | None = None) -> Outcome:
        """Wait for the job to end until `deadline` (None: now), kill everything it started,
        remove its scratch and say how it ended. Idempotent."""


class Sandbox(Protocol):
    name: str

    def start(self, job: Job) -> Session: ...


def run(sandbox: Sandbox, job: Job, stdin: bytes = b"") -> Outcome:
    """Run `job` to its end (or its wall limit) with `stdin`, and collect its stdout."""
    session = sandbox.start(job)
    deadline = time.monotonic() + job.limits.wall_s   # from the job's start, not before it
    try:
        try:
            session.send(stdin)
            session.close_stdin()
        except (BrokenPipeError, ValueError, OSError):
            pass   # it ended (or closed stdin) before reading everything: its outcome says why
        return session.close(deadline)
    except BaseException:
        session.close()
        raise
