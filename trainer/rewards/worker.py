"""A reward worker's main loop: the process the reward pool (trainer/rewards/pool.py) starts.

    python -c <boot> <fd> <kinds> <sandbox dir> <reward fn>

It says ("ready", pid) once its verifiers are imported, then reads ("score", items, item time
limit, batch time left) from the pipe on `fd`, scores each item with `dispatch.score_item`, and
answers ("part", results) every `_PART_EVERY_S` of a long chunk, then ("done", results), so that
a batch that runs out of time loses only unfinished items. It runs until the pipe closes;
Ctrl-C is the trainer's to handle.
"""
from __future__ import annotations

import logging
import os
import signal
import time

from trainer.rewards.dispatch import preload, resolve_reward_fn, score_item
from trainer.sandbox import process as process_sandbox

_PART_EVERY_S = 0.2      # a worker reports finished items of a long chunk this often


def main(argv: list[str]) -> None:
    """Serve the pool on the pipe: argv is `<fd> <kinds> <sandbox dir> <reward fn>`."""
    from multiprocessing.connection import Connection
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the trainer handles Ctrl-C and stops us
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
    conn = Connection(int(argv[0]))
    kinds = [k for k in argv[1].split(",") if k]
    process_sandbox.set_parent_dir(argv[2] if len(argv) > 2 and os.path.isdir(argv[2]) else None)
    fn = resolve_reward_fn(argv[3]) if len(argv) > 3 and argv[3] else None
    preload(kinds)
    try:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None or msg[0] != "score":
                return
            _, job, item_timeout, budget = msg
            deadline = time.monotonic() + budget
            done: list = []
            last_sent = time.monotonic()
            for k, (kind, answer, completion) in enumerate(job, start=1):
                left = deadline - time.monotonic()
                done.append(score_item(kind, answer, completion, min(item_timeout, left - 0.05),
                                       fn))
                if k < len(job) and time.monotonic() - last_sent > _PART_EVERY_S:
                    conn.send(("part", done))   # so a timeout loses only the unfinished items
                    done = []
                    last_sent = time.monotonic()
            conn.send(("done", done))
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return
