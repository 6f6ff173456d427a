"""The Runner: one training run, start to finish.

    runner = Runner(cfg, run_dir, sink=..., controls=...)
    status = runner.run()      # "finished" | "stopped"; raises on failure (after an event)

Each step: the step boundary (trainer/run/boundary.py: knob changes, pause, stop) -> the rollout
driver's groups, scored (trainer/rollout/scoring.py) -> the objective's inputs (trainer/algo/) -> update
-> push weights to the engine -> metrics -> maybe evaluate / checkpoint (trainer/run/state.py)
-> the step's timeline (trainer/observe/timeline.py: where each process's time went).
The runner never imports Django; the web app gives it a database sink and control source.
Over 400 lines because one step's sequence (collect, update, sync, metrics) and its timing for
the timeline read best in one place.
"""
from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from trainer import config as config_mod
from trainer.algo import objective
from trainer.algo.learner import Learner, TrainSequence
from trainer.cluster import distributed, sharding, training_ranks
from trainer.engine import build_engine
from trainer.models.loading import load_model, load_tokenizer, resolve_device, resolve_dtype
from trainer.observe import trackers
from trainer.observe.inspector import InspectorRecorder
from trainer.observe.metrics import MetricsSink, MultiSink, histogram, length_edges
from trainer.observe.system import ProcessMeter, SystemSampler
from trainer.observe.timeline import CONTROLLER, Timeline, rank_lane
from trainer.pilot.live import LivePilot
from trainer.rewards.pool import RewardService
from trainer.rollout import PromptSource, build_driver
from trainer.rollout.asynchronous import AsyncStall, CollectInterrupted
from trainer.rollout.base import step_metrics
from trainer.rollout.scoring import Scorer
from trainer.rollout.selection import PromptSelector
from trainer.run import state as run_state
from trainer.run.boundary import StepBoundary
from trainer.run.controls import AUTO, AUTOPILOT, ControlSource
from trainer.run.evaluate import evaluate
from trainer.tasks import build_task

FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"


