"""Start a run's training processes under `torchrun`, as a child that cannot outlive its parent.

    proc = TorchrunProcess(torchrun_argv(["-m", "trainer", "run", "demo"], nproc=2)).start()
    rc = proc.wait()           # torchrun's exit status; proc.failure() for the error message
    proc.stop()                # SIGTERM, then SIGKILL, to torchrun's process group

One machine: `python -m torch.distributed.run --standalone --nproc_per_node K <target...>`
(torchrun picks a free port itself). Several machines (N of them, K processes each): run on
every machine

    python -m torch.distributed.run --nnodes N --nproc_per_node K --rdzv_backend c10d \
        --rdzv_endpoint HOST:PORT --rdzv_id RUN_ID <target...>

with the same HOST:PORT (a port free on HOST, one of the machines) and RUN_ID; torchrun's c10d
rendezvous gives each machine its node rank (`torchrun_argv(..., nnodes=N, rdzv_endpoint=...)`
builds that command; pass node_rank=R to fix the order instead).

Who dies with whom (Linux; elsewhere only stop() ends the processes):
- torchrun gets SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG), even by
  SIGKILL: the dashboard's kill is Celery's revoke(terminate=True, signal=SIGKILL) of the worker
  child that waits here, and no Python code of that child runs after it. On SIGTERM torchrun
  SIGTERMs each rank's process group and exits (each rank runs in a session of its own).
- a rank started through `die_with_launcher()` gets SIGKILL when torchrun dies, so a torchrun
  killed with SIGKILL (stop()'s second signal) leaves no rank behind either.

No third-party code: the signal wiring is a few lines of ctypes, which no well-kept library
offers without pulling in a process supervisor.
"""
from __future__ import annotations

import collections
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Sequence

PR_SET_PDEATHSIG = 1     # <linux/prctl.h>
LAUNCHER_PID_ENV = "RLPILOT_LAUNCHER_PID"   # torchrun's pid, for its ranks (die_with_launcher)
TAIL_LINES = 200
# torchrun's own log lines (glog style: "E1202 10:04:05.508000 12654 .../torch/distributed/...] ...")
TORCHRUN_LOG = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S*torch/distributed/")
# torchrun's ChildFailedError table: the first rank that failed, its fields ("rank : 1 (local_rank: 1)")
ROOT_CAUSE = "Root Cause (first observed failure):"
REPORT_FIELD = re.compile(r"^\s*(rank|exitcode|host)\s*:\s*(-?\d+|\S+)")
# torchrun's banner before the ranks start, which says nothing about a failure
BANNER = re.compile(r"^\*+$|^Setting OMP_NUM_THREADS environment variable")


def torchrun_argv(target: Sequence[str], nproc: int, *, nnodes: int = 1, node_rank: int | None = None,
                  rdzv_endpoint: str | None = None, rdzv_id: str = "rlpilot",
                  python: str = sys.executable) -> list[str]:
    """torchrun's command line for `target` (`["-m", "module", args...]` or `["script.py", args...]`):
    K = `nproc` processes on this machine; with `nnodes` > 1, this machine's part of a run on
    several machines meeting at `rdzv_endpoint` (HOST:PORT)."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1; got {nproc}")
    if not target:
        raise ValueError("no target: give the module (-m name ...) or script torchrun should run")
    argv = [python, "-m", "torch.distributed.run"]
    if nnodes == 1:
        argv += ["--standalone"]
    else:
        if not rdzv_endpoint:
            raise ValueError(f"nnodes={nnodes}: several machines need rdzv_endpoint (HOST:PORT of one of them)")
        argv += ["--nnodes", str(nnodes), "--rdzv_backend", "c10d", "--rdzv_endpoint", rdzv_endpoint,
                 "--rdzv_id", rdzv_id]
        if node_rank is not None:
            argv += ["--node_rank", str(node_rank)]
    return argv + ["--nproc_per_node", str(nproc), *target]


def failure_cause(lines: Sequence[str]) -> str | None:
    """torchrun's report of the first rank that failed, in words: "training rank 1 was killed
    by SIGKILL (signal 9)", "training rank 0 exited with status 1"; None without a report."""
    start = next((i for i, line in enumerate(lines) if line.strip() == ROOT_CAUSE), None)
    if start is None:
        return None
    fields: dict[str, str] = {}
    for line in lines[start + 1:]:
        if line.startswith("====="):
            break
        m = REPORT_FIELD.match(line)
        if m:
            fields.setdefault(m[1], m[2])
    try:
        rank, code = int(fields["rank"]), int(fields["exitcode"])
    except (KeyError, ValueError):
        return None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "a signal"
        what = f"was killed by {name} (signal {-code})"
    else:
        what = f"exited with status {code}"
    host = fields.get("host")
    where = f" on {host}" if host and host not in ("localhost", socket.gethostname()) else ""
    return f"training rank {rank}{where} {what}"


