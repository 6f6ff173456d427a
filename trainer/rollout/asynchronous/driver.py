"""The asynchronous driver: the rollout driver interface (base.Driver) over the generation worker
(worker.py), the shared state (state.py) and collect (collect.py).

It starts, pauses, resumes and closes the worker with the run; passes new knob values and policy
versions to the state the worker admits by; holds the worker while an evaluation or a checkpoint
uses the engine (`suspended`); reports staleness against eta and how much each side waited;
moves eta itself with `async.auto_staleness` (`retune`); and keeps the queued and in-flight
groups in checkpoints, with the admission counter rebased on the restored version.
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque

from trainer.rollout import april as april_mod
from trainer.rollout.asynchronous import collect as collecting
from trainer.rollout.asynchronous.admission import counters_text
from trainer.rollout.asynchronous.state import AsyncState
from trainer.rollout.asynchronous.worker import GenerationWorker
from trainer.rollout.auto_staleness import STABLE, STABLE_STEPS, TIGHTEN, behaviour_verdict
from trainer.rollout.base import Driver, RolloutResult
from trainer.rollout.ledger import TokenLedger


class AsyncDriver(Driver):
    concurrent = True

    def __init__(self, engine, tokenizer, selector, scorer, *, lock: threading.RLock,
                 batch: int = 0):
        self.engine = engine
        self.batch = batch                   # groups per step (B), for the restored counters
        self.state = AsyncState()
        self.worker = GenerationWorker(self.state, engine, tokenizer, selector, scorer, lock)
        self.ledger = TokenLedger()
        self._stable_steps = 0               # auto staleness: consecutive steps with weights near 1
        self._busy_reported = 0.0            # the worker's busy_s at the last report
        self.said_gave_up = False            # a warning said so; reset by a knob change

    def held_tokens(self) -> int:
        with self.state.cond:
            groups = self.state.held()
        return sum(g.tokens() for g in groups)

    def held_draws(self) -> set[int]:
        # a group scored since the last collect (dynamic sampling's filtered ones are in no
        # queue) reaches the trainer's report with the next step
        with self.state.cond:
            groups = self.state.held() + self.state.scored
        return {g.draw for g in groups}

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self, cfg, version: int) -> None:
        self.state.cfg, self.state.version = cfg, version
        self.worker.start()

    def close(self) -> None:
        """Stop the worker promptly (between two decode steps) and wait for it."""
        self.worker.close()

    def pause(self, wait: bool = False) -> None:
        """Stop generating at the next decode-step boundary (`wait`: until the worker is idle)."""
        self.worker.pause(wait)

    def resume(self) -> None:
        self.worker.resume()

    def suspended(self):
        """Hold the worker and take its samples out of the engine (for an evaluation or a
        checkpoint); on exit they are submitted again and continue where they stopped."""
        return self._suspended() if self.worker.alive else contextlib.nullcontext([])

    @contextlib.contextmanager
    def _suspended(self):
        was_paused = self.worker.paused
        self.worker.pause(wait=True)
        partial = self.worker.take_out()
        with self.state.cond:  # nothing moves now: the ledger and the groups describe one moment
            collecting.settle_ledger(self.state, self.ledger)
        try:
            yield partial
        finally:
            if partial:
                self.engine.submit(partial)
            if not was_paused:
                self.worker.resume()

    def set_config(self, cfg) -> None:
        """New knob values (eta, caps...) take effect at the worker's next admission."""
        with self.state.cond:
            self.state.cfg = cfg
            self.said_gave_up = False   # new knob values: giving up is news again
            self.state.cond.notify_all()

    def on_new_version(self, version: int) -> None:
        with self.state.cond:
            self.state.version = version
            self.state.cond.notify_all()

    # --- the trainer side -------------------------------------------------------------------------
    def collect(self, cfg, version: int) -> RolloutResult:
        """Block until B groups are queued; return the oldest B whose staleness is within eta
        (collect.py). Raises AsyncStall when no group can come, and CollectInterrupted as soon
        as `interrupted()` says a stop or pause waits at the step boundary: the groups taken so
        far go back to the queue, so a checkpoint keeps them."""
        result = collecting.collect(self.state, self.worker, self.ledger, cfg, version,
                                    self.interrupted)
        result.events = collecting.give_up_warning(self.state, cfg, self.said_gave_up)
        self.said_gave_up = self.said_gave_up or bool(result.events)
        return result

    def counters(self) -> dict[str, int]:
        """The admission counters (for metrics, benchmarks and stall messages)."""
        return self.state.counters()

    def counters_text(self, taken: int) -> str:
        return counters_text(self.state.counters(), taken)

    def report(self, cfg, result, version, step_s, hist) -> dict[str, float]:
        """Staleness against eta, and how much each side waited for the other."""
        staleness = result.staleness
        hist("async/staleness", staleness, [float(i) for i in range(cfg.async_.max_staleness + 2)])
        busy_s = self.state.busy_s
        busy, self._busy_reported = busy_s - self._busy_reported, busy_s
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

    # --- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Queued groups and in-flight samples (with their tokens so far); called at a step
        boundary. In-flight samples are aborted, saved, and submitted again."""
        state = self.state
        with self.suspended(), state.cond:
            buf = april_mod.PartialBuffer()
            for g in state.held():
                buf.put(g)
            return {"groups": buf.state_dict()["groups"], "accepted": state.accepted,
                    "queued": len(state.queue), "dropped_stale": state.dropped_stale}

    def load_state_dict(self, saved: dict, version: int) -> None:
        """Restore queued and partial groups. `accepted` is rebased on the restored version
        (v * B consumed + the queue), so the staleness bound holds after a resume: a counter
        restarted at 0 would admit a burst of (eta + v + 1) * B groups at once."""
        state, batch = self.state, self.batch
        if not saved:
            state.accepted = version * batch
            return
        buf = april_mod.PartialBuffer()
        buf.load_state_dict({"groups": saved.get("groups", [])})
        state.queue = deque(g for g in buf.groups if g.complete and g.scored)
        state.restored = [g for g in buf.groups if not g.complete]
        state.accepted = version * batch + len(state.queue)
        state.dropped_stale = saved.get("dropped_stale", 0)
        state.version = version
