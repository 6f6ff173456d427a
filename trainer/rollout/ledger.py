"""Where every generated token goes.

Every token the engine generates for a rollout (evaluations excluded) ends in exactly one place:

    generated = trained + waiting + Σ dropped[reason]

    trained        in a sequence the loss saw
    waiting        held for a later step: APRIL's buffer, the asynchronous queue, samples still
                   generating (the one part not counted directly: it is what is left)
    version_span   APRIL: a buffered sample older than `april.max_version_span`, restarted
    stale          asynchronous: a queued group older than η when the trainer took it
    zero_variance  a complete group with equal rewards left out (dynamic sampling,
                   `algo.skip_zero_adv`)
    surplus        complete groups beyond what any step will take (dynamic sampling's extra
                   groups, APRIL's buffer shrunk to its bound after a knob change)
    aborted        samples aborted and not kept
    mismatch       tokens the rollout correction masked out of the loss (`mismatch.correction`
                   mask or band: the engine's and the trainer's probabilities too far apart)
    agent_timeout  an agent's episode that neither called again nor was rewarded in
                   `episode.agent_timeout_s`, or was still open when the run ended

`generated` comes from the engine's own counter, so "waiting" is checkable: wherever nothing is
left inside the engine (a synchronous step boundary, a stopped asynchronous run), it must equal
the tokens the driver holds (`Driver.held_tokens`). Tests check that in every mode.
"""
from __future__ import annotations

REASONS = ("version_span", "stale", "zero_variance", "surplus", "aborted", "mismatch",
           "agent_timeout")


class TokenLedger:
    def __init__(self):
        self.generated = 0
        self.trained = 0
        self.dropped = dict.fromkeys(REASONS, 0)
        self._engine_seen: int | None = None   # the engine counter at the last observation
        self._last = self._snapshot()           # totals at the last step's report

    # --- counting -----------------------------------------------------------------------------------
    def observe_engine(self, rollout_tokens: int) -> None:
        """The engine's counter of rollout tokens (its total minus evaluations'); the first call
        after a start or resume only sets the baseline (a restarted engine counts from 0)."""
        if self._engine_seen is not None:
            self.generated += max(rollout_tokens - self._engine_seen, 0)
        self._engine_seen = rollout_tokens

    def train(self, tokens: int) -> None:
        self.trained += tokens

    def drop(self, reason: str, tokens: int) -> None:
        if reason not in self.dropped:
            raise ValueError(f"unknown reason for dropped tokens {reason!r}; "
                             f"expected one of {', '.join(REASONS)}")
        self.dropped[reason] += tokens

    @property
    def waiting(self) -> int:
        return self.generated - self.trained - sum(self.dropped.values())

    # --- metrics ------------------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, int]:
        return {"generated": self.generated, "trained": self.trained, **self.dropped}

    def step_metrics(self) -> dict[str, float]:
        """This step's parts (`rollout/waste/<reason>` in tokens), the level waiting now, and the
        run's totals. generated = trained + Δwaiting + Σ waste, step by step."""
        now, last = self._snapshot(), self._last
        self._last = now
        d = {k: now[k] - last[k] for k in now}
        m = {"rollout/tokens/generated": d["generated"], "rollout/tokens/trained": d["trained"],
             "rollout/tokens/waiting": self.waiting,
             "rollout/tokens/generated_total": self.generated,
             "rollout/tokens/trained_total": self.trained}
        for r in REASONS:
            m[f"rollout/waste/{r}"] = d[r]
        wasted = sum(self.dropped.values())
        m["rollout/waste/total"] = sum(d[r] for r in REASONS)
        m["rollout/waste/share_total"] = wasted / self.generated if self.generated else 0.0
        return m

    # --- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"generated": self.generated, "trained": self.trained, "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict) -> None:
        self.generated = int(state.get("generated", 0))
        self.trained = int(state.get("trained", 0))
        for r in REASONS:
            self.dropped[r] = int(state.get("dropped", {}).get(r, 0))
        self._engine_seen = None
        self._last = self._snapshot()
