"""Where model-written code runs: the python tool of episodes and the code reward's candidate.

The policy is an adversary (RL optimises it against whatever it can reach), so its code runs
behind the operating system's boundary, not Python's:

    base.py      the interface: a Job (interpreter arguments, files, Limits) started as a Session
                 (stdin, stdout read with a byte cap, a deadline, close kills it all); `run`
    bwrap.py     the boundary (default): bubblewrap namespaces, a minimal read-only root, no
                 network, uid 65534 without capabilities, seccomp.py's filter, cgroup.py's limits
    process.py   the weaker opt-out (`sandbox.isolation = "process"`): rlimits and an audit hook
    session.py   driving a job's process: bounded output, deadline, kill
    programs.py  the Python the sandbox runs (the tool's snippet runner, the reward's candidate)
    codec.py     values across the boundary as data
    snippet.py   the python tool: run a snippet, say what it printed

The isolation a process uses is set once by the run (`use`, from `sandbox.isolation`) and
inherited by its child processes through RLPILOT_SANDBOX_ISOLATION, so reward workers and
generation processes sandbox as the run asked. docs/sandbox.md is the threat model.
"""
from __future__ import annotations

import os

from trainer.sandbox.base import SandboxUnavailable

ISOLATIONS = ("bwrap", "process")
ENV_VAR = "RLPILOT_SANDBOX_ISOLATION"
WEAK_WARNING = ("model-written code runs with sandbox.isolation = 'process': limits and an audit "
                "hook only, not an isolation boundary (code can reach the host through ctypes); "
                "see docs/sandbox.md")


def current() -> str:
    value = os.environ.get(ENV_VAR, "bwrap")
    if value not in ISOLATIONS:
        raise SandboxUnavailable(f"{ENV_VAR}={value!r}: expected one of {', '.join(ISOLATIONS)}")
    return value


def use(isolation: str) -> None:
    """Sandbox model-written code with `isolation` in this process and the processes it starts."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation {isolation!r}: expected one of {', '.join(ISOLATIONS)}")
    os.environ[ENV_VAR] = isolation


def get(isolation: str | None = None):
    """The sandbox backend for `isolation` (default: `current()`)."""
    isolation = isolation or current()
    if isolation == "process":
        from trainer.sandbox.process import ProcessSandbox
        return ProcessSandbox()
    from trainer.sandbox.bwrap import BwrapSandbox
    return BwrapSandbox()


def unavailable(isolation: str) -> str | None:
    """Why `isolation` cannot be used on this host, naming what to install (None: it can)."""
    if isolation == "process":
        return None
    from trainer.sandbox.bwrap import probe
    return probe()
