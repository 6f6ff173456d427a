"""Asynchronous rollout (AReaL): generation never waits for training.

A generation worker (a thread here; it only talks to the engine through the engine interface,
so the engine may live on another device or behind HTTP) keeps the engine busy: it admits new
groups, steps the engine, scores groups as they complete and queues them. The trainer takes
the complete groups whose oldest token is oldest (groups complete out of order, and taking them
as they completed would let a long answer's group fall out of the bound), trains, and pushes new
weights; the engine swaps them between two decode steps (interruptible generation), so a long
answer may carry tokens from several policy versions, each tagged with its version. The
staleness bound eta (`async.max_staleness`) limits how many versions old a trained token may be.

One module per job:

- `admission.py`: which groups may start and how many generate at once (the bound
  (eta + v + 1) x B), which queued group is taken first and which is too stale (pure rules);
- `state.py`: what the worker and the trainer share under one condition (queue, groups
  generating, admission counters);
- `worker.py`: the generation thread (admit, submit, step the engine, score and queue);
- `collect.py`: a training step's groups assembled on the trainer's thread, and the stall and
  interruption it raises instead of waiting forever;
- `driver.py`: `AsyncDriver`, the rollout driver interface composed of the above (the run's
  life, reports, auto staleness, checkpoints).

How the other techniques behave here (preset `all`):
- APRIL: generation has no step barrier, so there is nothing to terminate early; over-sampling
  is the in-flight cap, and "partial rollouts" are the interruptible samples that continue
  under new weights. A sample still stops at `april.segment_max_tokens` per version when APRIL
  is on, and yields its slot to the back of the queue (long answers cannot hog slots), unless
  its group is already eta versions old: one more version and it would be dropped as stale, so
  it gets its last chance (as in `april.py`) and runs to its end without a segment limit.
- GRESO: the pre-filter runs at admission, on the worker; p_easy/p_hard adapt once per
  training step from the groups that step consumed.
- Dynamic sampling: zero-variance groups are dropped on completion and never queued, so the
  trainer receives B groups with signal (after max_sampling_rounds x B filtered in a row the
  next is queued anyway: no signal to find must not stall the run).
The decoupled PPO loss (trainer/algo/decoupled.py) corrects for the staleness in training.
"""
from __future__ import annotations

from trainer.rollout.asynchronous.admission import admission_allowed, admission_bound
from trainer.rollout.asynchronous.collect import AsyncStall, CollectInterrupted
from trainer.rollout.asynchronous.driver import AsyncDriver

__all__ = ["AsyncDriver", "AsyncStall", "CollectInterrupted", "admission_allowed",
           "admission_bound"]
