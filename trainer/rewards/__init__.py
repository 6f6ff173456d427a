"""Rewards: the verifiers, the sandbox that runs code, and the pool of processes that scores.

    verifiers.py  math and code: (answer, completion) -> 0.0 or 1.0
    sandbox.py    running a completion's code and its tests in a limited child interpreter
    dispatch.py   one item: the verifier the task registry names for its kind, never raising
    pool.py       RewardService: batches in kept-alive worker processes, with time limits
    worker.py     a worker process's main loop

Import from the modules (`from trainer.rewards.pool import RewardService`): this package
re-exports nothing, because the task registry (trainer.tasks) imports the verifiers and the pool
imports the registry, so a re-export here would make the two packages import each other.
"""
