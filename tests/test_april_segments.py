"""APRIL at short segment limits: every step trains, and no token is generated
only to be dropped for its version span. The engine here is scripted: each answer has a length
fixed by its prompt and index (8 to 63 tokens), so what a segment limit of 1, 4 or 16 tokens does
to it is known in advance, and the runs are exact and fast."""
from collections import deque
from types import SimpleNamespace

import pytest

from trainer import config as C
from trainer.engine.base import ABORT, LENGTH, SEGMENT, STOP, EngineStats, Sample
from trainer.rollout import april
from trainer.rollout.synchronous import SynchronousDriver
from trainer.tasks.sum import SumTask

AVOIDABLE = ("version_span", "stale", "aborted", "surplus")


def answer_length(s: Sample) -> int:
    """8..63 tokens, spread over a group's samples (every group has one of 30 tokens or more)."""
    return 8 + (s.meta["draw"] * 7 + s.meta["index"] * 19) % 56


class ScriptedEngine:
    """One token per running sample a decode step, `max_slots` at once; a sample stops at its
    `answer_length`, its budget or its segment limit. Tokens carry the engine's version."""

    def __init__(self, max_slots: int = 8):
        self.max_slots, self.version, self.stats = max_slots, 0, EngineStats()
        self.queue: deque[Sample] = deque()
        self.running: list[Sample] = []

    @property
    def num_pending(self) -> int:
        return len(self.queue) + len(self.running)

    def submit(self, samples) -> None:
        for s in samples:
            s.finish_reason, s.segment_tokens = None, 0
            self.queue.append(s)

    def step(self) -> list[Sample]:
        while self.queue and len(self.running) < self.max_slots:
            self.running.append(self.queue.popleft())
        out = []
        for s in self.running:
            s.response_ids.append(7)
            s.logprobs.append(-1.0)
            s.versions.append(self.version)
            s.segment_tokens += 1
            self.stats.generated_tokens += 1
            segment = s.params.segment_max_tokens
            if len(s.response_ids) >= answer_length(s):
                s.finish_reason = STOP
            elif len(s.response_ids) >= s.params.max_new_tokens:
                s.finish_reason = LENGTH
            elif segment is not None and s.segment_tokens >= segment:
                s.finish_reason = SEGMENT
            if s.finish_reason:
                out.append(s)
        self.running = [s for s in self.running if not s.finish_reason]
        return out

    def abort(self, request_ids=None, keep_cache=False) -> list[Sample]:
        wanted = None if request_ids is None else set(request_ids)
        out = [s for s in [*self.queue, *self.running] if wanted is None or s.request_id in wanted]
        self.queue = deque(s for s in self.queue if s not in out)
        self.running = [s for s in self.running if s not in out]
        for s in out:
            s.finish_reason = ABORT
        return out

    def update_weights(self, named_tensors, version: int, recompute_kv: bool = False) -> None:
        self.version = version


def driver(engine) -> SynchronousDriver:
    task = SumTask(seed=0)
    cursor = iter(range(10**6))

    def select(cfg, counts):
        draw = next(cursor)
        return draw, task.train_problem(draw)

    def scorer(groups):   # half right, half wrong: every group has a signal to train
        for g in groups:
            g.rewards = [float(s.meta["index"] % 2) for s in g.samples]
            g.raw_scores = list(g.rewards)

    tokenizer = lambda text: SimpleNamespace(input_ids=[1, 2, 3])  # noqa: E731
    return SynchronousDriver(engine, tokenizer, select, scorer)


def cfg_for(segment: int, *extra: str):
    return C.load("demo", ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                           "rollout.max_response_len=64", "april.enabled=true",
                           "april.over_sampling_batch_size=8",
                           f"april.segment_max_tokens={segment}", *extra])


def run(cfg, steps: int = 12):
    engine = ScriptedEngine()
    rollout = run.rollout = driver(engine)   # the last run's driver, for a test to look into
    ledger = rollout.ledger
    ledger.observe_engine(0)
    results = []
    for version in range(steps):
        engine.update_weights(None, version)
        res = rollout.collect(cfg, version)
        ledger.observe_engine(engine.stats.generated_tokens)
        ledger.train(sum(g.tokens() for g in res.groups))
        results.append(res)
        c = res.counts
        assert c.submitted == c.completed + c.parked + c.dropped
        assert ledger.waiting == rollout.held_tokens()      # every token accounted
        assert len(rollout.buffer) <= april.over_sampling(cfg)
    return results, ledger


# (rounds a step, version span): one round and a span of one, then the defaults (8, 5)
SHAPES = {"1 round, span 1": ["rollout.max_sampling_rounds=1", "april.max_version_span=1"],
          "defaults": []}


def trained_spans(results) -> list[int]:
    """Each trained group's version span when it was trained (step k trains at version k)."""
    return [max(s.age(v) for s in g.samples) for v, r in enumerate(results) for g in r.groups]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("segment", [1, 4, 16])
