"""The rollout-engine interface, shared by the embedded torch engine and the SGLang client.

A `Sample` is one response being generated for one prompt. It carries, per generated token,
the token id, its log-probability under the behaviour policy, and the policy version that
produced it. A sample can be stopped part-way (abort, or the per-step segment limit) and
submitted again later: generation continues from its last token, and the lists only grow.

In a multi-turn episode (trainer/episode/) the response also holds the environment's turns (tool
results, feedback): tokens no policy sampled, with version `ENV_VERSION` and log-probability 0,
never trained. `policy_versions` and `model_tokens` leave them out.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable

# finish reasons
STOP = "stop"          # produced an end-of-sequence token
LENGTH = "length"      # reached max_new_tokens
SEGMENT = "segment"    # reached the per-segment limit (APRIL parks it; it is not finished)
ABORT = "abort"        # stopped from outside (APRIL early termination, shutdown)
DONE_REASONS = (STOP, LENGTH)

ENV_VERSION = -1   # an environment token's version: no policy sampled it

_ids = itertools.count()


def reserve_request_ids(up_to: int) -> None:
    """Make every later Sample's request id greater than `up_to`: samples restored from a
    checkpoint keep their ids, and a new sample must never share one (owners map ids to
    groups)."""
    global _ids
    nxt = next(_ids)
    _ids = itertools.count(max(nxt, up_to + 1))


class EngineError(RuntimeError):
    """A rollout engine failed in a way the run cannot recover from by itself (a server that
    stays down, keeps answering 5xx, or times out past the retry budget). The message names
    the server and the call; the runner turns it into an `error` event."""


class GenerationGaveUp(EngineError):
    """Every generation process was given up. `what`: which, with its pid and restarts, and how
    it last ended; `why`: the rule that gave it up. `during(step)` puts the step between them."""

    def __init__(self, what: str, why: str, processes: int = 1):
        self.what, self.why, self.processes = what, why, processes
        super().__init__(self.during(None))

    def during(self, step: int | None) -> str:
        when = f" during step {step}" if step is not None else ""
        was = "was" if self.processes == 1 else "were"
        return f"{self.what}{when} and {was} given up: {self.why}"


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 256         # the whole response's budget, over all segments
    segment_max_tokens: int | None = None  # at most this many new tokens per submission


@dataclass
class Sample:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    segment_tokens: int = 0           # tokens generated since the last submission
    request_id: int = field(default_factory=lambda: next(_ids))
    meta: dict[str, Any] = field(default_factory=dict)  # owner's data (group, problem, ...)

    @property
    def done(self) -> bool:
        """Finished: for an episode, once its episode is over (`meta["episode"]["end"]`), not when
        a turn stops (an engine in another process may file that stop before the episode
        wrapper has seen it)."""
        if self.finish_reason not in DONE_REASONS:
            return False
        return self.episode is None or bool(self.episode.get("end"))

    @property
    def episode(self) -> dict | None:
        """A multi-turn episode's state (`meta["episode"]`, trainer/episode/engine.py), or None."""
        episode = self.meta.get("episode")
        return episode if isinstance(episode, dict) else None

    @property
    def settled(self) -> bool:
        """Out of the engine until it is submitted again: finished, or stopped part-way (its
        segment limit, an abort). An episode whose turn stopped is not: its environment answers
        and it goes on (trainer/episode/engine.py)."""
        if self.finish_reason is None:
            return False
        return self.finish_reason not in DONE_REASONS or self.done

    @property
    def policy_versions(self) -> list[int]:
        """The versions of the tokens a policy sampled (environment tokens left out)."""
        return [v for v in self.versions if v != ENV_VERSION]

    def age(self, version: int) -> int:
        """How many versions before `version` the policy of its oldest sampled token was (0 for
        no tokens): APRIL's version span, asynchronous staleness."""
        versions = self.policy_versions
        return version - min(versions) if versions else 0

    @property
    def model_tokens(self) -> int:
        """Response tokens the engine generated (the environment's left out)."""
        return sum(1 for v in self.versions if v != ENV_VERSION)

    @property
    def turn_start(self) -> int:
        """Where the current model turn starts in the response: after the environment's last
        token (0 for a single-turn response)."""
        for i in range(len(self.versions) - 1, -1, -1):
            if self.versions[i] == ENV_VERSION:
                return i + 1
        return 0

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.response_ids)

    def check_fits(self, max_seq_len: int) -> None:
        """Refuse a sample whose prompt plus token budget exceeds an engine's sequence length."""
        if len(self.prompt_ids) + self.params.max_new_tokens > max_seq_len:
            raise ValueError(f"prompt ({len(self.prompt_ids)} tokens) + max_new_tokens "
                             f"({self.params.max_new_tokens}) exceeds the engine's "
                             f"max_seq_len {max_seq_len}")

    def check(self) -> None:
        """The per-token lists must always agree."""
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise AssertionError(f"sample {self.request_id}: {n} tokens, {len(self.logprobs)} "
                                 f"logprobs, {len(self.versions)} versions")


