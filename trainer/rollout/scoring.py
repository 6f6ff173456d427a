"""Scoring: the verifier's rewards for complete groups, shaped for the loss, and counted.

The rollout drivers call the `Scorer` with groups whose samples have all finished (the
asynchronous driver from its generation thread, hence the lock). Each sample gets its raw score
(the verifier's), its reward (with the overlong penalty, trainer/algo/objective.py, on the tokens
the model wrote: an episode's tool results are not its length) and its reward status (ok / error /
timeout, with the reason), and the step's and the run's error and timeout counts grow.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from trainer.algo import objective
from trainer.episode.engine import final_turn
from trainer.rewards.pool import RewardService
from trainer.rollout.base import Group


class Scorer:
    def __init__(self, rewards: RewardService, tokenizer, cfg: Callable[[], object],
                 totals: dict[str, int], lock: threading.RLock):
        self.rewards, self.tokenizer, self.cfg = rewards, tokenizer, cfg
        self.totals, self.lock = totals, lock   # the run's counters, shared with the runner
        self.new_step()

    def new_step(self) -> None:
        self.errors = self.timeouts = 0
        self.seconds = 0.0

    def __call__(self, groups: list[Group]) -> None:
        """Score every sample of `groups` (complete groups) in place."""
        t0 = time.monotonic()
        samples = [s for g in groups for s in g.samples]
        problems = [g.problem for g in groups for _ in g.samples]
        # an episode's answer is its last model turn (a tool's output is not the model's answer)
        completions = [self.tokenizer.decode(final_turn(s), skip_special_tokens=True) for s in samples]
        batch = self.rewards.score_batch(problems, completions)
        raw = list(batch.scores)
        shaped = objective.shaped_rewards(raw, [s.model_tokens for s in samples], self.cfg())
        statuses = batch.statuses or ["ok"] * len(raw)
        notes = batch.notes or [""] * len(raw)
        i = 0
        for g in groups:
            n = len(g.samples)
            g.rewards, g.raw_scores = shaped[i:i + n], raw[i:i + n]
            g.reward_status, g.reward_notes = list(statuses[i:i + n]), list(notes[i:i + n])
            i += n
        with self.lock:
            self.errors += batch.errors
            self.timeouts += batch.timeouts
            self.totals["reward_errors"] += batch.errors
            self.totals["reward_timeouts"] += batch.timeouts
            self.seconds += time.monotonic() - t0

    def texts(self, problems, completions) -> list[float]:
        """Scores of already decoded completions (evaluation), nothing counted."""
        with self.lock:
            return self.rewards.score_batch(problems, completions).scores

    def metrics(self) -> dict[str, float]:
        return {"reward/errors": self.errors, "reward/timeouts": self.timeouts,
                "timing/reward_s": self.seconds}