class Runner:
    def __init__(self, cfg: config_mod.Config, run_dir: str | Path, *,
                 sink: MetricsSink | None = None, controls: ControlSource | None = None,
                 resume: bool = False, keep_knobs=(), system_telemetry: bool = True, log=print):
        self.cfg = cfg.copy()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # K training processes under torchrun (trainer/cluster/distributed.py); K = 1 otherwise. Rank 0
        # is the controller: the rollout, reports, controls and checkpoints are its alone, and
        # the other ranks train their share of each update (trainer/cluster/training_ranks.py)
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
        self.last_eval: float | None = None
        # what the run is doing between two steps ("evaluating", "saving a checkpoint"), else
        # None: the dashboard's stall watch reads it, so a long evaluation is no stalled step
        self.phase: str | None = None
        # tokens the engine generated for evaluations: the token ledger counts rollouts only
        self.eval_tokens = 0

        ckpt_state = ckpt_tensors = resumed = None
        if resume and self.dist.is_main:
            path, ckpt_state, ckpt_tensors, self.cfg = run_state.load_latest(self.run_dir, self.cfg, keep_knobs)
            resumed = (path, sharding.is_sharded(path))   # (checkpoint, its model in DCP shards)
        # rank 0's config (knob values resumed) and checkpoint
        self.cfg, resumed = self.dist.broadcast_object((self.cfg, resumed))
        self.cfg.cluster.train_procs = self.dist.size     # the layout torchrun gave, recorded
        if self.dist.size > 1:
            config_mod.check(self.cfg)   # e.g. fsdp with the engine in rank 0: refused by name
        self.sharded = self.dist.size > 1 and self.cfg.cluster.sharding == "fsdp"
        # run.report_to: every record mirrored to TensorBoard / W&B / MLflow on a thread of its
        # own (trainer/observe/trackers/); it starts with the first record, so a failed build leaves nothing
        self.trackers = (trackers.build(self.cfg, self.run_dir, report=self.sink)
                         if self.dist.is_main else None)
        if self.trackers is not None:
            self.sink = MultiSink([self.sink, self.trackers])
        if not self.dist.is_main:
            self._init_training_rank(resumed)
            return
        if self.cfg.model.threads:
            torch.set_num_threads(self.cfg.model.threads)
        torch.manual_seed(self.cfg.run.seed)

        self.device = self.dist.local_device(resolve_device(self.cfg.model.device))
        self.dtype = resolve_dtype(self.cfg.model.dtype, self.device)
        self.tokenizer = load_tokenizer(self.cfg.model.path)
        # a sharded checkpoint's weights are read into the base model below (or by every rank)
        policy_path = str(path / "model") if resume and not resumed[1] else self.cfg.model.path
        self.model = load_model(policy_path, self.device, self.dtype).eval()
        reference = None
        if resume and (self.cfg.algo.track_kl or self.cfg.algo.kl_coef > 0):
            reference = load_model(self.cfg.model.path, self.device, self.dtype)
        if resume and resumed[1] and not self.sharded:   # sharded before, whole now
            ckpt_tensors["optimizer"] = sharding.read_whole(path, self.model)
        self.task = build_task(self.cfg, self.tokenizer)  # prompts rendered for its chat template
        self.prompts = PromptSource(self.task)
        # before the learner: generation processes copy the model whole, which sharding splits
        self.engine = build_engine(self.cfg, self.model, self.tokenizer, self.device, self.dtype,
                                   self.task.max_sequence_len(self.tokenizer, self.cfg),
                                   weights_dir=self.run_dir / "engine_weights")
        self.learner = Learner(self.model, lr=self.cfg.optim.lr,
                               weight_decay=self.cfg.optim.weight_decay,
                               track_reference=self.cfg.algo.track_kl or self.cfg.algo.kl_coef > 0,
                               reference=reference, dist=self.dist, sharded=self.sharded)
        # prompts, GRESO state and the reward pool are shared with the async generation worker
        self.lock = threading.RLock()
        self.selector = PromptSelector(self.prompts, self.task.train_size, self.cfg, self.lock)
        self.greso = self.selector.filter  # the GRESO state (checkpoints, tests)
        self.rewards = RewardService(workers=self.cfg.run.reward_workers,
                                     timeout_s=self.cfg.run.reward_timeout_s)
        self.scorer = Scorer(self.rewards, self.tokenizer, lambda: self.cfg, self.totals, self.lock)
        self.rollout = build_driver(self.cfg, self.engine, self.tokenizer, self.selector,
                                    self.scorer, self.lock)
        self.samples = InspectorRecorder(self.tokenizer, self.cfg.run.seed)  # the rollout inspector's
        self.timeline = Timeline(fill={CONTROLLER: "bookkeeping"})
        self.boundary = StepBoundary(self.controls, self.sink, self.rollout)
        self.pilot = LivePilot()   # advice events and the autopilot (trainer/pilot/)
        self.boundary.on_knobs = self._knobs_changed
        # a step waiting for asynchronous groups gives way to a stop or pause within a second,
        # and says at once what its engine reports (e.g. every generator gone: it waits)
        self.rollout.interrupted = self._waiting
        self.system = (SystemSampler(use_gpu=self.device.type == "cuda")
                       if system_telemetry else None)
        self.meter = ProcessMeter()   # CPU and memory per process (timeline lane)

        if ckpt_state is not None:
            run_state.restore(self, ckpt_state, ckpt_tensors)
        else:
            (self.run_dir / "config.toml").write_text(config_mod.to_toml(self.cfg))
        self._restore_optimizer(resumed, ckpt_tensors)
        if self.cfg.rollout.engine != "embedded" or self.sharded:
            # servers hold whatever weights they were started with, generation processes the
            # base model's when a sharded checkpoint was resumed: push the policy's
            self.engine.update_weights(self.learner.full_state_dict(), self.version)  # all ranks

    def _restore_optimizer(self, resumed, tensors) -> None:
        """Every rank: the resumed optimizer state (and a sharded checkpoint's weights). Sharded
        now: each rank reads its shards of a sharded checkpoint, or rank 0 spreads an unsharded
        one's; replicated: rank 0's state (run_state.restore loaded it) to the others."""
        if self.sharded:
            if resumed is not None and resumed[1]:
                sharding.load(resumed[0], self.learner.model, self.learner.optimizer)
            elif resumed is not None:
                sharding.spread_optimizer_from_rank0(self.learner.model, self.learner.optimizer,
                                                     tensors["optimizer"] if self.dist.is_main else None)
            return
        optimizer = self.dist.broadcast_object(self.learner.state_dict()
                                               if self.dist.is_main and resumed is not None else None)
        if optimizer is not None and not self.dist.is_main:
            self.learner.load_state_dict(optimizer)

    def _init_training_rank(self, resumed) -> None:
        """A rank > 0: the policy, its reference and the optimizer; no engine, no rollout.
        DDP's wrap broadcasts rank 0's weights (resumed or not), then rank 0's optimizer state;
        sharded, rank 0 spreads its weights, or each rank reads its shards of the checkpoint."""
        cfg = self.cfg
        if cfg.model.threads:
            torch.set_num_threads(cfg.model.threads)
        torch.manual_seed(cfg.run.seed)
        self.device = self.dist.local_device(resolve_device(cfg.model.device))
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.model = load_model(cfg.model.path, self.device, self.dtype).eval()
        self.learner = Learner(self.model, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                               track_reference=cfg.algo.track_kl or cfg.algo.kl_coef > 0,
                               dist=self.dist, sharded=self.sharded)
        self._restore_optimizer(resumed, None)
        if self.sharded:
            self.learner.full_state_dict()   # rank 0's first push to the generators
        self.engine = self.rewards = self.system = None

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
            self._process_metrics([])   # the first readings: step 1 reports its CPU shares
        self.sink.event(self.step, "run_started" if self.step == 0 else "run_resumed",
                        {"max_steps": self.cfg.run.max_steps, "device": str(self.device)})
        status = FINISHED
        try:
            if self.step == 0 and self.cfg.run.eval_every:
                self.evaluate()
            self._observe_generation()  # the ledger's baseline: this engine's counter so far
            self.rollout.start(self.cfg, self.version)
            while self.step < self.cfg.run.max_steps:
                cfg = self.boundary.cross(self.step, self.cfg)
                for start, end in self.boundary.pauses:
                    self.timeline.add(CONTROLLER, "paused", start, end)
                self.boundary.pauses.clear()
                if cfg is None:
                    status = STOPPED
                    break
                self.cfg = cfg
                try:
                    self.train_step()
                except CollectInterrupted:
                    continue  # a stop or pause came while the step waited: the boundary takes it
                if self.cfg.run.eval_every and self.step % self.cfg.run.eval_every == 0:
                    self.evaluate()
                if self.cfg.run.checkpoint_every and self.step % self.cfg.run.checkpoint_every == 0:
                    self.save_checkpoint()
                self._record_timeline()
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
        except BaseException as e:
            status = FAILED
            self.sink.event(self.step, "error", {"message": f"{type(e).__name__}: {e}",
                                                 "traceback": traceback.format_exc(limit=8)})
            raise
        finally:
            with contextlib.suppress(Exception):   # the training ranks leave their loop
                self.ranks.end(status)
            self.rollout.close()  # no generation thread outlives run()
            if self.system is not None:
                self.system.close()
            self.sink.flush()

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
        cfg = self.cfg
        t_step = time.monotonic()
        stats0 = copy.copy(self.engine.stats)
        self.scorer.new_step()
        # an asynchronous step waits for the generation worker's groups; a synchronous one generates
        with self.timeline.span(CONTROLLER, "waiting" if self.rollout.concurrent else "generating"):
            result = self.rollout.collect(cfg, self.version)
        engine_stats = self.engine.stats.minus(stats0)
        self._relay_engine_warnings()
        for kind, data in result.events:  # what the driver says about its step (e.g. too few groups)
            self.sink.event(self.step + 1, kind, data)
        groups = result.groups
        self.rollout.after_step(cfg, engine_stats.idle_slot_frac())

        t0, wall = time.monotonic(), time.time()
        seqs, adv_metrics, decoupled_loss = objective.train_sequences(groups, cfg, self.version,
                                                                      self._logprobs)
        # sharing one GPU with the trainer: hand the engine's KV cache back while training
        release = (self.device.type == "cuda" and not self.rollout.concurrent
                   and self.engine.num_pending == 0 and self.engine.release_memory())
        if self.device.type == "cuda":
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
        self.timeline.add(CONTROLLER, "training", wall, time.time())
        if not all(map(_finite, train_metrics.values())):
            self.sink.event(self.step + 1, "warning", {"message": "non-finite loss or gradient; "
                                                       "the update was skipped"})
        train_s = time.monotonic() - t0
        if self.device.type == "cuda":
            train_metrics["system/cuda_peak_mem_gb"] = (
                torch.cuda.max_memory_allocated(self.device) / 2**30)
        if release:
            self.engine.reacquire_memory()
        t_samples = time.monotonic()   # after the update: it reports the behaviour weights
        if cfg.run.log_samples:
            seen = {id(g) for g in groups}  # what the step trains on, and what it scored and left
            left_out = [g for g in result.scored if id(g) not in seen]
            with self.timeline.span(CONTROLLER, "recording samples"):
                self.sink.samples(self.step + 1, self.samples.record(
                    self.step + 1, groups, left_out, self.version, cfg))
        samples_s = time.monotonic() - t_samples

        t0 = time.monotonic()
        self.version += 1
        with self.timeline.span(CONTROLLER, "syncing weights"):
            self.engine.update_weights(self.ranks.full_weights(self.learner), self.version,
                                       recompute_kv=cfg.rollout.recompute_kv_on_update)
            self.rollout.on_new_version(self.version)
        sync_s = time.monotonic() - t0
        self.step += 1

        step_s = time.monotonic() - t_step
        m = self._step_metrics(cfg, result, self.engine.stats.minus(stats0), step_s)
        trained_tokens = sum(len(s.response_ids) for s in seqs)
        m.update(adv_metrics)
        m.update(train_metrics)
        m.update({
            "perf/trained_tokens_per_s": trained_tokens / max(step_s, 1e-9),
            "perf/rollout_trained_tokens_per_s": trained_tokens / max(result.gen_seconds, 1e-9),
            "timing/train_s": train_s, "timing/samples_s": samples_s,
            "timing/weight_sync_s": sync_s, "timing/step_s": step_s, "actor/lr": cfg.optim.lr,
            # what the update copied to the generators (0: the in-process engine shares them)
            "perf/weight_sync_bytes": getattr(self.engine, "last_sync_bytes", 0),
            "train/policy_version": self.version, "rollout/trained_tokens": trained_tokens,
        })
        if self.dist.size > 1:
            m.update({"dist/world_size": self.dist.size,
                      "dist/train_share_imbalance": self.ranks.imbalance})
        if hasattr(self.engine, "generators_alive"):  # generation processes (engine/pool.py)
            m.update(self.engine.report())
        self._observe_generation()
        ledger = self.rollout.ledger
        ledger.train(trained_tokens)
        # complete groups the objective left out (algo.skip_zero_adv)
        ledger.drop("zero_variance", sum(g.tokens() for g in groups) - trained_tokens)
        m.update(ledger.step_metrics())
        with self.lock:  # the async worker adds reward counts to the totals
            self.totals["samples"] += m["rollout/samples"]
            self.totals["gen_tokens"] += m["rollout/gen_tokens"]
            self.totals["trained_tokens"] += trained_tokens
            m.update({f"train/{k}_total": v for k, v in self.totals.items()
                      if k in ("samples", "gen_tokens", "trained_tokens")})
        proposal = self.rollout.retune(self.cfg, train_metrics)
        if proposal:  # e.g. async.auto_staleness moves eta: a knob change like a person's
            changes = proposal.pop("changes")
            self.boundary.request({k: ch["new"] for k, ch in changes.items()},
                                  reason={"rule": proposal.pop("kind"), **proposal})
        if self.system is not None:
            m.update(self.system.summary())
            m.update(self._process_metrics(ranks))
        self.sink.scalars(self.step, m)
        self._pilot_after_step(m)
        return m

    def _pilot_after_step(self, m: dict) -> None:
        """Announce new advice; queue the autopilot's move for the next boundary."""
        advice, move = self.pilot.after_step(self.step, m, self.cfg)
        for a in advice:
            self.sink.event(self.step, "advice", a.as_json())
        if move is not None:
            self.boundary.request(move.knobs, reason=move.reason, requested_by=AUTOPILOT)

    def _knobs_changed(self, cmd, applied: bool) -> None:
        if cmd.requested_by == AUTO:   # async.auto_staleness: neither a person nor the autopilot
            return
        if applied:
            self.pilot.autopilot.knob_applied(list(cmd.knobs), cmd.requested_by == AUTOPILOT)
        elif cmd.requested_by == AUTOPILOT:
            self.pilot.autopilot.knob_refused(list(cmd.knobs))

    def _step_metrics(self, cfg, result, engine_stats, step_s: float) -> dict[str, float]:
        """The rollout's metrics (common, the driver's own, GRESO's) and its histograms."""
        m = step_metrics(cfg, result, engine_stats)
        m.update(self.scorer.metrics())
        gen_time = step_s if self.rollout.concurrent else result.gen_seconds
        m["perf/gen_tokens_per_s"] = engine_stats.generated_tokens / max(gen_time, 1e-9)
        self.selector.observe(cfg, self.step, result.scored)
        m.update(self.selector.report(cfg, result.counts))
        m.update(self.rollout.report(cfg, result, self.version, step_s, self._histogram))
        lengths = [len(s.response_ids) for g in result.scored for s in g.samples]
        if lengths:
            self.sink.histogram(self.step, "rollout/response_len",
                                histogram(lengths, length_edges(cfg.rollout.max_response_len)))
        return m

    def _process_metrics(self, ranks) -> dict[str, float]:
        """proc/<lane>/cpu_pct and rss_gb: this process, the engine's processes, the ranks'."""
        lanes = {CONTROLLER: os.getpid(), **getattr(self.engine, "lane_pids", dict)()}
        m = self.meter.local(lanes, time.time())
        for rank, _, end, cpu_s, rss in ranks:
            m.update(self.meter.observe(rank_lane(rank), cpu_s, rss, end))
        return m

    def _record_timeline(self) -> None:
        """The spans since the last call, the generators' busy spans among them, to the sink."""
        for lane, start, end, occupancy in getattr(self.engine, "take_busy_spans", list)():
            self.timeline.add(lane, "generating", start, end, occupancy)
        spans = self.timeline.take()
        if spans:
            self.sink.timeline(self.step, spans)

    def _observe_generation(self) -> None:
        """Hand the ledger the engine's count of rollout tokens (evaluations' taken out)."""
        self.rollout.ledger.observe_engine(self.engine.stats.generated_tokens - self.eval_tokens)

    def _histogram(self, name: str, values: list, edges: list) -> None:
        self.sink.histogram(self.step, name, histogram(values, edges))

    def _logprobs(self, seqs: list[TrainSequence], reference: bool = False) -> list[list[float]]:
        """Per-token logprobs of `seqs` under the current policy (or the reference)."""
        return self.ranks.logprobs(self.learner, seqs, self.tokenizer.pad_token_id,
                                   self.cfg.optim.micro_batch_tokens, reference=reference)

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
                           max_new_tokens=cfg.rollout.max_response_len)
            self.eval_tokens += self.engine.stats.generated_tokens - before
        self.last_eval = res["accuracy"]
        self.best_eval = max(self.best_eval or 0.0, res["accuracy"])
        self.sink.scalars(self.step, {"eval/accuracy": res["accuracy"],
                                      "eval/reward_mean": res["reward_mean"],
                                      "eval/response_len_mean": res["response_len_mean"]})
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
            self._observe_generation()
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
