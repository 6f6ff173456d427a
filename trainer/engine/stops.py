"""Stop strings (`rollout.stop`) over any rollout engine.

Stop tokens (every eos id of the model and tokenizer, `trainer.models.loading.stop_token_ids`) end a
response inside the engine. Stop strings are text, so they are matched here, on the decoded tail
of each response, around whichever engine `build_engine` (trainer/run/engines.py) made:

- after every `step()`, each running sample that grew is checked (the embedded engine appends its
  tokens in place, so a match is seen the step it is generated, and the sample is aborted there);
  a sample that leaves the engine (finished, or at its segment limit) is checked from where its
  last check stopped (the process and SGLang engines hand tokens over only then);
- on a match the response is cut after the token that completes the stop string and the sample
  finishes with reason "stop", like an eos. The stop string stays in the completion: the trained
  tokens are exactly the generated ones, and cutting text inside a token would break that.
  Tokens generated past the match (only by engines that report late) are dropped with their
  log-probabilities.

Samples aborted by their owner (APRIL) are returned as they are and checked when they come back.
In a multi-turn episode only the current model turn is matched (`Sample.turn_start` on): an
earlier turn's stop string (a tool call's closing tag) is history, not a new stop.
"""
from __future__ import annotations

from typing import Iterable

from trainer.engine.base import DONE_REASONS, STOP, EngineWrapper, Sample


class StopStrings(EngineWrapper):
    """`engine` with responses also ending at any of `stops` (decoded with `tokenizer`). Every
    other attribute is the wrapped engine's (`inner`)."""

    def __init__(self, engine, tokenizer, stops: Iterable[str]):
        self.inner = engine
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        if not self.stops:
            raise ValueError("StopStrings needs at least one non-empty stop string")
        # tokens decoded behind the checked point: a token is at least one byte (byte-level BPE,
        # byte fallback), so this many cover the longest stop string
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 2
        self.live: dict[int, Sample] = {}
        self.checked: dict[int, int] = {}  # request id -> response tokens already checked
        # tokens an engine that reports late generated past a stop string, cut here: never part
        # of a response, so `stats.generated_tokens` leaves them out (the token ledger balances)
        self.cut_tokens = 0

    @property
    def stats(self):
        stats = self.inner.stats
        if not self.cut_tokens:
            return stats
        out = type(stats)(*stats.astuple())
        out.generated_tokens -= self.cut_tokens
        return out

    # --- the engine interface ----------------------------------------------------------------------
    def submit(self, samples: Iterable[Sample]) -> None:
        samples = list(samples)
        for s in samples:
            self.live[s.request_id] = s
            self.checked.setdefault(s.request_id, 0)
        self.inner.submit(samples)

    def step(self) -> list[Sample]:
        out = self.inner.step()
        for s in out:
            self.live.pop(s.request_id, None)
            self._settle(s)
        hits = {}
        for rid, s in self.live.items():
            if len(s.response_ids) > self.checked.get(rid, 0):
                keep = self._match(s)
                if keep is not None:
                    hits[rid] = keep
        if hits:
            # an episode's turn goes on after its environment's answer: its cache stays parked
            turns = [rid for rid in hits if self.live[rid].episode is not None]
            ended = [rid for rid in hits if self.live[rid].episode is None]
            stopped = ((self.inner.abort(turns, keep_cache=True) if turns else [])
                       + (self.inner.abort(ended) if ended else []))
            for s in stopped:
                self.live.pop(s.request_id, None)
                keep = hits.get(s.request_id)
                if keep is None:  # returned by the abort, but not asked for: settle it as is
                    self._settle(s)
                else:
                    self._cut(s, keep)
                out.append(s)
        return out

    def abort(self, request_ids: Iterable[int] | None = None, keep_cache: bool = False) -> list[Sample]:
        out = self.inner.abort(request_ids, keep_cache=keep_cache)
        for s in out:
            self.live.pop(s.request_id, None)  # checked later, when it comes back
        return out

    def close(self) -> None:
        self.live.clear()
        self.checked.clear()
        self.inner.close()

    # --- matching ------------------------------------------------------------------------------------
    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _match(self, s: Sample) -> int | None:
        """How many response tokens to keep (up to the one completing a stop string), or None;
        only text after the last check (and a window behind it) is looked at."""
        ids, floor = s.response_ids, s.turn_start
        start = max(self.checked.get(s.request_id, 0), floor)
        self.checked[s.request_id] = len(ids)
        lo = max(floor, start - self.window)
        if not any(stop in self._text(ids[lo:]) for stop in self.stops):
            return None
        for k in range(max(start, floor + 1), len(ids) + 1):  # the first token that completes one
            text = self._text(ids[max(floor, k - self.window):k])
            if any(stop in text for stop in self.stops):
                return k
        return len(ids)

    def _settle(self, s: Sample) -> None:
        """A sample leaving the engine: cut it at a stop string it holds."""
        keep = self._match(s)
        if keep is not None:
            self._cut(s, keep)
        if s.finish_reason in DONE_REASONS:
            self.checked.pop(s.request_id, None)

    def _cut(self, s: Sample, keep: int) -> None:
        self.cut_tokens += max(0, len(s.response_ids) - keep)
        del s.response_ids[keep:], s.logprobs[keep:], s.versions[keep:]
        s.finish_reason = STOP
        self.checked.pop(s.request_id, None)
