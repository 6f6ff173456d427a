"""Rollout: turning prompts into scored groups of responses, one training step at a time.

`Rollout.collect()` runs one step's generation in every synchronous mode:

- baseline: draw N prompts, generate G answers each with continuous batching, return when the
  last answer is done (the barrier at the end of the step that APRIL removes);
- APRIL (trainer/april.py): N' groups in flight, resumed partial groups first; stop as soon as
  N groups are complete and park the rest;
- dynamic sampling (DAPO): zero-variance groups are dropped and more prompts are drawn until N
  effective groups are ready, the next draw sized from the observed zero-variance ratio;
- GRESO (trainer/greso.py): prompts are pre-filtered by their reward history before any
  generation.

Invariants checked by tests, per step: submitted = completed + parked + dropped samples, and
every generated token ends up exactly once in a returned group, the buffer, or the discarded
count.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from trainer import april as april_mod
from trainer.engine.base import RolloutEngine, Sample, SamplingParams
from trainer.greso import next_sampling_batch_size
from trainer.tasks.base import Problem, Task


@dataclass
class Group:
    problem: Problem
    samples: list[Sample]
    rewards: list[float] = field(default_factory=list)  # what the loss uses (with penalties)
    draw: int = 0  # index of the draw that produced it (data cursor position)
    raw_scores: list[float] = field(default_factory=list)  # the verifier's scores alone

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def scored(self) -> bool:
        return len(self.rewards) == len(self.samples)

    @property
    def zero_variance(self) -> bool:
        return len(set(self.rewards)) <= 1

    @property
    def unfinished(self) -> list[Sample]:
        return [s for s in self.samples if not s.done]

    def tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)


class PromptSource:
    """Hands out training problems in order; the cursor is the only state (checkpointed)."""

    def __init__(self, task: Task, cursor: int = 0):
        self.task, self.cursor = task, cursor

    def next(self) -> tuple[int, Problem]:
        draw = self.cursor
        self.cursor += 1
        return draw, self.task.train_problem(draw)


def new_group(draw: int, problem: Problem, tokenizer, n: int, params: SamplingParams) -> Group:
    prompt_ids = tokenizer(problem.prompt).input_ids
    samples = [Sample(list(prompt_ids), params, meta={"draw": draw, "index": k})
               for k in range(n)]
    return Group(problem=problem, samples=samples, draw=draw)


@dataclass
class StepCounts:
    """Sample accounting of one step (see the invariant in the module docstring)."""
    submitted: int = 0
    completed: int = 0
    parked: int = 0
    dropped: int = 0
    aborted_tokens: int = 0     # tokens of samples parked at early termination
    discarded_tokens: int = 0   # generated tokens thrown away (span drops, surplus groups)
    filtered_groups: int = 0    # complete groups dropped by dynamic sampling (zero variance)
    span_dropped_groups: int = 0
    groups_started: int = 0     # new prompts rolled out
    skipped_easy: int = 0       # GRESO
    skipped_hard: int = 0
    rounds: int = 0


@dataclass
class RolloutResult:
    groups: list[Group]               # complete, scored, to train on (at most N)
    scored: list[Group]               # every group scored this step (for reward metrics)
    gen_seconds: float
    counts: StepCounts
    metrics: dict[str, float] = field(default_factory=dict)


class Rollout:
    """`scorer(groups)` fills `group.rewards` for complete groups. `selector(cfg)`, when given,
    returns the next (draw, problem) to roll out and may skip prompts (GRESO)."""

    def __init__(self, engine: RolloutEngine, tokenizer, prompts: PromptSource,
                 scorer: Callable[[list[Group]], None],
                 selector: Callable | None = None):
        self.engine, self.tokenizer, self.prompts = engine, tokenizer, prompts
        self.scorer = scorer
        self.selector = selector
        self.buffer = april_mod.PartialBuffer()
        self.length_history: dict[str, float] = {}  # problem id -> mean response length
        self.segment_tokens: int | None = None      # current APRIL segment limit (auto mode)
        self.next_batch: int | None = None          # dynamic sampling's next draw size

    # --- the step ----------------------------------------------------------------------------------
    def collect(self, cfg, version: int) -> RolloutResult:
        N, G = cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt
        use_april = cfg.april.enabled
        dynamic = cfg.rollout.dynamic_sampling
        params = self._params(cfg)
        counts = StepCounts()
        ready: list[Group] = []       # complete, scored, kept
        scored: list[Group] = []
        waiting: list[Group] = []     # complete, not yet scored
        active: dict[int, Group] = {}  # id(group) -> group with samples in the engine
        parked: list[Group] = []      # groups with samples stopped at the segment limit
        owner: dict[int, Group] = {}  # request id -> group

        def start(group: Group, samples: list[Sample]) -> None:
            for s in samples:
                s.params = params if not s.response_ids else _continue_params(s.params, params)
                owner[s.request_id] = group
            active[id(group)] = group
            counts.submitted += len(samples)
            self.engine.submit(samples)

        def score_waiting() -> None:
            if not waiting:
                return
            self.scorer(waiting)
            for g in waiting:
                scored.append(g)
                if dynamic and g.zero_variance:
                    counts.filtered_groups += 1
                    counts.discarded_tokens += g.tokens()
                else:
                    ready.append(g)
            waiting.clear()

        t0 = time.monotonic()
        # 1. the APRIL buffer first, oldest first
        budget = april_mod.over_sampling(cfg) if use_april else N
        if use_april:
            while self.buffer and len(ready) + len(active) + len(waiting) < budget:
                g = self.buffer.take()
                todo = g.unfinished
                span = max(april_mod.version_span(s, version) for s in g.samples)
                if span > cfg.april.max_version_span and cfg.april.span_policy == "drop":
                    counts.submitted += len(todo)
                    counts.dropped += len(todo)
                    counts.span_dropped_groups += 1
                    counts.discarded_tokens += g.tokens()
                    fresh = new_group(g.draw, g.problem, self.tokenizer, G, params)
                    counts.groups_started += 1
                    start(fresh, fresh.samples)
                    continue
                if g.complete:  # finished beyond N in an earlier step; it keeps its rewards
                    ready.append(g) if g.scored else waiting.append(g)
                    continue
                start(g, todo)
        # 2. new prompts
        first_draw = budget - len(ready) - len(active) - len(waiting)
        if dynamic and not use_april and self.next_batch:
            first_draw = max(first_draw, self.next_batch)
        self._start_new(cfg, max(first_draw, 0), params, start, counts)
        counts.rounds = 1

        # 3. generate until N groups are ready (APRIL) or everything is done
        while True:
            if use_april and len(ready) + len(waiting) >= N:
                score_waiting()
                if len(ready) >= N:
                    break
            for s in self.engine.step():
                g = owner[s.request_id]
                if s.done:
                    counts.completed += 1
                if all(x.finish_reason is not None for x in g.samples) and id(g) in active:
                    del active[id(g)]
                    if g.complete:
                        waiting.append(g)
                    else:  # some samples stopped at their segment limit
                        parked.append(g)
            if self.engine.num_pending:
                continue
            # the engine is idle: score, then maybe roll out more (dynamic sampling / top-up)
            score_waiting()
            if len(ready) >= N or not dynamic and not use_april:
                break
            if counts.rounds >= cfg.rollout.max_sampling_rounds:
                break
            if dynamic:
                observed = counts.filtered_groups / max(len(scored), 1)
                more = next_sampling_batch_size(N - len(ready), observed, 1, 8 * N)
            else:  # APRIL alone: everything left is parked; top up to N
                more = N - len(ready)
            self._start_new(cfg, more, params, start, counts)
            counts.rounds += 1
        gen_seconds = time.monotonic() - t0
        score_waiting()

        # 4. early termination: park everything unfinished (APRIL), keep surplus complete groups
        # (their KV cache stays parked in the engine: resuming them next step needs no prefill)
        for s in self.engine.abort(keep_cache=True):
            counts.aborted_tokens += s.segment_tokens
            g = owner[s.request_id]
            if id(g) in active:
                del active[id(g)]
                parked.append(g)
        ready.sort(key=lambda g: g.draw)
        train, surplus = ready[:N], ready[N:]
        counts.parked = sum(len(g.unfinished) for g in parked)
        if use_april:
            for g in surplus + parked:
                self.buffer.put(g)
        else:
            for g in surplus + parked:
                counts.discarded_tokens += g.tokens()
        if dynamic:
            ratio = counts.filtered_groups / max(len(scored), 1)
            self.next_batch = next_sampling_batch_size(N, ratio, N, 8 * N)
        for g in scored:
            lens = [len(s.response_ids) for s in g.samples]
            self.length_history[g.problem.id] = sum(lens) / len(lens)
        return RolloutResult(groups=train, scored=scored, gen_seconds=gen_seconds, counts=counts,
                             metrics=self._metrics(cfg, counts, version, len(ready)))

    # --- helpers -------------------------------------------------------------------------------
    def _params(self, cfg) -> SamplingParams:
        r = cfg.rollout
        segment = None
        if cfg.april.enabled:
            if self.segment_tokens is None or not cfg.april.segment_auto:
                self.segment_tokens = april_mod.segment_limit(cfg)
            segment = self.segment_tokens
        return SamplingParams(temperature=r.temperature, top_p=r.top_p,
                              max_new_tokens=r.max_response_len, segment_max_tokens=segment)

    def _start_new(self, cfg, n: int, params, start, counts: StepCounts) -> None:
        G = cfg.rollout.n_samples_per_prompt
        groups = []
        for _ in range(n):
            draw, problem = self.selector(cfg, counts) if self.selector else self.prompts.next()
            groups.append(new_group(draw, problem, self.tokenizer, G, params))
        if cfg.april.enabled and cfg.april.admission == "short_first":
            groups.sort(key=lambda g: self.length_history.get(g.problem.id, 0.0))
        for g in groups:
            counts.groups_started += 1
            start(g, g.samples)

    def after_step(self, cfg, idle_slot_frac: float) -> None:
        """segment_auto: adapt the segment limit to how busy the engine was."""
        if cfg.april.enabled and cfg.april.segment_auto and self.segment_tokens:
            self.segment_tokens = april_mod.adjust_segment(self.segment_tokens, idle_slot_frac,
                                                           cfg.rollout.max_response_len)

    def _metrics(self, cfg, c: StepCounts, version: int, n_ready: int) -> dict[str, float]:
        m = {"rollout/groups_started": c.groups_started, "rollout/rounds": c.rounds,
             "rollout/effective_groups": n_ready}
        if cfg.april.enabled:
            m.update({"april/buffer_size": len(self.buffer),
                      "april/buffer_samples": sum(1 for _ in self.buffer.samples()),
                      "april/buffer_tokens": self.buffer.tokens(),
                      "april/submitted": c.submitted, "april/completed": c.completed,
                      "april/parked": c.parked, "april/dropped": c.dropped,
                      "april/aborted_tokens": c.aborted_tokens,
                      "april/span_dropped_groups": c.span_dropped_groups,
                      "april/segment_max_tokens": self.segment_tokens or 0})
        if cfg.rollout.dynamic_sampling:
            m["rollout/filtered_groups"] = c.filtered_groups
        m["rollout/discarded_tokens"] = c.discarded_tokens
        return m

    def state_dict(self) -> dict:
        return {"buffer": self.buffer.state_dict(), "length_history": self.length_history,
                "segment_tokens": self.segment_tokens, "next_batch": self.next_batch}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.buffer.load_state_dict(state.get("buffer", {}))
        self.length_history = dict(state.get("length_history", {}))
        self.segment_tokens = state.get("segment_tokens")
        self.next_batch = state.get("next_batch")


def _continue_params(old: SamplingParams, new: SamplingParams) -> SamplingParams:
    """A resumed sample keeps its sampling distribution (its earlier tokens' logprobs were
    taken under it) and its budget; only the per-step segment limit is the current one."""
    return SamplingParams(temperature=old.temperature, top_p=old.top_p,
                          max_new_tokens=old.max_new_tokens,
                          segment_max_tokens=new.segment_max_tokens)
