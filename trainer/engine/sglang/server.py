"""Start and stop a real SGLang server for a model directory: the one `make sglang` installs in
its own virtualenv (`.venv-sglang`, never the project's: SGLang pins its own torch and
transformers). Used by `python -m trainer sglang-server`, the real-server tests and
`bench engine --engine sglang`.

The server is a child process group (SGLang forks a scheduler and a detokenizer), started on a
free 127.0.0.1 port; `start()` returns once `/health` answers 200, `stop()` ends the whole group
(SIGTERM, then SIGKILL), `kill()` kills it at once (a server dying mid-run).

Two flavours, written by tools/sglang/setup.sh into `.venv-sglang/rlpilot-flavour`:
- `cuda`: SGLang as published; launched with its defaults plus the port and model.
- `cpu`: SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) with tools/sglang/cpu_path first on
  PYTHONPATH (a stand-in for the unpublished CPU build of sgl_kernel), plain-torch attention, no
  CUDA graphs or overlap scheduling, a small KV pool, a scheduler that sleeps while idle
  (--sleep-on-idle), and OMP_NUM_THREADS=`threads` (two threads next to another busy process
  fell to ~1 token/s on 2 cores).

`dtype` is the server's `--dtype`: by default float32 on the CPU flavour (the trainer's CPU
precision: no training–inference mismatch), SGLang's own default ("auto": the checkpoint's
dtype, float16 for a float32 one) on CUDA. The CPU flavour of SGLang 0.5.23 serves
SmolLM2-135M in float32, bfloat16 and float16 with the torch_native attention backend
(docs/engines.md, "Precision"); the client checks a server's dtype against `rollout.dtype`.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]   # trainer/engine/sglang/server.py -> the repository
VENV = ROOT / ".venv-sglang"
GUARD = Path(__file__).with_name("group_guard.py")
CPU_PATH = ROOT / "tools" / "sglang" / "cpu_path"
FLAVOUR_FILE = "rlpilot-flavour"

CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native",
            "--disable-overlap-schedule", "--disable-cuda-graph",
            # the KV budget is (free memory after the weights) - (1 - this) x (free before): 0.1
            # failed the start whenever another process took ~0.4 GB meanwhile; the pool is
            # --max-total-tokens either way
            "--mem-fraction-static", "0.5", "--max-total-tokens", "16384",
            "--chunked-prefill-size", "1024", "--tp", "1", "--skip-server-warmup",
            # the scheduler's event loop spins a whole core while idle without it (measured: 1.01
            # cores idle, 0.02 with it; 48 greedy tokens 3.3 s either way): on 2 cores that core
            # is the trainer's, or a second server's
            "--sleep-on-idle"]
DTYPES = ("auto", "float32", "bfloat16", "float16")   # what `dtype` may be (SGLang's --dtype)


class SGLangServerError(RuntimeError):
    pass


def venv_python(venv: Path = VENV) -> Path:
    """The SGLang virtualenv's python; a clear error naming `make sglang` when it is missing."""
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        raise SGLangServerError(f"no SGLang virtualenv at {venv}: run `make sglang` first")
    return python


