"""The Runner: one training run, start to finish.

    runner = Runner(cfg, run_dir, sink=..., controls=...)
    status = runner.run()      # "finished" | "stopped"; raises on failure (after an event)

Each step (`train_step`): the step boundary (trainer/run/boundary.py: knob changes, pause, stop)
-> collect the rollout driver's groups, scored as they complete (trainer/rollout/scoring.py)
-> the objective's inputs (trainer/algo/) -> update -> push weights to the engine -> the step's
metric record (trainer/run/step_record.py) -> the pilot's advice and autopilot -> maybe evaluate /
checkpoint (trainer/run/state.py) -> the step's timeline (trainer/observe/timeline.py: where each
process's time went). Its collaborators, for each rank role, and a resume's state come from
trainer/run/build.py. The runner never imports Django; the web app gives it a database sink and
control source.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from trainer import config as config_mod
from trainer.accounting import cost
from trainer.algo import objective
from trainer.algo.learner import TrainSequence
from trainer.cluster import distributed
from trainer.engine import generation_device, rollout_precision
from trainer.engine.base import GenerationGaveUp
from trainer.episode.engine import apply_limits
from trainer.episode.environments import offered_tools
from trainer.models import lora
from trainer.observe import clock, trackers
from trainer.observe.metrics import MetricsSink, MultiSink
from trainer.observe.timeline import CONTROLLER, rank_lane
from trainer.pilot import episodes as single_turn
from trainer.rollout import april, staleness_schedule
from trainer.rollout.asynchronous import AsyncStall, CollectInterrupted
from trainer.rollout.base import RolloutResult
from trainer.run import build, checkpoint, step_record, training_ranks
from trainer.run import state as run_state
from trainer.run.controls import AUTO, AUTOPILOT, SCHEDULE, ControlSource
from trainer.run.evaluate import evaluate
from trainer.run.invariant_watch import InvariantWatch
from trainer.run.parts import RunParts
from trainer.run.step_record import StepResults
from trainer.sandbox.preflight import weak_isolation_warning

FINISHED, STOPPED, FAILED, INTERRUPTED = "finished", "stopped", "failed", "interrupted"


class RunFailed(RuntimeError):
    """The run ended for a cause its message says whole, for a person: the CLI prints it and the
    dashboard shows it as the run's error, word for word."""


