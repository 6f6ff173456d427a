"""What the generation worker and the trainer share: the queue of complete groups, the groups
generating, the admission counters, the step's sample accounting. Both sides change it under one
condition (`cond`), which also wakes the other side; the admission rule it applies is
admission.py's.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from trainer.rollout.asynchronous import admission
from trainer.rollout.base import Group, StepCounts


class AsyncState:
    """The shared state; every field is read and written under `cond` unless it says otherwise."""

    def __init__(self):
        self.cond = threading.Condition()
        self.cfg = None                      # the config the worker admits by (knobs applied)
        self.version = 0                     # the engine's policy version
        self.queue: deque[Group] = deque()   # complete, scored, waiting for the trainer
        self.running: dict[int, Group] = {}  # id(group) -> generating group
        self.owner: dict[int, Group] = {}    # request id -> group (the worker's alone)
        self.restored: list[Group] = []      # unfinished groups from a checkpoint, resumed first
        self.accepted = 0                    # queued and not dropped: trained or waiting
        self.dropped_stale = 0
        self.counts = StepCounts()           # since the last collect
        self.scored: list[Group] = []        # scored since the last collect (metrics)
        self.busy_s = 0.0                    # the worker's time stepping the engine
        self.progress_at = time.monotonic()  # the last admission, finished sample or queued group
        self.filtered_tokens = 0             # dropped by dynamic sampling, not yet in the ledger
        self.filtered_in_a_row = 0           # groups dynamic sampling filtered since one was queued
        self.gave_up = 0                     # zero-variance groups queued after that many in a row

    def held(self) -> list[Group]:
        """The groups held for a later step: queued, generating, restored and not yet resumed."""
        return list(self.queue) + list(self.running.values()) + self.restored

    def cap(self) -> int:
        """Groups that may generate at once (admission.inflight_cap)."""
        cfg = self.cfg
        return admission.inflight_cap(cfg.async_.max_inflight, cfg.rollout.rollout_batch_size,
                                      cfg.rollout.max_slots, cfg.cluster.gen_procs,
                                      cfg.rollout.n_samples_per_prompt)

    def can_admit(self) -> bool:
        """May one more new group start now (the cap and the staleness bound)?"""
        cfg = self.cfg
        return admission.may_start(self.accepted, len(self.running), self.version,
                                   cfg.async_.max_staleness, cfg.rollout.rollout_batch_size,
                                   self.cap())

    def counters(self) -> dict[str, int]:
        """The admission counters (for metrics, benchmarks and stall messages)."""
        cfg = self.cfg
        return {"accepted": self.accepted, "running": len(self.running),
                "queued": len(self.queue), "version": self.version,
                "eta": cfg.async_.max_staleness, "batch": cfg.rollout.rollout_batch_size,
                "bound": admission.admission_bound(self.version, cfg.async_.max_staleness,
                                                   cfg.rollout.rollout_batch_size),
                "dropped_stale": self.dropped_stale}
