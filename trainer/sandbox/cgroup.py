"""A control group per sandboxed call: limits on its processes and memory that hold for root.

RLIMIT_NPROC does not apply to root (nor to a user namespace mapped onto root), and RLIMIT_AS
bounds one process, not a tree of them: as root, only a cgroup bounds the whole job. A call gets
a group of its own under this process's own group (so a container's limits still hold above it),
with `pids.max` and a memory limit; the job's first process joins it before it starts the
sandbox (`join_command`), and `kill` ends every process in it. cgroup v2 (the unified hierarchy)
and v1 (the pids and memory controllers mounted apart) are both handled. Where no group can be
made (no permission, no controller), `Cgroup.make` returns None and the caller says so.
"""
from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _own_path(controller: str) -> str | None:
    """This process's group in `controller`'s hierarchy ("" for v2's unified one)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers.split(",") == [controller] or (controller == "" and controllers == ""):
            return path
    return None


class Cgroup:
    def __init__(self, dirs: list[Path], v2: bool):
        self.dirs, self.v2 = dirs, v2

    @classmethod
    def make(cls, *, pids: int, memory_bytes: int) -> "Cgroup | None":
        name = "rlpilot-sandbox-" + secrets.token_hex(6)
        try:
            if (ROOT / "cgroup.controllers").exists():
                return cls._make_v2(name, pids, memory_bytes)
            return cls._make_v1(name, pids, memory_bytes)
        except OSError:
            return None

    @classmethod
    def _make_v2(cls, name: str, pids: int, memory_bytes: int) -> "Cgroup | None":
        # v2's rule of no processes in inner groups: the sandboxes' parent is a sibling of ours
        own = _own_path("")
        if own is None:
            return None
        parent = ROOT / own.lstrip("/")
        parent = parent.parent if parent != ROOT else parent
        base = parent / "rlpilot-sandbox"
        base.mkdir(exist_ok=True)
        (base / "cgroup.subtree_control").write_text("+pids +memory")
        d = base / name
        d.mkdir()
        group = cls([d], True)
        try:
            (d / "pids.max").write_text(str(pids))
            (d / "memory.max").write_text(str(memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
        except OSError:
            group.remove()
            raise
        return group

    @classmethod
    def _make_v1(cls, name: str, pids: int, memory_bytes: int) -> "Cgroup | None":
        made: list[Path] = []
        try:
            for controller, limits in (("pids", {"pids.max": pids}),
                                       ("memory", {"memory.limit_in_bytes": memory_bytes})):
                own = _own_path(controller)
                if own is None or not (ROOT / controller).is_dir():
                    raise OSError(f"no {controller} controller")
                d = ROOT / controller / own.lstrip("/") / name
                d.mkdir()
                made.append(d)
                for key, value in limits.items():
                    (d / key).write_text(str(value))
        except OSError:
            cls(made, False).remove()
            raise
        return cls(made, False)

    def join_command(self, argv: list[str]) -> list[str]:
        """`argv` run by a shell that first moves itself into the group (its children are born
        inside: nothing the job starts can be outside it)."""
        script = ('for f; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; '
                  'shift; exec "$@"')
        return ["/bin/sh", "-c", script, "sh", *[str(d / "cgroup.procs") for d in self.dirs],
                "--", *argv]

    def peak_processes(self) -> int | None:
        for d in self.dirs:
            if (d / "pids.peak").exists():
                try:
                    return int((d / "pids.peak").read_text())
                except (OSError, ValueError):
                    return None
        return None

    def kill(self) -> None:
        """SIGKILL every process in the group (repeatedly: one may fork while it is read)."""
        if self.v2 and (self.dirs[0] / "cgroup.kill").exists():
            try:
                (self.dirs[0] / "cgroup.kill").write_text("1")
            except OSError:
                pass
        for pause in _pauses(0.5):
            pids = self._pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(pause)

    def _pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def remove(self) -> None:
        self.kill()
        for d in self.dirs:
            for pause in _pauses(1.0):   # a killed process leaves its group when it is reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(pause)


def _pauses(total_s: float):
    """Waits of 0.5 ms doubling up to 10 ms, `total_s` in all: a killed job is usually gone
    within a millisecond or two, which a fixed 10 ms wait would add to every call."""
    pause, spent = 0.0005, 0.0
    while spent < total_s:
        yield pause
        spent += pause
        pause = min(2 * pause, 0.01)
