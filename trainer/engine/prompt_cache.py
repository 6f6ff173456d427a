"""The prompts' KV entries, computed once per prompt and weights version and copied into the
slots of every sample of that prompt (a GRPO group's samples share it).

Why: the samples of a group are admitted a few at a time as slots free up, and a new prompt is
then prefilled alone, one forward pass for a handful of tokens. On a small model such a pass
costs its fixed per-call work (a few dozen kernel calls), not its tokens: `bench april` on 2 CPU
cores spent its admissions in ~25 one- or two-row prefill calls a step while ~30 distinct new
prompts waited in the queue. So when a new prompt must be prefilled, the engine prefills the
prompts of the queued new samples with it, in one batch (`lookahead`, within the admission's
token budget), keeps their keys and values here, and every later sample of those prompts gets
a copy instead of a forward pass (`stats.prefill_shared_tokens`).

Entries: prompt less its last token (the part a new sample prefills; its first decode step
feeds the last one) -> (keys, values, row, length), where keys/values are the prefill batch's
[layers, rows, kv heads, positions, head dim] tensors (the batch's own output, not copied:
a batch lives as long as one of its entries does). Oldest-used first; at most `max_tokens`
positions (the entries' own lengths; a batch's padding is not counted). Only today's weights'
entries are lent: `clear()` at every weight update (the running siblings' rule,
`prompt_kv_version`, is the same).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

Entry = tuple[torch.Tensor, torch.Tensor, int, int]   # keys, values, row, length


def copy_entries(items: list[tuple[Entry, int]], k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
    """For each (entry, slot): write the entry's positions into positions 0..length-1 of `slot`
    (caches [layers, slots, kv heads, positions, head dim]). A plain slice copy per row: on CPU
    one costs ~13 us where an indexed copy of 3 rows into the cache cost ~160 us (and more
    with two threads on a busy machine)."""
    for (keys, values, row, n), slot in items:
        k_cache[:, slot, :, :n] = keys[:, row, :, :n]
        v_cache[:, slot, :, :n] = values[:, row, :, :n]


class PromptCache:
    """Prompt (less its last token) -> its KV entries under today's weights, least recently
    used first, at most `max_tokens` positions."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max(0, int(max_tokens))
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()
        self.tokens = 0

    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, key: tuple, keys: torch.Tensor, values: torch.Tensor, row: int) -> None:
        """Keep row `row` of a prefill batch as `key`'s entries (len(key) positions), giving up
        the least recently used entries beyond the bound."""
        n = len(key)
        if n > self.max_tokens or key in self.entries:
            return
        while self.tokens + n > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.tokens -= old[3]
        self.entries[key] = (keys, values, row, n)
        self.tokens += n

    def get(self, key: tuple) -> Entry | None:
        """key's entries (now the most recently used), or None."""
        e = self.entries.get(key)
        if e is not None:
            self.entries.move_to_end(key)
        return e

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
