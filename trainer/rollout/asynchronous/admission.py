"""Admission and staleness (AReaL's bound eta): which groups may start, how many may generate at
once, and which queued group is too stale to train.

1. Start (`admission_allowed`): one more group may start while

       accepted + running + 1 <= (eta + v + 1) * B     (`admission_bound`)

   `accepted` counts the groups queued and not dropped (trained or waiting), `running` those
   still generating, v is the current policy version and B the groups a step trains. eta = 0
   is the synchronous loop: B groups per version, generated with that version's weights.
2. In flight (`inflight_cap`): at most `async.max_inflight` groups (0 = 2B) generate at once,
   and never more samples than fill the engine's slots ENGINE_ROUNDS times (rollout.max_slots in
   each of cluster.gen_procs generation processes). Past that, samples wait in the engine's
   queue, and a sample parked at APRIL's segment limit rejoins behind all of them: with a large
   eta nearly every group then waits for all the others, and no step completes.
3. Take (`oldest_first`): the trainer takes the queued group whose oldest token is oldest (the
   first queued on a tie). Groups complete out of order (a long answer started early finishes
   late); taking them in completion order would let the trainer pass over such a group until it
   is too stale, wasting its whole generation.
4. Drop (`too_stale`): a group whose oldest token is more than eta versions old when the trainer
   takes it is dropped, and gives its admission back (AReaL counts a rejected rollout as not
   accepted: a drop that kept its slot would narrow the window for good).

Pure logic: no engine, no config object, no lock. Hand-computed tests: tests/test_async.py.
"""
from __future__ import annotations

# at most this many times the engine's slots (rollout.max_slots) in samples generating at once
ENGINE_ROUNDS = 4


def admission_bound(version: int, eta: int, batch: int) -> int:
    """(eta + v + 1) * B: the groups that may be accepted or running at policy version v."""
    return (eta + version + 1) * batch


def admission_allowed(accepted: int, running: int, version: int, eta: int, batch: int) -> bool:
    """AReaL's staleness rule: may one more group start now?"""
    return accepted + running + 1 <= admission_bound(version, eta, batch)


def inflight_cap(max_inflight: int, batch: int, max_slots: int, gen_procs: int,
                 samples_per_group: int) -> int:
    """Groups generating at once: `max_inflight` (0 = 2B), at most ENGINE_ROUNDS times the
    engine's slots (`max_slots` in each of `gen_procs` processes, at least one) in samples; at
    least 1."""
    wanted = max_inflight or 2 * batch
    fits = ENGINE_ROUNDS * max_slots * max(1, gen_procs) // samples_per_group
    return max(1, min(wanted, fits))


def may_start(accepted: int, running: int, version: int, eta: int, batch: int, cap: int) -> bool:
    """One more group may start: under the in-flight cap and within the staleness bound."""
    return running < cap and admission_allowed(accepted, running, version, eta, batch)


def oldest_version(group, default: int) -> int:
    """The policy version of `group`'s oldest token (`default` when it has none yet)."""
    return min((min(s.policy_versions) for s in group.samples if s.policy_versions),
               default=default)


def oldest_first(queue, version: int) -> int:
    """The index in `queue` of the group whose oldest token is oldest (the first on a tie)."""
    return min(range(len(queue)), key=lambda k: oldest_version(queue[k], version))


def too_stale(version: int, oldest: int, eta: int) -> bool:
    """A group whose oldest token is from version `oldest` is more than eta versions old."""
    return version - oldest > eta


def counters_text(c: dict[str, int], taken: int) -> str:
    """The admission counters (`AsyncState.counters`) for a stall message."""
    return (f"accepted={c['accepted']} running={c['running']} queued={c['queued']} "
            f"taken={taken}/{c['batch']} bound=(eta {c['eta']} + version {c['version']} + 1)"
            f" x B {c['batch']} = {c['bound']}, dropped as stale={c['dropped_stale']}")