def _gave_up(e: BaseException) -> GenerationGaveUp | None:
    """The GenerationGaveUp behind `e` (the asynchronous worker's error wraps it), or None."""
    seen = set()
    while e is not None and id(e) not in seen:   # a chain may loop back
        if isinstance(e, GenerationGaveUp):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


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
        self.device_s: dict[str, float] = {}   # device-seconds held so far, by kind (cost/*)
        self._reach = float("-inf")             # the latest time they count to
        self._held: dict | None = None
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
            self.boundary.on_knobs = self._knobs_changed
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
        self.sink.event(self.step, "run_started" if self.step == 0 else "run_resumed",
                        {"max_steps": self.cfg.run.max_steps, "device": str(self.device),
                         # the trainer's precision and the engine's (the mismatch metrics' cause)
                         "model_dtype": str(self.dtype).removeprefix("torch."),
                         "rollout_dtype": rollout_precision(self.engine, self.cfg.rollout.dtype,
                                                            self.dtype),
                         # what trains: every parameter, or LoRA's adapters (their file's bytes)
                         **lora.sizes(self.model),
                         # what each process holds, for the cost account (trainer/accounting/cost.py)
                         "devices": self._held_devices(),
                         # a resume holds no KV cache: how its parked samples go on
                         **({"kv_cache": april.resume_kv_note(self.cfg)} if self.step else {}),
                         # how many prompts' GRESO history came from another run
                         **({"greso_warm_start": self.greso_warm} if self.greso_warm else {}),
                         # where the agents call (episode.agents; the token is never written)
                         **({"agents_url": self.rollout.server.base_url}
                            if self.cfg.episode.agents else {})})
        # said at every start and resume, as the run page and the report keep saying
        for warning in filter(None, (weak_isolation_warning(self.cfg), lora.dropout_warning(self.cfg))):
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
            lost = _gave_up(e)
            message = self.lost_generation(lost) if lost else f"{type(e).__name__}: {e}"
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

    def lost_generation(self, lost: GenerationGaveUp) -> str:
        """Why the run ends when its generation processes were given up, for a person: which,
        how, after how many restarts, in which step, and where a resume continues."""
        saved = checkpoint.latest_step(self.run_dir)
        resume = (f"resume continues from the checkpoint at step {saved}" if saved is not None
                  else "no checkpoint was written: a resume starts over")
        return f"{lost.during(self.step + 1)}; {resume}"

    def _cross_boundary(self):
        """The step boundary: the config to go on with (knob changes applied), None to stop;
        the time it held the run paused goes to the timeline."""
        self._schedule_point()
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
        self._retune(results.train_metrics)
        m.update(self._cost_figures())
        self.sink.scalars(self.step, m)
        self._pilot_after_step(m)
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

    # --- the trainer's own knob changes and the pilot -------------------------------------------------
    def _retune(self, train_metrics: dict) -> None:
        """The driver's own knob change (e.g. async.auto_staleness moves eta), queued for the next
        boundary like a person's."""
        proposal = self.rollout.retune(self.cfg, train_metrics)
        if proposal:
            changes = proposal.pop("changes")
            self.boundary.request({k: ch["new"] for k, ch in changes.items()},
                                  reason={"rule": proposal.pop("kind"), **proposal})

    def _schedule_point(self) -> None:
        """async.staleness_schedule's point due at this boundary, if any, queued like any knob
        change (trainer/rollout/staleness_schedule.py: each point once, also across a resume)."""
        text = self.cfg.async_.staleness_schedule
        point = staleness_schedule.due(staleness_schedule.parse(text), self.schedule_through,
                                       self.step) if text.strip() else None
        self.schedule_through = self.step
        if point is not None:
            self.boundary.request({"async.max_staleness": point.eta}, requested_by=SCHEDULE,
                                  reason={"rule": "staleness_schedule", "point": f"{point.step}:{point.eta}",
                                          "schedule": text})

    def _pilot_after_step(self, m: dict) -> None:
        """Announce new advice; queue the autopilot's move for the next boundary."""
        advice, move = self.pilot.after_step(self.step, m, self.cfg)
        for a in advice:
            self.sink.event(self.step, "advice", a.as_json())
            if a.reason == single_turn.REASON:   # no silent fallback: an event too (an alert)
                self.sink.event(self.step, single_turn.EVENT, {"message": a.message})
        if move is not None:
            self.boundary.request(move.knobs, reason=move.reason, requested_by=AUTOPILOT)

    def _knobs_changed(self, cmd, applied: bool) -> None:
        if cmd.requested_by == AUTO:   # async.auto_staleness: neither a person nor the autopilot
            return
        if cmd.requested_by == SCHEDULE:   # a point set at launch: not a person's knob from now on
            if applied:
                self.pilot.autopilot.knob_scheduled(list(cmd.knobs))
            return
        if applied:
            self.pilot.autopilot.knob_applied(list(cmd.knobs), cmd.requested_by == AUTOPILOT)
        elif cmd.requested_by == AUTOPILOT:
            self.pilot.autopilot.knob_refused(list(cmd.knobs))

    def _record_timeline(self) -> None:
        """The spans since the last call, the generators' busy spans among them, to the sink."""
        for lane, start, end, occupancy in getattr(self.engine, "take_busy_spans", list)():
            self.timeline.add(lane, "generating", start, end, occupancy)
        spans = self.timeline.take()
        if spans:
            self.sink.timeline(self.step, spans)
            wall, self._reach = cost.new_cover(spans, self._reach)
            for kind, n in cost.kind_counts(self._held_devices()).items():
                self.device_s[kind] = self.device_s.get(kind, 0.0) + wall * n

    def device_seconds_now(self) -> dict[str, float]:
        """Device-seconds held so far by kind, as the cost account counts them (the union of the
        steps' timelines: asynchronous steps overlap): the timelines recorded and the spans not
        yet recorded. Checkpoints carry it, so a resumed run counts on from its checkpoint."""
        wall, _ = cost.new_cover(self.timeline.pending(), self._reach)
        return {k: self.device_s.get(k, 0.0) + wall * n for k, n in cost.kind_counts(self._held_devices()).items()}

    def _cost_figures(self) -> dict[str, float]:
        """The step row's device-hours so far by kind (cost/gpu_hours, cost/cpu_core_hours; its
        evaluation and checkpoint count in the next step's row) and their price at the run's own
        rates (cost/price, only when its [cost] section sets one)."""
        held = self.device_seconds_now()
        m = {"cost/gpu_hours": held["gpu"] / 3600, "cost/cpu_core_hours": held["cpu"] / 3600}
        money = cost.price(held, cost.run_rates(self.cfg.cost.gpu_hour, self.cfg.cost.cpu_core_hour))
        if money is not None:
            m["cost/price"] = money
        return m

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

    def _held_devices(self) -> dict:
        """What each process holds in this start of the run (read once: the layout is fixed)."""
        if self._held is None:
            self._held = self._devices()
        return self._held

    def _devices(self) -> dict:
        """What each process holds, for the cost account (trainer/accounting/cost.py)."""
        lanes = getattr(self.engine, "lane_pids", dict)()
        # generation processes on CUDA share the trainer's GPU when the machine has too few
        own_gpu = self.device.type != "cuda" or generation_device(self.device, 0, max(len(lanes), 1)) != self.device
        return cost.layout_devices(self.device.type, self.dist.size, torch.get_num_threads(), lanes,
                                   self.cfg.async_.worker_threads, len(getattr(self.engine, "servers", ())),
                                   engine_own_gpu=own_gpu)

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
