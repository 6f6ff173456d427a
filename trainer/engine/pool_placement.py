"""Placing a pool's samples: a submitted sample goes to the live member with the least
outstanding tokens,

    load(m) = sum over the samples m holds of  min(max_new_tokens - generated, segment_max_tokens)

(the tokens each may still generate in this submission; ties: fewer samples, then the lower
index), and a sample that comes back is released from its member, its new tokens counted.

`Placement` is a mixin of `EnginePool` (trainer/engine/pool.py): it works on the pool's queue,
members and delivered count; calls on a member go through `_guard` (pool_members.py).
"""
from __future__ import annotations

from trainer.engine.base import Sample
from trainer.engine.pool_members import Member


def budget(s: Sample) -> int:
    """The tokens `s` may still generate in this submission."""
    seg = s.params.segment_max_tokens
    return max(0, min(s.remaining, seg) if seg else s.remaining)


def place(m: Member, s: Sample) -> None:
    cost = budget(s)
    m.held[s.request_id] = (s, len(s.response_ids), cost)
    m.load += cost


class Placement:
    """Samples to members, least outstanding tokens first, and back."""

    def _dispatch(self) -> None:
        """Give the queued samples to the live members, least outstanding tokens first."""
        while self._queue:
            live = self._live()
            if not live:
                return
            batches: dict[int, list[Sample]] = {}
            for s in self._queue:
                m = min(live, key=lambda m: (m.load, len(m.held), m.index))
                place(m, s)
                batches.setdefault(m.index, []).append(s)
            self._queue = []
            for index, batch in batches.items():
                m = self.members[index]
                if m.engine is not None:  # else lost meanwhile: its samples are queued again
                    self._guard(m, "submit", batch)

    def _collect(self, members: list[Member], wait_s: float) -> list[Sample]:
        out = []
        for m in members:
            if m.engine is None or not m.held:
                continue
            for s in self._guard(m, "step", wait_s):
                if self._release(m, s):
                    out.append(s)
        return out

    def _ready_now(self) -> list[Sample]:
        out, self._ready = self._ready, []
        return out + self._collect(self._live(), 0.0)

    def _release(self, m: Member, s: Sample) -> bool:
        """A sample came back from m: count its new tokens; False if m did not hold it."""
        entry = m.held.pop(s.request_id, None)
        if entry is None:
            return False
        _, tokens_then, cost = entry
        new = len(s.response_ids) - tokens_then
        self._delivered += new
        m.delivered += new
        m.load -= cost
        m.failures = 0  # it works
        return True

