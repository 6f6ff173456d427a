"""Two CPU training processes on gloo for the multi-process tests (tests/test_distributed.py,
tests/test_fsdp.py): the environment torchrun would give, a spawn that waits for both, and the
CLI's way to end a rank (imported as `ranks`; pytest puts tests/ on sys.path)."""
import hashlib
import json
import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from trainer.algo.learner import TrainSequence
from trainer.cluster import distributed
from trainer.run.controls import SET_KNOBS, Command, ControlSource

# the tiny run of the multi-process tests: 4 prompts x 4 answers, one thread, no reward process
TINY = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_response_len=48", "rollout.max_slots=16", "run.eval_every=0",
        "run.checkpoint_every=0", "run.reward_workers=0", "model.threads=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, size: int, port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RLPILOT_DIST_TIMEOUT_S": "90"})
    torch.set_num_threads(1)


def spawn(fn, *args) -> None:
    """`fn(rank, *args)` in two processes; raises when either fails."""
    mp.spawn(fn, args=args, nprocs=2, join=True)


def finish() -> None:
    """Leave the group and end the process as the CLI does (distributed.exit_process: gloo
    threads may abort a process in interpreter shutdown)."""
    distributed.destroy()
    distributed.exit_process(0)


def sequences(n=12, seed=0) -> list[TrainSequence]:
    """`n` random sequences of 2-7 prompt and 1-23 response tokens with behaviour logprobs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, r = int(torch.randint(2, 8, (1,), generator=g)), int(torch.randint(1, 24, (1,), generator=g))
        ids = torch.randint(4, 30, (p + r,), generator=g).tolist()
        old = (-0.5 - 2 * torch.rand(r, generator=g)).tolist()
        out.append(TrainSequence(ids[:p], ids[p:], old, float(torch.randn(1, generator=g)), 1.0))
    return out


def digest(model) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


class KnobsAt(ControlSource):
    """One knob change, read once the run has finished `after` steps (whenever it polls)."""

    def __init__(self, after: int, knobs: dict):
        self.after, self.knobs, self.sent, self.runner = after, knobs, False, None

    def poll(self):
        if self.sent or self.runner is None or self.runner.step < self.after:
            return []
        self.sent = True
        return [Command(SET_KNOBS, knobs=self.knobs)]