def flavour(venv: Path = VENV) -> str:
    """'cpu' or 'cuda': how tools/sglang/setup.sh installed SGLang there."""
    marker = Path(venv) / FLAVOUR_FILE
    return marker.read_text().strip() if marker.is_file() else "cuda"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class SGLangServer:
    """One SGLang server process group for `model_path`. Use as a context manager, or
    `start()` ... `stop()`. Its output goes to `log_path` (default: rlpilot-sglang-PORT.log in
    the system's temporary folder)."""

    def __init__(self, model_path: str | os.PathLike, *, port: int | None = None,
                 host: str = "127.0.0.1", threads: int = 1, venv: Path = VENV,
                 log_path: str | os.PathLike | None = None, extra_args: list[str] | None = None,
                 dtype: str | None = None):
        self.model_path = Path(model_path)
        if not (self.model_path / "config.json").is_file():
            raise SGLangServerError(f"{self.model_path} is not a model directory (no config.json)")
        self.host, self.port = host, port or free_port(host)
        self.threads = int(threads)
        self.venv = Path(venv)
        self.flavour = flavour(self.venv)
        self.log_path = Path(log_path) if log_path else Path(
            tempfile.gettempdir()) / f"rlpilot-sglang-{self.port}.log"
        self.extra_args = list(extra_args or [])
        if dtype is not None and dtype not in DTYPES:
            raise SGLangServerError(f"dtype: one of {', '.join(DTYPES)}, not {dtype!r}")
        # --dtype: float32 on the CPU flavour unless told otherwise; SGLang's own default on CUDA
        self.dtype = dtype or ("float32" if self.flavour == "cpu" else None)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [str(venv_python(self.venv)), "-m", "sglang.launch_server",
               "--model-path", str(self.model_path), "--host", self.host,
               "--port", str(self.port)]
        if self.flavour == "cpu":
            cmd += CPU_ARGS
        if self.dtype is not None:
            cmd += ["--dtype", self.dtype]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not rlpilot's path
        env["OMP_NUM_THREADS"] = str(self.threads)
        env["HF_HUB_OFFLINE"] = "1"          # a local model directory; never the network
        env["TRANSFORMERS_OFFLINE"] = "1"
        if self.flavour == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONPATH"] = str(CPU_PATH)
        return env

    def start(self, timeout_s: float = 300.0) -> "SGLangServer":
        """Launch the server and wait until /health answers 200 (raises with the log's tail if
        the process exits or `timeout_s` passes first)."""
        if self.proc is not None:
            raise SGLangServerError("this server was started already")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        try:
            # the group ends with this process even when it is SIGKILLed (group_guard.py)
            guarded = [sys.executable, str(GUARD), str(os.getpid()), "--", *self.command()]
            self.proc = subprocess.Popen(guarded, env=self.environment(), cwd=ROOT,
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.proc = None
                raise SGLangServerError(f"the SGLang server exited while starting "
                                        f"(log {self.log_path}):\n{tail}")
            if self.healthy():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise SGLangServerError(f"the SGLang server did not answer /health within "
                                        f"{timeout_s:.0f} s (log {self.log_path}):\n"
                                        f"{self.log_tail()}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after `timeout_s`."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)   # the scheduler and detokenizer children too
        self.proc.wait(timeout=10)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the whole group now (a server dying mid-run)."""
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)   # start_new_session: the group's id is the pid
        except ProcessLookupError:
            pass

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --- python -m trainer sglang-server ---------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("sglang-server", help="run a real SGLang server (from make sglang) for a "
                                             "model directory until Ctrl-C")
    p.add_argument("--model", required=True, help="a local Hugging Face model directory")
    p.add_argument("--port", type=int, default=0, help="default: a free port")
    p.add_argument("--threads", type=int, default=1, help="OMP threads of a CPU server")
    p.add_argument("--dtype", choices=DTYPES, help="the server's precision (SGLang's --dtype; "
                   "default: float32 on the CPU flavour, SGLang's auto on CUDA); set "
                   "rollout.dtype to the same or to auto")
    p.add_argument("--log", help="the server's log file (default: rlpilot-sglang-PORT.log in the "
                   "temporary folder)")
    p.set_defaults(func=_cmd_sglang_server)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _cmd_sglang_server(args) -> int:
    import sys

    try:
        server = SGLangServer(args.model, port=args.port or None, threads=args.threads,
                              log_path=args.log, dtype=args.dtype)
        server.start()
    except SGLangServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"SGLang ({server.flavour}, --dtype {server.dtype or 'auto'}) serving "
          f"{server.model_path} at {server.url} (log {server.log_path}); Ctrl-C stops it",
          flush=True)
    stopping = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)   # `kill` stops the server as Ctrl-C does
    try:
        while server.running:
            time.sleep(1.0)
        print(f"error: the server exited (log {server.log_path})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, stopping)
        server.stop()