@dataclass
class EngineStats:
    decode_steps: int = 0
    slot_steps_used: int = 0      # sum over decode steps of active sequences
    slot_steps_capacity: int = 0  # sum over decode steps of the slots that could have run
    generated_tokens: int = 0
    prefill_tokens: int = 0         # prompt/context tokens run through the model
    prefill_shared_tokens: int = 0  # ... and those copied from a sample with the same context
    # wall seconds in decode steps and in admissions (prefills, cache moves); 0 where an
    # engine does not time them. Per generated token they show what a full batch costs here
    decode_s: float = 0.0
    admit_s: float = 0.0
    # the KV cache of samples that left the engine part-way and came back (APRIL's parked
    # samples, an episode's next turn): prefill tokens spent on a sample's history (it had
    # response tokens; part of prefill_tokens), cached positions it went on from instead,
    # parked caches given up (prefilled again if resumed), and, levels rather than counts,
    # the positions parked caches hold now, and those of them outside the engine's slots
    resumed_prefill_tokens: int = 0
    kv_kept_tokens: int = 0
    kv_evicted: int = 0
    parked_kv_tokens: int = 0
    kv_store_tokens: int = 0
    prefill_calls: int = 0        # forward passes admissions ran (batches of prefilled rows)

    def idle_slot_frac(self) -> float:
        if self.slot_steps_capacity == 0:
            return 0.0
        return 1.0 - self.slot_steps_used / self.slot_steps_capacity

    def minus(self, other: "EngineStats") -> "EngineStats":
        """The counters since `other`; the levels (parked_kv_tokens, kv_store_tokens) as they
        are now."""
        out = EngineStats(*(a - b for a, b in zip(self.astuple(), other.astuple())))
        out.parked_kv_tokens, out.kv_store_tokens = self.parked_kv_tokens, self.kv_store_tokens
        return out

    def astuple(self):
        return (self.decode_steps, self.slot_steps_used, self.slot_steps_capacity,
                self.generated_tokens, self.prefill_tokens, self.prefill_shared_tokens,
                self.decode_s, self.admit_s, self.resumed_prefill_tokens, self.kv_kept_tokens,
                self.kv_evicted, self.parked_kv_tokens, self.kv_store_tokens, self.prefill_calls)


class RolloutEngine:
    """What the trainer needs from an engine."""

    version: int = 0
    stats: EngineStats

    def submit(self, samples: Iterable[Sample]) -> None:
        """Queue new or partial samples (a partial one continues from its last token)."""
        raise NotImplementedError

    def step(self) -> list[Sample]:
        """Advance generation a little; return the samples that left the engine (finished,
        or stopped at their segment limit)."""
        raise NotImplementedError

    def abort(self, request_ids: Iterable[int] | None = None,
              keep_cache: bool = False) -> list[Sample]:
        """Stop the given (default: all) samples, queued or running, and return them as they
        are, with finish_reason 'abort'. `keep_cache` is a hint: an engine that can keep their
        KV cache until they are submitted again may do so."""
        raise NotImplementedError

    def update_weights(self, named_tensors, version: int, recompute_kv: bool = False) -> None:
        """Load new policy weights between decode steps; later tokens carry `version`."""
        raise NotImplementedError

    def drop_cache(self, request_ids: Iterable[int]) -> None:
        """Give up what the engine keeps for these samples (a parked KV cache): they will not
        come back. The default keeps nothing."""

    def probe_logprobs(self, token_ids: list[int]) -> dict[str, list[float]]:
        """log p(token_ids[t] | token_ids[:t]), t = 1..n-1, at temperature 1, under the weights
        each of this engine's generators samples with now, by generator name (one entry per
        process or server that generates): what the invariant probe compares with the
        trainer's after a weight sync (trainer/invariants/probe.py). Raises
        NotImplementedError where an engine cannot say."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a probe sequence")

    @property
    def num_pending(self) -> int:
        """Samples queued or running, or finished and not yet returned by step()."""
        raise NotImplementedError

    def release_memory(self) -> bool:
        """Free what the engine holds on the trainer's device (its KV cache) for the training
        phase, with nothing running; True if it did. The default holds on: the engine's memory
        is elsewhere (an SGLang server) or it decodes while the trainer trains."""
        return False

    def reacquire_memory(self) -> None:
        """Take back what release_memory freed (the next step() would do it anyway)."""

    def close(self) -> None:
        pass

    def generate(self, samples: list[Sample]) -> list[Sample]:
        """Run `samples` until each finishes or stops at its segment limit (the synchronous
        pattern). Returns them in the order they left the engine."""
        self.submit(samples)
        out: list[Sample] = []
        while self.num_pending:
            out.extend(self.step())
        return out


class EngineWrapper(RolloutEngine):
    """An engine around another (`inner`): what it does not define itself is the inner engine's
    (stop strings, trainer/engine/stops.py; episodes, trainer/episode/engine.py)."""

    inner: RolloutEngine

    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value

    @property
    def num_pending(self) -> int:
        return self.inner.num_pending

    @property
    def stats(self) -> EngineStats:
        return self.inner.stats

    def update_weights(self, named_tensors, version: int, recompute_kv: bool = False) -> None:
        self.inner.update_weights(named_tensors, version, recompute_kv=recompute_kv)

    def probe_logprobs(self, token_ids: list[int]) -> dict[str, list[float]]:
        return self.inner.probe_logprobs(token_ids)

    def drop_cache(self, request_ids: Iterable[int]) -> None:
        drop = getattr(self.inner, "drop_cache", None)   # an engine that keeps nothing may not say
        if drop is not None:
            drop(request_ids)

    # Inherited defaults would answer for the wrapper; the memory is the inner engine's.
    def release_memory(self) -> bool:
        return self.inner.release_memory()

    def reacquire_memory(self) -> None:
        self.inner.reacquire_memory()