def test_every_step_trains_and_no_group_is_trained_beyond_its_span(segment, shape):
    cfg = cfg_for(segment, *SHAPES[shape])
    results, ledger = run(cfg)
    trained = [len(r.groups) for r in results]
    assert all(trained), f"steps trained {trained} groups"
    assert max(trained_spans(results)) <= cfg.april.max_version_span
    if shape == "defaults":   # a span of 5: nothing is generated only to be dropped
        avoidable = sum(ledger.dropped[r] for r in AVOIDABLE)
        assert avoidable <= 0.10 * ledger.generated, ledger.dropped
        assert ledger.dropped["version_span"] == 0
    # at span 1 and one round a step more groups reach their last chance in a step than it
    # trains: the others are dropped for their span (27-30% of generation), counted, never trained
    # the guard: answers of up to 63 tokens need more steps than the span allows at this segment
    # limit and round count (63 > segment x rounds x (span + 1)), so the last chance was needed
    rounds, span = cfg.rollout.max_sampling_rounds, cfg.april.max_version_span
    if 63 > segment * rounds * (span + 1):
        assert sum(r.counts.last_chance_groups for r in results) > 0


def test_the_round_limit_ends_a_step_that_has_a_group_and_not_one_that_has_none():
    """One token a segment, one round a step: the first step has no complete group after its
    round (the shortest answer is 8 tokens), so it goes on; it ends at the first round with one."""
    results, _ = run(cfg_for(1, "rollout.max_sampling_rounds=1", "april.max_version_span=100"), 1)
    first = results[0]
    # the shortest group of the first 8 draws ends with its longest answer: rounds = that length
    longest = [max(8 + (d * 7 + k * 19) % 56 for k in range(4)) for d in range(8)]
    assert first.counts.rounds == min(longest) and len(first.groups) >= 1


def test_a_group_at_its_last_chance_runs_to_its_end_and_the_step_waits_for_it():
    """Span 1, one round of 4 tokens a step: a group resumed one version after its first token
    is at its last chance; it is submitted without a segment limit, never aborted, and complete
    (trained or kept whole) when the step ends."""
    cfg = cfg_for(4, "rollout.max_sampling_rounds=1", "april.max_version_span=1")
    engine = ScriptedEngine()
    rollout = driver(engine)
    rollout.collect(cfg, 0)
    at_last_chance = [g for g in rollout.buffer.groups if any(s.versions for s in g.samples)]
    assert at_last_chance and all(not g.complete for g in at_last_chance)
    unfinished = [s for g in at_last_chance for s in g.unfinished]
    engine.update_weights(None, 1)
    res = rollout.collect(cfg, 1)
    assert res.counts.last_chance_groups == len(at_last_chance)
    assert all(g.complete for g in at_last_chance)
    assert all(s.params.segment_max_tokens is None for s in unfinished)
    carried = {id(g) for g in res.groups} | {id(g) for g in rollout.buffer.groups}
    assert all(id(g) in carried for g in at_last_chance)
    assert res.metrics["april/last_chance_groups"] == len(at_last_chance)


def test_at_span_zero_no_sample_is_segmented_and_nothing_older_is_trained():
    """max_version_span = 0: a token may not outlive its step, so every group is at its last
    chance from its first token: over-sampling without partial rollouts. What the step does not
    train (complete beyond N, or unfinished when N are complete) is dropped for its span next
    step, counted, and its prompt started afresh; it was trained a step later, 1-2 versions old,
    before."""
    results, ledger = run(cfg_for(4, "april.max_version_span=0"), 6)
    assert all(len(r.groups) == 4 for r in results)
    # every trained answer was generated whole by the policy being trained
    assert all(set(s.versions) == {v} for v, r in enumerate(results) for g in r.groups
               for s in g.samples)
    assert ledger.dropped["version_span"] > 0
    assert sum(ledger.dropped.values()) == ledger.dropped["version_span"]
    assert sum(r.counts.span_dropped_groups for r in results) > 0


@pytest.mark.parametrize("span", [0, 1, 2])
def test_no_group_is_trained_beyond_the_span_complete_or_carried_over(span):
    """The review's replay (N = 4, N' = 8, segment limit 4, one round a step, 30 steps): a group
    complete beyond N went to the next step's batch without its span checked and could be
    carried over again and again. Before: 116, 37 and 14 trained groups beyond spans 0, 1, 2.
    Now none, and what is dropped for its span is in the ledger."""
    cfg = cfg_for(4, f"april.max_version_span={span}", "rollout.max_sampling_rounds=1")
    results, ledger = run(cfg, 30)
    assert max(trained_spans(results)) <= span
    assert ledger.dropped["version_span"] > 0
    assert ledger.dropped["version_span"] == sum(r.counts.discarded_tokens for r in results)
    # every prompt dropped for its span was started afresh: each draw is trained once or held
    trained = [g.draw for r in results for g in r.groups]
    assert len(trained) == len(set(trained))
    held = {g.draw for g in run.rollout.buffer.groups}
    assert set(trained) | held == set(range(max(set(trained) | held) + 1))
