"""Reward functions and the process pool that runs them.

`score(kind, answer, completion) -> float` is the one entry point the trainer needs: a pure,
picklable function of a problem's kind and answer and a model completion.

    sum   the built-in list-sum task (trainer.tasks.sum.score_sum)
    math  the completion's final answer (the last \\boxed{...}, else the last number or
          expression) is compared with the gold answer by math_verify, so \\boxed{1/2}, 0.5
          and \\frac12 are the same answer
    code  the completion's code and the problem's tests run in a sandboxed Python subprocess
          (see run_code); 1.0 when every test passes

`RewardService` scores whole batches, in worker processes that it keeps alive between batches,
under a time limit. A reward that raises, a worker that dies and a batch that runs out of time
all give 0 for the items concerned (counted in `RewardBatch.errors` / `.timeouts`) and never
raise into the trainer; stuck workers are killed with their subprocesses and replaced.
"""
from __future__ import annotations

import collections
import functools
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from trainer.tasks.sum import score_sum

log = logging.getLogger(__name__)

KINDS = ("sum", "math", "code")


def score(kind: str, answer: Any, completion: str) -> float:
    """The reward of `completion` for a problem of `kind` whose answer is `answer`: 0.0 or 1.0."""
    if kind == "sum":
        return score_sum(answer, completion)
    if kind == "math":
        return score_math(answer, completion)
    if kind == "code":
        return score_code(answer, completion)
    raise ValueError(f"unknown reward kind {kind!r}; known kinds: " + ", ".join(KINDS))


# =============================================================================================
# math
# =============================================================================================

_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
# Candidates for an unboxed final answer, scanned left to right; the last one that parses wins.
_CANDIDATE = re.compile(
    r"\$\$(?P<d2>.+?)\$\$|\$(?P<d1>[^$]+?)\$|\\\[(?P<br>.+?)\\\]|\\\((?P<pa>.+?)\\\)"
    r"|(?P<frac>-?\\[dt]?frac\s*(?:\{[^{}]*\}|\d)\s*(?:\{[^{}]*\}|\d))"
    r"|(?P<num>-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+)",
    re.S)
_MAX_CANDIDATES = 4   # unboxed candidates tried, from the end, before giving up
_MAX_ANSWER_CHARS = 1000


