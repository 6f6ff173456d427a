"""Parked KV caches: a sample that left the embedded engine part-way keeps its cache until it is
submitted again, and then continues without prefilling what the cache holds.

Who parks: a stop at the segment limit, `abort(keep_cache=True)` (APRIL's early termination
with `engine.kv_on_update = keep`, an asynchronous suspension), and an episode's model turn that
ended for its environment (the next turn prefills only the environment's tokens). A parked cache
survives a weight update unless the update recomputes (`recompute_kv`): it was computed by the
weights of its day, and the sample's next tokens come from the new ones (each token records its
version; the trainer recomputes every log-probability with its own weights).

Where: first in a slot no active sequence uses (slots n..max_slots-1 while n run): no memory
beyond the cache the engine allocated. When a new sequence needs that slot, the parked cache
moves to a free slot, or, with none free, is copied out to a store of its own (exact-length
tensors; a copy costs memory bandwidth, a prefill a forward pass). The store holds at most
`park_tokens` positions: beyond it the oldest parked caches in it are given up
(`stats.kv_evicted`), and their samples are prefilled again when they come back.
`stats.parked_kv_tokens` counts every parked position, `stats.kv_store_tokens` those in the store
(the memory parking costs: `Decoder.kv_bytes_per_token` each).

Resuming: the sample's tokens must extend the cached ones (lists only grow; a stop string cuts
a response after a late report, which leaves the cache a valid longer prefix). Positions past
the cache are prefilled on top of it (`Decoder.extend`); a cache longer than the sample is cut.
The admission (`EmbeddedEngine._admit`) resumes first the queued sample whose cache already sits
at the next active slot (nothing to copy), else the next in queue order (its cache is swapped in).

A mixin of `EmbeddedEngine` (trainer/engine/embedded.py): it moves the same per-slot state
(`slots`, `cached`, `cache`, `parked`, `stored`).
"""
from __future__ import annotations

from typing import Iterable

from trainer.engine.base import Sample

STORED = -1   # a parked entry's slot when its cache is in the store


class ParkedCaches:
    """`self.parked`: request id -> (slot or STORED, cached positions, the token at the last
    cached position), oldest first; `self.stored`: request id -> (keys, values) of the stored
    ones, each [layers, kv heads, cached, head dim]."""

    def drop_cache(self, request_ids: Iterable[int]) -> None:
        """Give up the parked caches of these samples (they will not come back)."""
        with self.lock:
            for rid in request_ids:
                self._forget(rid)
            self._count_parked()

    def _forget(self, rid: int) -> None:
        self.parked.pop(rid, None)
        self.stored.pop(rid, None)

    def _forget_all(self) -> None:
        self.parked.clear()
        self.stored.clear()
        self._count_parked()

    def _count_parked(self) -> None:
        self.stats.parked_kv_tokens = sum(e[1] for e in self.parked.values())
        self.stats.kv_store_tokens = sum(self.parked[rid][1] for rid in self.stored)

    def _park(self, i: int) -> Sample:
        """Take active slot i out of the active range, keeping its cache."""
        last = len(self.slots) - 1
        if i != last:
            self.cache.swap(i, last, self.cached[i], self.cached[last])
            self.slots[i], self.slots[last] = self.slots[last], self.slots[i]
            self.cached[i], self.cached[last] = self.cached[last], self.cached[i]
        s, cached = self.slots.pop(), self.cached.pop()
        tokens = self._tokens(s)
        self._forget(s.request_id)
        self.parked[s.request_id] = (last, cached, tokens[cached - 1] if cached else -1)
        return s

    def _parked_at(self, index: int) -> int | None:
        for rid, entry in self.parked.items():
            if entry[0] == index:
                return rid
        return None

    def _claim(self, index: int) -> None:
        """Make slot `index` free for an active sequence: a parked cache there moves to a free
        slot; with none free, the oldest parked cache in a slot goes to the store (or is given
        up) and this one takes its slot."""
        rid = self._parked_at(index)
        if rid is None:
            return
        used = {e[0] for e in self.parked.values()} | set(range(len(self.slots)))
        free = [j for j in range(self.max_slots) if j not in used]
        if not free:
            oldest = next(r for r, e in self.parked.items() if e[0] != STORED)
            free = [self.parked[oldest][0]]
            self._spill(oldest)
            if oldest == rid:
                return
        _, cached, tail = self.parked[rid]
        self.cache.move(index, free[0], cached)
        self.parked[rid] = (free[0], cached, tail)

    def _spill(self, rid: int) -> None:
        """Copy a parked cache out of its slot to the store, giving up the oldest stored caches
        (this one in its turn) while the store would hold more than `park_tokens` positions."""
        slot, cached, tail = self.parked[rid]
        held = sum(self.parked[r][1] for r in self.stored)
        for old in [r for r in self.parked if r in self.stored or r == rid]:
            if held + cached <= self.park_tokens:
                break
            self.stats.kv_evicted += 1
            if old == rid:
                del self.parked[rid]
                return
            held -= self.parked[old][1]
            self._forget(old)
        self.stored[rid] = (self.cache.k[:, slot, :, :cached].clone(),
                            self.cache.v[:, slot, :, :cached].clone())
        self.parked[rid] = (STORED, cached, tail)

    def _unpark(self, s: Sample) -> bool:
        """Activate a parked sample's cache at slot len(self.slots), prefilling the positions
        its tokens added since (an environment's turn); False if it has no usable cache."""
        entry = self.parked.pop(s.request_id, None)
        stored = self.stored.pop(s.request_id, None)
        if entry is None:
            return False
        slot, cached, tail = entry
        tokens = self._tokens(s)
        need = len(tokens) - 1          # the last token is pending: fed by the next decode
        if cached <= need and cached and tokens[cached - 1] != tail:
            return False  # not the tokens the cache was computed from: prefill afresh
        n = len(self.slots)
        if stored is not None:
            self._claim(n)
            self.cache.k[:, n, :, :cached] = stored[0]
            self.cache.v[:, n, :, :cached] = stored[1]
        elif slot != n:
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
            self.stats.prefill_calls += 1
        self.stats.kv_kept_tokens += kept
        self.slots.append(s)
        self.cached.append(need)
        return True
