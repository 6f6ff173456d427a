"""The Runner: one training run, start to finish.

    runner = Runner(cfg, run_dir, sink=..., controls=...)
    status = runner.run()      # "finished" | "stopped"; raises on failure (after an event)

Each step (`train_step`): the step boundary (trainer/run/boundary.py: knob changes, pause, stop)
-> collect the rollout driver's groups, scored as they complete (trainer/rollout/scoring.py)
-> the objective's inputs (trainer/algo/) -> update -> push weights to the engine -> the step's
metric record (trainer/run/step_record.py) -> the pilot's advice and autopilot -> maybe evaluate /
checkpoint (trainer/run/state.py) -> the step's timeline (trainer/observe/timeline.py: where each
process's time went). Its collaborators, for each rank role, and a resume's state come from
trainer/run/build.py. Beside it: the device-seconds and cost figures (trainer/run/device_account.py),
the knob changes the run asks of itself and the pilot's advice (trainer/run/knob_requests.py), what
it says at its start and end (trainer/run/run_events.py). The runner never imports Django; the web
app gives it a database sink and control source.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from trainer import config as config_mod
from trainer.algo import objective
from trainer.algo.learner import TrainSequence
from trainer.cluster import distributed
from trainer.episode.engine import apply_limits
from trainer.episode.environments import offered_tools
from trainer.models import lora
from trainer.observe import clock, trackers
from trainer.observe.metrics import MetricsSink, MultiSink
from trainer.observe.timeline import CONTROLLER, rank_lane
from trainer.rollout.asynchronous import AsyncStall, CollectInterrupted
from trainer.rollout.base import RolloutResult
from trainer.run import build, checkpoint, knob_requests, run_events, step_record, training_ranks
from trainer.run import state as run_state
from trainer.run.controls import ControlSource
from trainer.run.device_account import DeviceAccount, process_layout
from trainer.run.evaluate import evaluate
from trainer.run.invariant_watch import InvariantWatch
from trainer.run.parts import RunParts
from trainer.run.step_record import StepResults

FINISHED, STOPPED, FAILED, INTERRUPTED = "finished", "stopped", "failed", "interrupted"


class RunFailed(RuntimeError):
    """The run ended for a cause its message says whole, for a person: the CLI prints it and the
    dashboard shows it as the run's error, word for word."""


