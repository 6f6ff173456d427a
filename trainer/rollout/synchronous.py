"""The synchronous step: draw N prompts, generate G answers each with continuous batching,
return when the last answer is done (the barrier at the end of the step that APRIL removes).

- DAPO dynamic sampling (`rollout.dynamic_sampling`): zero-variance groups are dropped and more
  prompts are drawn until N effective groups are ready, each round sized from the observed
  zero-variance ratio (`greso.next_sampling_batch_size`), at most `max_sampling_rounds` rounds;
- prompts come from the selector (`selection.py`: the data cursor, filtered by GRESO);
- while `april.enabled` the step is APRIL's (`april.py`: over-sampling, early termination,
  partial rollouts); the knob may change mid-run, so this driver keeps APRIL's state.
"""
from __future__ import annotations

import time

from trainer.greso import next_sampling_batch_size
from trainer.rollout import april
from trainer.rollout.base import Driver, RolloutResult, StepRun, sampling_params
from trainer.rollout.ledger import TokenLedger


class SynchronousDriver(Driver):
    """`scorer(groups)` fills `group.rewards` for complete groups; `select(cfg, counts)` returns
    the next (draw, problem) to roll out."""

    def __init__(self, engine, tokenizer, select, scorer):
        self.engine, self.tokenizer, self.select, self.scorer = engine, tokenizer, select, scorer
        self.april = april.AprilRollout()
        self.length_history: dict[str, float] = {}  # problem id -> mean response length
        self.next_batch: int | None = None          # dynamic sampling's next draw size
        self.ledger = TokenLedger()

    def held_tokens(self) -> int:
        return self.buffer.tokens()

    @property
    def buffer(self) -> april.PartialBuffer:
        return self.april.buffer

    def collect(self, cfg, version: int) -> RolloutResult:
        if cfg.april.enabled:
            return self.april.collect(self, cfg, version)
        N = cfg.rollout.rollout_batch_size
        step = StepRun(self.engine, self.tokenizer, self.select, self.scorer, cfg,
                       sampling_params(cfg))
        c = step.counts
        t0 = time.monotonic()
        first = max(N, self.next_batch or 0) if step.dynamic else N
        step.start_new(first)
        c.rounds = 1
        while True:  # generate until the engine is idle: every answer is done
            step.advance()
            if self.engine.num_pending:
                continue
            step.score_waiting()
            if len(step.ready) >= N or not step.dynamic:
                break
            if c.rounds >= cfg.rollout.max_sampling_rounds:
                break
            observed = c.filtered_groups / max(len(step.scored), 1)
            step.start_new(next_sampling_batch_size(N - len(step.ready), observed, 1, 8 * N))
            c.rounds += 1
        gen_seconds = time.monotonic() - t0
        step.ready.sort(key=lambda g: g.draw)
        train = step.ready[:N]
        for g in step.ready[N:]:  # dynamic sampling's surplus
            c.discarded_tokens += g.tokens()
        self.finish_step(cfg, step)
        return self.result(cfg, step, train, gen_seconds, {})

    # --- shared with APRIL's step ----------------------------------------------------------------
    def finish_step(self, cfg, step: StepRun) -> None:
        if step.dynamic:
            ratio = step.counts.filtered_groups / max(len(step.scored), 1)
            N = cfg.rollout.rollout_batch_size
            self.next_batch = next_sampling_batch_size(N, ratio, N, 8 * N)
        for g in step.scored:
            lens = [len(s.response_ids) for s in g.samples]
            self.length_history[g.problem.id] = sum(lens) / len(lens)

    def result(self, cfg, step: StepRun, train, gen_seconds: float, extra: dict) -> RolloutResult:
        c = step.counts
        m = {"rollout/groups_started": c.groups_started, "rollout/rounds": c.rounds,
             "rollout/effective_groups": len(step.ready), **extra}
        if cfg.rollout.dynamic_sampling:
            m["rollout/filtered_groups"] = c.filtered_groups
        m["rollout/discarded_tokens"] = c.discarded_tokens
        return RolloutResult(groups=train, scored=step.scored, gen_seconds=gen_seconds, counts=c,
                             metrics=m)

    def after_step(self, cfg, idle_slot_frac: float) -> None:
        if cfg.april.enabled:
            self.april.after_step(cfg, idle_slot_frac)

    def report(self, cfg, result, version, step_s, histogram) -> dict[str, float]:
        return april.report(result, version, histogram, self.buffer) if cfg.april.enabled else {}

    # --- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"buffer": self.buffer.state_dict(), "length_history": self.length_history,
                "segment_tokens": self.april.segment_tokens, "next_batch": self.next_batch}

    def load_state_dict(self, state: dict, version: int) -> None:
        if not state:
            return
        self.buffer.load_state_dict(state.get("buffer", {}))
        self.length_history = dict(state.get("length_history", {}))
        self.april.segment_tokens = state.get("segment_tokens")
        self.next_batch = state.get("next_batch")
