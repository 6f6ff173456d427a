"""Collect: a training step's groups, assembled on the trainer's thread from the worker's queue.

`collect` waits until B groups are taken, taking the queued group whose oldest token is oldest
first and dropping those staler than eta (admission.py); the step's result carries them sorted
by draw, every group scored since the last collect, the sample accounting and the staleness of
each sample. The trainer never waits forever: if nothing is queued, nothing is generating and the
rule admits nothing, no progress is possible, and after `async.collect_timeout_s` without any
progress either way the run stops with an `AsyncStall` naming the admission counters. A stop or
pause waiting at the step boundary (`interrupted`) gives the groups taken back to the queue
(a checkpoint keeps them) and raises `CollectInterrupted`.
"""
from __future__ import annotations

import time
from typing import Callable

from trainer.rollout.asynchronous import admission
from trainer.rollout.asynchronous.state import AsyncState
from trainer.rollout.asynchronous.worker import GenerationWorker
from trainer.rollout.base import Group, RolloutResult, StepCounts
from trainer.rollout.ledger import TokenLedger


class AsyncStall(RuntimeError):
    """The trainer waited for groups that cannot come (or did not come in time)."""


class CollectInterrupted(Exception):
    """A stop or pause waits at the step boundary: the step gave its groups back, unstarted."""


# a state that admits nothing with nothing queued or running must hold this long before it is
# called a deadlock (a knob change or a new version may be on its way)
DEADLOCK_GRACE_S = 2.0


def collect(state: AsyncState, worker: GenerationWorker, ledger: TokenLedger, cfg, version: int,
            interrupted: Callable[[], bool]) -> RolloutResult:
    """Block until B groups are taken; return them (the oldest B within eta). Raises AsyncStall
    when no group can come, CollectInterrupted when `interrupted()` says a stop or pause waits."""
    B = cfg.rollout.rollout_batch_size
    t0 = time.monotonic()
    taken: list[Group] = []
    stuck_since = None
    while True:
        with state.cond:
            state.cfg = cfg
            try:
                take(state, ledger, taken, B, cfg.async_.max_staleness, version)
                if len(taken) >= B:
                    break
                stuck_since = check_progress(state, worker, cfg, t0, stuck_since, len(taken))
            except BaseException:
                give_back(state, taken)
                raise
            state.cond.wait(timeout=0.2)
        # outside the lock: reading the controls must never hold up the worker
        if interrupted():
            with state.cond:
                give_back(state, taken)
            raise CollectInterrupted("a stop or pause is waiting at the step boundary")
    with state.cond:
        waited = time.monotonic() - t0
        counts, state.counts = state.counts, StepCounts()
        scored, state.scored = state.scored, []
        queue_len = len(state.queue)
        counters = state.counters()
        settle_ledger(state, ledger)
    taken.sort(key=lambda g: g.draw)
    staleness = [version - min(s.policy_versions) for g in taken for s in g.samples
                 if s.policy_versions]
    result = RolloutResult(groups=taken, scored=scored, gen_seconds=waited, counts=counts,
                           staleness=staleness)
    result.metrics = {"async/queue_size": queue_len, "async/running_groups": len(state.running),
                      "async/dropped_stale_groups": state.dropped_stale,
                      "async/max_staleness": cfg.async_.max_staleness,
                      "async/accepted": counters["accepted"],
                      "async/admission_bound": counters["bound"],
                      "async/trainer_wait_s": waited,
                      "rollout/effective_groups": len(taken),
                      "rollout/groups_started": counts.groups_started}
    return result


def take(state: AsyncState, ledger: TokenLedger, taken: list[Group], B: int, eta: int,
         version: int) -> None:
    """Move queued groups to `taken`, oldest first, until it holds B; a group staler than eta
    is dropped and gives its admission back (under cond)."""
    while state.queue and len(taken) < B:
        i = admission.oldest_first(state.queue, version)
        g = state.queue[i]
        del state.queue[i]
        if admission.too_stale(version, admission.oldest_version(g, version), eta):
            state.dropped_stale += 1
            state.accepted -= 1  # a dropped group gives its admission back
            state.counts.discarded_tokens += g.tokens()
            ledger.drop("stale", g.tokens())
            state.cond.notify_all()
            continue
        taken.append(g)


def give_back(state: AsyncState, taken: list[Group]) -> None:
    """Return groups a collect took but will not train to the queue's front (under cond)."""
    state.queue.extendleft(reversed(taken))
    taken.clear()
    state.cond.notify_all()


def check_progress(state: AsyncState, worker: GenerationWorker, cfg, t0: float,
                   stuck_since: float | None, taken: int) -> float | None:
    """Raise AsyncStall when no group can come; returns when the deadlock began (or None)
    (under cond)."""
    worker.raise_error()
    if not worker.started:
        raise RuntimeError("the generation worker is not running")
    now = time.monotonic()
    if deadlocked(state, worker):
        stuck_since = stuck_since or now
        if now - stuck_since >= DEADLOCK_GRACE_S:
            raise AsyncStall("asynchronous rollout deadlocked: nothing is queued or "
                             "generating and the staleness rule admits no new group; "
                             + admission.counters_text(state.counters(), taken))
    else:
        stuck_since = None
    limit = cfg.async_.collect_timeout_s
    if now - max(t0, state.progress_at) > limit:
        raise AsyncStall(f"no generation progress for {limit:.0f} s "
                         f"(async.collect_timeout_s); "
                         + admission.counters_text(state.counters(), taken))
    return stuck_since


def deadlocked(state: AsyncState, worker: GenerationWorker) -> bool:
    """Nothing queued or generating, and the rule admits nothing (under cond)."""
    return (not state.queue and not state.running and not state.restored
            and not worker.paused and not state.can_admit())


def settle_ledger(state: AsyncState, ledger: TokenLedger) -> None:
    """Hand the ledger the tokens the worker dropped since the last call (the ledger is the
    trainer thread's; under cond, on the trainer thread)."""
    if state.filtered_tokens:
        ledger.drop("zero_variance", state.filtered_tokens)
        state.filtered_tokens = 0


def give_up_warning(state: AsyncState, cfg, said: bool) -> list[tuple[str, dict]]:
    """The warning that dynamic sampling found no signal in max_sampling_rounds x B groups in a
    row and let zero-variance groups through; none when nothing gave up or it was `said`."""
    with state.cond:
        gave_up, state.gave_up = state.gave_up, 0
    if not gave_up or said:
        return []
    n = cfg.rollout.max_sampling_rounds * cfg.rollout.rollout_batch_size
    return [("warning", {"message": (
        f"dynamic sampling found no group with different rewards in {n} in a row "
        f"(rollout.max_sampling_rounds x rollout.rollout_batch_size) and let {gave_up} "
        "zero-variance group(s) through, which train nothing; answers may all be alike "
        "(rollout.temperature, rollout.top_p) or the task too easy or too hard")})]
