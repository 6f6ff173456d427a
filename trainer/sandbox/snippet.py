"""The python tool's run: a snippet in the sandbox, answered with what it printed.

The output is what the code wrote to `sys.stdout` and `sys.stderr`, interleaved in order (not
tracebacks: an exception is the `error`, its last line), at most `max_output_chars` of it, ending
with `TRUNCATED` when cut. The answer comes back as one JSON line that the program writes last;
bytes the code writes straight to its file descriptors are read under a hard cap
(`_HARD_CAP_BYTES`) and, where they spoil that line, the run is an error that says so. Nothing the
code prints is trusted beyond being the tool's text: the tool decides no reward.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from trainer.sandbox import get
from trainer.sandbox.base import Job, Limits, run
from trainer.sandbox.programs import SNIPPET

TRUNCATED = "…[truncated]"       # ends an output that `clip` cut
CODE_MEMORY_BYTES = 1 << 30
_HARD_CAP_BYTES = 1 << 20        # what is read back of a run whatever it writes


@dataclass
class SnippetResult:
    status: str      # "ok", "error" (it raised, or the process died) or "timeout"
    output: str      # what it printed (stdout and stderr, interleaved), clipped
    error: str = ""  # why it failed: "ZeroDivisionError: division by zero", "timed out after 5s", ...


def clip(text: str, limit: int) -> str:
    """`text` in at most `limit` characters: cut, ending with `TRUNCATED`, when it is longer (what a
    model is shown is bounded, and says when it is not the whole)."""
    if len(text) <= limit:
        return text
    if limit <= len(TRUNCATED):
        return text[:max(0, limit)]
    return text[:limit - len(TRUNCATED)] + TRUNCATED


def run_snippet(code: str, *, timeout_s: float, memory_bytes: int = CODE_MEMORY_BYTES,
                max_output_chars: int = 2000, isolation: str | None = None) -> SnippetResult:
    """Run `code` as the python tool does, in the run's sandbox (or `isolation`'s)."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}")
    limit = max(0, int(max_output_chars))
    limits = Limits(wall_s=max(0.05, float(timeout_s)), memory_bytes=int(memory_bytes),
                    output_bytes=_HARD_CAP_BYTES)
    first = json.dumps({"code": code, "max_output": limit, "rlimits": limits.rlimits()})
    outcome = run(get(isolation), Job(("-c", SNIPPET), limits), first.encode() + b"\n")
    answer = _answer(outcome.stdout)
    if answer is None:
        if outcome.timed_out:
            return SnippetResult("timeout", "", outcome.why)
        if outcome.truncated:
            return SnippetResult("error", "", f"it wrote more than {_HARD_CAP_BYTES} bytes "
                                              "straight to its output")
        return SnippetResult("error", "", outcome.why or "it ended without an answer")
    output = clip(str(answer.get("output", "")) + (TRUNCATED if answer.get("cut") else ""), limit)
    error = str(answer.get("error", ""))[:500]
    return SnippetResult("error" if error else "ok", output, error)


def _answer(stdout: bytes) -> dict | None:
    lines = stdout.decode("utf-8", "replace").rstrip("\n").rsplit("\n", 1)
    try:
        msg = json.loads(lines[-1])
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None
