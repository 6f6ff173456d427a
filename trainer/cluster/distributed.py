"""Training across processes (torch.distributed): K ranks under torchrun, rank 0 the controller.

Launch one process per GPU (or several CPU processes) with torchrun:

    torchrun --nproc_per_node K -m trainer run PRESET [--set ...] [--out DIR]

(`--set cluster.train_procs=K` without torchrun starts it for you.) torchrun sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `init()` reads them and joins the process
group: NCCL when the model runs on CUDA (each process on cuda:LOCAL_RANK), gloo on CPU. Without
those variables (or with WORLD_SIZE=1) nothing is initialised and every helper here is the
identity, so a single-process run takes exactly the code path it always took.

The layout (docs/scaling.md): rank 0 owns the rollout -- the engine or generation processes,
APRIL, GRESO, dynamic sampling, asynchronous admission, the data cursor -- and reports, reads
controls and writes checkpoints; every rank, rank 0 included, holds the policy wrapped in
DistributedDataParallel (which broadcasts rank 0's weights when it wraps the model), or a shard
of it (`cluster.sharding = "fsdp"`: trainer/cluster/sharding.py), and trains its share of each update
(trainer/run/training_ranks.py says how the batch is cut and what rank 0 sends). The learner
all-reduces each mini-batch's token count, so each rank's loss is its share of the global token
mean and one update equals the one-process update up to float rounding.
Every technique and engine works with any K, and a resumed run may have another K: the
controller's state is rank 0's, the other ranks get the weights and optimizer from it.

Failure: a rank that raises ends its process; torchrun then stops the others. A rank stuck in a
collective waits at most RLPILOT_DIST_TIMEOUT_S seconds (default 1800). A successful process
ends through `exit_process()` (see there: gloo threads and interpreter shutdown).
"""
from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise RuntimeError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None


@dataclass
class World:
    """This process's place among the K training processes (K = 1: every method is the
    identity and nothing is communicated)."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # --- small collectives ---------------------------------------------------------------------
    def _reduce(self, values: list[float], op) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def all_sum(self, x):
        """The sum of `x` (a number) over the ranks; ints stay ints."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        out = self._reduce([float(x)], dist.ReduceOp.SUM)[0]
        return int(round(out)) if isinstance(x, int) else out

    def all_max(self, x: int) -> int:
        """The largest `x` (an int) over the ranks."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        return int(self._reduce([float(x)], dist.ReduceOp.MAX)[0])

    def all_sum_dict(self, d: dict[str, float]) -> dict[str, float]:
        """Every value summed over the ranks (every rank must pass the same keys)."""
        if self.size == 1:
            return d
        import torch.distributed as dist

        keys = sorted(d)
        out = self._reduce([float(d[k]) for k in keys], dist.ReduceOp.SUM)
        return {k: (int(round(v)) if isinstance(d[k], int) else v) for k, v in zip(keys, out)}

    def broadcast_object(self, obj, src: int = 0):
        """Rank `src`'s `obj` (picklable), on every rank."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self._object_device())
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if self.backend == "nccl":
                dist.barrier(device_ids=[self.local_rank])
            else:
                dist.barrier()

    def main_only(self, fn: Callable[[], Any]):
        """Run `fn` on rank 0 and return its result on every rank; an exception on rank 0 is
        raised on every rank (so no rank waits forever for a checkpoint that failed)."""
        if self.size == 1:
            return fn()
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except BaseException as e:  # re-raised below, after the others are told
                error = e
        sent = error
        if error is not None:
            try:  # the same exception on every rank when it pickles, else a RuntimeError
                pickle.loads(pickle.dumps(error))
            except Exception:
                sent = RuntimeError(f"rank 0 failed: {type(error).__name__}: {error}")
        result, sent = self.broadcast_object((result, sent))
        if error is not None:
            raise error
        if sent is not None:
            raise sent
        return result

    def _object_device(self):
        return self.device if self.backend == "nccl" else None

    # --- model ---------------------------------------------------------------------------------
    def ddp_device_ids(self) -> list[int] | None:
        """DistributedDataParallel's device_ids: this rank's GPU under NCCL, none on the CPU."""
        return [self.device.index] if self.backend == "nccl" else None

    # --- the runner's helpers ------------------------------------------------------------------
    def local_device(self, device: torch.device) -> torch.device:
        """cuda -> cuda:LOCAL_RANK when data parallel."""
        if self.size > 1 and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device


# ---------------------------------------------------------------------------------------------
# The process's world (module-level helpers)
# ---------------------------------------------------------------------------------------------

_WORLD: World | None = None


def init(device: str = "auto") -> World:
    """Join the process group torchrun describes (idempotent). `device` is model.device: the
    backend is NCCL when it resolves to CUDA, gloo otherwise. Returns the single-process world
    when WORLD_SIZE is unset or 1."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # set up by the caller
        rank, size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
        local = _env_int("LOCAL_RANK", rank)
        dev = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
        _WORLD = World(rank=rank, size=size, local_rank=local, backend=backend, device=dev)
        return _WORLD
    size = _env_int("WORLD_SIZE", 1)
    if size <= 1:
        _WORLD = World()
        return _WORLD
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"WORLD_SIZE={size} but {var} is not set: launch with torchrun "
                               "--nproc_per_node K -m trainer run ...")
    from trainer.models.loading import resolve_device

    on_cuda = resolve_device(device).type == "cuda"
    timeout = datetime.timedelta(seconds=float(os.environ.get("RLPILOT_DIST_TIMEOUT_S", 1800)))
    if on_cuda:
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA "
                               "device(s) are visible: use --nproc_per_node <= the GPU count")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", rank=rank, world_size=size, timeout=timeout, device_id=dev)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timeout)
        backend = "gloo"
    _WORLD = World(rank=rank, size=size, local_rank=local, backend=backend, device=dev)
    return _WORLD


def world() -> World:
    """This process's world (initialised from the environment on first use, on CPU/auto)."""
    return _WORLD if _WORLD is not None else init()


def destroy(sync: bool = True) -> int:
    """Leave the process group (if this module joined or wrapped one) and forget the world;
    returns the world size it had (1 if none). `sync`: first wait until every rank is here, so
    no rank tears its connections down while another still finishes a collective (pass False
    on an error path: the others may never come)."""
    global _WORLD
    import torch.distributed as dist

    size = _WORLD.size if _WORLD is not None else 1
    if size > 1 and dist.is_initialized():
        if sync:
            _WORLD.barrier()
        dist.destroy_process_group()
    _WORLD = None
    return size


def exit_process(code: int = 0) -> None:
    """End a data-parallel process now (after destroy()), skipping interpreter shutdown.

    Gloo's worker threads release the tensors of finished collectives asynchronously, and a
    release that needs the GIL while the interpreter is shutting down aborts the process
    ("terminate called without an active exception", SIGABRT) after a successful run. It
    happens under CPU load, more often once transformers has loaded a model (something then
    keeps the process group alive past destroy_process_group). Everything the run writes is
    closed by then; stdout and stderr are flushed here."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
