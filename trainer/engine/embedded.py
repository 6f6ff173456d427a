"""The embedded rollout engine: continuous batching over a per-slot KV cache, in torch.

Each decode step runs every active sequence one token forward. A sequence that finishes leaves
its slot at once and a queued one is prefilled into it, so no slot waits for the batch's
longest answer. Every sampled token is recorded with its log-probability (under the
temperature-scaled distribution) and the policy version of the weights that produced it.

State of an active slot: the cache holds `cached` positions; `pending` is the last token of the
sequence, not yet in the cache. A decode step feeds the pending tokens and samples the next.
Admission prefills every token of prompt + response except the last, which becomes pending, so
new samples and partial ones resumed after an abort take the same path.

Slots 0..n-1 hold the n active sequences (compact, so a decode step reads a plain slice).
`abort(keep_cache=True)` parks an aborted sequence's KV cache in a slot above them, and so do
a stop at the segment limit (`SamplingParams.segment_max_tokens`) and the end of an episode's
model turn: when the same sample is submitted again it continues without a new prefill, only
the tokens added since (an environment's turn) are prefilled (trainer/engine/parking.py: the
bound, eviction, counting). Parked caches are dropped when the weights change with
`recompute_kv` (the sample is prefilled again under the new weights).

A new sample's prompt entries come from the prompt cache (trainer/engine/prompt_cache.py:
each prompt computed once per weights version, the queued ones in the same batch) or a running
sibling; only what neither holds is prefilled.

Per decode step the Python work is O(active rows), never O(sequence length): the pending token
is the sample's last one, the cached lengths are a list kept in step. When a sequence finishes
is decided in one place, `_finish_reason` (end-of-sequence tokens: `self.eos`).

Long because admission, decode, abort/park and weight swaps all move the same per-slot state.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Iterable

import torch

from trainer.engine.base import ABORT, LENGTH, SEGMENT, STOP, EngineStats, RolloutEngine, Sample
from trainer.engine.decoder import Decoder
from trainer.engine.parking import ParkedCaches
from trainer.engine.prompt_cache import PromptCache, copy_entries
from trainer.observe import clock
from trainer.observe.timeline import BusyRecorder


def slots_from_free_memory(decoder: Decoder, max_seq_len: int, fraction: float = 0.5, *,
                           cap: int = 1024, minimum: int = 1) -> int:
    """How many KV-cache slots of `max_seq_len` positions fit in `fraction` of the memory free
    now on the decoder's device (CUDA: torch.cuda.mem_get_info; CPU: available RAM), clamped
    to [minimum, cap]."""
    per_slot = (2 * decoder.n_layers * decoder.n_kv * max_seq_len * decoder.head_dim
                * torch.empty((), dtype=decoder.dtype).element_size())
    if decoder.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(decoder.device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    return int(max(minimum, min(cap, int(free * fraction) // per_slot)))


class EmbeddedEngine(ParkedCaches, RolloutEngine):
    def __init__(self, model, *, eos_token_ids: Iterable[int], max_slots: int | str = 64,
                 max_seq_len: int = 512, seed: int = 0, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, prefill_tokens: int = 8192,
                 kv_memory_fraction: float = 0.5, slots_cap: int = 1024,
                 attn_bucket_overhead: float | None = None, park_tokens: int = -1,
                 prompt_cache_tokens: int = -1):
        params = next(model.parameters())
        self.device = device or params.device
        self.dtype = dtype or params.dtype
        # attn_bucket_overhead: the decode attention's cost model (buckets.plan_buckets); None =
        # the device's default, 0 = a bucket per length class (tests)
        self.decoder = Decoder(model, self.device, self.dtype,
                               bucket_overhead=attn_bucket_overhead)
        # max_slots="auto": as many slots as fit in kv_memory_fraction of the free memory, at
        # most slots_cap (sized again at each reacquire_memory)
        self.auto_slots, self.kv_memory_fraction = max_slots == "auto", kv_memory_fraction
        self.slots_cap = slots_cap
        if self.auto_slots:
            max_slots = slots_from_free_memory(self.decoder, max_seq_len, kv_memory_fraction,
                                               cap=slots_cap)
        self.max_slots, self.max_seq_len = int(max_slots), max_seq_len
        self.cache = self.decoder.new_cache(max_slots, max_seq_len)
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=self.device)
        self.prefill_budget = prefill_tokens
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.version = 0
        self.last_sync_bytes = 0   # bytes the last update_weights copied in
        self.stats = EngineStats()
        self.lock = threading.RLock()  # step() and update_weights() never interleave
        self.busy = BusyRecorder("engine")  # its steps, for the run's timeline
        self.queue: deque[Sample] = deque()
        self.slots: list[Sample] = []      # active samples, slot i holds slots[i]
        self.cached: list[int] = []        # cached positions per active slot
        # parked caches (trainer/engine/parking.py): request id -> (slot, cached, last cached
        # token), oldest first; the ones outside the slots, at most park_tokens positions (-1:
        # as many as the slots hold)
        self.parked: dict[int, tuple[int, int, int]] = {}
        self.stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.park_tokens = self.max_slots * max_seq_len if park_tokens < 0 else park_tokens
        # prompts' KV entries under today's weights (trainer/engine/prompt_cache.py), at most
        # prompt_cache_tokens positions (-1: 8 x max_seq_len)
        self.prompts = PromptCache(8 * max_seq_len if prompt_cache_tokens < 0 else prompt_cache_tokens)
        # request id -> the weights version that computed its prompt's KV entries (a running
        # sample of the same prompt may lend them to a new one only when that is today's)
        self.prompt_kv_version: dict[int, int] = {}

    # --- public interface -----------------------------------------------------------------------
    def submit(self, samples: Iterable[Sample]) -> None:
        with self.lock:
            for s in samples:
                s.check()
                s.check_fits(self.max_seq_len)
                if not s.prompt_ids:
                    raise ValueError("empty prompt")
                s.finish_reason = None
                s.segment_tokens = 0
                if s.remaining <= 0:  # nothing left to generate: it is finished already
                    s.finish_reason = LENGTH
                self.queue.append(s)

    @property
    def num_pending(self) -> int:
        return len(self.queue) + len(self.slots)

    @property
    def num_running(self) -> int:
        return len(self.slots)

    def step(self) -> list[Sample]:
        with self.lock:
            if self.cache is None:  # released for training: take it back before generating
                self.reacquire_memory()
            t0, wall = time.perf_counter(), clock.now()
            used, capacity = self.stats.slot_steps_used, self.stats.slot_steps_capacity
            out = self._admit()
            t1 = time.perf_counter()
            self.stats.admit_s += t1 - t0
            if self.slots:
                out.extend(self._decode())
                self.stats.decode_s += time.perf_counter() - t1
            self.busy.record(wall, clock.now(), self.stats.slot_steps_used - used,
                             self.stats.slot_steps_capacity - capacity)
            self._count_parked()
            return out

    def take_busy_spans(self) -> list[tuple[str, float, float, float | None]]:
        """(lane, start, end, occupancy) of the steps since the last call (trainer/observe/timeline.py)."""
        return self.busy.take()

    def abort(self, request_ids: Iterable[int] | None = None,
              keep_cache: bool = False) -> list[Sample]:
        """Stop samples (default: all). With `keep_cache`, running ones keep their KV cache
        parked so that submitting them again continues without a prefill; without it, caches
        parked earlier (a segment stop) for these samples are given up too."""
        with self.lock:
            wanted = None if request_ids is None else set(request_ids)
            if not keep_cache:
                for rid in [r for r in self.parked if wanted is None or r in wanted]:
                    self._forget(rid)
            out = []
            keep_q: deque[Sample] = deque()
            for s in self.queue:
                if wanted is None or s.request_id in wanted:
                    s.finish_reason = ABORT
                    out.append(s)
                else:
                    keep_q.append(s)
            self.queue = keep_q
            for i in reversed(range(len(self.slots))):
                if wanted is None or self.slots[i].request_id in wanted:
                    s = self._park(i) if keep_cache else self._evict(i)
                    s.finish_reason = ABORT
                    out.append(s)
            self._count_parked()
            return out

    def update_weights(self, named_tensors, version: int, recompute_kv: bool = False) -> None:
        """Swap weights between decode steps. In-flight sequences keep their cache (computed
        by the old weights) unless `recompute_kv`, which re-prefills them under the new ones."""
        with self.lock:
            self.last_sync_bytes = self.decoder.load(named_tensors)
            self.version = version
            self.prompts.clear()  # computed by the old weights: never lent to a new sample
            if recompute_kv:
                self._forget_all()  # stale: resumed samples are prefilled under the new weights
                if self.slots:
                    self._prefill(list(range(len(self.slots))))

    def probe_logprobs(self, token_ids: list[int]) -> dict[str, list[float]]:
        """The weights decoding uses now, scored on `token_ids` (no slot touched)."""
        with self.lock:
            return {"embedded": self.decoder.score(list(token_ids))}

    def close(self) -> None:
        with self.lock:
            self.queue.clear()
            self.slots.clear()
            self.cached.clear()
            self._forget_all()
            self.prompt_kv_version.clear()
            self.prompts.clear()

    # --- memory (engine and trainer sharing one GPU) ----------------------------------------------
    def release_memory(self) -> bool:
        """Free the KV cache for the training phase (and return it to CUDA with empty_cache).
        Refused while sequences are running (their cache would be lost); queued samples stay
        queued. The next step() or reacquire_memory() allocates it again."""
        with self.lock:
            if self.slots:
                raise RuntimeError(f"release_memory: {len(self.slots)} sequences are running; "
                                   "finish or abort them before releasing the KV cache")
            if self.cache is None:
                return True
            self._forget_all()
            self.prompts.clear()
            self.cache.release()
            self.cache = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return True

    def reacquire_memory(self) -> None:
        """Allocate the KV cache again (with max_slots="auto", resized to the memory free now)."""
        with self.lock:
            if self.cache is not None:
                return
            if self.auto_slots:
                self.max_slots = slots_from_free_memory(self.decoder, self.max_seq_len,
                                                        self.kv_memory_fraction, cap=self.slots_cap)
            self.cache = self.decoder.new_cache(self.max_slots, self.max_seq_len)

    # --- internals --------------------------------------------------------------------------------
    def _tokens(self, s: Sample) -> list[int]:
        return s.prompt_ids + s.response_ids

    def _admit(self) -> list[Sample]:
        """Move queued samples into free slots (parked ones without a prefill) and prefill the
        new ones, within the token budget."""
        done, new = [], []
        budget = self.prefill_budget
        if self.parked and self.queue:  # queued samples with a parked cache go first: no prefill
            # the one whose cache already sits at the next active slot first (no copy), else
            # the next in queue order (its cache is swapped in)
            todo = {s.request_id: s for s in self.queue
                    if s.request_id in self.parked and s.finish_reason != LENGTH}
            order, k, resumed = list(todo), 0, set()
            while todo and len(self.slots) < self.max_slots:
                rid = self._parked_at(len(self.slots))
                if rid not in todo:
                    while order[k] not in todo:
                        k += 1
                    rid = order[k]
                if self._unpark(todo.pop(rid)):
                    resumed.add(rid)
            if resumed:
                self.queue = deque(s for s in self.queue if s.request_id not in resumed)
        while self.queue and len(self.slots) < self.max_slots:
            s = self.queue[0]
            if s.finish_reason == LENGTH:  # submitted with no budget left
                done.append(self.queue.popleft())
                continue
            n = len(s.prompt_ids) + len(s.response_ids) - 1
            if new and n > budget:
                break
            budget -= n
            self.queue.popleft()
            self._claim(len(self.slots))
            self.slots.append(s)
            self.cached.append(0)
            new.append(len(self.slots) - 1)
        if new:
            self._prefill(new)
        return done

    def _prefill(self, slot_ids: list[int]) -> None:
        rows = [self._tokens(self.slots[i])[:-1] for i in slot_ids]
        # the samples of a GRPO group start from the same prompt: each distinct context runs
        # through the model once and its KV entries are copied to the other slots: new samples
        # (no response yet) take them from the prompt cache (trainer/engine/prompt_cache.py),
        # else from a sample of the group already running (its siblings are admitted a few at a
        # time); a prompt that must be computed takes the queued new prompts with it
        first: dict[tuple, int] = {}
        fresh: dict[tuple, list[int]] = {}
        resumed, src, dst, shared_len = [], [], [], 0
        for i, r in zip(slot_ids, rows):
            if not r:
                continue
            key = tuple(r)
            if not self.slots[i].response_ids:
                fresh.setdefault(key, []).append(i)
            elif key in first:
                src.append(first[key])
                dst.append(i)
                shared_len = max(shared_len, len(r))
                self.stats.prefill_shared_tokens += len(r)
            else:
                first[key] = i
                resumed.append((i, r))
        copies = []
        # taken before this admission's own puts, which may evict them (least recently used)
        held = {k: e for k in fresh if (e := self.prompts.get(k)) is not None}
        missing = [k for k in fresh if k not in held]
        donors = self._prompt_donors(set(slot_ids)) if missing else {}
        compute = [k for k in missing if k not in donors]
        if compute:
            compute += self._lookahead(set(fresh), self.prefill_budget - sum(map(len, compute)))
        batches = {}
        for batch in _length_batches(compute):
            keys, values = self.decoder.prefill_batch([list(k) for k in batch])
            self.stats.prefill_calls += 1
            for b, key in enumerate(batch):
                batches[key] = (keys, values, b, len(key))
                self.prompts.put(key, keys, values, b)
        self.stats.prefill_tokens += sum(map(len, compute))
        for key, slots in fresh.items():
            entry = batches.get(key) or held.get(key)
            if entry is None:       # a running sibling's
                src.extend([donors[key]] * len(slots))
                dst.extend(slots)
                shared_len = max(shared_len, len(key))
            else:
                copies.extend((entry, i) for i in slots)
            self.stats.prefill_shared_tokens += len(key) * (len(slots) - (key in batches))
        for batch in _length_batches(resumed, len_of=lambda x: len(x[1])):
            self.decoder.prefill(self.cache, [i for i, _ in batch], [r for _, r in batch])
            self.stats.prefill_calls += 1
        if copies:
            copy_entries(copies, self.cache.k, self.cache.v)
        if dst:  # positions past a row's own length are garbage its decode never reads
            self.cache.copy_rows(src, dst, shared_len)
        self.stats.prefill_tokens += sum(len(r) for _, r in resumed)
        self.stats.resumed_prefill_tokens += sum(len(r) for _, r in resumed)
        for i, r in zip(slot_ids, rows):
            self.cached[i] = len(r)
            self.prompt_kv_version[self.slots[i].request_id] = self.version
        if len(self.prompt_kv_version) > 4 * self.max_slots:  # forget samples long gone
            keep = {s.request_id for s in self.slots} | set(self.parked)
            self.prompt_kv_version = {k: v for k, v in self.prompt_kv_version.items() if k in keep}

    def _lookahead(self, exclude: set[tuple], budget: int) -> list[tuple]:
        """Distinct prompts of queued new samples (prompt less its last token) that the prompt
        cache lacks, in queue order, within `budget` tokens and half the cache's bound: computed
        with the prompts an admission must prefill, one batch instead of a call each later."""
        budget = min(budget, self.prompts.max_tokens // 2)
        out, seen = [], set(exclude)
        for s in self.queue:
            if s.response_ids or len(s.prompt_ids) < 2:
                continue
            key = tuple(s.prompt_ids[:-1])
            if key in seen or key in self.prompts:
                continue
            seen.add(key)
            if len(key) > budget:
                break
            budget -= len(key)
            out.append(key)
        return out

    def _prompt_donors(self, exclude: set[int]) -> dict[tuple, int]:
        """Running slots (not in `exclude`) whose first cached positions hold their prompt's KV
        entries as today's weights compute them, by prompt less its last token (the part a new
        sample of that prompt prefills; the first decode step feeds the last token)."""
        out: dict[tuple, int] = {}
        for k, s in enumerate(self.slots):
            if k not in exclude and self.prompt_kv_version.get(s.request_id) == self.version:
                out.setdefault(tuple(s.prompt_ids[:-1]), k)
        return out

    # --- removal -------------------------------------------------------------------------------------
    def _evict(self, i: int) -> Sample:
        """Remove slot i, moving the last active slot into its place (slots stay compact)."""
        s = self.slots[i]
        self.prompt_kv_version.pop(s.request_id, None)
        last = len(self.slots) - 1
        if i != last:
            self.cache.move(last, i, self.cached[last])
            self.slots[i], self.cached[i] = self.slots[last], self.cached[last]
        self.slots.pop()
        self.cached.pop()
        return s

    def _decode(self) -> list[Sample]:
        B = len(self.slots)
        tokens = torch.tensor([_last(s) for s in self.slots], device=self.device)
        logits = self.decoder.decode(self.cache, tokens, self.cached)
        new_tokens, logprobs = self._sample(logits)
        stop = self._is_eos(new_tokens).tolist()
        new_tokens, logprobs = new_tokens.tolist(), logprobs.tolist()

        self.stats.decode_steps += 1
        self.stats.slot_steps_used += B
        self.stats.slot_steps_capacity += self.max_slots
        self.stats.generated_tokens += B

        finished = []
        version = self.version
        for i, s in enumerate(self.slots):
            s.response_ids.append(new_tokens[i])
            s.logprobs.append(logprobs[i])
            s.versions.append(version)
            s.segment_tokens += 1
            self.cached[i] += 1
            s.finish_reason = self._finish_reason(s, stop[i])
            if s.finish_reason is not None:
                finished.append(i)
        # descending: each removal touches only slot i and the last active slot; a segment stop
        # and an episode's turn keep their cache parked (like abort(keep_cache=True)), a
        # finished sample frees its slot
        out = [self._park(i) if _comes_back(self.slots[i]) else self._evict(i)
               for i in reversed(finished)]
        return out[::-1]

    # --- when a sequence stops (the one place) ----------------------------------------------------
    def _is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        """Which sampled tokens end their sequence."""
        return torch.isin(tokens, self.eos)

    @staticmethod
    def _finish_reason(s: Sample, eos: bool) -> str | None:
        """After a token was appended: why `s` leaves the engine now (None: it continues)."""
        if eos:
            return STOP
        if s.remaining <= 0:
            return LENGTH
        if s.params.segment_max_tokens is not None and s.segment_tokens >= s.params.segment_max_tokens:
            return SEGMENT
        return None

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row; return it and its log-probability under the
        temperature-scaled distribution (what the trainer recomputes)."""
        temps = [s.params.temperature for s in self.slots]
        greedy = [t <= 0 for t in temps]
        scale = torch.tensor([1.0 if g else t for g, t in zip(greedy, temps)], device=self.device)
        logp = torch.log_softmax(logits / scale.unsqueeze(1), dim=-1)
        if all(greedy):  # no draw: the RNG is left as it is
            choice = logits.argmax(dim=-1)
        else:
            probs = logp.exp()
            top_p = [s.params.top_p for s in self.slots]
            if any(p < 1 for p in top_p):
                probs = _top_p_filter(probs, torch.tensor(top_p, device=self.device))
            choice = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            if any(greedy):
                choice = torch.where(torch.tensor(greedy, device=self.device),
                                     logits.argmax(dim=-1), choice)
        return choice, logp.gather(1, choice.unsqueeze(1)).squeeze(1)


def _length_batches(items: list, len_of=len) -> list[list]:
    """Length-sorted batches with little padding: a long row must not pad many short ones."""
    out, batch, total = [], [], 0
    for item in sorted(items, key=len_of):
        n = len_of(item)
        if batch and (len(batch) + 1) * n > 1.25 * (total + n) + 32:
            out.append(batch)
            batch, total = [], 0
        batch.append(item)
        total += n
    if batch:
        out.append(batch)
    return out


def _comes_back(s: Sample) -> bool:
    """Whether a sample leaving the engine will be submitted again: stopped at its segment
    limit, or an episode's model turn that its environment answers (an episode over since is
    given up by the wrapper: `drop_cache`)."""
    if s.finish_reason == SEGMENT:
        return True
    return s.finish_reason == STOP and s.episode is not None and not s.episode.get("end")


def _last(s: Sample) -> int:
    """The sequence's last token (pending: not in the cache yet)."""
    return s.response_ids[-1] if s.response_ids else s.prompt_ids[-1]


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of strictly more likely tokens
    sorted_p = sorted_p.masked_fill(before >= top_p.unsqueeze(1), 0.0)
    return torch.zeros_like(probs).scatter(1, idx, sorted_p)
