"""The boundary: bubblewrap (`bwrap`, Debian's `bubblewrap`) around every model-written program.

Each job is a fresh process tree in new user, mount, PID, network, IPC, UTS and cgroup namespaces:
- a read-only root holding only the interpreter (its prefix and binary, its standard library but
  not the host's site-packages) and the system's shared libraries (/usr/lib, /lib*): no host
  /proc (a new one shows the job's own processes), no /etc, no project files, no run directory,
  no home;
- a private writable scratch folder (/sandbox, a size-limited tmpfs) and /tmp, gone with the job;
- uid and gid 65534 inside, every capability dropped, no further user namespaces;
- the seccomp filter of trainer/sandbox/seccomp.py, loaded before the interpreter starts;
- no network at all (an empty namespace: not even the host's loopback);
- per-process limits (address space, CPU seconds, file size, open files) and, where a control
  group can be made (root), limits on the job's processes and total memory (cgroup.py);
- `--die-with-parent` and the PID namespace: when the job's first process ends or is killed,
  the kernel kills every process left in it, so nothing outlives the call.

Why bubblewrap rather than namespaces by hand: it is the well-kept tool for exactly this (Flatpak's
sandbox), small enough to audit, and refuses to run rather than half-isolate.
"""
from __future__ import annotations

import functools
import os
import shutil
import site
import sys

from trainer.sandbox.base import Job, Limits, SandboxUnavailable, run
from trainer.sandbox.cgroup import Cgroup
from trainer.sandbox.seccomp import FilterUnavailable, bpf_program
from trainer.sandbox.session import ProcessSession, killed_by

INSTALL = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; `make run` and `make test` do)"
SCRATCH = "/sandbox"
NOBODY = 65534
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": SCRATCH,
       "TMPDIR": "/tmp", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}


def interpreter() -> tuple[str, str]:
    """(the base interpreter's binary, its prefix): the Python the sandbox runs, not the
    project's virtualenv (whose packages and paths the job has no business seeing)."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def _root_binds(exe: str, prefix: str) -> list[str]:
    args: list[str] = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top) and top.startswith("/lib"):
            args += ["--ro-bind", top, top]
    for d in ("/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32"):
        if os.path.isdir(d) and not os.path.islink(d):
            args += ["--ro-bind", d, d]
    if not prefix.startswith("/usr/lib") and prefix not in ("/usr", "/"):
        args += ["--ro-bind", prefix, prefix]
    args += ["--ro-bind", exe, exe]
    bound = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64",
             "/usr/libx32", prefix)
    for d in _site_packages(prefix):
        if any(d == b or d.startswith(b.rstrip("/") + "/") for b in bound):
            args += ["--tmpfs", d, "--remount-ro", d]
    return args


def _site_packages(prefix: str) -> list[str]:
    """The interpreter's third-party package folders, which the job does not see (an empty,
    read-only folder over each): the sandbox holds the interpreter and its standard library,
    and `site` importing whatever `.pth` files a host installed there costs every job its time
    (measured: a `.pth` that imports certifi made every job 14-18 ms of CPU dearer, ~40%)."""
    return sorted({os.path.realpath(d) for d in site.getsitepackages([prefix]) if os.path.isdir(d)})


class BwrapSandbox:
    name = "bwrap"

    def __init__(self, bwrap: str | None = None):
        self.bwrap = bwrap or shutil.which("bwrap") or ""

    def start(self, job: Job) -> ProcessSession:
        if not self.bwrap:
            raise SandboxUnavailable(f"bubblewrap (bwrap) is not on PATH: {INSTALL}")
        try:
            program = bpf_program()
        except FilterUnavailable as e:
            raise SandboxUnavailable(str(e)) from None
        exe, prefix = interpreter()
        lim = job.limits
        fds: list[int] = []

        def data_fd(data: bytes) -> int:
            fd = os.memfd_create("rlpilot-sandbox", 0)
            os.write(fd, data)
            os.lseek(fd, 0, os.SEEK_SET)
            fds.append(fd)
            return fd

        argv = [self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try", "--disable-userns",
                "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
                "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
                *_root_binds(exe, prefix), "--proc", "/proc", "--dev", "/dev",
                "--size", str(lim.scratch_bytes), "--perms", "0777", "--tmpfs", "/tmp",
                "--size", str(lim.scratch_bytes), "--perms", "0777", "--tmpfs", SCRATCH]
        try:
            for name, data in job.files.items():
                if "/" in name or name in ("", ".", ".."):
                    raise ValueError(f"a sandbox file is a plain name, got {name!r}")
                argv += ["--file", str(data_fd(data)), f"{SCRATCH}/{name}"]
            for key, value in {**ENV, **job.env}.items():
                argv += ["--setenv", key, value]
            argv += ["--chdir", SCRATCH, "--seccomp", str(data_fd(program)), "--", exe, "-I",
                     *job.args]
            group = Cgroup.make(pids=lim.processes, memory_bytes=lim.memory_bytes + (64 << 20)) \
                if os.geteuid() == 0 else None
            if group is not None:
                argv = group.join_command(argv)
            try:
                return ProcessSession(argv, env=dict(ENV), cwd="/", limits=lim, pass_fds=tuple(fds),
                                      on_close=group.remove if group else None,
                                      describe_end=_describe_end)
            except BaseException:
                if group is not None:
                    group.remove()
                raise
        finally:
            for fd in fds:   # the child has its copies
                os.close(fd)


def _describe_end(rc: int) -> str:
    """bwrap exits 128 + N when the job's process was killed by signal N."""
    return killed_by(rc - 128) if rc > 128 else f"the process exited with code {rc}"


@functools.cache
def probe(bwrap: str = "") -> str | None:
    """Why the boundary cannot be set up on this host (None: it can): one trivial job, started
    exactly as every job is."""
    path = bwrap or shutil.which("bwrap")
    if not path:
        return f"bubblewrap (bwrap) is not installed: {INSTALL}"
    try:
        outcome = run(BwrapSandbox(path), Job(("-c", "import os; print(os.getuid())"),
                                              Limits(wall_s=30)))
    except SandboxUnavailable as e:
        return str(e)
    except OSError as e:
        return f"bubblewrap could not run ({type(e).__name__}: {e})"
    if outcome.exit_code != 0 or outcome.stdout.strip() != str(NOBODY).encode():
        return (f"bubblewrap cannot make its namespaces on this host ({outcome.why or 'no answer'}); "
                "user namespaces must be allowed (sysctl kernel.unprivileged_userns_clone=1, or "
                "in a container, run it with the namespaces permitted)")
    return None
