"""Data-parallel training across processes (torch.distributed), for the synchronous loop.

Launch one process per GPU (or several CPU processes) with torchrun:

    torchrun --nproc_per_node K -m trainer run PRESET [--set ...] [--out DIR]

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `init()` reads them and
joins the process group: NCCL when the model runs on CUDA (each process on cuda:LOCAL_RANK),
gloo on CPU. Without those variables (or with WORLD_SIZE=1) nothing is initialised and every
helper here is the identity, so a single-process run takes exactly the code path it always took.

The design (K processes, N = rollout.rollout_batch_size groups per step):

- Every rank holds the whole policy, its frozen reference, an AdamW optimizer and its own
  embedded engine. The policy is broadcast from rank 0 once at start (DDP does it when it wraps
  the model); after that the ranks stay identical because they apply identical (all-reduced)
  gradients.
- Rollouts: rank r generates N/K groups per step (N must be a multiple of K). Prompts are
  dealt round-robin from the one global data cursor: rank r takes draws c+r, c+r+K, c+r+2K...
  (`ShardedPromptSource`), so no prompt is generated twice, the union over ranks is exactly the
  draws c..c+N-1 a single process would take, and the cursor advances by N per step on every
  rank (checkpoints store one cursor, the same for any K).
- Rewards and group advantages are per group, so they stay on the rank that generated it.
- The update: the loss is the token mean over the *global* mini-batch. Each rank all-reduces
  its token count (sum of token weights) first, computes loss = (its token sum) / (global
  count), and back-propagates its own micro-batches through DistributedDataParallel (trainer/
  learner.py): `no_sync()` for all but the last micro-batch of a mini-batch, whose backward
  all-reduces the accumulated gradients, bucketed and overlapped with the backward pass. DDP
  averages over the K ranks, so the backward runs on K x the loss: the result is the sum of the
  per-rank gradients, the gradient of the global token mean, and one update equals a
  single-process update on the union of the sequences up to float rounding (tested). Ranks may
  hold different numbers of micro-batches (each packs its own); a rank with no sequence in a
  mini-batch (all its groups zero-variance) takes part with one empty backward (a one-token
  forward times zero), so every rank joins each mini-batch's all-reduce exactly once.
  With optim.mini_batches > 1 each rank splits its own sequences, so a mini-batch holds other
  sequences than in a single-process run (each is still a token mean over all ranks' share).
- Sampling: the engine's generator is seeded with run.seed + rank. A group's samples depend on
  the other sequences sharing its decode batches (one generator draws for the whole batch), so
  a K-process run samples different tokens from a single-process run on the same prompts; the
  training math is the same.
- Metrics, events and checkpoints: only rank 0 writes them; the other ranks get a null sink and
  a null control source. Before rank 0 reports a step, `reduce_metrics` combines the ranks'
  values: means over samples (reward/mean, reward/accuracy, zero-variance ratios, ...) weighted
  by each rank's sample count, counts and throughputs summed, timings as the slowest rank,
  response lengths (mean, p50, p90, max, histogram) over every rank's responses; the
  train/*_total counters are summed step by step, so every rank holds the global totals.
  actor/* metrics are already global (the learner all-reduces its sums).
- Controls (knob changes, pause, resume, stop) are polled on rank 0 and broadcast at each step
  boundary, so every rank applies the same change before the same step; while paused, the
  ranks wait together. The time budget is decided on rank 0 and broadcast too.
- Evaluation: every rank scores its share of the held-out prompts; the results are averaged.
- Checkpoints: rank 0 saves (with every rank's sampling RNG state); every rank resumes from the
  same checkpoint. Resuming with another world size works (the cursor is global) but the
  sampling RNG of ranks > 0 is then re-seeded, so it is not a bit-exact continuation.

Not supported with K > 1, refused by `check_config` (at start and for knob changes):
asynchronous mode, APRIL, dynamic sampling, GRESO (each makes the number of prompts a rank draws
per step depend on what it generated, which the round-robin cursor does not allow yet), and the
SGLang engine (every rank would push weights to the same servers).

Failure: a rank that raises ends its process; torchrun then stops the others. A rank stuck in a
collective waits at most RLPILOT_DIST_TIMEOUT_S seconds (default 1800). A successful process
ends through `exit_process()` (see there: gloo threads and interpreter shutdown).
GRESO's reward traces (recorded even while GRESO is off) are per rank; checkpoints hold rank 0's.

Long because every collective the loop needs (config, controls, metrics, histograms, RNG,
checkpoints) is here, so the runner never calls torch.distributed itself.
"""
from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# metrics that are means over a step's samples: weighted by each rank's `rollout/samples`
MEAN_BY_SAMPLES = ("reward/mean", "reward/accuracy", "rollout/truncated_ratio",
                   "rollout/zero_var_ratio", "rollout/zero_var_ratio/all_correct",
                   "rollout/zero_var_ratio/all_wrong", "actor/advantage_abs_mean",
                   "rollout/idle_slot_frac")