def last_boxed(text: str) -> str | None:
    """The content of the last well-formed \\boxed{...} (or \\fbox{...}, \\boxed 5) in `text`."""
    for m in reversed(list(_BOXED.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                c = text[j]
                if c == "\\":  # skip escaped characters such as \{ and \}
                    j += 2
                    continue
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j]
                j += 1
            continue  # unbalanced: try an earlier box
        if i > m.end():  # "\boxed 5"
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                return tok.group(0)
    return None


def extract_answer(completion: str) -> list[str]:
    """Candidate final answers of a completion, best first: the last \\boxed{} if there is one,
    else the last few LaTeX segments / fractions / numbers, from the end backwards."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return [boxed]
    found = []
    for m in _CANDIDATE.finditer(completion):
        found.append(next(v for v in m.groupdict().values() if v is not None))
    return found[::-1][:_MAX_CANDIDATES]


def _mv_timeout() -> int | None:
    # math_verify enforces its time limits with SIGALRM, which works in the main thread only.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _clean(text: str) -> str:
    return text.strip().rstrip(".,;:!").strip()


def _parse_latex(text: str) -> list:
    from math_verify import parse
    text = _clean(text)[:_MAX_ANSWER_CHARS]
    if not text:
        return []
    t = _mv_timeout()
    parsed = parse(f"${text}$", parsing_timeout=t)
    if not parsed:
        parsed = parse(text, parsing_timeout=t)
    return parsed


@functools.lru_cache(maxsize=8192)
def _parse_gold(answer: str) -> tuple:
    if "\\boxed" in answer or "$" in answer:
        from math_verify import parse
        return tuple(parse(answer, parsing_timeout=_mv_timeout()))
    return tuple(_parse_latex(answer))


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def _normalize_text(s: str) -> str:
    s = _TEXT_WRAPPER.sub(r"\1", s)
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    return re.sub(r"\s+", "", _clean(s)).lower()


def score_math(answer: Any, completion: str) -> float:
    """1.0 when the completion's final answer equals `answer` mathematically, else 0.0."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a string, got {type(completion).__name__}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TypeError(f"a math answer must be a string or a number, got {answer!r}")
    gold_text = answer if isinstance(answer, str) else repr(answer)
    gold = _parse_gold(gold_text)
    candidates = extract_answer(completion)
    if not candidates:
        return 0.0
    from math_verify import verify
    t = _mv_timeout()
    for cand in candidates:
        pred = _parse_latex(cand)
        if pred:
            if gold and verify(list(gold), pred, timeout_seconds=t):
                return 1.0
            # The last parseable candidate is the model's answer: don't fall back to earlier ones.
            return 1.0 if _normalize_text(cand) == _normalize_text(gold_text) else 0.0
    # Nothing parsed (e.g. a textual answer): exact match of the boxed text.
    return 1.0 if _normalize_text(candidates[0]) == _normalize_text(gold_text) else 0.0


# =============================================================================================
# code
# =============================================================================================

CODE_TIMEOUT_S = 10.0            # wall-clock limit of one sandboxed run
CODE_MEMORY_BYTES = 1 << 30      # address space of the sandboxed process
CODE_FILE_BYTES = 16 << 20       # largest file it may write
_CODE_MAX_NPROC_EXTRA = 64       # non-root: threads/processes it may add to the user's count

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_CODE_LANGS = {"", "python", "py", "python3", "py3"}

_sandbox_parent: str | None = None   # where sandbox directories are made (set by the worker)


@dataclass
class CodeResult:
    passed: bool
    status: str      # "pass", "fail" (a test failed or the code did not run) or "timeout"
    detail: str = ""


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The Python code of a completion: the last ```python fenced block (the last one that
    defines `entry_point`, if any does), or the whole completion when it has no fences."""
    blocks = [m.group(2) for m in _FENCE.finditer(completion) if m.group(1).lower() in _CODE_LANGS]
    if not blocks:
        return completion
    if entry_point:
        pat = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(|"
                         rf"^\s*{re.escape(entry_point)}\s*=", re.M)
        defining = [b for b in blocks if pat.search(b)]
        if defining:
            return defining[-1]
    return blocks[-1]


def score_code(answer: dict, completion: str, timeout_s: float = CODE_TIMEOUT_S) -> float:
    """1.0 when the completion defines answer['entry_point'] and passes answer['tests']."""
    return 1.0 if _run_answer(answer, completion, timeout_s).passed else 0.0


def _run_answer(answer: dict, completion: str, timeout_s: float) -> CodeResult:
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a string, got {type(completion).__name__}")
    if not isinstance(answer, dict) or "tests" not in answer or "entry_point" not in answer:
        raise TypeError("a code answer must be a dict with 'tests' and 'entry_point', "
                        f"got {answer!r:.200}")
    tests = answer["tests"]
    tests = [tests] if isinstance(tests, str) else list(tests)
    entry_point = answer["entry_point"]
    return run_code(extract_code(completion, entry_point), tests, entry_point, timeout_s=timeout_s)


# The program the sandboxed interpreter runs. It reads its job from stdin, applies the limits,
# blocks the network, process creation and writes outside its directory, then runs the code
# and the tests and reports on a private copy of stdout. Only a report carrying the nonce of
# this run counts as a pass, so code that prints a pass or exits early cannot fake one; the
# nonce is a local of _main(), not a global of __main__ that the code could import.
_RUNNER_BODY = r'''
import ast, json, os, resource, sys
job = json.loads(sys.stdin.buffer.read() or b"null")
if job is None:
    os._exit(3)
report_fd = os.dup(1)
devnull = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(devnull, fd)

def report(msg):
    os.write(report_fd, (json.dumps(msg) + "\n").encode())
    os._exit(0)

def limit(name, value):
    r = getattr(resource, name, None)
    if r is not None:
        try:
            resource.setrlimit(r, (value, value))
        except (OSError, ValueError):
            pass

limit("RLIMIT_AS", job["mem"])
limit("RLIMIT_CPU", job["cpu"])
limit("RLIMIT_FSIZE", job["fsize"])
limit("RLIMIT_CORE", 0)
limit("RLIMIT_NOFILE", 256)
if job["nproc"]:
    limit("RLIMIT_NPROC", job["nproc"])
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL: die with the process that started us
    if os.getppid() != job["ppid"]:
        os._exit(3)
    if os.geteuid() == 0:
        libc.unshare(0x40000000)  # CLONE_NEWNET: an empty network namespace (root only)
except Exception:
    pass

import socket

def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the reward sandbox")

_AF_UNIX = getattr(socket, "AF_UNIX", None)

class _NoSocket(socket.socket):  # a class, so that modules subclassing socket.socket import
    __slots__ = ()
    def __init__(self, family=-1, *args, **kwargs):
        if family != _AF_UNIX or _AF_UNIX is None:  # socketpair() (asyncio needs it) stays
            _no_network()
        super().__init__(family, *args, **kwargs)

socket.socket = socket.SocketType = _NoSocket
socket.create_connection = _no_network
socket.create_server = _no_network
socket.fromfd = _no_network

SANDBOX = os.path.realpath(os.getcwd())
_NO = frozenset("""socket.connect socket.bind socket.sendto socket.sendmsg
    socket.getaddrinfo socket.gethostbyname socket.gethostbyaddr socket.getnameinfo
    subprocess.Popen os.system os.exec os.posix_spawn os.spawn os.fork os.forkpty pty.spawn
    os.kill os.killpg signal.pthread_kill os.symlink os.link ctypes.dlopen ctypes.dlsym
    os.setuid os.setgid os.chroot""".split())
_PATHS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.replace": (0, 1),
          "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.mkdir": (0,),
          "os.utime": (0,), "shutil.rmtree": (0,), "os.setxattr": (0,),
          "os.removexattr": (0,), "sqlite3.connect": (0,)}
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_abspath, _fspath, _sep = os.path.abspath, os.fspath, os.sep

def _inside(p):
    if isinstance(p, int):
        return True
    try:
        p = _abspath(_fspath(p))
    except Exception:
        return False
    if isinstance(p, bytes):
        p = p.decode("utf-8", "surrogateescape")
    return p == SANDBOX or p.startswith(SANDBOX + _sep)

def _guard(event, args):
    if event in _NO or (event == "socket.__new__" and args[1] != _AF_UNIX):
        raise PermissionError(f"{event} is not allowed in the reward sandbox")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and flags & _WRITE)
        if writing and not _inside(path):
            raise PermissionError(f"writing {path!r} is not allowed in the reward sandbox")
    elif event in _PATHS:
        for i in _PATHS[event]:
            if i < len(args) and args[i] is not None and not _inside(args[i]):
                raise PermissionError(f"{event} on {args[i]!r} is not allowed in the reward sandbox")

sys.addaudithook(_guard)

nonce, entry, code, tests = job["nonce"], job["entry_point"], job["code"], job["tests"]
del job

def _name(e):
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 300 else text[:297] + "..."

ns = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(code, "solution.py", "exec"), ns)
except BaseException as e:
    report({"status": "fail", "detail": "the code raised " + _name(e)})
if not callable(ns.get(entry)):
    report({"status": "fail", "detail": f"the code does not define {entry}()"})
for i, t in enumerate(tests):
    try:
        tree = ast.parse(t)
        defines_check = any(isinstance(s, ast.FunctionDef) and s.name == "check" for s in tree.body)
        calls_check = any(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                          and isinstance(s.value.func, ast.Name) and s.value.func.id == "check"
                          for s in tree.body)
        exec(compile(tree, f"tests[{i}]", "exec"), ns)
        if defines_check and not calls_check:  # HumanEval style: def check(candidate): ...
            ns["check"](ns[entry])
    except BaseException as e:
        report({"status": "fail", "detail": f"tests[{i}] failed: " + _name(e)})
report({"status": "pass", "nonce": nonce})
'''
_RUNNER = "def _main():\n" + textwrap.indent(_RUNNER_BODY, "    ") + "\n_main()\n"


def run_code(code: str, tests: Sequence[str], entry_point: str, *,
             timeout_s: float = CODE_TIMEOUT_S, memory_bytes: int = CODE_MEMORY_BYTES) -> CodeResult:
    """Run `code` and then each test source in a fresh sandboxed interpreter.

    The child is `python -I` in a new session and a fresh temporary directory (its cwd, HOME
    and TMPDIR) with a minimal environment, limited in wall-clock time (`timeout_s`), CPU time,
    address space (`memory_bytes`), file size and open files. Sockets are replaced by functions
    that raise, and an audit hook refuses sockets, process creation, signals to other processes
    and writes outside the directory; as root it also unshares the network namespace. This
    stops accidents and honest mistakes (infinite loops, memory bombs, stray network calls,
    `rm -rf`), not a determined attacker: it is not a security boundary.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}")
    timeout_s = max(0.05, float(timeout_s))
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "code": code, "tests": list(tests), "entry_point": entry_point,
           "mem": int(memory_bytes), "cpu": int(math.ceil(timeout_s)) + 1, "fsize": CODE_FILE_BYTES,
           "nproc": _nproc_limit(), "ppid": os.getpid()}
    payload = json.dumps(job).encode()
    with tempfile.TemporaryDirectory(prefix="rlpilot-code-", dir=_sandbox_parent) as tmp:
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": tmp,
               "TMPDIR": tmp, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _RUNNER], cwd=tmp, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            out, _ = proc.communicate(payload, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return CodeResult(False, "timeout", f"timed out after {timeout_s:g}s")
        except BaseException:
            _kill_group(proc)
            raise
        _kill_group(proc)  # threads or children the code left behind
    lines = out.decode("utf-8", "replace").strip().splitlines()
    msg = None
    if lines:
        try:
            msg = json.loads(lines[-1])
        except ValueError:
            msg = None
    if isinstance(msg, dict) and msg.get("status") == "pass":
        if msg.get("nonce") == nonce:
            return CodeResult(True, "pass")
        return CodeResult(False, "fail", "forged pass report")
    if isinstance(msg, dict) and msg.get("status") == "fail":
        return CodeResult(False, "fail", str(msg.get("detail", ""))[:500])
    rc = proc.returncode
    if rc is not None and rc < 0:
        sig = -rc
        if sig == getattr(signal, "SIGXCPU", None):
            return CodeResult(False, "timeout", "CPU time limit exceeded")
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return CodeResult(False, "fail", f"the process was killed by {name}")
    return CodeResult(False, "fail", f"the process exited with code {rc} before the tests finished")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _nproc_limit() -> int:
    """RLIMIT_NPROC for a sandbox: 0 (unset) for root, which ignores it; otherwise the number
    of threads the user runs now (the kernel counts threads) plus a margin, so that fork bombs
    stop quickly. 0 when /proc cannot be read."""
    if not hasattr(os, "geteuid") or os.geteuid() == 0:
        return 0
    uid, count = os.getuid(), 0
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0
    for name in names:
        if name.isdigit():
            try:
                st = os.stat(f"/proc/{name}/task")   # its link count is threads + 2
            except OSError:
                continue
            if st.st_uid == uid:
                count += max(1, st.st_nlink - 2)
    return count + _CODE_MAX_NPROC_EXTRA if count else 0


# =============================================================================================
# Scoring one item with a status (what the service runs)
# =============================================================================================

def resolve_reward_fn(spec: str):
    """'package.module:function' -> the function (ValueError naming what is wrong)."""
    import importlib
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"reward function {spec!r}: expected 'module:function'")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except ImportError as e:
        raise ValueError(f"reward function {spec!r}: cannot import {mod_name!r}: {e}") from None
    except AttributeError:
        raise ValueError(f"reward function {spec!r}: {mod_name!r} has no {fn_name!r}") from None
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn


def _score_item(kind: str, answer: Any, completion: str, code_timeout_s: float,
                fn=None) -> tuple[float, str, str]:
    """(score, status, note); status is "ok", "error" or "timeout". Never raises.

    `fn(kind, answer, completion)` replaces `score` when given."""
    try:
        if fn is not None:
            value = float(fn(kind, answer, completion))
            if not math.isfinite(value):
                raise ValueError(f"the reward is {value}")
            return value, "ok", ""
        if kind == "code":
            if code_timeout_s <= 0.05:
                return 0.0, "timeout", "no time left in the batch"
            r = _run_answer(answer, completion, code_timeout_s)
            if r.status == "timeout":
                return 0.0, "timeout", r.detail
            return (1.0 if r.passed else 0.0), "ok", r.detail
        value = float(score(kind, answer, completion))
        if not math.isfinite(value):
            raise ValueError(f"the reward is {value}")
        return value, "ok", ""
    except Exception as e:  # noqa: BLE001 -- a reward must never take the trainer down
        text = f"{type(e).__name__}: {e}"
        return 0.0, "error", text[:300]


def _preload(kinds: Iterable[str]) -> None:
    if "math" in kinds:
        try:
            score_math("1", "\\boxed{1}")   # imports math_verify and sympy, warms their caches
        except Exception:  # noqa: BLE001
            pass


# =============================================================================================
# The reward service
# =============================================================================================
#
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
# replacing dead workers; memory and the rest of the sandbox are limited by run_code's child.

@dataclass
class RewardBatch:
    scores: list[float]
    errors: int
    timeouts: int
    statuses: list[str] = field(default_factory=list)   # per item: "ok", "error", "timeout"
    notes: list[str] = field(default_factory=list)      # per item: why it failed, if known


_CHUNK_MAX = 64
_PART_EVERY_S = 0.2      # a worker reports finished items of a long chunk this often
_STARTUP_FAILURES = 3    # consecutive worker deaths before ready -> score in-process
_STARTUP_LIMIT_S = 120.0  # a worker not ready after this long is killed and replaced
_WORKER_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from trainer.rewards import _worker_main; _worker_main(sys.argv[2:])")


class _Chunk:
    __slots__ = ("indices", "reported")

    def __init__(self, indices: list[int]):
        self.indices = indices
        self.reported = 0   # leading items whose results came back


class _Worker:
    def __init__(self, preload: Iterable[str], sandbox_dir: str, reward_fn: str):
        import multiprocessing
        parent, child = multiprocessing.Pipe(duplex=True)
        root = str(Path(__file__).resolve().parents[1])
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
    `reward_fn` ('module:function', importable by the workers) replaces `score` for every item.
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
        self._kinds = {k for k in kinds if k in KINDS}
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
            self._kinds.update(k for k, _, _ in items if k in KINDS)
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

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    # -- in-process ----------------------------------------------------------------------------

    def _score_inline(self, items) -> list[tuple[float, str, str]]:
        deadline = time.monotonic() + self.timeout_s
        out = []
        for kind, answer, completion in items:
            left = deadline - time.monotonic()
            if left <= 0:
                out.append((0.0, "timeout", "the batch ran out of time"))
                continue
            out.append(_score_item(kind, answer, completion, min(self.item_timeout_s, left),
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
                      "on (check that `%s -c 'import trainer.rewards'` works)", sys.executable)
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
        if any(k == "code" for k, _, _ in items):
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


def _worker_main(argv: list[str]) -> None:
    """A reward worker: `python -c ... <fd> <kinds> <sandbox dir> <reward fn>`; runs until EOF."""
    global _sandbox_parent
    from multiprocessing.connection import Connection
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the trainer handles Ctrl-C and stops us
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
    conn = Connection(int(argv[0]))
    kinds = [k for k in argv[1].split(",") if k]
    _sandbox_parent = argv[2] if len(argv) > 2 and os.path.isdir(argv[2]) else None
    fn = resolve_reward_fn(argv[3]) if len(argv) > 3 and argv[3] else None
    _preload(kinds)
    try:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None or msg[0] != "score":
                return
            _, job, item_timeout, budget = msg
            deadline = time.monotonic() + budget
            done: list = []
            last_sent = time.monotonic()
            for k, (kind, answer, completion) in enumerate(job, start=1):
                left = deadline - time.monotonic()
                done.append(_score_item(kind, answer, completion, min(item_timeout, left - 0.05),
                                        fn))
                if k < len(job) and time.monotonic() - last_sent > _PART_EVERY_S:
                    conn.send(("part", done))   # so a timeout loses only the unfinished items
                    done = []
                    last_sent = time.monotonic()
            conn.send(("done", done))
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return
