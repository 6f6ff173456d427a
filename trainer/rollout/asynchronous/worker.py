"""The generation worker: a thread that keeps the engine busy, never waiting for the trainer.

Its loop: admit (groups restored from a checkpoint first, then new prompts while the staleness
rule allows, state.py / admission.py) -> submit their samples -> step the engine -> handle what
finished: a sample parked at APRIL's segment limit goes to the back of the engine's queue (its
last chance, unsegmented, when its group is eta versions old: one more version and it would be
dropped), a complete group is scored and queued for the trainer, or left out by dynamic sampling.
It talks to the engine only through the engine interface, so the engine may live in another
process or behind HTTP. It stops, pauses and resumes between two decode steps; an error ends the
loop and is raised to the trainer by the next collect (`raise_error`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

from trainer.engine.base import SEGMENT, Sample, SamplingParams
from trainer.episode.environments import offered_tools
from trainer.rollout import april as april_mod
from trainer.rollout.asynchronous.state import AsyncState
from trainer.rollout.base import Group, new_group, sampling_params
from trainer.rollout.dynamic import filtered


class GenerationWorker:
    def __init__(self, state: AsyncState, engine, tokenizer, selector, scorer,
                 lock: threading.RLock):
        self.state = state
        self.engine, self.tokenizer = engine, tokenizer
        self.selector, self.scorer = selector, scorer
        self.lock = lock                 # guards prompts/GRESO/reward state shared with the trainer
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._idle = threading.Event()       # set by the worker while it is paused
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # --- the thread's life ------------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rlpilot-generator", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread promptly (between two decode steps) and wait for it."""
        self._stop.set()
        with self.state.cond:
            self.state.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                raise RuntimeError("the generation worker did not stop within 30 s")
            self._thread = None

    @property
    def started(self) -> bool:
        """A thread was started and not closed (it may have ended with an error)."""
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def pause(self, wait: bool = False) -> None:
        """Stop generating at the next decode-step boundary (`wait`: until the worker is idle)."""
        self._paused.set()
        if wait and self.alive:
            if not self._idle.wait(timeout=30):
                raise RuntimeError("the generation worker did not pause within 30 s")

    def resume(self) -> None:
        self._paused.clear()
        self._idle.clear()
        with self.state.cond:
            self.state.cond.notify_all()

    def raise_error(self) -> None:
        """Raise, on the caller's thread, the error that ended the loop (once)."""
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"generation worker failed: {type(err).__name__}: {err}") from err

    def take_out(self) -> list[Sample]:
        """(Paused) Take the in-flight samples out of the engine, keeping their cache, and return
        them. Samples that finished but were not handed out yet (an engine in another process
        files them while it waits for the abort's reply) are handled now: left in the engine,
        an evaluation's generate() would take them and their groups would wait forever."""
        with self.state.cond:
            partial = self.engine.abort(keep_cache=True)
            left = self.engine.step() if self.engine.num_pending else []
        partial += [s for s in left if s.finish_reason == SEGMENT]
        self.handle([s for s in left if s.finish_reason != SEGMENT])
        return partial

    # --- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        state = self.state
        try:
            while not self._stop.is_set():
                if self._paused.is_set():
                    self._idle.set()
                    self._stop.wait(0.02)
                    continue
                self._idle.clear()
                self.admit()
                if not self.engine.num_pending:
                    with state.cond:  # nothing to do until a new version or a stop
                        if not self._stop.is_set() and not state.can_admit():
                            state.cond.wait(timeout=0.2)
                    continue
                t0 = time.monotonic()
                finished = self.engine.step()
                state.busy_s += time.monotonic() - t0
                self.handle(finished)
        except BaseException as e:  # surfaced to the trainer by collect()
            self._error = e
            with state.cond:
                state.cond.notify_all()

    def _params(self) -> SamplingParams:
        cfg = self.state.cfg
        return sampling_params(cfg, april_mod.segment_limit(cfg) if cfg.april.enabled else None)

    def admit(self) -> None:
        """Start the restored groups (up to the cap), then new ones while the rule allows."""
        state = self.state
        while state.restored and len(state.running) < state.cap():
            g = state.restored.pop(0)
            self.launch(g, g.unfinished)
        while state.can_admit():
            cfg = state.cfg
            with self.lock:
                draw, problem = self.selector(cfg, state.counts)
            g = new_group(draw, problem, self.tokenizer, cfg.rollout.n_samples_per_prompt,
                          self._params(), offered_tools(cfg))
            state.counts.groups_started += 1
            self.launch(g, g.samples)

    def launch(self, g: Group, samples: list[Sample]) -> None:
        state = self.state
        for sm in samples:
            state.owner[sm.request_id] = g
        with state.cond:
            state.running[id(g)] = g
        state.counts.submitted += len(samples)
        state.progress_at = time.monotonic()
        self.engine.submit(samples)

    def handle(self, finished: list[Sample]) -> None:
        """Samples the engine returned: a segment stop goes back to the engine's queue; a group
        whose last sample finished is scored and queued (or left out by dynamic sampling)."""
        state = self.state
        complete: dict[int, Group] = {}  # a group whose samples finish together counts once
        for s in finished:
            g = state.owner.get(s.request_id)
            if s.finish_reason == SEGMENT:  # APRIL segment limit: back of the queue
                if g is not None and april_mod.last_chance(g, state.version,
                                                           state.cfg.async_.max_staleness, "drop"):
                    # one more version and it is stale: its last chance, to its end unsegmented
                    s.params = replace(s.params, segment_max_tokens=None)
                self.engine.submit([s])
                continue
            state.owner.pop(s.request_id, None)
            state.counts.completed += 1
            state.progress_at = time.monotonic()
            if g is not None and g.complete and id(g) in state.running:
                complete[id(g)] = g
        if not complete:
            return
        groups = list(complete.values())
        with self.lock:
            self.scorer(groups)
        # a group leaves `running` only once it is queued (or filtered): the trainer never sees
        # a moment where a scored group is in neither, which would look like a deadlock
        with state.cond:
            for g in groups:
                del state.running[id(g)]
                state.scored.append(g)
                self._file(g)
            state.cond.notify_all()

    def _file(self, g: Group) -> None:
        """Queue a scored group for the trainer, or leave it out by dynamic sampling (under cond).
        Dynamic sampling never waits forever for signal (a temperature or top_p that makes every
        answer alike): after max_sampling_rounds x B groups filtered in a row, as many as a
        synchronous step may draw, the next one is queued anyway and the objective leaves it
        out (counted as zero-variance waste)."""
        state, cfg = self.state, self.state.cfg
        dynamic = cfg.rollout.dynamic_sampling
        give_up = cfg.rollout.max_sampling_rounds * cfg.rollout.rollout_batch_size
        if dynamic and filtered(g) and state.filtered_in_a_row < give_up:
            state.filtered_in_a_row += 1
            state.counts.filtered_groups += 1
            state.counts.discarded_tokens += g.tokens()
            state.filtered_tokens += g.tokens()
            return
        if dynamic and filtered(g):
            state.gave_up += 1
        state.filtered_in_a_row = 0
        state.queue.append(g)
        state.accepted += 1