SUMMED = ("reward/errors", "reward/timeouts", "rollout/gen_tokens", "rollout/samples",
          "rollout/trained_tokens", "rollout/groups_started", "rollout/effective_groups",
          "rollout/discarded_tokens", "perf/gen_tokens_per_s", "perf/trained_tokens_per_s",
          "perf/rollout_trained_tokens_per_s")
MAXED_PREFIXES = ("timing/",)
MAXED = ("rollout/decode_steps", "rollout/rounds", "system/cuda_peak_mem_gb")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise RuntimeError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None


@dataclass
class World:
    """This process's place among the K data-parallel processes (K = 1: every method is the
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

    def gather_list(self, items: list) -> list:
        """The concatenation, in rank order, of every rank's `items`, on every rank."""
        if self.size == 1:
            return list(items)
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, list(items))
        return [x for part in out for x in part]

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

    def prompt_source(self, task):
        from trainer.rollout import PromptSource

        return PromptSource(task) if self.size == 1 else ShardedPromptSource(task, self)

    def local_config(self, cfg):
        """The config this rank's rollout uses: its share N/K of the step's groups."""
        if self.size == 1:
            return cfg
        local = cfg.copy()
        local.rollout.rollout_batch_size = cfg.rollout.rollout_batch_size // self.size
        return local

    def seed_engine(self, engine, seed: int) -> None:
        """Each rank samples with its own stream: seed + rank."""
        if self.size > 1 and getattr(engine, "generator", None) is not None:
            engine.generator.manual_seed(seed + self.rank)

    def restore_rng(self, tensors: dict, generator, seed: int, step: int) -> None:
        """Set this rank's RNG states from a checkpoint's (see Runner.save_checkpoint)."""
        from trainer import checkpoint

        ranks = tensors.get("rng_ranks")
        if self.size == 1 or self.rank == 0:
            checkpoint.set_rng_state(tensors["rng"], generator)
        elif ranks and len(ranks) == self.size:
            checkpoint.set_rng_state(ranks[self.rank], generator)
        else:  # saved by another world size: a fresh stream for this rank
            checkpoint.set_rng_state(tensors["rng"], generator)
            if generator is not None:
                generator.manual_seed(hash((seed, self.rank, step)) & 0x7FFF_FFFF)

    def sync_totals(self, before: dict[str, int], totals: dict[str, int]) -> None:
        """Make the run's counters global: add every rank's increments since `before`."""
        if self.size == 1:
            return
        delta = self.all_sum_dict({k: totals[k] - before.get(k, 0) for k in totals})
        for k in totals:
            totals[k] = before.get(k, 0) + delta[k]

    def sum_histogram(self, hist: dict[str, Any]) -> dict[str, Any]:
        """A histogram over every rank's values (same edges on every rank)."""
        if self.size == 1:
            return hist
        counts = self.all_sum_dict({f"{i:06d}": int(c) for i, c in enumerate(hist["counts"])})
        return {**hist, "counts": [counts[k] for k in sorted(counts)]}

    def reduce_metrics(self, m: dict[str, float], lengths: list[int]) -> dict[str, float]:
        """One step's metrics over the whole global batch (see the module docstring); metrics
        without a rule keep rank 0's value (already global or machine-wide)."""
        if self.size == 1:
            return m
        from trainer.metrics import percentile

        parts = self.gather_list([(m, list(lengths))])
        out = dict(m)
        weights = [p[0].get("rollout/samples", 0) for p in parts]
        for key in m:
            vals = [p[0][key] for p in parts if key in p[0]]
            if not all(isinstance(v, (int, float)) for v in vals):
                continue
            if key in MEAN_BY_SAMPLES:
                w = [wt for p, wt in zip(parts, weights) if key in p[0]]
                out[key] = (sum(v * x for v, x in zip(vals, w)) / sum(w) if sum(w)
                            else sum(vals) / len(vals))
            elif key in SUMMED:
                out[key] = sum(vals)
            elif key in MAXED or key.startswith(MAXED_PREFIXES):
                out[key] = max(vals)
        every = [x for p in parts for x in p[1]]
        out["rollout/response_len/mean"] = sum(every) / max(len(every), 1)
        out["rollout/response_len/p50"] = percentile(every, 0.5)
        out["rollout/response_len/p90"] = percentile(every, 0.9)
        out["rollout/response_len/max"] = max(every, default=0)
        out["dist/world_size"] = self.size
        return out

    def reduce_eval(self, res: dict[str, float]) -> dict[str, float]:
        """Evaluation results of every rank's share of the held-out prompts, averaged by count."""
        if self.size == 1:
            return res
        parts = self.gather_list([res])
        n = sum(p["n"] for p in parts)
        out = dict(res, n=n, seconds=max(p["seconds"] for p in parts))
        for key in ("accuracy", "reward_mean", "response_len_mean"):
            out[key] = sum(p[key] * p["n"] for p in parts) / max(n, 1)
        return out


