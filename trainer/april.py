"""APRIL: active partial rollouts, in one place.

A synchronous step waits for its longest answer. APRIL (as in THUDM/slime's
`--over-sampling-batch-size` / `--partial-rollout`) removes that wait:

1. Over-sample: keep N' >= N groups in flight, resumed partial groups first (oldest first),
   then new prompts.
2. Early termination: as soon as N groups are complete, abort every unfinished request. Each
   unfinished sample goes to the `PartialBuffer` with its tokens, logprobs and per-token policy
   versions, and continues (not restarts) in a later step. Groups that completed beyond N are
   kept whole for the next step.
3. Segments: a sample may generate at most `segment_max_tokens` per step before it is parked,
   so one very long answer cannot hold a step.
4. Version span: a buffered sample whose oldest token is more than `max_version_span` versions
   old is dropped (its prompt starts afresh) or kept with off-policy handling.
5. Off-policy handling of tokens from older versions (`token_weights`): train as they are,
   mask them out, or truncated importance sampling against the current policy, optionally with
   a decay weight lambda^age.

The step loop that drives the engine lives in trainer/rollout.py; this module holds the
buffer, its checkpoint format and the per-token weighting.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict
from typing import Iterable

from trainer.engine.base import Sample, SamplingParams
from trainer.tasks.base import Problem


class PartialBuffer:
    """Groups carried over between steps, oldest first. A group here is either complete
    (finished beyond N in an earlier step: it keeps its rewards) or partial."""

    def __init__(self):
        self.groups: deque = deque()

    def __len__(self) -> int:
        return len(self.groups)

    def put(self, group) -> None:
        self.groups.append(group)

    def take(self):
        return self.groups.popleft()

    def samples(self) -> Iterable[Sample]:
        return (s for g in self.groups for s in g.samples)

    def tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples())

    def ages(self, version: int) -> list[int]:
        """Versions behind `version` of each buffered sample's oldest token."""
        return [version - min(s.versions) for s in self.samples() if s.versions]

    # --- checkpoint format: plain data, loadable without pickling classes -----------------------
    def state_dict(self) -> dict:
        return {"groups": [_group_to_dict(g) for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        from trainer.rollout import Group

        self.groups = deque()
        for d in state.get("groups", []):
            samples = []
            for sd in d["samples"]:
                params = SamplingParams(**sd.pop("params"))
                samples.append(Sample(params=params, **sd))
            self.groups.append(Group(problem=Problem(**d["problem"]), samples=samples,
                                     rewards=list(d["rewards"]), draw=d["draw"],
                                     raw_scores=list(d.get("raw_scores", []))))


def _group_to_dict(g) -> dict:
    return {"problem": asdict(g.problem), "rewards": list(g.rewards), "draw": g.draw,
            "raw_scores": list(g.raw_scores),
            "samples": [{"prompt_ids": s.prompt_ids, "params": asdict(s.params),
                         "response_ids": s.response_ids, "logprobs": s.logprobs,
                         "versions": s.versions, "finish_reason": s.finish_reason,
                         "request_id": s.request_id, "meta": s.meta} for s in g.samples]}


def version_span(sample: Sample, version: int) -> int:
    """How many versions old the sample's oldest token is (0 for no tokens)."""
    return version - min(sample.versions) if sample.versions else 0


def segment_limit(cfg) -> int:
    """The per-step token limit of one sample (0 in the config = half the response limit)."""
    return cfg.april.segment_max_tokens or max(1, cfg.rollout.max_response_len // 2)


def over_sampling(cfg) -> int:
    return cfg.april.over_sampling_batch_size or 2 * cfg.rollout.rollout_batch_size


def token_weights(versions: list[int], version: int, behaviour_logp: list[float],
                  current_logp: list[float] | None, *, mode: str, cap: float,
                  decay: float) -> tuple[list[float], list[float]]:
    """Loss weights and the logprobs to use as pi_old for one sample's tokens.

    `version` is the policy being updated; a token's age is version - its version.
    - as_is: weight 1, pi_old = behaviour logprob.
    - mask:  weight 0 on tokens with age > 0.
    - tis:   pi_old = current policy logprob (needs `current_logp`), and tokens with age > 0
             weighted by min(pi_current / pi_behaviour, cap) (truncated importance sampling).
    Then every token is multiplied by decay ** age.
    """
    weights, old = [], []
    for i, v in enumerate(versions):
        age = version - v
        w = 1.0
        if age > 0 and mode == "mask":
            w = 0.0
        if mode == "tis":
            if current_logp is None:
                raise ValueError("offpolicy='tis' needs the current policy's logprobs")
            if age > 0:
                w = min(math.exp(current_logp[i] - behaviour_logp[i]), cap)
            old.append(current_logp[i])
        else:
            old.append(behaviour_logp[i])
        weights.append(w * decay ** max(age, 0))
    return weights, old


def adjust_segment(current: int, idle_slot_frac: float, max_len: int) -> int:
    """segment_auto: more idle slots -> shorter segments (park long answers sooner so the step
    ends sooner); few idle slots -> longer segments (fewer resumptions)."""
    if idle_slot_frac > 0.3:
        return max(8, int(current * 0.8))
    if idle_slot_frac < 0.1:
        return min(max_len, int(math.ceil(current * 1.25)))
    return current