class Runner:
    """One run. Besides its own state (step, version, totals, evaluations, cost), it holds its
    parts as attributes: each field of `RunParts` (trainer/run/parts.py: the device, the model,
    the learner, the engine, the rollout driver, ...), made by trainer/run/build.py."""

    def __init__(self, cfg: config_mod.Config, run_dir: str | Path, *,
                 sink: MetricsSink | None = None, controls: ControlSource | None = None,
                 resume: bool = False, keep_knobs=(), system_telemetry: bool = True, log=print,
                 agent_token: str | None = None):
        self.cfg = cfg.copy()
        self.agent_token = agent_token   # episode.agents: the endpoint's token (trainer/agents/)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # K training processes under torchrun (trainer/cluster/distributed.py); K = 1 otherwise. Rank 0
        # is the controller: the rollout, reports, controls and checkpoints are its alone, and
        # the other ranks train their share of each update (trainer/run/training_ranks.py)
        self.dist = distributed.init(self.cfg.model.device)
        self.sink = (sink or MetricsSink()) if self.dist.is_main else MetricsSink()
        self.controls = (controls or ControlSource()) if self.dist.is_main else ControlSource()
        self.ranks = training_ranks.Controller(self.dist)
        self.log = log
        self.step = 0
        self.version = 0
        self.totals = {"samples": 0, "gen_tokens": 0, "trained_tokens": 0, "reward_errors": 0,
                       "reward_timeouts": 0}
        self.best_eval: float | None = None
        # device-seconds held, by kind, and the cost figures (trainer/run/device_account.py)
        self.device_account = DeviceAccount(lambda: process_layout(
            self.engine, self.device, self.dist.size, self.cfg.async_.worker_threads))
        self.last_eval: float | None = None
        self.last_eval_result: dict | None = None   # the last evaluation's figures (benches)
        # what the run is doing between two steps ("evaluating", "saving a checkpoint"), else
        # None: the dashboard's stall watch reads it, so a long evaluation is no stalled step
        self.phase: str | None = None
        # tokens the engine generated for evaluations: the token ledger counts rollouts only
        self.eval_tokens = 0
        # async.staleness_schedule: the last step boundary it looked at (a checkpoint keeps it)
        self.schedule_through = -1
        # what a new run took from greso.warm_start (trainer/run/warm_start.py); None otherwise
        self.greso_warm: dict | None = None
        # the invariants checked each step (trainer/run/invariant_watch.py; a checkpoint keeps it)
        self.invariants = InvariantWatch()

        # rank 0's config (knob values resumed) and checkpoint, for every rank
        resumed, ckpt_state, ckpt_tensors = build.checkpoint_and_config(self, resume, keep_knobs)
        self.sharded = self.dist.size > 1 and self.cfg.cluster.sharding == "fsdp"
        # run.report_to: every record mirrored to TensorBoard / W&B / MLflow on a thread of its
        # own (trainer/observe/trackers/); it starts with the first record, so a failed build leaves nothing
        self.trackers = (trackers.build(self.cfg, self.run_dir, report=self.sink)
                         if self.dist.is_main else None)
        if self.trackers is not None:
            self.sink = MultiSink([self.sink, self.trackers])
        self._hold(build.collaborators(self, resumed, ckpt_tensors,
                                       system_telemetry=system_telemetry))
        if self.is_controller:
            self.boundary.on_knobs = functools.partial(knob_requests.tell_autopilot, self.pilot)
            # a step waiting for asynchronous groups gives way to a stop or pause within a second,
            # and says at once what its engine reports (e.g. every generator gone: it waits)
            self.rollout.interrupted = self._waiting
        build.resume_state(self, resumed, ckpt_state, ckpt_tensors)

    def _hold(self, parts: RunParts) -> None:
        """Hold each of `parts` as the attribute of its name (`self.engine` is `parts.engine`)."""
        for field in dataclasses.fields(parts):
            setattr(self, field.name, getattr(parts, field.name))

    @property
    def is_controller(self) -> bool:
        return self.dist.is_main

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> str:
        if not self.is_controller:   # a training rank: rank 0 sends each step's share
            return training_ranks.follow(self.ranks, self.learner, self.tokenizer.pad_token_id,
                                         on_step=self._follow_step)
        t_start = time.monotonic()
        if self.system is not None:
            self.system.start()
            step_record.process_metrics(self, [])   # the first readings: step 1 reports its CPU shares
        self.sink.event(self.step, "run_started" if self.step == 0 else "run_resumed", run_events.start(
            self.cfg, self.step, device=self.device, dtype=self.dtype, engine=self.engine,
            model=self.model, devices=self.device_account.held(), greso_warm=self.greso_warm,
            rollout=self.rollout))
        for warning in run_events.start_warnings(self.cfg):
            self.sink.event(self.step, "warning", {"message": warning})
        status = FINISHED
        try:
            if self.step == 0 and self.cfg.run.eval_every:
                self.evaluate()
            step_record.observe_generation(self)  # the ledger's baseline: this engine's counter so far
            self.task.begin_step(self.step + 1)   # an asynchronous worker draws from here on
            self.rollout.start(self.cfg, self.version)
            while self.step < self.cfg.run.max_steps:
                cfg = self._cross_boundary()
                if cfg is None:
                    status = STOPPED
                    break
                self.cfg = cfg
                apply_limits(self.engine, cfg)   # episode.* knobs (multi-turn runs)
                try:
                    self.train_step()
                except CollectInterrupted:
                    continue  # a stop or pause came while the step waited: the boundary takes it
                self._after_step()
                budget = self.cfg.run.time_budget_s
                if budget and time.monotonic() - t_start >= budget:
                    self.sink.event(self.step, "time_budget_reached", {"seconds": budget})
                    break
            self.save_checkpoint()
            self._record_timeline()
            self.sink.event(self.step, "run_" + status, self.summary())
            return status
        except AsyncStall as e:
            status = FAILED
            # a step boundary: the state is consistent, so keep it; a resume rebases the
            # admission counters and continues from here
            with contextlib.suppress(Exception):
                self.save_checkpoint()
            self.sink.event(self.step, "error", {"message": f"{type(e).__name__}: {e}",
                                                 "resumable_from_step": self.step})
            raise
        except (KeyboardInterrupt, SystemExit) as e:
            # told to stop from outside (Ctrl-C, a worker's shutdown): not the run's failure; the
            # step in flight is lost and a resume continues from the last checkpoint
            status = INTERRUPTED
            self.sink.event(self.step, "run_interrupted", {
                "message": f"the process was told to stop mid-step ({type(e).__name__}: {e})",
                "resumable_from_step": checkpoint.latest_step(self.run_dir)})
            raise
        except BaseException as e:
            status = FAILED
            with contextlib.suppress(Exception):   # what the engine said on the way (each death)
                self._relay_engine_warnings()
            lost = run_events.gave_up(e)
            message = (run_events.lost_generation(lost, self.step + 1, self.run_dir) if lost
                       else f"{type(e).__name__}: {e}")
            self.sink.event(self.step, "error", {"message": message,
                                                 "traceback": traceback.format_exc(limit=8)})
            if lost:
                raise RunFailed(message) from e
            raise
        finally:
            with contextlib.suppress(Exception):   # the training ranks leave their loop
                self.ranks.end(status)
            self.rollout.close()  # no generation thread outlives run()
            if self.system is not None:
                self.system.close()
            self.sink.flush()

    def _cross_boundary(self):
        """The step boundary: the config to go on with (knob changes applied), None to stop;
        the time it held the run paused goes to the timeline."""
        self.schedule_through = knob_requests.schedule_point(self.boundary, self.cfg,
                                                             self.schedule_through, self.step)
        cfg = self.boundary.cross(self.step, self.cfg)
        for start, end in self.boundary.pauses:
            self.timeline.add(CONTROLLER, "paused", start, end)
        self.boundary.pauses.clear()
        return cfg

    def _after_step(self) -> None:
        """Evaluate and checkpoint when due; the step's timeline to the sink."""
        if self.cfg.run.eval_every and self.step % self.cfg.run.eval_every == 0:
            self.evaluate()
        if self.cfg.run.checkpoint_every and self.step % self.cfg.run.checkpoint_every == 0:
            self.save_checkpoint()
        self._record_timeline()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the engine, the reward processes, the telemetry thread and the trackers."""
        if self.trackers is not None:
            self.trackers.close()   # a bounded wait; its last warnings go to the run's sink
        if self.system is not None:
            self.system.close()
        if self.rewards is not None:
            self.rewards.close()
        if self.engine is not None:
            self.engine.close()
        self.sink.flush()

    def _waiting(self) -> bool:
        self._relay_engine_warnings()
        return self.boundary.interrupted()

    def _relay_engine_warnings(self) -> None:
        """The engine's non-fatal news (a generator lost, back, all gone) as warning events."""
        for message in getattr(self.engine, "take_warnings", list)():
            self.sink.event(self.step + 1, "warning", {"message": message})

    def _follow_step(self, step: int, cfg) -> None:
        """A training rank before its share of `step`'s update: rank 0's config and step."""
        self.cfg, self.step = cfg, step - 1

    # --- one step -----------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One step: learn (step `self.step + 1` in progress), count it done, then account for
        it (`self.step` is its number). The step counter moves here alone (and when a checkpoint
        is restored or a training rank follows rank 0)."""
        results = self._learn()
        self.step += 1
        return self._account(results)

    def _learn(self) -> StepResults:
        """collect (the driver's groups, scored as they complete) -> objective -> update ->
        the inspector's samples -> sync the engine's weights."""
        cfg, version = self.cfg, self.version
        t_step, stats0 = time.monotonic(), copy.copy(self.engine.stats)
        result = self._collect(cfg, stats0)
        groups = result.groups
        # the objective's forward passes (old and reference logprobs) count as training
        t_train, wall = time.monotonic(), clock.now()
        seqs, adv_metrics, decoupled_loss, histograms = objective.train_sequences(
            groups, cfg, self.version, self._logprobs)
        train_metrics, ranks, train_s = self._update(cfg, seqs, groups, decoupled_loss,
                                                     t_train, wall)
        samples_s = self._record_samples(cfg, result)   # after the update: the behaviour weights
        sync_s = self._sync_weights(cfg)
        self.invariants.after_sync(self, cfg)   # the engine scores a probe with what it was sent
        return StepResults(result, self.engine.stats.minus(stats0), seqs, adv_metrics,
                           train_metrics, ranks, train_s=train_s, samples_s=samples_s,
                           sync_s=sync_s, step_s=time.monotonic() - t_step,
                           histograms=histograms, version=version)

    def _account(self, results: StepResults) -> dict[str, float]:
        """The learnt step's state advanced (GRESO, the ledger, the totals), its record and
        invariants, the driver's own knob change, the cost so far, the sink and the pilot."""
        cfg = self.cfg
        step_record.advance(self, cfg, results)
        m = step_record.record(self, cfg, results)
        m.update(self.invariants.after_step(self, cfg, results.seqs, results.rollout,
                                            results.version))
        knob_requests.retune(self.rollout, self.boundary, self.cfg, results.train_metrics)
        m.update(self.device_account.figures(self.timeline.pending(), self.cfg.cost))
        self.sink.scalars(self.step, m)
        knob_requests.pilot_after_step(self.pilot, self.sink, self.boundary, self.step, m, self.cfg)
        return m

    def _collect(self, cfg, stats0) -> RolloutResult:
        """This step's groups from the rollout driver, scored (the scorer counts per step); what
        the driver and the engine say about them as events."""
        self.scorer.new_step()
        self.task.begin_step(self.step + 1)   # a drifting task draws by the step it is on
        # an asynchronous step waits for the generation worker's groups; a synchronous one generates
        with self.timeline.span(CONTROLLER, "waiting" if self.rollout.concurrent else "generating"):
            result = self.rollout.collect(cfg, self.version)
        engine_stats = self.engine.stats.minus(stats0)
        self._relay_engine_warnings()
        for kind, data in result.events:  # what the driver says about its step (e.g. too few groups)
            self.sink.event(self.step + 1, kind, data)
        self.rollout.after_step(cfg, engine_stats.idle_slot_frac())
        return result

    def _update(self, cfg, seqs, groups, decoupled_loss, t_train: float, wall: float):
        """The policy update: rank 0's share here, the other ranks' sent to them. Returns the
        train metrics, the other ranks' reports, and the seconds since `t_train` (the time.monotonic()
        when training began; `wall`: its clock.now(), for the timeline)."""
        # sharing one GPU with the trainer: hand the engine's KV cache back while training
        cuda = self.device.type == "cuda"
        release = (cuda and not self.rollout.concurrent and self.engine.num_pending == 0
                   and self.engine.release_memory())
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        mine = self.ranks.share(seqs, cfg, self.step + 1, decoupled_loss)  # theirs sent
        train_metrics = self.learner.train([s for c in mine for s in c], cfg,
                                           self.tokenizer.pad_token_id,
                                           [s for g in groups for s in g.samples], decoupled_loss,
                                           chunks=mine)
        # the behaviour weights the other ranks measured, when each trained, its CPU and memory
        ranks = self.ranks.gather_reports()
        for rank, start, end, *_ in ranks:
            self.timeline.add_after_wait(rank_lane(rank), "training", start, end)
        self.timeline.add(CONTROLLER, "training", wall, clock.now())
        if not all(map(_finite, train_metrics.values())):
            self.sink.event(self.step + 1, "warning", {"message": "non-finite loss or gradient; "
                                                       "the update was skipped"})
        train_s = time.monotonic() - t_train
        if cuda:
            train_metrics["system/cuda_peak_mem_gb"] = (
                torch.cuda.max_memory_allocated(self.device) / 2**30)
        if release:
            self.engine.reacquire_memory()
        return train_metrics, ranks, train_s

    def _record_samples(self, cfg, result: RolloutResult) -> float:
        """run.log_samples: the step's samples for the rollout inspector, what it trains on and
        what it scored and left. Returns the seconds it took."""
        t0 = time.monotonic()
        if cfg.run.log_samples:
            seen = {id(g) for g in result.groups}
            left_out = [g for g in result.scored if id(g) not in seen]
            with self.timeline.span(CONTROLLER, "recording samples"):
                self.sink.samples(self.step + 1, self.samples.record(
                    self.step + 1, result.groups, left_out, self.version, cfg))
        return time.monotonic() - t0

    def _sync_weights(self, cfg) -> float:
        """A new policy version, pushed to the engine and announced to the driver. Returns the
        seconds it took."""
        t0 = time.monotonic()
        self.version += 1
        with self.timeline.span(CONTROLLER, "syncing weights"):
            only_changed = lora.engine_holds_base(cfg)   # LoRA: the factors alone
            self.engine.update_weights(self.ranks.full_weights(self.learner, only_changed),
                                       self.version, recompute_kv=cfg.rollout.recompute_kv_on_update)
            self.rollout.on_new_version(self.version)
        return time.monotonic() - t0

    def _logprobs(self, seqs: list[TrainSequence], reference: bool = False) -> list[list[float]]:
        """Per-token logprobs of `seqs` under the current policy (or the reference)."""
        return self.ranks.logprobs(self.learner, seqs, self.tokenizer.pad_token_id,
                                   self.cfg.optim.micro_batch_tokens, reference=reference)

    # --- the timeline and the device account -------------------------------------------------------
    def _record_timeline(self) -> None:
        """The spans since the last call, the generators' busy spans among them, to the sink."""
        for lane, start, end, occupancy in getattr(self.engine, "take_busy_spans", list)():
            self.timeline.add(lane, "generating", start, end, occupancy)
        spans = self.timeline.take()
        if spans:
            self.sink.timeline(self.step, spans)
            self.device_account.count(spans)

    # --- evaluation ---------------------------------------------------------------------------------
    def evaluate(self) -> float:
        cfg = self.cfg
        problems = self.task.eval_problems(cfg.run.eval_size)

        with self._between_steps("evaluating"), self.timeline.span(CONTROLLER, "evaluating"), \
                self.rollout.suspended():
            # (the async worker shares the engine: suspended() holds it)
            before = self.engine.stats.generated_tokens
            res = evaluate(self.engine, self.tokenizer, problems, self.scorer.texts,
                           temperature=cfg.run.eval_temperature,
                           max_new_tokens=cfg.rollout.max_response_len, tools=offered_tools(cfg))
            self.eval_tokens += self.engine.stats.generated_tokens - before
        self.last_eval = res["accuracy"]
        self.best_eval = max(self.best_eval or 0.0, res["accuracy"])
        self.sink.scalars(self.step, {"eval/accuracy": res["accuracy"],
                                      "eval/reward_mean": res["reward_mean"],
                                      "eval/response_len_mean": res["response_len_mean"],
                                      **{f"eval/{k}": res[k] for k in ("tool_use_rate", "turns_mean")
                                         if k in res}})
        self.last_eval_result = res
        return res["accuracy"]

    def summary(self) -> dict[str, Any]:
        return {"steps": self.step, "policy_version": self.version, **{
            f"{k}_total": v for k, v in self.totals.items()},
            "eval_accuracy_last": self.last_eval, "eval_accuracy_best": self.best_eval}

    # --- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        with self._between_steps("saving a checkpoint"), \
                self.timeline.span(CONTROLLER, "checkpointing"), self.rollout.suspended():
            # generation held: the ledger's count and the groups saved describe one moment
            step_record.observe_generation(self)
            path = run_state.save(self)
        self.sink.event(self.step, "checkpoint", {"path": str(path)})
        return path

    @contextlib.contextmanager
    def _between_steps(self, phase: str):
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None


def _finite(v) -> bool:
    return not isinstance(v, float) or v == v and abs(v) != float("inf")
