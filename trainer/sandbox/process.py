"""The weaker sandbox, by explicit opt-out only (`sandbox.isolation = "process"`): the job is the
project's interpreter in a session of its own and a fresh temporary folder, with a minimal
environment, per-process limits and the audit hook of trainer/sandbox/programs.py; as root it
also loses the network (its own network namespace). It stops accidents and honest mistakes
(infinite loops, memory bombs, stray network calls, `rm -rf`), not a determined program: code that
reaches libc through ctypes can fork, signal, open files anywhere and rejoin the network, and root
ignores the process limit. docs/sandbox.md says what it lets through.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

from trainer.sandbox.base import Job
from trainer.sandbox.session import ProcessSession, killed_by

ENV = {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
       "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
       "PYTHONDONTWRITEBYTECODE": "1"}

_parent_dir: str | None = None   # where scratch folders are made (None: the system's tmp)


def set_parent_dir(path: str | None) -> None:
    """Make scratch folders under `path` (a reward worker's folder, which its pool removes when
    it closes, so nothing a killed run leaves behind outlives the pool)."""
    global _parent_dir
    _parent_dir = path


class ProcessSandbox:
    name = "process"

    def start(self, job: Job) -> ProcessSession:
        tmp = tempfile.mkdtemp(prefix="rlpilot-code-", dir=_parent_dir)
        try:
            for name, data in job.files.items():
                if "/" in name or name in ("", ".", ".."):
                    raise ValueError(f"a sandbox file is a plain name, got {name!r}")
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            env = {**ENV, "HOME": tmp, "TMPDIR": tmp, **job.env}
            argv = [sys.executable, "-I", *job.args]
            if os.geteuid() == 0 and shutil.which("unshare"):
                argv = [shutil.which("unshare"), "--net", "--", *argv]   # root: no network
            return ProcessSession(argv, env=env, cwd=tmp, limits=job.limits,
                                  on_close=lambda: shutil.rmtree(tmp, ignore_errors=True),
                                  describe_end=_describe_end)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _describe_end(rc: int) -> str:
    return killed_by(-rc) if rc < 0 else f"the process exited with code {rc}"