class ShardedPromptSource:
    """Round-robin share of the global draw sequence: rank r's next draw is cursor + r, then
    the cursor moves on by K. After every rank drew the same number n of prompts, every rank's
    cursor is c + n*K: the global cursor, which checkpoints store."""

    def __init__(self, task, world: World, cursor: int = 0):
        self.task, self.world, self.cursor = task, world, cursor

    def next(self):
        draw = self.cursor + self.world.rank
        self.cursor += self.world.size
        return draw, self.task.train_problem(draw)


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
    from trainer.model import resolve_device

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


def is_main() -> bool:
    return world().is_main


def rank() -> int:
    return world().rank


def barrier() -> None:
    world().barrier()


def all_reduce_metrics(d: dict[str, float]) -> dict[str, float]:
    """Sum of every value over the ranks (same keys on every rank)."""
    return world().all_sum_dict(d)


def broadcast_object(obj, src: int = 0):
    return world().broadcast_object(obj, src)


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


def check_config(cfg, size: int) -> None:
    """Refuse, naming each setting, what data-parallel training does not support yet."""
    if size <= 1:
        return
    from trainer.config import ConfigError

    why = f"not supported with data-parallel training ({size} processes)"
    errors: dict[str, str] = {}
    n = cfg.rollout.rollout_batch_size
    if n % size:
        errors["rollout.rollout_batch_size"] = (f"must be a multiple of the number of processes "
                                                f"({size}); got {n}")
    if cfg.async_.enabled:
        errors["async.enabled"] = why + "; run asynchronous training with one process"
    if cfg.april.enabled:
        errors["april.enabled"] = why
    if cfg.rollout.dynamic_sampling:
        errors["rollout.dynamic_sampling"] = why
    if cfg.greso.enabled:
        errors["greso.enabled"] = why
    if cfg.rollout.engine != "embedded":
        errors["rollout.engine"] = why + " (only the embedded engine)"
    if cfg.run.eval_every and cfg.run.eval_size < size:
        errors["run.eval_size"] = f"must be at least the number of processes ({size})"
    if errors:
        raise ConfigError(errors)
