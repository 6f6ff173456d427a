"""APRIL: active partial rollouts, top to bottom.

A synchronous step waits for its longest answer. APRIL (as in THUDM/slime's
`--over-sampling-batch-size` / `--partial-rollout`) removes that wait:

1. Over-sample: keep N' >= N groups in flight, resumed partial groups first (oldest first),
   then new prompts.
2. Early termination: as soon as N groups are complete, abort every unfinished request. Each
   unfinished sample goes to the `PartialBuffer` with its tokens, logprobs and per-token policy
   versions, and continues (not restarts) in a later step. Groups that completed beyond N are
   kept whole for the next step.
3. Segments: a sample may generate at most `segment_max_tokens` per step before it is parked,
   so one very long answer cannot hold a step (`segment_auto` adapts the limit).
4. Version span: a buffered sample whose oldest token is more than `max_version_span` versions
   old is dropped (its prompt starts afresh) or kept with off-policy handling.
5. Off-policy tokens are weighted in the objective (`trainer/algo/objective.py`).

Invariants checked by tests, per step: submitted = completed + parked + dropped samples, and
every generated token ends up exactly once in a returned group, the buffer, or the discarded
count. The synchronous driver (`synchronous.py`) hands its step here while `april.enabled`.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict
from typing import Iterable

from trainer.engine.base import Sample, SamplingParams, reserve_request_ids
from trainer.greso import next_sampling_batch_size
from trainer.rollout.base import Group, RolloutResult, StepRun, new_group, sampling_params
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
        self.groups = deque()
        for d in state.get("groups", []):
            samples = []
            for sd in d["samples"]:
                params = SamplingParams(**sd.pop("params"))
                samples.append(Sample(params=params, **sd))
            self.groups.append(Group(problem=Problem(**d["problem"]), samples=samples,
                                     rewards=list(d["rewards"]), draw=d["draw"],
                                     raw_scores=list(d.get("raw_scores", []))))
        reserve_request_ids(max((s.request_id for s in self.samples()), default=-1))


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


def adjust_segment(current: int, idle_slot_frac: float, max_len: int) -> int:
    """segment_auto: more idle slots -> shorter segments (park long answers sooner so the step
    ends sooner); few idle slots -> longer segments (fewer resumptions)."""
    if idle_slot_frac > 0.3:
        return max(8, int(current * 0.8))
    if idle_slot_frac < 0.1:
        return min(max_len, int(math.ceil(current * 1.25)))
    return current


class AprilRollout:
    """APRIL's state across steps (the buffer and the segment limit) and its step."""

    def __init__(self):
        self.buffer = PartialBuffer()
        self.segment_tokens: int | None = None      # current segment limit (auto mode)

    def params(self, cfg) -> SamplingParams:
        if self.segment_tokens is None or not cfg.april.segment_auto:
            self.segment_tokens = segment_limit(cfg)
        return sampling_params(cfg, self.segment_tokens)

    def collect(self, driver, cfg, version: int) -> RolloutResult:
        """One step: buffer first, over-sample, stop at N complete groups, park the rest."""
        N, G = cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt
        step = StepRun(driver.engine, driver.tokenizer, driver.select, driver.scorer, cfg,
                       self.params(cfg))
        c = step.counts
        t0 = time.monotonic()
        # 1. the buffer first, oldest first
        budget = over_sampling(cfg)
        while self.buffer and step.in_hand() < budget:
            g = self.buffer.take()
            todo = g.unfinished
            span = max(version_span(s, version) for s in g.samples)
            if span > cfg.april.max_version_span and cfg.april.span_policy == "drop":
                c.submitted += len(todo)
                c.dropped += len(todo)
                c.span_dropped_groups += 1
                c.discarded_tokens += g.tokens()
                fresh = new_group(g.draw, g.problem, driver.tokenizer, G, step.params)
                c.groups_started += 1
                step.start(fresh, fresh.samples)
                continue
            if g.complete:  # finished beyond N in an earlier step; it keeps its rewards
                step.ready.append(g) if g.scored else step.waiting.append(g)
                continue
            step.start(g, todo)
        # 2. new prompts up to N' in flight
        order = None
        if cfg.april.admission == "short_first":
            order = lambda g: driver.length_history.get(g.problem.id, 0.0)  # noqa: E731
        step.start_new(max(budget - step.in_hand(), 0), order)
        c.rounds = 1
        # 3. generate until N groups are ready. Groups parked at their segment limit leave the
        # engine short of N' in hand: top up at once (as slime does), not only once it runs dry;
        # at most max_sampling_rounds x N' new groups a step, so a step whose every answer hits
        # the segment limit still ends
        top_up_limit = cfg.rollout.max_sampling_rounds * budget
        while True:
            if len(step.ready) + len(step.waiting) >= N:
                step.score_waiting()
                if len(step.ready) >= N:
                    break
            step.advance()
            short = budget - step.in_hand()
            if short > 0 and not step.dynamic and c.groups_started + short <= top_up_limit:
                step.start_new(short, order)
                c.top_ups += 1
            if driver.engine.num_pending:
                continue
            step.score_waiting()
            if len(step.ready) >= N or c.rounds >= cfg.rollout.max_sampling_rounds:
                break
            if step.dynamic:  # dropped groups don't count towards N
                observed = c.filtered_groups / max(len(step.scored), 1)
                more = next_sampling_batch_size(N - len(step.ready), observed, 1, 8 * N)
            else:  # everything left is parked: top up to N
                more = N - len(step.ready)
            step.start_new(more, order)
            c.rounds += 1
        gen_seconds = time.monotonic() - t0
        step.score_waiting()
        # 4. early termination: park everything unfinished, keep surplus complete groups
        # (their KV cache stays parked in the engine: resuming them next step needs no prefill)
        for s in driver.engine.abort(keep_cache=True):
            c.aborted_tokens += s.segment_tokens
            g = step.owner[s.request_id]
            if id(g) in step.active:
                del step.active[id(g)]
                step.parked.append(g)
        step.ready.sort(key=lambda g: g.draw)
        train, surplus = step.ready[:N], step.ready[N:]
        c.parked = sum(len(g.unfinished) for g in step.parked)
        for g in surplus + step.parked:
            self.buffer.put(g)
        driver.finish_step(cfg, step)
        metrics = {"april/buffer_size": len(self.buffer),
                   "april/buffer_samples": sum(1 for _ in self.buffer.samples()),
                   "april/buffer_tokens": self.buffer.tokens(),
                   "april/submitted": c.submitted, "april/completed": c.completed,
                   "april/parked": c.parked, "april/dropped": c.dropped,
                   "april/aborted_tokens": c.aborted_tokens,
                   "april/span_dropped_groups": c.span_dropped_groups,
                   "april/segment_max_tokens": self.segment_tokens or 0,
                   "april/top_ups": c.top_ups}
        return driver.result(cfg, step, train, gen_seconds, metrics)

    def after_step(self, cfg, idle_slot_frac: float) -> None:
        """segment_auto: adapt the segment limit to how busy the engine was."""
        if cfg.april.segment_auto and self.segment_tokens:
            self.segment_tokens = adjust_segment(self.segment_tokens, idle_slot_frac,
                                                 cfg.rollout.max_response_len)


def report(result: RolloutResult, version: int, hist, buffer: PartialBuffer | None) -> dict:
    """APRIL's off-policy share and histograms of a step (`version`: the policy after it)."""
    old = sum(1 for g in result.groups for s in g.samples for v in s.versions if v < version - 1)
    total = sum(len(s.response_ids) for g in result.groups for s in g.samples)
    spans = [max(s.versions) - min(s.versions) for g in result.groups for s in g.samples
             if s.versions]
    edges = [float(i) for i in range(0, 12)]
    hist("april/version_span", spans, edges)
    if buffer is not None:  # asynchronous: no buffer, partial samples stay in flight
        hist("april/buffer_age", buffer.ages(version), edges)
    return {"april/offpolicy_token_ratio": old / max(total, 1)}
