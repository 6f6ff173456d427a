"""APRIL: active partial rollouts, top to bottom.

A synchronous step waits for its longest answer. APRIL (as in THUDM/slime's
`--over-sampling-batch-size` / `--partial-rollout`) removes that wait. One step
(`AprilRollout.collect`):

1. The buffer first: every group left in the `PartialBuffer` is resumed (oldest first) before
   any new prompt is drawn; complete ones (finished beyond N earlier) keep their rewards.
2. Over-sample: new prompts enter only while the groups held for later steps — the buffer, the
   groups in flight (generating, or parked at the segment limit) and the complete groups beyond
   N — number fewer than N'. When a group completes (or dynamic sampling filters it) its place
   is topped up at once, buffer first. So the buffer never holds more than N' groups.
3. Segments and rounds: a sample generates at most `segment_max_tokens` before it parks and
   yields its slot. When the engine runs dry with fewer than N complete groups, the next round
   gives every parked group another segment, at most `max_sampling_rounds` rounds a step — once
   the step has a group to train: while it has none and groups are parked, rounds go on (a step
   never ends empty while progress is possible).
4. Early termination: as soon as N groups are complete, every unfinished request is aborted;
   its samples keep their tokens, logprobs and per-token policy versions and continue (never
   restart) next step. A step whose rounds end with fewer than N trains what it has.
5. Version span and the last chance (`span_policy = "drop"`). Every token carries the version
   that generated it and the weights change once a step, so a group's span (current version
   minus its oldest token's) grows by one each step it waits, whatever the segment limit; one
   that would start a step with span > `max_version_span` is dropped (its prompt starts afresh),
   complete or partial: a group complete beyond N ages in the buffer like any other.
   With segment s and response length L a sample needs ceil(L / s) segments, at most
   `max_sampling_rounds` a step: at a short s a long answer cannot finish within the span, and
   every token it got would be generated only to be dropped. So a group whose span reaches
   `max_version_span` (one more step would drop it) gets its last chance: its samples run
   unsegmented to their end this step, and early termination spares those among the N oldest
   prompts at their last chance (`spared_groups`; the step waits for them), which the step
   trains first. The others at their last chance cannot be trained within the span: they are
   dropped next step. At max_version_span = 0 every group is at its last chance from its first
   token: no partial rollouts, only over-sampling (what a step does not train is dropped).
   `span_policy = "keep"` keeps old groups with off-policy handling (weights in
   `trainer/algo/objective.py`).
6. A lower N' (a knob change) leaves the buffer over its bound: the step drops the newest
   groups beyond N' before resuming the rest.

`collect` returns what to train and what to keep; the synchronous driver (`synchronous.py`)
puts the kept groups in the buffer and finishes the step. Every generated token ends up in a
trained group, the buffer, or the token ledger's dropped count under its reason
(`ledger.py`); tests check that and submitted = completed + parked + dropped samples, per step.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, replace
from typing import Callable, Iterable

from trainer.engine.base import Sample, SamplingParams, reserve_request_ids
from trainer.episode.environments import offered_tools
from trainer.rollout.base import Group, RolloutResult, StepCounts, StepRun, new_group, sampling_params
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
        return sum(s.model_tokens for s in self.samples())

    def ages(self, version: int) -> list[int]:
        """Versions behind `version` of each buffered sample's oldest token."""
        return [version - min(s.policy_versions) for s in self.samples() if s.policy_versions]

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
            problem = dict(d["problem"])
            if problem.get("tools") is not None:   # a JSON list in the checkpoint
                problem["tools"] = tuple(problem["tools"])
            self.groups.append(Group(problem=Problem(**problem), samples=samples,
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


def resume_kv_note(cfg) -> str:
    """What a resumed run's event says about the KV cache (a checkpoint holds none)."""
    if cfg.engine.kv_on_update == "keep":
        return ("not checkpointed: parked samples are prefilled again under the resumed weights "
                "(engine.kv_on_update = keep: the run would have gone on from caches the "
                "earlier weights computed, so their next tokens may differ)")
    return ("not checkpointed: parked samples are prefilled again under the resumed weights, "
            "as engine.kv_on_update = recompute does at every update (exact)")


def version_span(sample: Sample, version: int) -> int:
    """How many versions old the sample's oldest token is (0 for no tokens)."""
    return sample.age(version)


def last_chance(group: Group, version: int, max_version_span: int, span_policy: str) -> bool:
    """Whether one more step would drop `group` for its span: its last chance to finish is this
    step (only under span_policy "drop"; a group with no token yet has span 0)."""
    if span_policy != "drop":
        return False
    return max((version_span(s, version) for s in group.samples), default=0) >= max_version_span


def spared_groups(step: StepRun, batch: int, version: int, max_version_span: int,
                  span_policy: str) -> list[Group]:
    """The unfinished groups early termination spares: those among the `batch` oldest prompts
    at their last chance, complete or not (the step trains those first, so a long answer is not
    passed over for good by shorter ones)."""
    held = [*step.ready, *step.waiting, *step.active.values()]
    oldest = sorted((g for g in held if last_chance(g, version, max_version_span, span_policy)),
                    key=lambda g: g.draw)[:batch]
    return [g for g in oldest if id(g) in step.active]


def segment_limit(cfg) -> int:
    """The most tokens one sample generates in a round (0 in the config = half the response
    limit)."""
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


def admission_order(cfg, length_history: dict[str, float]) -> Callable | None:
    """short_first: new prompts shortest historical response first; else the data order."""
    if cfg.april.admission != "short_first":
        return None
    return lambda g: length_history.get(g.problem.id, 0.0)


class AprilRollout:
    """APRIL's state across steps (the buffer and the segment limit) and its step."""

    def __init__(self):
        self.buffer = PartialBuffer()
        self.segment_tokens: int | None = None      # current segment limit (auto mode)

    def params(self, cfg) -> SamplingParams:
        if self.segment_tokens is None or not cfg.april.segment_auto:
            self.segment_tokens = segment_limit(cfg)
        if cfg.april.max_version_span == 0 and cfg.april.span_policy == "drop":
            return sampling_params(cfg)  # every group is at its last chance: no segments
        return sampling_params(cfg, self.segment_tokens)

    def collect(self, step: StepRun, version: int) -> tuple[list[Group], list[Group]]:
        """One step: (at most N complete groups to train, oldest draw first; the groups to keep
        for the next step, at most N'). The buffer is empty afterwards: the caller keeps."""
        cfg, c = step.cfg, step.counts
        N, budget = cfg.rollout.rollout_batch_size, over_sampling(cfg)
        self._shrink(step, budget)
        order = admission_order(cfg, step.length_history)
        # new prompts a step may start, so that a step whose groups are all filtered still ends
        new_limit = cfg.rollout.max_sampling_rounds * budget

        def top_up(mid_step: bool = True) -> None:
            while self.buffer:  # the buffer first, oldest first
                self._resume(step, self.buffer.take(), version)
            room = min(budget - self._held(step, N), new_limit - c.groups_started)
            if room > 0:
                c.top_ups += mid_step
                step.start_new(room, order)

        c.rounds = 1
        top_up(mid_step=False)
        while True:
            if step.engine.num_pending:
                step.advance()
                top_up()
                if step.complete() < N:
                    continue
            step.score_waiting()
            if len(step.ready) >= N:
                break
            top_up()  # groups dynamic sampling filtered free their places
            if step.engine.num_pending:
                continue
            # the engine ran dry: every group in hand is complete or parked at its segment limit.
            # The round limit ends a step that has something to train; an empty one goes on
            if not step.parked or (c.rounds >= cfg.rollout.max_sampling_rounds and step.ready):
                break
            c.rounds += 1
            step.resume_parked()
        # early termination: park everything unfinished in the buffer, except the groups at
        # their last chance (parked, they would be dropped next step) that this step can still
        # train: the step waits for those. A last-chance group beyond the N this step trains
        # would be dropped next step complete or not, so it is not waited for. The KV cache:
        # `engine.kv_on_update = keep` parks it in the engine (computed by this version's
        # weights, it carries the history into the next; only new tokens run under the new
        # weights), `recompute` gives it up (the sample is prefilled again under the next
        # weights: exact, and what a run resumed from a checkpoint, which holds no cache, does)
        span, policy = cfg.april.max_version_span, cfg.april.span_policy
        spared = {s.request_id for g in spared_groups(step, N, version, span, policy)
                  for s in g.samples}
        doomed = None if not spared else [rid for rid in step.owner if rid not in spared]
        for s in step.engine.abort(doomed, keep_cache=cfg.engine.kv_on_update == "keep"):
            c.aborted_tokens += s.segment_tokens
            g = step.owner[s.request_id]
            if id(g) in step.active:
                del step.active[id(g)]
                step.parked.append(g)
        # the spared groups finish now; an engine in other processes may also have filed finished
        # samples while it answered the abort: hand them out, or a group they complete would be
        # neither trained nor kept
        while step.engine.num_pending:
            step.advance()
        step.score_waiting()
        c.parked = sum(len(g.unfinished) for g in step.parked)
        # the groups one more step would drop for their span first (kept, they could not be
        # trained), then the oldest prompt first
        step.ready.sort(key=lambda g: (not last_chance(g, version, span, policy), g.draw))
        # oldest prompt first: the order the next step resumes them in, and shrinks them from
        keep = sorted(step.ready[N:] + step.parked, key=lambda g: g.draw)
        return step.ready[:N], keep

    def _held(self, step: StepRun, batch: int) -> int:
        """Groups held for later steps: buffered, in flight, and complete beyond the batch."""
        return (len(self.buffer) + len(step.active) + len(step.parked)
                + max(step.complete() - batch, 0))

    def _shrink(self, step: StepRun, bound: int) -> None:
        """Keep the oldest `bound` groups; the newest beyond it are dropped, their tokens counted."""
        surplus = []
        while len(self.buffer) > bound:
            surplus.append(self.buffer.groups.pop())
        step.drop("surplus", surplus)

    def _resume(self, step: StepRun, g: Group, version: int) -> None:
        """Carry a buffered group on: train it if complete, continue it, or restart its prompt
        when its oldest token is older than the version span allows."""
        cfg, c = step.cfg, step.counts
        todo = g.unfinished
        span = max(version_span(s, version) for s in g.samples)
        if span > cfg.april.max_version_span and cfg.april.span_policy == "drop":
            # complete or not: a group finished beyond N in an earlier step ages as a partial one
            # does, and is not trained past the span either
            c.submitted += len(todo)
            c.dropped += len(todo)
            c.span_dropped_groups += 1
            step.drop("version_span", [g])
            fresh = new_group(g.draw, g.problem, step.tokenizer, cfg.rollout.n_samples_per_prompt,
                              step.params, offered_tools(cfg))
            c.groups_started += 1
            step.start(fresh, fresh.samples)
            return
        if g.complete:  # finished beyond N in an earlier step, within the span: keeps its rewards
            step.ready.append(g) if g.scored else step.waiting.append(g)
            return
        if last_chance(g, version, cfg.april.max_version_span, cfg.april.span_policy):
            # one more step would drop it: its samples run to their end, unsegmented
            c.last_chance_groups += 1
            step.start(g, todo, replace(step.params, segment_max_tokens=None))
            return
        step.start(g, todo)

    def after_step(self, cfg, idle_slot_frac: float) -> None:
        """segment_auto: adapt the segment limit to how busy the engine was."""
        if cfg.april.segment_auto and self.segment_tokens:
            self.segment_tokens = adjust_segment(self.segment_tokens, idle_slot_frac,
                                                 cfg.rollout.max_response_len)

    def metrics(self, c: StepCounts) -> dict[str, float]:
        """The step's APRIL counts and the buffer it leaves (after the kept groups went in)."""
        return {"april/buffer_size": len(self.buffer),
                "april/buffer_samples": sum(1 for _ in self.buffer.samples()),
                "april/buffer_tokens": self.buffer.tokens(),
                "april/submitted": c.submitted, "april/completed": c.completed,
                "april/parked": c.parked, "april/dropped": c.dropped,
                "april/aborted_tokens": c.aborted_tokens,
                "april/span_dropped_groups": c.span_dropped_groups,
                "april/last_chance_groups": c.last_chance_groups,
                "april/segment_max_tokens": self.segment_tokens or 0,
                "april/top_ups": c.top_ups}


def report(result: RolloutResult, version: int, hist, buffer: PartialBuffer | None) -> dict:
    """APRIL's off-policy share and histograms of a step (`version`: the policy after it)."""
    old = sum(1 for g in result.groups for s in g.samples for v in s.policy_versions
              if v < version - 1)
    total = sum(s.model_tokens for g in result.groups for s in g.samples)
    versions = [s.policy_versions for g in result.groups for s in g.samples]
    spans = [max(v) - min(v) for v in versions if v]
    edges = [float(i) for i in range(0, 12)]
    hist("april/version_span", spans, edges)
    if buffer is not None:  # asynchronous: no buffer, partial samples stay in flight
        hist("april/buffer_age", buffer.ages(version), edges)
    return {"april/offpolicy_token_ratio": old / max(total, 1)}