def layout_text(train_procs: int, gen_procs: int, sharding: str = "ddp") -> str:
    """The processes a run uses, in words (the run page): "2 training processes + 1 generation
    process", "2 training processes (model sharded) + ..."; a one-process run is "1 process"."""
    if train_procs <= 1 and gen_procs <= 0:
        return "1 process"
    parts = [f"{train_procs} training process" + ("es" if train_procs != 1 else "")
             + (" (model sharded)" if sharding == "fsdp" and train_procs > 1 else "")]
    if gen_procs > 0:
        parts.append(f"{gen_procs} generation process" + ("es" if gen_procs != 1 else ""))
    return " + ".join(parts)


# --- the signal wiring -----------------------------------------------------------------------------

def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread dies; False where
    that is not possible (not Linux)."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_launcher() -> None:
    """Called first by a rank that TorchrunProcess started: SIGKILL when torchrun dies. If
    torchrun is already gone (the rank was re-parented), exit now."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher:
        return
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(launcher):
        os._exit(1)


def _exec_with_death_signal(parent: int, argv: list[str]) -> None:
    """The child's side of TorchrunProcess.start(): set PDEATHSIG, then become torchrun. Done
    here after exec, not in a Popen preexec_fn, which is unsafe in a process with threads (a
    Celery worker child has them)."""
    set_parent_death_signal(signal.SIGTERM)   # survives execv
    if os.getppid() != parent:                # the parent died before prctl: do not start
        os._exit(1)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())   # execv keeps the pid: torchrun's
    os.execv(argv[0], argv)


# --- the child --------------------------------------------------------------------------------------

class TorchrunProcess:
    """One torchrun (or any command) started in a session of its own, dying with the thread
    that called start() (keep that thread alive as long as the run: PR_SET_PDEATHSIG follows the
    thread, not the process). Its stderr is copied to `stderr` (default: this process's) and its
    last lines kept for error messages."""

    def __init__(self, argv: Sequence[str], *, env: dict | None = None, cwd: str | None = None,
                 stderr: IO[str] | None = None, tail_lines: int = TAIL_LINES):
        self.argv, self.env, self.cwd = list(argv), env, cwd
        self.copy_to = stderr
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.proc: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "TorchrunProcess":
        wrapper = [sys.executable, "-c", "import sys; from trainer.cluster.launch import _exec_with_death_signal as "
                   "e; e(int(sys.argv[1]), sys.argv[2:])", str(os.getpid()), *self.argv]
        env = dict(os.environ if self.env is None else self.env)
        root = str(Path(__file__).resolve().parents[2])   # the directory holding trainer/: importable
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(wrapper, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace",
                                     bufsize=1, start_new_session=True)
        self.reader = threading.Thread(target=self._read_stderr, name=f"torchrun-stderr-{self.pid}",
                                       daemon=True)
        self.reader.start()
        return self

    def _read_stderr(self) -> None:
        out = self.copy_to if self.copy_to is not None else sys.stderr
        for line in self.proc.stderr:
            self.tail.append(line.rstrip("\n"))
            try:
                out.write(line)
                out.flush()
            except (OSError, ValueError):
                pass

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """torchrun's exit status (after its stderr is read to the end)."""
        rc = self.proc.wait(timeout)
        if self.reader is not None:
            self.reader.join(5)
        return rc

    def stderr_tail(self, lines: int = 20) -> str:
        return "\n".join(list(self.tail)[-lines:])

    def _rank_lines(self) -> tuple[int | None, list[str]]:
        """(where torchrun's failure report starts in the tail, or None; the lines the ranks
        wrote before it, without torchrun's own log lines (its ChildFailedError traceback and
        table say only which rank exited) and banner)."""
        tail = list(self.tail)
        report = next((i for i, line in enumerate(tail)
                       if TORCHRUN_LOG.match(line) and "failed (exitcode" in line), None)
        ranks = [line for line in tail[:report if report is not None else 0]
                 if not TORCHRUN_LOG.match(line) and not BANNER.match(line.strip())]
        return report, ranks

    def failure(self, *, last_step: int | None = None, checkpoint_step: int | None = None,
                without_checkpoint: str = "no checkpoint was written: a resume starts over",
                lines: int = 20) -> str:
        """Why the run's processes failed, for a person: the first failed rank in words
        (failure_cause), the step it was in (after `last_step`), where a resume continues
        (`checkpoint_step`), then what the ranks last wrote before torchrun's report (without
        its banner; without a report, stderr's tail), if anything."""
        cause = failure_cause(list(self.tail)) or "the training processes failed"
        during = f" during step {last_step + 1}" if last_step is not None else ""
        resume = (f"resume continues from the checkpoint at step {checkpoint_step}"
                  if checkpoint_step is not None else without_checkpoint)
        report, ranks = self._rank_lines()
        said = "\n".join(ranks[-lines:]) if report is not None else self.stderr_tail(lines)
        head = f"{cause}{during}; {resume}"
        return f"{head}\n{said}" if said else head

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM torchrun's process group (torchrun forwards it to the ranks), SIGKILL it
        after `grace_s` seconds (the ranks then die with it: die_with_launcher)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)   # whatever of its group is left
        return self.wait()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
