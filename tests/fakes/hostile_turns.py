"""A policy that writes hostile tool calls: an engine wrapper for tests.

`HostileTurns(inner, tokenizer, texts, every=k)` sits under the episode wrapper
(trainer/episode/engine.py), around the run's real engine. Every k-th new episode it is given
does not reach the real engine for its first turn: that turn "is generated" as one of `texts` (in
turn, tokenized with the run's tokenizer by `forced_ids`, finished "stop" as a tool call's closing
tag would), so
the episode wrapper hands it to the environment as any model turn. When the episode comes back for
its next turn, the real engine continues it. `forced` maps each such request id to the text it got;
`resubmitted` keeps, per request id, the response (ids, versions) as the episode wrapper sent it
back after the hostile turn: the environment's tokens as they entered the conversation.

The forced tokens carry the engine's policy version and a log-probability of -1 (no model
sampled them; the trainer's ratio for them is whatever the policy now gives them, as for any
off-policy token).
"""
from __future__ import annotations

from typing import Iterable

from trainer.engine.base import ABORT, STOP, EngineWrapper, Sample

FORCED_LOGPROB = -1.0


def forced_ids(tokenizer, text: str) -> list[int]:
    """`text` as the tokens a model writes it with: a special token's string in it is its
    characters (a model that sampled the special token itself would have ended its turn)."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)


class HostileTurns(EngineWrapper):
    def __init__(self, inner, tokenizer, texts: list[str], *, every: int = 4):
        if not texts or every < 1:
            raise ValueError("HostileTurns needs texts and every >= 1")
        self.inner, self.tokenizer = inner, tokenizer
        self.texts, self.every = list(texts), int(every)
        self.forced: dict[int, str] = {}                       # request id -> its hostile text
        self.resubmitted: dict[int, tuple[list[int], list[int]]] = {}
        self.held: list[Sample] = []                           # first turns "generated" at the next step
        self._seen = 0

    @property
    def num_pending(self) -> int:
        return self.inner.num_pending + len(self.held)

    def submit(self, samples: Iterable[Sample]) -> None:
        real = []
        for s in samples:
            text = self._text_for(s)
            if text is None:
                if s.request_id in self.forced and s.request_id not in self.resubmitted:
                    self.resubmitted[s.request_id] = (list(s.response_ids), list(s.versions))
                real.append(s)
            else:
                self.held.append(s)
        if real:
            self.inner.submit(real)

    def _text_for(self, s: Sample) -> str | None:
        """The hostile text `s`'s first turn is, or None: the real engine generates it."""
        if s.episode is None or s.response_ids:
            return None
        if s.request_id not in self.forced:
            self._seen += 1
            if (self._seen - 1) % self.every:
                return None
            self.forced[s.request_id] = self.texts[len(self.forced) % len(self.texts)]
        return self.forced[s.request_id]

    def step(self) -> list[Sample]:
        out = self.inner.step()
        held, self.held = self.held, []
        for s in held:
            ids = forced_ids(self.tokenizer, self.forced[s.request_id])
            ids = ids[:s.params.max_new_tokens]
            s.response_ids.extend(ids)
            s.logprobs.extend([FORCED_LOGPROB] * len(ids))
            s.versions.extend([self.inner.version] * len(ids))
            s.segment_tokens = len(ids)
            s.finish_reason = STOP
        return out + held

    def abort(self, request_ids: Iterable[int] | None = None, keep_cache: bool = False) -> list[Sample]:
        ids = None if request_ids is None else set(request_ids)
        out = self.inner.abort(None if ids is None else list(ids), keep_cache=keep_cache)
        back = [s for s in self.held if ids is None or s.request_id in ids]
        self.held = [s for s in self.held if not (ids is None or s.request_id in ids)]
        for s in back:   # not started: it comes back as it went in, and is forced again
            s.finish_reason = ABORT
        return out + back
