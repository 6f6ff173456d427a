"""A run's invariants, each step: what the step trained, checked against the bounds in force.

    figures = watch.after_step(run, cfg, seqs, result, version)

From the objective's train sequences (each token's loss weight; a sequence is matched to its
sample by the response list it was built on) and the step's groups (draw, member index, each
token's policy version), the rules of trainer/invariants/rules.py at the bound in force after
the step's knob changes and schedule points (`bounds`). Returns the invariants/* figures (0 when
healthy) and the seconds the checks took (timing/invariants_s); each rule broken is an
`invariant_violated` event naming the rule, the step and the samples, and with
run.stop_on_violation a stop queued at the next boundary, saying why. The trained ids go into
checkpoints (`state_dict`), so a resumed run still sees a repeat.

After each weight sync (`after_sync`, called by the runner right after it) the probe of
trainer/invariants/probe.py: a fixed short sequence scored by every generator of the engine and
by the trainer (with LoRA also with its adapters off); a generator beyond the precision's band is
`weights_not_applied`, reported with the step's figures like a rule (an engine that cannot score
a sequence: one warning, and no probe figures: no claim).

The data accounting (trainer/invariants/draws.py) runs beside them: the data cursor, the
positions the step's groups were scored for, GRESO skipped or a driver dropped on purpose, and
those the driver still holds; a position lost is `prompts_skipped`, one handed out again
`prompts_repeated`, each an event like the rules'.
"""
from __future__ import annotations

import time

from trainer.algo.learner import TrainSequence
from trainer.engine import rollout_precision
from trainer.invariants import draws, probe, rules

STOPPED_BY = "invariants"   # requested_by of the stop run.stop_on_violation queues


def bounds(cfg, version: int) -> rules.Bounds:
    """The token-age bound in force at a step trained at policy `version` (`cfg`: the step's)."""
    if cfg.async_.enabled:
        return rules.Bounds(version, "beyond_eta", cfg.async_.max_staleness)
    if cfg.april.enabled:
        keeps_old = cfg.april.span_policy != "drop"   # "keep": old groups kept, weighted off-policy
        return rules.Bounds(version, "beyond_span", None if keeps_old else cfg.april.max_version_span)
    return rules.Bounds(version, "beyond_span", 0)   # synchronous: its own policy's tokens only


def trained_samples(seqs, groups) -> list[rules.TrainedSample]:
    """The trained samples: each train sequence's loss weights with its sample's versions."""
    where = {id(s.response_ids): (g.draw, k, s) for g in groups for k, s in enumerate(g.samples)}
    out = []
    for seq in seqs:
        found = where.get(id(seq.response_ids))
        if found is None:
            raise LookupError("a train sequence matches no sample of the step's groups "
                              "(the objective must build it on the sample's response list)")
        draw, k, s = found
        out.append(rules.TrainedSample(draw, k, tuple(s.versions), tuple(seq.weights)))
    return out


class InvariantWatch:
    def __init__(self):
        self.seen = rules.TrainedIds()
        self.draws = draws.DrawAccount()
        self.probe_ids: list[int] | None = None     # the probe sequence (built once)
        self.probe_off = False                      # the engine cannot score one
        self._probed: tuple[probe.Probe, float] | None = None   # the last sync's, not reported yet

    def after_sync(self, run, cfg) -> None:
        """The probe of the weights just sent (run.check_invariants off: none): every
        generator's log-probabilities of the probe sequence against the trainer's, reported by
        the next after_step."""
        if not cfg.run.check_invariants or self.probe_off:
            return
        t0 = time.monotonic()
        if self.probe_ids is None:
            self.probe_ids = probe.probe_tokens(run.tokenizer)
        try:
            engines = run.engine.probe_logprobs(self.probe_ids)
        except NotImplementedError as e:
            self.probe_off = True
            run.sink.event(run.step, "warning", {"message": f"the weight probe is off: {e}; "
                                                 "whether the engine samples with the weights "
                                                 "sent is not checked"})
            return
        seq = TrainSequence(self.probe_ids[:1], self.probe_ids[1:], [0.0] * (len(self.probe_ids) - 1),
                            0.0, 1.0)
        trainer = run._logprobs([seq])[0]
        base = run._logprobs([seq], reference=True)[0] if run.learner.adapted else None
        width = probe.band(rollout_precision(run.engine, cfg.rollout.dtype, run.dtype), run.dtype)
        self._probed = (probe.judge(engines, trainer, width, base), time.monotonic() - t0)

    def after_step(self, run, cfg, seqs, result, version: int) -> dict[str, float]:
        """The step's invariants/* figures (run.check_invariants off: none); events and the
        stop for what it broke (`run.step` is the step's number by now)."""
        if not cfg.run.check_invariants:
            return {}
        t0 = time.monotonic()
        limit = bounds(cfg, version)
        found = rules.check(run.step, trained_samples(seqs, result.groups), limit, self.seen)
        # a trained group was scored, in this step or before: an asynchronous group scored
        # between the last step and a checkpoint is reported scored by no step of the resumed run
        scored = [g.draw for g in result.scored] + [g.draw for g in result.groups]
        accounted = self.draws.step(run.prompts.cursor, scored,
                                    result.counts.greso_draws, result.counts.dropped_draws,
                                    run.rollout.held_draws())
        found += data_violations(run.step, accounted)
        probed, probe_s = self._probed or (None, 0.0)
        self._probed = None
        if probed is not None and probed.broken:
            found.append(rules.Violation(probe.RULE, run.step, list(probed.broken), probed.detail()))
        for v in found:
            run.sink.event(run.step, "invariant_violated", v.as_json())
        if found and cfg.run.stop_on_violation:
            first = found[0]
            run.boundary.request_stop({"rule": first.rule, "step": first.step, "count": first.count,
                                       "message": stop_reason(found)}, requested_by=STOPPED_BY)
        return {**rules.figures([v for v in found if v.rule in rules.RULES], limit),
                **accounted.figures(), **(probed.figures() if probed is not None else {}),
                "timing/invariants_s": time.monotonic() - t0 + probe_s,
                **({"timing/probe_s": probe_s} if probed is not None else {})}

    def state_dict(self) -> dict:
        return {**self.seen.state_dict(), "draws": self.draws.state_dict()}

    def load_state_dict(self, state: dict, cursor: int) -> None:
        """A checkpoint's (`cursor`: its data cursor; a checkpoint from before the checks: {})."""
        self.seen.load_state_dict(state or {})
        self.draws.load_state_dict((state or {}).get("draws", {}), cursor)


def data_violations(step: int, accounted: draws.DrawStep) -> list[rules.Violation]:
    """The data accounting's breaches as violations: positions lost, positions handed out again."""
    out = []
    if accounted.skipped:
        out.append(rules.Violation("prompts_skipped", step, [str(p) for p in accounted.skipped],
                                   "data-cursor positions drawn and lost: never scored, skipped by "
                                   "GRESO or dropped on purpose, and no longer held"))
    if accounted.repeated:
        out.append(rules.Violation("prompts_repeated", step, [str(p) for p in accounted.repeated],
                                   f"the data cursor moved back {len(accounted.repeated)} "
                                   "position(s): their prompts are drawn again"))
    return out


def stop_reason(found: list[rules.Violation]) -> str:
    """Why run.stop_on_violation stops the run, for a person."""
    broken = "; ".join(f"{v.rule} at step {v.step} ({v.count} sample(s): {v.detail})" for v in found)
    return f"run.stop_on_violation: an invariant was broken: {broken}"
