"""The code reward's verdict, decided where the candidate's code cannot reach.

The completion's code runs in the sandbox (trainer/sandbox/, the CANDIDATE program) and never
sees a test. The problem's tests run here, in the judge (the reward worker's interpreter), in
a namespace where each function the code defined is a stub: calling it sends the arguments into
the sandbox as data (trainer/sandbox/codec.py) and returns the decoded result, or raises the
exception the candidate raised (a built-in type by name, else `CandidateError`). Nothing the
code prints, writes or reads can change the verdict: the expected values stay on this side, and
a result is plain data compared by the tests' own `==`.

Tests are the problem's code (assert statements, or a HumanEval `check(candidate)` that the judge
calls): trusted like the task file they come from. What cannot cross the boundary fails the test
and says so: an argument or a result that is not plain data (a function, an object), and a test
that expects the candidate to mutate its argument in place.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import json
import time
from dataclasses import dataclass
from typing import Sequence

from trainer.sandbox import get
from trainer.sandbox.base import Job, Limits
from trainer.sandbox.codec import Unsendable, decode, encode
from trainer.sandbox.programs import CANDIDATE

CODE_TIMEOUT_S = 10.0            # wall-clock limit of one code reward
CODE_MEMORY_BYTES = 1 << 30      # address space of each candidate process
_OUTPUT_BYTES = 16 << 20         # what is read back from a candidate over all its calls
# modules a test may use without importing them (the candidate's imports stay in the sandbox)
_TEST_MODULES = ("math", "re", "itertools", "collections", "functools", "string", "heapq",
                 "bisect")


@dataclass
class CodeResult:
    passed: bool
    status: str      # "pass", "fail" (a test failed or the code did not run) or "timeout"
    detail: str = ""


class CandidateError(Exception):
    """The candidate raised an exception that is not one of Python's built-in types."""


class _Ended(BaseException):
    """The candidate's process is gone or past its time: no test can go on (not catchable by a
    test's `except Exception`)."""


def judge(code: str, tests: Sequence[str], entry_point: str, *, timeout_s: float = CODE_TIMEOUT_S,
          memory_bytes: int = CODE_MEMORY_BYTES, isolation: str | None = None) -> CodeResult:
    """Run `code` in the sandbox and `tests` here against its functions."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}")
    limits = Limits(wall_s=max(0.05, float(timeout_s)), memory_bytes=int(memory_bytes),
                    output_bytes=_OUTPUT_BYTES)
    session = get(isolation).start(Job(("-c", CANDIDATE), limits))
    try:
        return _judge(session, code, list(tests), entry_point, limits)
    except _Ended as e:
        outcome = session.close()
        return CodeResult(False, "timeout" if outcome.timed_out else "fail",
                          str(e) if str(e) else outcome.why)
    finally:
        session.close()


def _judge(session, code: str, tests: list[str], entry_point: str, limits: Limits) -> CodeResult:
    deadline = time.monotonic() + limits.wall_s
    channel = _Channel(session, deadline)
    hello = channel.ask({"code": code, "rlimits": limits.rlimits(), "close_stdin": False})
    if not hello.get("loaded"):
        return CodeResult(False, "fail", "the code raised " + str(hello.get("error", ""))[:300])
    functions = [f for f in hello.get("functions", []) if isinstance(f, str) and f.isidentifier()]
    if entry_point not in functions:
        return CodeResult(False, "fail", f"the code does not define {entry_point}()")
    ns: dict = {"__name__": "__judge__", "__builtins__": builtins}
    ns.update({m: importlib.import_module(m) for m in _TEST_MODULES})
    ns.update({name: _Stub(channel, name) for name in functions})
    for i, source in enumerate(tests):
        try:
            tree = ast.parse(source)
            defines_check = any(isinstance(s, ast.FunctionDef) and s.name == "check" for s in tree.body)
            calls_check = any(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                              and isinstance(s.value.func, ast.Name) and s.value.func.id == "check"
                              for s in tree.body)
            exec(compile(tree, f"tests[{i}]", "exec"), ns)
            if defines_check and not calls_check:   # HumanEval style: def check(candidate): ...
                ns["check"](ns[entry_point])
        except _Ended:
            raise
        except BaseException as e:  # noqa: BLE001 -- a failing test, whatever it raised
            return CodeResult(False, "fail", f"tests[{i}] failed: " + _describe(e))
    return CodeResult(True, "pass")


class _Channel:
    """One JSON line to the candidate, one back, before the deadline."""

    def __init__(self, session, deadline: float):
        self.session, self.deadline = session, deadline

    def ask(self, msg: dict) -> dict:
        try:
            self.session.send(json.dumps(msg).encode() + b"\n")
        except (BrokenPipeError, ValueError, OSError):
            raise _Ended(self._why()) from None
        line = self.session.read_line(self.deadline)
        if line is None:
            raise _Ended(self._why())
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise _Ended("the candidate answered something that is not a result")
        return answer

    def _why(self) -> str:
        if time.monotonic() >= self.deadline:
            return ""   # the session's outcome says "timed out after ..."
        outcome = self.session.close()
        if outcome.truncated:
            return "the candidate wrote more than the judge reads"
        return outcome.why or "the candidate's process ended"


class _Stub:
    """A function of the candidate's, called across the boundary."""

    def __init__(self, channel: _Channel, name: str):
        self.channel, self.__name__ = channel, name

    def __call__(self, *args, **kwargs):
        try:
            msg = {"call": self.__name__, "args": encode(list(args)), "kwargs": encode(kwargs)}
        except Unsendable as e:
            raise TypeError(f"the test passes {e} to {self.__name__}(), which cannot cross the "
                            "sandbox boundary (plain data only)") from None
        answer = self.channel.ask(msg)
        if "value" in answer:
            try:
                return decode(answer["value"])
            except (ValueError, TypeError) as e:
                raise _Ended(f"the candidate's result is not plain data ({e})") from None
        if "unsendable" in answer:
            raise TypeError(f"{self.__name__}() returned {answer['unsendable']}, which cannot "
                            "cross the sandbox boundary (plain data only)")
        name, message = str(answer.get("raised", "Exception")), str(answer.get("message", ""))[:300]
        kind = getattr(builtins, name, None)
        error = None
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                error = kind(message)
            except Exception:  # noqa: BLE001 -- a built-in whose constructor wants other arguments
                error = None
        raise error if error is not None else CandidateError(f"{name}: {message}")


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
