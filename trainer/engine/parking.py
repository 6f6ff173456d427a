"""Parked KV caches: a sample that left the embedded engine part-way keeps its cache in a free
slot until it is submitted again, and then continues without prefilling what the cache holds.

Who parks: a stop at the segment limit, `abort(keep_cache=True)` (APRIL's early termination
with `engine.kv_on_update = keep`, an asynchronous suspension), and an episode's model turn that
ended for its environment (the next turn prefills only the environment's tokens). A parked cache
survives a weight update unless the update recomputes (`recompute_kv`): it was computed by the
weights of its day, and the sample's next tokens come from the new ones (each token records its
version; the trainer recomputes every log-probability with its own weights).

The bound is the engine's own: parked caches live in slots no active sequence uses (slots
n..max_slots-1 while n run), so they cost no memory beyond the cache the engine allocated.
When a new sequence needs the slot, the parked cache there moves to a free one or, with none
free, the oldest parked cache is given up (`stats.kv_evicted`); its sample is prefilled again
when it comes back. `stats.parked_kv_tokens` is the positions parked caches hold.

Resuming: the sample's tokens must extend the cached ones (lists only grow; a stop string cuts
a response after a late report, which leaves the cache a valid longer prefix). Positions past
the cache are prefilled on top of it (`Decoder.extend`); a cache longer than the sample is cut.

A mixin of `EmbeddedEngine` (trainer/engine/embedded.py): it moves the same per-slot state
(`slots`, `cached`, `cache`, `parked`).
"""
from __future__ import annotations

from typing import Iterable

from trainer.engine.base import Sample


class ParkedCaches:
    """request id -> (slot, cached positions, the token at the last cached position), oldest
    first, in `self.parked`."""

    def drop_cache(self, request_ids: Iterable[int]) -> None:
        """Give up the parked caches of these samples (their episode is over)."""
        with self.lock:
            for rid in request_ids:
                self.parked.pop(rid, None)
            self._count_parked()

    def _count_parked(self) -> None:
        self.stats.parked_kv_tokens = sum(e[1] for e in self.parked.values())

    def _park(self, i: int) -> Sample:
        """Take active slot i out of the active range, keeping its cache."""
        last = len(self.slots) - 1
        if i != last:
            self.cache.swap(i, last, self.cached[i], self.cached[last])
            self.slots[i], self.slots[last] = self.slots[last], self.slots[i]
            self.cached[i], self.cached[last] = self.cached[last], self.cached[i]
        s, cached = self.slots.pop(), self.cached.pop()
        tokens = self._tokens(s)
        self.parked[s.request_id] = (last, cached, tokens[cached - 1] if cached else -1)
        return s

    def _parked_at(self, index: int) -> int | None:
        for rid, entry in self.parked.items():
            if entry[0] == index:
                return rid
        return None

    def _claim(self, index: int) -> None:
        """Make slot `index` free for an active sequence: a parked cache there moves to a free
        slot, or, with none free, the oldest parked cache is given up."""
        rid = self._parked_at(index)
        if rid is None:
            return
        used = {e[0] for e in self.parked.values()} | set(range(len(self.slots)))
        free = [j for j in range(self.max_slots) if j not in used]
        self.stats.kv_evicted += not free
        if not free:  # give up the oldest parked cache (maybe this one)
            oldest = next(iter(self.parked))
            if oldest != rid:
                free = [self.parked.pop(oldest)[0]]
            else:
                del self.parked[rid]
                return
        _, cached, tail = self.parked[rid]
        self.cache.move(index, free[0], cached)
        self.parked[rid] = (free[0], cached, tail)

    def _unpark(self, s: Sample) -> bool:
        """Activate a parked sample's cache at slot len(self.slots), prefilling the positions
        its tokens added since (an environment's turn); False if it has no usable cache."""
        entry = self.parked.pop(s.request_id, None)
        if entry is None:
            return False
        slot, cached, tail = entry
        tokens = self._tokens(s)
        need = len(tokens) - 1          # the last token is pending: fed by the next decode
        if cached <= need and cached and tokens[cached - 1] != tail:
            return False  # not the tokens the cache was computed from: prefill afresh
        n = len(self.slots)
        if slot != n:
            other = self._parked_at(n)
            if other is not None:  # swap the two parked caches
                o_slot, o_cached, o_tail = self.parked[other]
                self.cache.swap(slot, n, cached, o_cached)
                self.parked[other] = (slot, o_cached, o_tail)
            else:
                self.cache.move(slot, n, cached)
        kept = min(cached, need)
        if kept < need:
            self.decoder.extend(self.cache, n, kept, tokens[kept:need])
            self.stats.prefill_tokens += need - kept
        self.stats.kv_kept_tokens += kept
        self.slots.append(s)
        self.cached.append(need)
        return True
