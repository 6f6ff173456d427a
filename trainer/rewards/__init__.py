"""Rewards: the verifiers, the code judge, and the pool of processes that scores.

    verifiers.py  math and code: (answer, completion) -> 0.0 or 1.0
    judge.py      the code reward's verdict: the code in the sandbox (trainer/sandbox/), the
                  tests here, results crossing as data
    dispatch.py   one item: the verifier the task registry names for its kind, never raising
    pool.py       RewardService: batches in kept-alive worker processes, with time limits
    worker.py     a worker process's main loop

Import from the modules (`from trainer.rewards.pool import RewardService`): this package
re-exports nothing, because the task registry (trainer.tasks) imports the verifiers and the pool
imports the registry, so a re-export here would make the two packages import each other.
"""
