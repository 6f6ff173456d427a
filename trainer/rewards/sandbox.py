"""The code sandbox: a completion's code and its tests run in a fresh, limited Python interpreter.

A code reward executes what the model wrote, so it runs in a child process that cannot take the
trainer down: limited in time and memory, without network, process creation or writes outside
its own directory, and able to report a pass only by echoing a nonce it cannot read from the
code (see `run_code`). The code verifier (trainer/rewards/verifiers.py) is its caller. The same
runner also serves the python tool of multi-turn episodes (`run_snippet`, trainer/episode/tools.py):
it reports what a snippet printed instead of a pass.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from typing import Sequence

CODE_TIMEOUT_S = 10.0            # wall-clock limit of one sandboxed run
CODE_MEMORY_BYTES = 1 << 30      # address space of the sandboxed process
CODE_FILE_BYTES = 16 << 20       # largest file it may write
_CODE_MAX_NPROC_EXTRA = 64       # non-root: threads/processes it may add to the user's count
TRUNCATED = "…[truncated]"       # ends an output that `clip` cut

_parent_dir: str | None = None   # where sandbox directories are made (None: the system's tmp)


def set_parent_dir(path: str | None) -> None:
    """Make sandbox directories under `path` (a reward worker's directory, which its pool removes
    when it closes, so nothing a killed run leaves behind outlives the pool)."""
    global _parent_dir
    _parent_dir = path


@dataclass
class CodeResult:
    passed: bool
    status: str      # "pass", "fail" (a test failed or the code did not run) or "timeout"
    detail: str = ""



# The program the sandboxed interpreter runs. It reads its job from stdin, applies the limits,
# blocks the network, process creation and writes outside its directory, then runs the code
# and the tests and reports on a private copy of stdout. Only a report carrying the nonce of
# this run counts as a pass, so code that prints a pass or exits early cannot fake one; the
# nonce is a local of _main(), not a global of __main__ that the code could import.
_RUNNER_BODY = r'''
import ast, contextlib, io, json, os, resource, sys
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

nonce, mode, code = job["nonce"], job.get("mode", "code"), job["code"]
entry, tests, cap = job.get("entry_point"), job.get("tests", ()), job.get("max_output", 0)
del job

def _name(e):
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 300 else text[:297] + "..."

ns = {"__name__": "__main__", "__builtins__": __builtins__}
if mode == "snippet":  # a python tool: run the code, report what it printed (the first `cap` chars)
    class _Capped(io.StringIO):
        cut = False
        def write(self, s):
            room = cap - self.tell()
            if len(s) > room:
                self.cut, s = True, s[:max(0, room)]
            return super().write(s)
    out, status, error = _Capped(), "ok", ""
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(code, "<python>", "exec"), ns)
    except SystemExit as e:
        if e.code not in (None, 0):
            status, error = "error", _name(e)
    except BaseException as e:
        status, error = "error", _name(e) if str(e) else type(e).__name__
    ns.clear()  # free what a memory bomb holds, so that the report can be written
    report({"nonce": nonce, "status": status, "output": out.getvalue(), "cut": out.cut, "error": error})
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
    address space (`memory_bytes`), file size and open files. Opening a socket other than a Unix
    one raises, and an audit hook refuses network calls, process creation, signals to other
    processes and writes outside the directory; as root it also unshares the network namespace. This
    stops accidents and honest mistakes (infinite loops, memory bombs, stray network calls,
    `rm -rf`), not a determined attacker: it is not a security boundary.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}")
    run = _run_runner({"code": code, "tests": list(tests), "entry_point": entry_point},
                      timeout_s, memory_bytes, "before the tests finished")
    msg = run.report or {}
    if msg.get("status") == "pass":
        if msg.get("nonce") == run.nonce:
            return CodeResult(True, "pass")
        return CodeResult(False, "fail", "forged pass report")
    if msg.get("status") == "fail":
        return CodeResult(False, "fail", str(msg.get("detail", ""))[:500])
    return CodeResult(False, "timeout" if run.timed_out else "fail", run.why)


@dataclass
class SnippetResult:
    status: str      # "ok", "error" (it raised, or the process died) or "timeout"
    output: str      # what it printed (stdout and stderr, interleaved), clipped
    error: str = ""  # why it failed: "ZeroDivisionError: division by zero", "timed out after 5s", ...


def run_snippet(code: str, *, timeout_s: float, memory_bytes: int = CODE_MEMORY_BYTES,
                max_output_chars: int = 2000) -> SnippetResult:
    """Run a Python snippet as a "python tool" does and return what it printed.

    Same interpreter, limits and guards as `run_code`. The output is what the code wrote to
    `sys.stdout` and `sys.stderr`, interleaved in order (not tracebacks: an exception is `error`,
    its last line); text written straight to file descriptors 1 and 2 is discarded. The child keeps
    at most `max_output_chars` of it, and a clipped output ends with `TRUNCATED` (the whole output,
    marker included, is at most `max_output_chars`). Output printed before a failure is kept.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}")
    limit = max(0, int(max_output_chars))
    run = _run_runner({"mode": "snippet", "code": code, "max_output": limit},
                      timeout_s, memory_bytes, "before it finished")
    msg = run.report
    if msg is None:
        return SnippetResult("timeout" if run.timed_out else "error", "", run.why)
    if msg.get("nonce") != run.nonce:
        return SnippetResult("error", "", "forged report")
    output = str(msg.get("output", ""))
    output = clip(output + (TRUNCATED if msg.get("cut") else ""), limit)
    if msg.get("status") == "ok":
        return SnippetResult("ok", output)
    return SnippetResult("error", output, str(msg.get("error", ""))[:500])


