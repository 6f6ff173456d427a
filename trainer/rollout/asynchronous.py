"""Asynchronous rollout (AReaL): generation never waits for training.

A generation worker (a thread here; it only talks to the engine through the engine interface,
so the engine may live on another device or behind HTTP) keeps the engine busy: it admits new
groups, steps the engine, scores groups as they complete and queues them. The trainer takes
the complete groups whose oldest token is oldest (`collect`; groups complete out of order, and
taking them as they completed would let a long answer's group fall out of the bound), trains,
and pushes new weights; the engine swaps them between two decode steps (interruptible
generation), so a long answer may carry tokens from several policy versions, each tagged with
its version.

Staleness bound eta (`async.max_staleness`): a new group is admitted only while

    accepted + running <= (eta + v + 1) * B        (v = current policy version, B = N groups/step)

where `accepted` counts every group queued and not dropped (trained or waiting) and `running`
those still generating; the number generating at once is also capped (`async.max_inflight`,
and at most 4 x `rollout.max_slots` samples, whatever the knob says: see `_cap`). A
group whose oldest token is still more than eta versions old when the trainer takes it is
dropped and gives its admission back (as AReaL counts a rejected rollout as not accepted: a
drop that kept its slot would narrow the window for good). eta = 0 is the synchronous loop: B
groups per version, generated with that version's weights.

The trainer never waits forever (`collect`): if nothing is queued, nothing is generating and the
rule admits nothing, no progress is possible, and after `async.collect_timeout_s` without any
progress either way the run stops with an `AsyncStall` naming the admission counters.

How the other techniques behave here (preset `all`):
- APRIL: generation has no step barrier, so there is nothing to terminate early; over-sampling
  is the in-flight cap, and "partial rollouts" are the interruptible samples that continue
  under new weights. A sample still stops at `april.segment_max_tokens` per version when APRIL
  is on, and yields its slot to the back of the queue (long answers cannot hog slots), unless
  its group is already eta versions old: one more version and it would be dropped as stale, so
  it gets its last chance (as in `april.py`) and runs to its end without a segment limit.
- GRESO: the pre-filter runs at admission, on the worker; p_easy/p_hard adapt once per
  training step from the groups that step consumed.
- Dynamic sampling: zero-variance groups are dropped on completion and never queued, so the
  trainer receives B groups with signal (after max_sampling_rounds x B filtered in a row the
  next is queued anyway: no signal to find must not stall the run).
The decoupled PPO loss (trainer/algo/decoupled.py) corrects for the staleness in training.

Long because the worker and the trainer side share one lock-guarded state (queue, running
groups, admission counters); this file is all of it.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import replace

from trainer.engine.base import SEGMENT, Sample, SamplingParams
from trainer.episode.environments import offered_tools
from trainer.rollout import april as april_mod
from trainer.rollout.auto_staleness import STABLE, STABLE_STEPS, TIGHTEN, behaviour_verdict
from trainer.rollout.base import Driver, Group, RolloutResult, StepCounts, new_group, sampling_params
from trainer.rollout.dynamic import filtered
from trainer.rollout.ledger import TokenLedger


def admission_allowed(accepted: int, running: int, version: int, eta: int, batch: int) -> bool:
    """AReaL's staleness rule: may one more group start now?"""
    return accepted + running + 1 <= admission_bound(version, eta, batch)


def admission_bound(version: int, eta: int, batch: int) -> int:
    return (eta + version + 1) * batch


class AsyncStall(RuntimeError):
    """The trainer waited for groups that cannot come (or did not come in time)."""


class CollectInterrupted(Exception):
    """A stop or pause waits at the step boundary: the step gave its groups back, unstarted."""


# at most this many times the engine's slots (rollout.max_slots) in samples generating at once
ENGINE_ROUNDS = 4

# a state that admits nothing with nothing queued or running must hold this long before it is
# called a deadlock (a knob change or a new version may be on its way)
_DEADLOCK_GRACE_S = 2.0


