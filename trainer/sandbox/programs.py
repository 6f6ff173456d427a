"""The Python programs a sandbox runs, as source text (no project file is visible inside).

`PRELUDE` comes first in each: it applies the per-process limits and installs the audit hook,
a second layer behind the operating system's boundary (it refuses sockets, process creation,
signals and writes outside the scratch folder at the Python level; code that goes around it,
through ctypes or by removing it, still meets the namespaces, the filter and the cgroup of the
bubblewrap backend). `SNIPPET` is the python tool; `CANDIDATE` serves the code reward's judge.
Each reads its job as one JSON line from stdin and answers on stdout, the only channel back.
"""
import inspect

from trainer.sandbox import codec

PRELUDE = r'''
import json, os, resource, sys
_job = json.loads(sys.stdin.buffer.readline() or b"null")
if _job is None:
    os._exit(3)
_out = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="backslashreplace", closefd=True)
_null = os.open(os.devnull, os.O_RDWR)
for _fd in (0, 1, 2):
    if _fd != 0 or _job.get("close_stdin", True):
        os.dup2(_null, _fd)
for _name, _value in _job["rlimits"].items():
    try:
        resource.setrlimit(getattr(resource, _name), (_value, _value))
    except (AttributeError, OSError, ValueError):
        pass
if _job.get("die_with_parent"):
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL
        if os.getppid() != _job["die_with_parent"]:
            os._exit(3)
    except Exception:
        pass

def _install_guard():
    import socket
    _AF_UNIX = getattr(socket, "AF_UNIX", None)
    def _no_network(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")
    class _NoSocket(socket.socket):
        __slots__ = ()
        def __init__(self, family=-1, *args, **kwargs):
            if family != _AF_UNIX or _AF_UNIX is None:
                _no_network()
            super().__init__(family, *args, **kwargs)
    socket.socket = socket.SocketType = _NoSocket
    socket.create_connection = socket.create_server = socket.fromfd = _no_network
    scratch = os.path.realpath(os.getcwd())
    no = frozenset("""socket.connect socket.bind socket.sendto socket.sendmsg socket.getaddrinfo
        socket.gethostbyname socket.gethostbyaddr socket.getnameinfo subprocess.Popen os.system
        os.exec os.posix_spawn os.spawn os.fork os.forkpty pty.spawn os.kill os.killpg
        signal.pthread_kill os.symlink os.link ctypes.dlopen ctypes.dlsym os.setuid os.setgid
        os.chroot""".split())
    paths = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.replace": (0, 1),
             "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.mkdir": (0,),
             "os.utime": (0,), "shutil.rmtree": (0,), "os.setxattr": (0,),
             "os.removexattr": (0,), "sqlite3.connect": (0,)}
    write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    abspath, fspath, sep = os.path.abspath, os.fspath, os.sep
    def inside(p):
        if isinstance(p, int):
            return True
        try:
            p = abspath(fspath(p))
        except Exception:
            return False
        if isinstance(p, bytes):
            p = p.decode("utf-8", "surrogateescape")
        return p == scratch or p.startswith(scratch + sep)
    def guard(event, args):
        if event in no or (event == "socket.__new__" and args[1] != _AF_UNIX):
            raise PermissionError(f"{event} is not allowed in the sandbox")
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and flags & write)
            if writing and not inside(path):
                raise PermissionError(f"writing {path!r} is not allowed in the sandbox")
        elif event in paths:
            for i in paths[event]:
                if i < len(args) and args[i] is not None and not inside(args[i]):
                    raise PermissionError(f"{event} on {args[i]!r} is not allowed in the sandbox")
    sys.addaudithook(guard)

_install_guard()
del _install_guard, _fd, _name, _value, _null

def _describe(e):
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
'''

# The python tool: run the code, then write one JSON line: what it printed through sys.stdout and
# sys.stderr (the first `max_output` characters, in order), whether that was cut, and its error.
SNIPPET = PRELUDE + r'''
import contextlib, io

class _Capped(io.StringIO):
    cut = False
    def write(self, s):
        room = _job["max_output"] - self.tell()
        if len(s) > room:
            self.cut, s = True, s[:max(0, room)]
        return super().write(s)

def _main(code):
    out, error = _Capped(), ""
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(code, "<python>", "exec"), ns)
    except SystemExit as e:
        if e.code not in (None, 0):
            error = _describe(e)
    except BaseException as e:
        error = _describe(e)
    ns.clear()  # free what a memory bomb holds, so that the answer can be written
    return out.getvalue(), out.cut, error

_text, _cut, _error = _main(_job.pop("code"))
_out.write(json.dumps({"output": _text, "cut": _cut, "error": _error}) + "\n")
_out.flush()
os._exit(0)
'''

# The code reward's candidate: run the completion's code once, say which top-level functions it
# defined, then answer calls to them ({"call": name, "args": [...], "kwargs": {...}}, encoded by
# codec) with {"value": ...}, {"raised": type, "message": ...} or {"unsendable": what}. It never
# sees a test or an expected value: the judge (trainer/rewards/judge.py) keeps those.
CANDIDATE = PRELUDE + inspect.getsource(codec) + r'''
import contextlib, io

def _answer(msg):
    _out.write(json.dumps(msg) + "\n")
    _out.flush()

def _serve(code):
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            exec(compile(code, "solution.py", "exec"), ns)
    except BaseException as e:
        _answer({"loaded": False, "error": _describe(e)})
        return
    _answer({"loaded": True, "functions": sorted(k for k, v in ns.items()
                                                 if callable(v) and not k.startswith("__"))})
    stdin = os.fdopen(0, "rb", closefd=False)
    for line in stdin:
        sink.seek(0)
        sink.truncate()
        try:
            msg = json.loads(line)
            fn = ns[msg["call"]]
            args, kwargs = decode(msg["args"]), decode(msg["kwargs"])
        except Exception as e:
            _answer({"raised": "ProtocolError", "message": _describe(e)})
            continue
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                value = fn(*args, **kwargs)
        except BaseException as e:
            _answer({"raised": type(e).__name__, "message": str(e)[:300]})
            continue
        try:
            _answer({"value": encode(value)})
        except Unsendable as e:
            _answer({"unsendable": str(e)})

_serve(_job.pop("code"))
os._exit(0)
'''