def clip(text: str, limit: int) -> str:
    """`text` in at most `limit` characters: cut, ending with `TRUNCATED`, when it is longer (what a
    model is shown is bounded, and says when it is not the whole)."""
    if len(text) <= limit:
        return text
    if limit <= len(TRUNCATED):
        return text[:max(0, limit)]
    return text[:limit - len(TRUNCATED)] + TRUNCATED


@dataclass
class _Run:
    nonce: str
    report: dict | None   # the child's report (its last line, a JSON object), if any
    timed_out: bool       # past the wall-clock or the CPU time limit
    why: str              # why it ended, for when the report does not say ("timed out after 2s", ...)


def _run_runner(job: dict, timeout_s: float, memory_bytes: int, unfinished: str) -> _Run:
    """Run `_RUNNER` on `job` (plus the limits and a fresh nonce) in a fresh temporary directory,
    and read its report. `unfinished` ends the message for a child that exited without one."""
    timeout_s = max(0.05, float(timeout_s))
    nonce = secrets.token_hex(16)
    job = {**job, "nonce": nonce, "mem": int(memory_bytes), "cpu": int(math.ceil(timeout_s)) + 1,
           "fsize": CODE_FILE_BYTES, "nproc": _nproc_limit(), "ppid": os.getpid()}
    payload = json.dumps(job).encode()
    with tempfile.TemporaryDirectory(prefix="rlpilot-code-", dir=_parent_dir) as tmp:
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
            return _Run(nonce, None, True, f"timed out after {timeout_s:g}s")
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
    return _Run(nonce, msg if isinstance(msg, dict) else None, *_ending(proc.returncode, unfinished))


def _ending(rc: int | None, unfinished: str) -> tuple[bool, str]:
    """(timed out, why) for a child that ended with return code `rc`, whatever it reported."""
    if rc is not None and rc < 0:
        sig = -rc
        if sig == getattr(signal, "SIGXCPU", None):
            return True, "CPU time limit exceeded"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return False, f"the process was killed by {name}"
    return False, f"the process exited with code {rc} {unfinished}"


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


