"""What every way of producing groups shares: the group, the prompt source, the step's sample
accounting, the result a step gets back, and the driver interface the runner talks to.

A training step asks its driver for `collect(cfg, version)`: at most N complete, scored groups
to train on (plus every group scored this step, for the reward metrics). The driver also says
what it measured (`report`), keeps its state in checkpoints, and hears about the run's life:
new knob values, new policy versions, pause/resume/stop, evaluations and checkpoints that need
the engine to itself (`suspended`). The runner never asks which driver it has.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

from trainer.engine.base import LENGTH, Sample, SamplingParams
from trainer.episode.engine import new_episode
from trainer.episode.environments import offered_tools
from trainer.observe.metrics import percentile
from trainer.rollout import dynamic
from trainer.rollout.greso import classify
from trainer.rollout.ledger import TokenLedger
from trainer.tasks.base import Problem, Task


@dataclass
class Group:
    problem: Problem
    samples: list[Sample]
    rewards: list[float] = field(default_factory=list)  # what the loss uses (with penalties)
    draw: int = 0  # index of the draw that produced it (data cursor position)
    raw_scores: list[float] = field(default_factory=list)  # the verifier's scores alone
    reward_status: list[str] = field(default_factory=list)  # per sample: "ok", "error", "timeout"
    reward_notes: list[str] = field(default_factory=list)   # per sample: why scoring failed

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
        """Generated tokens (an episode's environment tokens are not the engine's)."""
        return sum(s.model_tokens for s in self.samples)

    def lengths(self) -> list[int]:
        """Each response's length: the tokens the model wrote (an episode's tool results and
        feedback are the environment's, not the model's)."""
        return [s.model_tokens for s in self.samples]


class PromptSource:
    """Hands out training problems in order; the cursor is the only state (checkpointed)."""

    def __init__(self, task: Task, cursor: int = 0):
        self.task, self.cursor = task, cursor

    def next(self) -> tuple[int, Problem]:
        draw = self.cursor
        self.cursor += 1
        return draw, self.task.train_problem(draw)


def new_group(draw: int, problem: Problem, tokenizer, n: int, params: SamplingParams,
              tools: tuple[str, ...] | None = None) -> Group:
    """A group of `n` samples of `problem`; episodes offered `tools` when that is not None
    (`trainer.episode.engine.offered_tools`: multi-turn runs)."""
    prompt_ids = tokenizer(problem.prompt).input_ids
    samples = [Sample(list(prompt_ids), params, meta={"draw": draw, "index": k})
               for k in range(n)]
    if tools is not None:
        for s in samples:
            s.meta["episode"] = new_episode(problem, tools)
    return Group(problem=problem, samples=samples, draw=draw)


def sampling_params(cfg, segment: int | None = None) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p,
                          max_new_tokens=r.max_response_len, segment_max_tokens=segment)


@dataclass
class StepCounts:
    """Sample accounting of one step (the invariants are in trainer/rollout/april.py)."""
    submitted: int = 0
    completed: int = 0
    parked: int = 0
    dropped: int = 0
    aborted_tokens: int = 0     # tokens of samples parked at early termination
    discarded_tokens: int = 0   # generated tokens thrown away (the ledger has them by reason)
    filtered_groups: int = 0    # complete groups dropped by dynamic sampling (zero variance)
    span_dropped_groups: int = 0
    last_chance_groups: int = 0  # APRIL: resumed at the span limit, generated to their end
    groups_started: int = 0     # new prompts rolled out
    skipped_easy: int = 0       # GRESO
    skipped_hard: int = 0
    rounds: int = 0
    top_ups: int = 0            # APRIL: times new groups were started mid-step to keep N' in hand
    # the data cursor's positions that reached an outcome without a scored group (the run's data
    # accounting, trainer/invariants/draws.py): GRESO's skips, unfinished groups dropped on purpose
    greso_draws: list[int] = field(default_factory=list)
    dropped_draws: list[int] = field(default_factory=list)


@dataclass
class RolloutResult:
    groups: list[Group]               # complete, scored, to train on (at most N)
    scored: list[Group]               # every group scored this step (for reward metrics)
    gen_seconds: float
    counts: StepCounts
    metrics: dict[str, float] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)  # per sample, versions behind (async)
    events: list[tuple[str, dict]] = field(default_factory=list)  # (kind, data) for the run's log


# (name, values, bin edges) -> None: how a driver reports a histogram
Histogram = Callable[[str, list, list], None]


class Driver:
    """The interface between the step loop and a way of producing groups. The defaults are a
    driver that generates only inside `collect` (nothing runs between steps)."""

    concurrent = False  # True: generation goes on while the trainer trains (the engine is busy)
    ledger: TokenLedger  # where this driver's generated tokens went (set by each driver)

    def interrupted(self) -> bool:
        """Whether a stop or pause waits at the step boundary; the runner replaces it with the
        boundary's own check. A `collect` that may wait long for groups asks it."""
        return False

    def held_tokens(self) -> int:
        """Generated tokens held for a later step (buffered, queued or generating), as far as
        this process knows: the ledger's "waiting" where nothing is inside the engine."""
        return 0

    def held_draws(self) -> set[int]:
        """The data cursor's positions of the groups held for a later step (buffered, queued,
        generating): the data accounting's "held"."""
        return set()

    def collect(self, cfg, version: int) -> RolloutResult:
        raise NotImplementedError

    def after_step(self, cfg, idle_slot_frac: float) -> None:
        """Called once the step's generation is over, with how idle the engine's slots were."""

    def report(self, cfg, result: RolloutResult, version: int, step_s: float,
               histogram: Histogram) -> dict[str, float]:
        """This driver's own metrics of the step (after the update: `version` is the new one)."""
        return {}

    def retune(self, cfg, train_metrics: dict[str, float]) -> dict | None:
        """Knob changes the driver decides by itself after a step, as an event:
        {"kind": ..., "changes": {key: {"old", "new"}}, ...}; None for none."""
        return None

    # --- the run's life --------------------------------------------------------------------------
    def start(self, cfg, version: int) -> None: ...
    def close(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def set_config(self, cfg) -> None: ...
    def on_new_version(self, version: int) -> None: ...

    def suspended(self):
        """Hold generation while something else uses the engine (an evaluation, a checkpoint)."""
        return contextlib.nullcontext([])

    # --- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, version: int) -> None: ...


class StepRun:
    """One synchronous step: what it works with (the engine, the tokenizer, the prompt selector,
    the scorer, the config and sampling parameters, the driver's token ledger and each prompt's
    last mean response length) and its bookkeeping (the baseline, dynamic sampling and APRIL
    share it): which groups are generating, complete but unscored, scored and kept, or parked,
    and which group each request belongs to."""

    def __init__(self, engine, tokenizer, select, scorer, cfg, params: SamplingParams, *,
                 ledger: TokenLedger, length_history: dict[str, float]):
        self.engine, self.tokenizer, self.select, self.scorer = engine, tokenizer, select, scorer
        self.cfg, self.params = cfg, params
        self.ledger, self.length_history = ledger, length_history
        self.dynamic = cfg.rollout.dynamic_sampling
        self.counts = StepCounts()
        self.ready: list[Group] = []        # complete, scored, kept
        self.scored: list[Group] = []
        self.waiting: list[Group] = []      # complete, not yet scored
        self.active: dict[int, Group] = {}  # id(group) -> group with samples in the engine
        self.parked: list[Group] = []       # groups with samples stopped at the segment limit
        self.owner: dict[int, Group] = {}   # request id -> group

    def start(self, group: Group, samples: list[Sample], params: SamplingParams | None = None) -> None:
        """Submit `samples` of `group` with `params` (default: the step's)."""
        params = params or self.params
        for s in samples:
            s.params = params if not s.response_ids else _continue_params(s.params, params)
            self.owner[s.request_id] = group
        self.active[id(group)] = group
        self.counts.submitted += len(samples)
        self.engine.submit(samples)

    def start_new(self, n: int, order: Callable | None = None) -> None:
        """Draw `n` new prompts (the selector may skip some: GRESO) and start their groups."""
        G = self.cfg.rollout.n_samples_per_prompt
        groups = []
        for _ in range(n):
            draw, problem = self.select(self.cfg, self.counts)
            groups.append(new_group(draw, problem, self.tokenizer, G, self.params,
                                    offered_tools(self.cfg)))
        if order is not None:
            groups.sort(key=order)
        for g in groups:
            self.counts.groups_started += 1
            self.start(g, g.samples)

    def resume_parked(self) -> None:
        """Another segment for every group parked at the segment limit, oldest first."""
        parked, self.parked = self.parked, []
        for g in parked:  # already submitted this step: `counts.submitted` has them
            self.active[id(g)] = g
            self.engine.submit(g.unfinished)

    def score_waiting(self) -> None:
        """Score the complete groups; dynamic sampling drops the zero-variance ones."""
        if not self.waiting:
            return
        self.scorer(self.waiting)
        for g in self.waiting:
            self.scored.append(g)
            if self.dynamic and dynamic.filtered(g):
                self.counts.filtered_groups += 1
                self.drop("zero_variance", [g])
            else:
                self.ready.append(g)
        self.waiting.clear()

    def advance(self) -> None:
        """One engine step; groups whose samples all stopped leave `active`."""
        for s in self.engine.step():
            g = self.owner[s.request_id]
            if s.done:
                self.counts.completed += 1
            if all(x.settled for x in g.samples) and id(g) in self.active:
                del self.active[id(g)]
                if g.complete:
                    self.waiting.append(g)
                else:  # some samples stopped at their segment limit
                    self.parked.append(g)

    def drop(self, reason: str, groups: list[Group]) -> None:
        """Throw the generated tokens of `groups` away, counted in the ledger under `reason`."""
        tokens = sum(g.tokens() for g in groups)
        self.ledger.drop(reason, tokens)
        self.counts.discarded_tokens += tokens
        drop_cache = getattr(self.engine, "drop_cache", None)
        ids = [s.request_id for g in groups for s in g.samples if not s.done]
        if ids and drop_cache is not None:   # a parked cache of theirs has no sample to serve
            drop_cache(ids)
        if reason != "version_span":   # a span drop starts its prompt afresh: it is still held
            self.counts.dropped_draws += [g.draw for g in groups if not g.scored]

    def complete(self) -> int:
        """Complete groups in hand: scored and kept, or not scored yet."""
        return len(self.ready) + len(self.waiting)


def _continue_params(old: SamplingParams, new: SamplingParams) -> SamplingParams:
    """A resumed sample keeps its sampling distribution (its earlier tokens' logprobs were
    taken under it) and its budget; only the per-step segment limit is the current one."""
    return SamplingParams(temperature=old.temperature, top_p=old.top_p,
                          max_new_tokens=old.max_new_tokens,
                          segment_max_tokens=new.segment_max_tokens)


def step_metrics(cfg, result: RolloutResult, engine_stats) -> dict[str, float]:
    """What every driver's step reports: rewards, lengths, zero-variance shares, engine use."""
    c, scored = result.counts, result.scored
    rewards = [r for g in scored for r in g.rewards]
    lengths = response_lengths(scored)
    n_groups, n = max(len(scored), 1), max(len(rewards), 1)
    kinds = [classify(g.rewards) for g in scored]
    all_correct, all_wrong = kinds.count("all_correct"), kinds.count("all_wrong")
    m = dict(result.metrics)
    m.update({
        "rollout/idle_slot_frac": engine_stats.idle_slot_frac(),
        "rollout/decode_steps": engine_stats.decode_steps,
        "rollout/gen_tokens": engine_stats.generated_tokens,
        "rollout/samples": c.groups_started * cfg.rollout.n_samples_per_prompt,
        "timing/gen_s": result.gen_seconds,
        "engine/prefill_tokens": engine_stats.prefill_tokens,
        "engine/prefill_shared_tokens": engine_stats.prefill_shared_tokens,
        "engine/prefill_calls": engine_stats.prefill_calls,
        "engine/resumed_prefill_tokens": engine_stats.resumed_prefill_tokens,
        "engine/kv_kept_tokens": engine_stats.kv_kept_tokens,
        "engine/kv_evicted": engine_stats.kv_evicted,
        "engine/parked_kv_tokens": engine_stats.parked_kv_tokens,
    })
    if not scored:
        # nothing was scored this step (an asynchronous step served wholly from the queue, e.g.
        # right after a resume): no reward or length to report, rather than a false 0 on the charts
        return m
    m.update({
        "reward/mean": sum(rewards) / n,
        "reward/accuracy": sum(1 for g in scored for r in g.raw_scores if r >= 1.0) / n,
        "rollout/response_len/mean": sum(lengths) / max(len(lengths), 1),
        "rollout/response_len/p50": percentile(lengths, 0.5),
        "rollout/response_len/p90": percentile(lengths, 0.9),
        "rollout/response_len/max": max(lengths, default=0),
        "rollout/truncated_ratio": sum(s.finish_reason == LENGTH for g in scored
                                       for s in g.samples) / max(len(lengths), 1),
        "rollout/zero_var_ratio": (all_correct + all_wrong) / n_groups,
        "rollout/zero_var_ratio/all_correct": all_correct / n_groups,
        "rollout/zero_var_ratio/all_wrong": all_wrong / n_groups,
    })
    m.update(episode_metrics([s for g in scored for s in g.samples]))
    return m


def response_lengths(groups: list[Group]) -> list[int]:
    """The groups' response lengths in model tokens (the length figures and histogram)."""
    return [n for g in groups for n in g.lengths()]


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """The step's scored episodes (multi-turn runs; nothing for single-turn samples): model turns
    per episode, tool calls, tool errors and tool seconds, the share that called a tool, the
    share that ran out of turns, and the environment's tokens in them."""
    episodes = [(s, s.episode) for s in samples if s.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    return {
        "episode/turns": sum(e["turns"] for _, e in episodes) / n,
        "episode/turns/max": max(e["turns"] for _, e in episodes),
        "episode/tool_calls": sum(e["tool_calls"] for _, e in episodes),
        "episode/tool_errors": sum(e["tool_errors"] for _, e in episodes),
        "episode/tool_s": sum(e["tool_s"] for _, e in episodes),
        "episode/tool_use_rate": sum(1 for _, e in episodes if e["tool_calls"]) / n,
        "episode/max_turns_ratio": sum(1 for _, e in episodes if e["end"] == "max_turns") / n,
        "episode/env_tokens": sum(len(s.versions) - s.model_tokens for s, _ in episodes),
        "episode/env_errors": sum(1 for _, e in episodes if e.get("error")),
    }