class AsyncDriver(Driver):
    concurrent = True

    def __init__(self, engine, tokenizer, selector, scorer, *, lock: threading.RLock,
                 batch: int = 0):
        self.engine, self.tokenizer = engine, tokenizer
        self.scorer, self.selector = scorer, selector
        self.batch = batch                   # groups per step (B), for the restored counters
        self.lock = lock                 # guards prompts/GRESO/reward state shared with the trainer
        self.cond = threading.Condition()
        self.queue: deque[Group] = deque()   # complete, scored, waiting for the trainer
        self.running: dict[int, Group] = {}  # id(group) -> generating group
        self.owner: dict[int, Group] = {}    # request id -> group
        self.accepted = 0                    # queued and not dropped: trained or waiting
        self.version = 0
        self.counts = StepCounts()
        self.scored: list[Group] = []        # scored since the last collect (metrics)
        self.dropped_stale = 0
        self.busy_s = 0.0                    # generator time spent stepping the engine
        self.progress_at = time.monotonic()  # the last admission, finished sample or queued group
        self.cfg = None
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._idle = threading.Event()       # set by the worker while it is paused
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._restored: list[Group] = []     # from a checkpoint, resumed first
        self._stable_steps = 0               # auto staleness: consecutive steps with weights near 1
        self._busy_reported = 0.0            # busy_s at the last report
        self.ledger = TokenLedger()
        self._filtered_tokens = 0            # dropped by dynamic sampling, not yet in the ledger
        self._filtered_in_a_row = 0          # groups dynamic sampling filtered since one was queued
        self._gave_up = 0                    # zero-variance groups queued after that many in a row
        self.said_gave_up = False            # a warning said so; reset by a knob change

    def held_tokens(self) -> int:
        with self.cond:
            groups = list(self.queue) + list(self.running.values()) + self._restored
        return sum(g.tokens() for g in groups)

    def held_draws(self) -> set[int]:
        # a group scored since the last collect (dynamic sampling's filtered ones are in no
        # queue) reaches the trainer's report with the next step
        with self.cond:
            groups = list(self.queue) + list(self.running.values()) + self._restored + self.scored
        return {g.draw for g in groups}

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self, cfg, version: int) -> None:
        self.cfg, self.version = cfg, version
        self._stop.clear()
        self._thread = threading.Thread(target=self._worker, name="rlpilot-generator",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the worker promptly (between two decode steps) and wait for it."""
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                raise RuntimeError("the generation worker did not stop within 30 s")
            self._thread = None

    @property
    def running_worker(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pause(self, wait: bool = False) -> None:
        """Stop generating at the next decode-step boundary (`wait`: until the worker is idle)."""
        self._paused.set()
        if wait and self._thread is not None and self._thread.is_alive():
            if not self._idle.wait(timeout=30):
                raise RuntimeError("the generation worker did not pause within 30 s")

    def resume(self) -> None:
        self._paused.clear()
        self._idle.clear()
        with self.cond:
            self.cond.notify_all()

    def suspended(self):
        """Hold the worker and take its samples out of the engine (for an evaluation or a
        checkpoint); on exit they are submitted again and continue where they stopped."""
        return self._suspended() if self.running_worker else contextlib.nullcontext([])

    @contextlib.contextmanager
    def _suspended(self):
        was_paused = self._paused.is_set()
        self.pause(wait=True)
        with self.cond:
            partial = self.engine.abort(keep_cache=True)
            # samples that finished but were not handed out yet (an engine in another process
            # files them while it waits for the abort's reply): hand them to the worker's
            # bookkeeping now. Left in the engine, the evaluation's generate() would take them
            # and their groups would wait forever; the checkpoint also sees them done
            left = self.engine.step() if self.engine.num_pending else []
        partial += [s for s in left if s.finish_reason == SEGMENT]
        self._handle([s for s in left if s.finish_reason != SEGMENT])
        with self.cond:  # nothing moves now: the ledger and the groups describe one moment
            self._settle_ledger()
        try:
            yield partial
        finally:
            if partial:
                self.engine.submit(partial)
            if not was_paused:
                self.resume()

    def set_config(self, cfg) -> None:
        """New knob values (eta, caps...) take effect at the worker's next admission."""
        with self.cond:
            self.cfg = cfg
            self.said_gave_up = False   # new knob values: giving up is news again
            self.cond.notify_all()

    def on_new_version(self, version: int) -> None:
        with self.cond:
            self.version = version
            self.cond.notify_all()

    # --- the trainer side -------------------------------------------------------------------------
    def _take_oldest(self, version: int) -> tuple[Group, int]:
        """Remove and return the queued group whose oldest token is oldest (the first queued on
        a tie), with that token's version. Groups complete out of order (a long answer started
        early finishes late); taking in completion order would let the trainer pass over such
        a group until it is too stale and must be dropped, wasting its whole generation."""
        def oldest(g):
            return min((min(s.policy_versions) for s in g.samples if s.policy_versions),
                       default=version)
        i = min(range(len(self.queue)), key=lambda k: oldest(self.queue[k]))
        g = self.queue[i]
        del self.queue[i]
        return g, oldest(g)

    def collect(self, cfg, version: int) -> RolloutResult:
        """Block until B groups are queued; return the oldest B whose staleness is within eta.
        Raises AsyncStall when no group can come (see the module docstring), and
        CollectInterrupted as soon as `interrupted()` says a stop or pause waits at the step
        boundary: the groups taken so far go back to the queue, so a checkpoint keeps them."""
        B = cfg.rollout.rollout_batch_size
        t0 = time.monotonic()
        taken: list[Group] = []
        stuck_since = None
        while True:
            with self.cond:
                self.cfg = cfg
                try:
                    self._take(taken, B, cfg, version)
                    if len(taken) >= B:
                        break
                    stuck_since = self._check_progress(cfg, t0, stuck_since, len(taken))
                except BaseException:
                    self._give_back(taken)
                    raise
                self.cond.wait(timeout=0.2)
            # outside the lock: reading the controls must never hold up the worker
            if self.interrupted():
                with self.cond:
                    self._give_back(taken)
                raise CollectInterrupted("a stop or pause is waiting at the step boundary")
        with self.cond:
            waited = time.monotonic() - t0
            counts, self.counts = self.counts, StepCounts()
            scored, self.scored = self.scored, []
            queue_len = len(self.queue)
            counters = self.counters()
            self._settle_ledger()
        taken.sort(key=lambda g: g.draw)
        staleness = [version - min(s.policy_versions) for g in taken for s in g.samples
                     if s.policy_versions]
        result = RolloutResult(groups=taken, scored=scored, gen_seconds=waited, counts=counts,
                               staleness=staleness)
        result.metrics = {"async/queue_size": queue_len, "async/running_groups": len(self.running),
                          "async/dropped_stale_groups": self.dropped_stale,
                          "async/max_staleness": cfg.async_.max_staleness,
                          "async/accepted": counters["accepted"],
                          "async/admission_bound": counters["bound"],
                          "async/trainer_wait_s": waited,
                          "rollout/effective_groups": len(taken),
                          "rollout/groups_started": counts.groups_started}
        result.events = self._give_up_warning(cfg)
        return result

    def _give_up_warning(self, cfg) -> list[tuple[str, dict]]:
        """Once until the knobs change: dynamic sampling found no signal in
        max_sampling_rounds x B groups in a row and let zero-variance groups through."""
        with self.cond:
            gave_up, self._gave_up = self._gave_up, 0
        if not gave_up or self.said_gave_up:
            return []
        self.said_gave_up = True
        n = cfg.rollout.max_sampling_rounds * cfg.rollout.rollout_batch_size
        return [("warning", {"message": (
            f"dynamic sampling found no group with different rewards in {n} in a row "
            f"(rollout.max_sampling_rounds x rollout.rollout_batch_size) and let {gave_up} "
            "zero-variance group(s) through, which train nothing; answers may all be alike "
            "(rollout.temperature, rollout.top_p) or the task too easy or too hard")})]

    def _take(self, taken: list[Group], B: int, cfg, version: int) -> None:
        """Move queued groups to `taken` (oldest first) until it holds B; a group older than eta
        is dropped (called under cond)."""
        while self.queue and len(taken) < B:
            g, oldest = self._take_oldest(version)
            if version - oldest > cfg.async_.max_staleness:
                self.dropped_stale += 1
                self.accepted -= 1  # a dropped group gives its admission back
                self.counts.discarded_tokens += g.tokens()
                self.ledger.drop("stale", g.tokens())
                self.cond.notify_all()
                continue
            taken.append(g)

    def _give_back(self, taken: list[Group]) -> None:
        """Return groups a collect took but will not train to the queue (called under cond)."""
        self.queue.extendleft(reversed(taken))
        taken.clear()
        self.cond.notify_all()

    def _check_progress(self, cfg, t0: float, stuck_since: float | None, taken: int):
        """Raise AsyncStall when no group can come; returns when the deadlock began (or None)."""
        self._raise_worker_error()
        if self._thread is None:
            raise RuntimeError("the generation worker is not running")
        now = time.monotonic()
        if self._deadlocked():
            stuck_since = stuck_since or now
            if now - stuck_since >= _DEADLOCK_GRACE_S:
                raise AsyncStall("asynchronous rollout deadlocked: nothing is queued or "
                                 "generating and the staleness rule admits no new group; "
                                 + self.counters_text(taken))
        else:
            stuck_since = None
        limit = cfg.async_.collect_timeout_s
        if now - max(t0, self.progress_at) > limit:
            raise AsyncStall(f"no generation progress for {limit:.0f} s "
                             f"(async.collect_timeout_s); " + self.counters_text(taken))
        return stuck_since

    def _settle_ledger(self) -> None:
        """Hand the ledger the tokens the worker dropped since the last call (the ledger is the
        trainer thread's; called under cond, on the trainer thread)."""
        if self._filtered_tokens:
            self.ledger.drop("zero_variance", self._filtered_tokens)
            self._filtered_tokens = 0

    def counters(self) -> dict[str, int]:
        """The admission counters (for metrics, benchmarks and stall messages)."""
        cfg = self.cfg
        return {"accepted": self.accepted, "running": len(self.running),
                "queued": len(self.queue), "version": self.version,
                "eta": cfg.async_.max_staleness, "batch": cfg.rollout.rollout_batch_size,
                "bound": admission_bound(self.version, cfg.async_.max_staleness,
                                         cfg.rollout.rollout_batch_size),
                "dropped_stale": self.dropped_stale}

    def counters_text(self, taken: int) -> str:
        c = self.counters()
        return (f"accepted={c['accepted']} running={c['running']} queued={c['queued']} "
                f"taken={taken}/{c['batch']} bound=(eta {c['eta']} + version {c['version']} + 1)"
                f" x B {c['batch']} = {c['bound']}, dropped as stale={c['dropped_stale']}")

    def _deadlocked(self) -> bool:
        """Nothing queued or generating, and the rule admits nothing (called under cond)."""
        return (not self.queue and not self.running and not self._restored
                and not self._paused.is_set() and not self._can_admit())

    def report(self, cfg, result, version, step_s, hist) -> dict[str, float]:
        """Staleness against eta, and how much each side waited for the other."""
        staleness = result.staleness
        hist("async/staleness", staleness, [float(i) for i in range(cfg.async_.max_staleness + 2)])
        busy, self._busy_reported = self.busy_s - self._busy_reported, self.busy_s
        m = {"async/staleness/mean": sum(staleness) / max(len(staleness), 1),
             "async/staleness/max": max(staleness, default=0),
             "async/generator_idle_frac": max(0.0, 1.0 - busy / max(step_s, 1e-9)),
             "async/trainer_idle_frac": result.gen_seconds / max(step_s, 1e-9)}
        if cfg.april.enabled:
            m.update(april_mod.report(result, version, hist, None))
        return m

    def retune(self, cfg, tm: dict[str, float]) -> dict | None:
        """async.auto_staleness: tighten eta when behaviour importance weights drift from 1
        (data too stale), relax it after STABLE_STEPS steps near 1 (trainer/rollout/auto_staleness.py).
        Returns the `auto_staleness` event."""
        a = cfg.async_
        if not a.auto_staleness or "actor/behave_imp_weight" not in tm:
            return None
        capped = tm.get("actor/behave_capped_ratio", 0.0)
        verdict = behaviour_verdict(tm["actor/behave_imp_weight"], capped)   # the pilot's eta rules' too
        new = a.max_staleness
        if verdict == TIGHTEN:
            new, self._stable_steps = max(0, a.max_staleness - 1), 0
        elif verdict == STABLE:
            self._stable_steps += 1
            if self._stable_steps >= STABLE_STEPS:
                new, self._stable_steps = min(a.auto_staleness_max, a.max_staleness + 1), 0
        if new == a.max_staleness:
            return None
        return {"kind": "auto_staleness",
                "changes": {"async.max_staleness": {"old": a.max_staleness, "new": new}},
                "behave_imp_weight": tm["actor/behave_imp_weight"], "capped_ratio": capped}

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"generation worker failed: {type(err).__name__}: {err}") from err

    # --- the worker -----------------------------------------------------------------------------
    def _worker(self) -> None:
        try:
            while not self._stop.is_set():
                if self._paused.is_set():
                    self._idle.set()
                    self._stop.wait(0.02)
                    continue
                self._idle.clear()
                self._admit()
                if not self.engine.num_pending:
                    with self.cond:  # nothing to do until a new version or a stop
                        if not self._stop.is_set() and not self._can_admit():
                            self.cond.wait(timeout=0.2)
                    continue
                t0 = time.monotonic()
                finished = self.engine.step()
                self.busy_s += time.monotonic() - t0
                self._handle(finished)
        except BaseException as e:  # surfaced to the trainer by collect()
            self._error = e
            with self.cond:
                self.cond.notify_all()

    def _cap(self) -> int:
        """Groups generating at once: `async.max_inflight` (0 = 2B), but never more samples than
        fill the engine's slots ENGINE_ROUNDS times (rollout.max_slots in each of
        cluster.gen_procs generation processes). Past that, samples wait in the engine's
        queue, and a sample parked at APRIL's segment limit rejoins behind all of them: with a
        large eta nearly every group then waits for all the others, and no step completes."""
        cfg = self.cfg
        wanted = cfg.async_.max_inflight or 2 * cfg.rollout.rollout_batch_size
        slots = cfg.rollout.max_slots * max(1, cfg.cluster.gen_procs)
        fits = ENGINE_ROUNDS * slots // cfg.rollout.n_samples_per_prompt
        return max(1, min(wanted, fits))

    def _can_admit(self) -> bool:
        cfg = self.cfg
        return (len(self.running) < self._cap() and
                admission_allowed(self.accepted, len(self.running), self.version,
                                  cfg.async_.max_staleness, cfg.rollout.rollout_batch_size))

    def _params(self) -> SamplingParams:
        segment = april_mod.segment_limit(self.cfg) if self.cfg.april.enabled else None
        return sampling_params(self.cfg, segment)

    def _admit(self) -> None:
        while self._restored and len(self.running) < self._cap():
            g = self._restored.pop(0)
            self._launch(g, g.unfinished)
        while self._can_admit():
            with self.lock:
                draw, problem = self.selector(self.cfg, self.counts)
            g = new_group(draw, problem, self.tokenizer, self.cfg.rollout.n_samples_per_prompt,
                          self._params(), offered_tools(self.cfg))
            self.counts.groups_started += 1
            self._launch(g, g.samples)

    def _launch(self, g: Group, samples: list[Sample]) -> None:
        for sm in samples:
            self.owner[sm.request_id] = g
        with self.cond:
            self.running[id(g)] = g
        self.counts.submitted += len(samples)
        self.progress_at = time.monotonic()
        self.engine.submit(samples)

    def _handle(self, finished: list[Sample]) -> None:
        complete: dict[int, Group] = {}  # a group whose samples finish together counts once
        for s in finished:
            g = self.owner.get(s.request_id)
            if s.finish_reason == SEGMENT:  # APRIL segment limit: back of the queue
                if g is not None and april_mod.last_chance(g, self.version,
                                                           self.cfg.async_.max_staleness, "drop"):
                    # one more version and it is stale: its last chance, to its end unsegmented
                    s.params = replace(s.params, segment_max_tokens=None)
                self.engine.submit([s])
                continue
            self.owner.pop(s.request_id, None)
            self.counts.completed += 1
            self.progress_at = time.monotonic()
            if g is not None and g.complete and id(g) in self.running:
                complete[id(g)] = g
        if not complete:
            return
        complete = list(complete.values())
        with self.lock:
            self.scorer(complete)
        dynamic = self.cfg.rollout.dynamic_sampling
        # a group leaves `running` only once it is queued (or filtered): the trainer never sees
        # a moment where a scored group is in neither, which would look like a deadlock
        with self.cond:
            for g in complete:
                del self.running[id(g)]
                self.scored.append(g)
                # dynamic sampling never waits forever for signal (a temperature or top_p that
                # makes every answer alike): after max_sampling_rounds x B groups filtered in a
                # row, as many as a synchronous step may draw, the next one is queued anyway and
                # the objective leaves it out (counted as zero-variance waste)
                give_up = (self.cfg.rollout.max_sampling_rounds
                           * self.cfg.rollout.rollout_batch_size)
                if dynamic and filtered(g) and self._filtered_in_a_row < give_up:
                    self._filtered_in_a_row += 1
                    self.counts.filtered_groups += 1
                    self.counts.discarded_tokens += g.tokens()
                    self._filtered_tokens += g.tokens()
                    continue
                if dynamic and filtered(g):
                    self._gave_up += 1
                self._filtered_in_a_row = 0
                self.queue.append(g)
                self.accepted += 1
            self.cond.notify_all()

    # --- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Queued groups and in-flight samples (with their tokens so far); called at a step
        boundary. In-flight samples are aborted, saved, and submitted again."""
        with self.suspended(), self.cond:
            buf = april_mod.PartialBuffer()
            for g in list(self.queue) + list(self.running.values()) + self._restored:
                buf.put(g)
            return {"groups": buf.state_dict()["groups"], "accepted": self.accepted,
                    "queued": len(self.queue), "dropped_stale": self.dropped_stale}

    def load_state_dict(self, state: dict, version: int) -> None:
        """Restore queued and partial groups. `accepted` is rebased on the restored version
        (v * B consumed + the queue), so the staleness bound holds after a resume: a counter
        restarted at 0 would admit a burst of (eta + v + 1) * B groups at once."""
        batch = self.batch
        if not state:
            self.accepted = version * batch
            return
        buf = april_mod.PartialBuffer()
        buf.load_state_dict({"groups": state.get("groups", [])})
        self.queue = deque(g for g in buf.groups if g.complete and g.scored)
        self._restored = [g for g in buf.groups if not g.complete]
        self.accepted = version * batch + len(self.queue)
        self.dropped_stale = state.get("dropped_stale", 0)
        self.version = version

