"""Which prompt to roll out next: the data cursor, filtered by GRESO when `greso.enabled`.

GRESO's rule itself (traces, the skip decision, the adaptation of p_easy/p_hard) is pure logic
in `trainer/rollout/greso.py`; this module applies it to a run: it skips prompts before generation,
feeds each step's groups back, and reports the filter's metrics. With asynchronous training the
generation worker selects while the trainer feeds back, so both hold `lock`.
"""
from __future__ import annotations

import threading

from trainer.rollout.base import PromptSource, StepCounts
from trainer.rollout.greso import GresoFilter


class PromptSelector:
    def __init__(self, prompts: PromptSource, train_size: int, cfg, lock: threading.RLock):
        self.prompts, self.train_size, self.lock = prompts, train_size, lock
        self.filter = GresoFilter(p_easy=cfg.greso.p_easy, p_hard=cfg.greso.p_hard,
                                  seed=cfg.run.seed)

    def __call__(self, cfg, counts: StepCounts):
        """The next (draw, problem); GRESO may skip some (bounded, so it always returns)."""
        for _ in range(max(1, self.train_size)):
            draw, problem = self.prompts.next()
            if not cfg.greso.enabled:
                return draw, problem
            d = self.filter.decide(problem.id, cfg.greso)
            if not d.skip:
                return draw, problem
            counts.greso_draws.append(draw)
            if d.kind == "easy":
                counts.skipped_easy += 1
            else:
                counts.skipped_hard += 1
        return draw, problem  # every prompt skippable: take the last one rather than loop

    def observe(self, cfg, step: int, scored) -> None:
        """Feed back a training step's scored groups: adapt p (GRESO on), then record traces
        (kept even while GRESO is off, so it starts warm when switched on mid-run)."""
        with self.lock:
            if cfg.greso.enabled:
                self.filter.adapt_from_groups([(g.problem.id, g.rewards) for g in scored],
                                              cfg.greso)
            for g in scored:
                self.filter.record(g.problem.id, step, g.rewards)

    def report(self, cfg, counts: StepCounts) -> dict[str, float]:
        if not cfg.greso.enabled:
            return {}
        drawn = counts.groups_started + counts.skipped_easy + counts.skipped_hard
        with self.lock:
            wrong, right = self.filter.take_skip_judgements()
        judged = {"greso/skips_judged": wrong + right,
                  **({"greso/wrong_skip_ratio": wrong / (wrong + right)} if wrong + right else {})}
        return {**judged, "greso/skip_rate": (counts.skipped_easy + counts.skipped_hard) / max(drawn, 1),
                "greso/skip_rate/easy": counts.skipped_easy / max(drawn, 1),
                "greso/skip_rate/hard": counts.skipped_hard / max(drawn, 1),
                "greso/p_easy": self.filter.p_easy, "greso/p_hard": self.filter.p_hard,
                "greso/prompts_sampled": drawn}
