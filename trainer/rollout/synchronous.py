"""The synchronous step: draw N prompts, generate G answers each with continuous batching,
return when the last answer is done (the barrier at the end of the step that APRIL removes).

One step (`collect`), read with `april.py` beside it:

1. a step context (`base.StepRun`) with what the step works with: the engine, the tokenizer,
   the prompt selector (`selection.py`: the data cursor, filtered by GRESO), the scorer, the
   token ledger;
2. the groups: while `april.enabled` APRIL's step (`april.py`: over-sampling, early
   termination, partial rollouts) returns what to train and what to keep, and the kept groups go
   to APRIL's buffer; otherwise every answer is generated to the end, with DAPO dynamic sampling
   (`dynamic.py`: zero-variance groups left out, more rounds drawn until N have signal, at most
   `max_sampling_rounds`) when `rollout.dynamic_sampling`;
3. the step is finished here: the next dynamic-sampling round size, each prompt's response
   length (APRIL's short_first admission), the metrics, and a warning when a step ends with
   fewer than N groups (once until the knobs change).

Every generated token this driver throws away goes to its ledger under its reason; the knobs
may change mid-run (APRIL on and off included), so this driver keeps APRIL's state.
"""
from __future__ import annotations

import time

from trainer.rollout import april, dynamic
from trainer.rollout.base import Driver, Group, RolloutResult, StepRun, sampling_params
from trainer.rollout.ledger import TokenLedger


class SynchronousDriver(Driver):
    """`scorer(groups)` fills `group.rewards` for complete groups; `select(cfg, counts)` returns
    the next (draw, problem) to roll out."""

    def __init__(self, engine, tokenizer, select, scorer):
        self.engine, self.tokenizer, self.select, self.scorer = engine, tokenizer, select, scorer
        self.april = april.AprilRollout()
        self.length_history: dict[str, float] = {}  # problem id -> mean model tokens
        self.next_batch: int | None = None          # dynamic sampling's next first round
        self.ledger = TokenLedger()
        self.said_short = False  # a step fell short and said so; reset by a knob change

    def held_tokens(self) -> int:
        return self.buffer.tokens()

    @property
    def buffer(self) -> april.PartialBuffer:
        return self.april.buffer

    def collect(self, cfg, version: int) -> RolloutResult:
        t0 = time.monotonic()
        if cfg.april.enabled:
            step = self._new_step(cfg, self.april.params(cfg))
            train, keep = self.april.collect(step, version)
            for g in keep:
                self.buffer.put(g)
        else:
            step = self._new_step(cfg, sampling_params(cfg))
            train = self._generate_all(step)
        return self._finish(step, train, time.monotonic() - t0)

    def _new_step(self, cfg, params) -> StepRun:
        return StepRun(self.engine, self.tokenizer, self.select, self.scorer, cfg, params,
                       ledger=self.ledger, length_history=self.length_history)

    def _generate_all(self, step: StepRun) -> list[Group]:
        """The barrier step: every answer generated to its end; with dynamic sampling, more
        rounds until N groups have reward variance. The complete groups beyond N are dropped."""
        N, c = step.cfg.rollout.rollout_batch_size, step.counts
        step.start_new(max(N, self.next_batch or 0) if step.dynamic else N)
        c.rounds = 1
        while True:
            while self.engine.num_pending:
                step.advance()
            step.score_waiting()
            if (len(step.ready) >= N or not step.dynamic
                    or c.rounds >= step.cfg.rollout.max_sampling_rounds):
                break
            step.start_new(dynamic.round_size(N, len(step.ready), c.filtered_groups,
                                              len(step.scored)))
            c.rounds += 1
        step.ready.sort(key=lambda g: g.draw)
        step.drop("surplus", step.ready[N:])
        return step.ready[:N]

    def _finish(self, step: StepRun, train: list[Group], gen_seconds: float) -> RolloutResult:
        cfg, c = step.cfg, step.counts
        N = cfg.rollout.rollout_batch_size
        if step.dynamic:
            self.next_batch = dynamic.first_round_size(N, c.filtered_groups, len(step.scored))
        for g in step.scored:
            lens = g.lengths()
            self.length_history[g.problem.id] = sum(lens) / len(lens)
        m = {"rollout/groups_started": c.groups_started, "rollout/rounds": c.rounds,
             "rollout/effective_groups": len(step.ready),
             "rollout/discarded_tokens": c.discarded_tokens}
        if cfg.rollout.dynamic_sampling:
            m["rollout/filtered_groups"] = c.filtered_groups
        if cfg.april.enabled:
            m.update(self.april.metrics(c))
        return RolloutResult(groups=train, scored=step.scored, gen_seconds=gen_seconds, counts=c,
                             metrics=m, events=self._shortfall(step, len(train)))

    def _shortfall(self, step: StepRun, trained: int) -> list[tuple[str, dict]]:
        """A warning when a step trains fewer than N groups: once until the knobs change (the
        values that keep steps short would otherwise repeat it every step)."""
        cfg, c = step.cfg, step.counts
        N = cfg.rollout.rollout_batch_size
        if trained >= N or self.said_short:
            return []
        self.said_short = True
        why = [f"{c.rounds} of {cfg.rollout.max_sampling_rounds} rounds"]
        if c.filtered_groups:
            why.append(f"{c.filtered_groups} groups left out for equal rewards")
        if cfg.april.enabled and step.parked:
            why.append(f"{len(step.parked)} groups still unfinished at a segment limit of "
                       f"{self.april.segment_tokens} tokens")
        knobs = "rollout.max_sampling_rounds" + (" or april.segment_max_tokens"
                                                 if cfg.april.enabled else "")
        return [("warning", {
            "message": f"a step trained {trained} of {N} groups ({'; '.join(why)}); raising "
                       f"{knobs} lets a step complete more. Said once: later short steps are "
                       f"not reported again until the knobs change.",
            "trained_groups": trained, "rollout_batch_size": N, "rounds": c.rounds})]

    def set_config(self, cfg) -> None:
        self.said_short = False  # new knob values: a short step is news again

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
