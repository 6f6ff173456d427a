"""The Runner: one training run, start to finish.

    runner = Runner(cfg, run_dir, sink=..., controls=...)
    status = runner.run()      # "finished" | "stopped"; raises on failure (after an event)

Each step: apply controls (knob changes, pause, stop) -> rollout -> rewards -> advantages ->
update -> push weights to the engine -> metrics -> maybe evaluate / checkpoint.
The runner never imports Django; the web app gives it a database sink and control source.
"""
from __future__ import annotations

import contextlib
import copy
import shutil
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from trainer import april as april_mod
from trainer import checkpoint, distributed
from trainer import config as config_mod
from trainer.algo import grpo
from trainer.asynchronous import AsyncRollout
from trainer.controls import PAUSE, RESUME, SET_KNOBS, STOP, Command, ControlSource
from trainer.engine import build_engine
from trainer.engine.base import LENGTH
from trainer.engine.embedded import EmbeddedEngine
from trainer.evaluate import evaluate
from trainer.greso import GresoFilter, classify
from trainer.learner import Learner, TrainSequence
from trainer.metrics import MetricsSink, histogram, length_edges, percentile
from trainer.model import load_model, load_tokenizer, resolve_device, resolve_dtype
from trainer.rollout import Group, Rollout, StepCounts
from trainer.system import SystemSampler
from trainer.tasks.base import build_task

FINISHED, STOPPED = "finished", "stopped"


class Runner:
    def __init__(self, cfg: config_mod.Config, run_dir: str | Path, *,
                 sink: MetricsSink | None = None, controls: ControlSource | None = None,
                 resume: bool = False, keep_knobs=(), system_telemetry: bool = True, log=print):
        self.cfg = cfg.copy()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # data parallel under torchrun (trainer/distributed.py); K = 1 otherwise. Only rank 0
        # reports and reads controls (it broadcasts them at step boundaries).
        self.dist = distributed.init(self.cfg.model.device)
        self.sink = (sink or MetricsSink()) if self.dist.is_main else MetricsSink()
        self.controls = (controls or ControlSource()) if self.dist.is_main else ControlSource()
        self.log = log
        self.step = 0
        self.version = 0
        self.totals = {"samples": 0, "gen_tokens": 0, "trained_tokens": 0, "reward_errors": 0,
                       "reward_timeouts": 0}
        self.best_eval: float | None = None
        self.last_eval: float | None = None

        ckpt_state = ckpt_tensors = None
        if resume:
            path = checkpoint.latest(self.run_dir)
            ckpt_state, ckpt_tensors = checkpoint.load(path)
            # knob values changed during the run win over the saved config's starting values,
            # except the ones the caller sets explicitly for the resumed run (keep_knobs)
            self.cfg = config_mod.apply_overrides(self.cfg, {
                k: v for k, v in ckpt_state["knobs"].items() if k not in set(keep_knobs)})
        distributed.check_config(self.cfg, self.dist.size)
        if self.cfg.model.threads:
            torch.set_num_threads(self.cfg.model.threads)
        torch.manual_seed(self.cfg.run.seed)

        self.device = self.dist.local_device(resolve_device(self.cfg.model.device))
        self.dtype = resolve_dtype(self.cfg.model.dtype, self.device)
        self.tokenizer = load_tokenizer(self.cfg.model.path)
        policy_path = str(path / "model") if resume else self.cfg.model.path
        self.model = load_model(policy_path, self.device, self.dtype).eval()
        reference = None
        if resume and (self.cfg.algo.track_kl or self.cfg.algo.kl_coef > 0):
            reference = load_model(self.cfg.model.path, self.device, self.dtype)
        self.learner = Learner(self.model, lr=self.cfg.optim.lr,
                               weight_decay=self.cfg.optim.weight_decay,
                               track_reference=self.cfg.algo.track_kl or self.cfg.algo.kl_coef > 0,
                               reference=reference, dist=self.dist)
        self.task = build_task(self.cfg)
        self.prompts = self.dist.prompt_source(self.task)  # rank r: every K-th draw
        a = self.cfg.async_
        if a.enabled and a.worker == "process" and self.cfg.rollout.engine == "embedded":
            from trainer.engine.process import ProcessEngine
            self.engine = ProcessEngine(
                self.model, eos_token_ids=[self.tokenizer.eos_token_id],
                max_slots=self.cfg.rollout.max_slots, max_seq_len=self._max_seq_len(),
                seed=self.cfg.run.seed, threads=a.worker_threads)
        else:
            self.engine = build_engine(self.cfg, self.model, self.tokenizer, self.device,
                                       self.dtype, self._max_seq_len(),
                                       weights_dir=self.run_dir / "engine_weights")
        self.dist.seed_engine(self.engine, self.cfg.run.seed)  # seed + rank
        self.greso = GresoFilter(p_easy=self.cfg.greso.p_easy, p_hard=self.cfg.greso.p_hard,
                                 seed=self.cfg.run.seed)
        # prompts, GRESO state and the reward pool are shared with the async generation worker
        self.lock = threading.RLock()
        if self.cfg.async_.enabled:
            self.rollout = AsyncRollout(self.engine, self.tokenizer, self.prompts, self._score,
                                        self._select_prompt, lock=self.lock)
        else:
            self.rollout = Rollout(self.engine, self.tokenizer, self.prompts, scorer=self._score,
                                   selector=self._select_prompt)
        self._stable_steps = 0  # auto staleness: consecutive steps with weights near 1
        self._last_busy_prev = 0.0
        self._reward_counts = [0, 0]  # errors, timeouts of the current step
        self._reward_seconds = 0.0

        from trainer.rewards import (
            RewardService,  # process pool: start after the model loads
        )
        self.rewards = RewardService(workers=self.cfg.run.reward_workers,
                                     timeout_s=self.cfg.run.reward_timeout_s)
        self.system = (SystemSampler(use_gpu=self.device.type == "cuda")
                       if system_telemetry and self.dist.is_main else None)

        if ckpt_state is not None:
            self._restore(ckpt_state, ckpt_tensors)
        elif self.dist.is_main:
            (self.run_dir / "config.toml").write_text(config_mod.to_toml(self.cfg))
        if self.cfg.rollout.engine != "embedded":
            # servers hold whatever weights they were started with: push the policy's
            self.engine.update_weights(self.model.state_dict(), self.version)

    # --- setup helpers ----------------------------------------------------------------------------
    def _max_seq_len(self) -> int:
        longest_prompt = max(len(self.tokenizer(p.prompt).input_ids)
                             for p in self.task.eval_problems(64))
        if self.cfg.data.task == "sum":  # the longest possible list prompt
            longest_prompt = max(longest_prompt, 2 + self.cfg.data.max_list_len
                                 * (len(str(self.cfg.data.max_operand)) + 1))
        return longest_prompt * 2 + self.cfg.rollout.max_response_len + 8

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> str:
        t_start = time.monotonic()
        if self.system is not None:
            self.system.start()
        self.sink.event(self.step, "run_started" if self.step == 0 else "run_resumed",
                        {"max_steps": self.cfg.run.max_steps, "device": str(self.device)})
        status = FINISHED
        try:
            if self.step == 0 and self.cfg.run.eval_every:
                self.evaluate()
            if isinstance(self.rollout, AsyncRollout):
                self.rollout.start(self.cfg, self.version)
            while self.step < self.cfg.run.max_steps:
                if not self._apply_controls():
                    status = STOPPED
                    break
                self.train_step()
                if self.cfg.run.eval_every and self.step % self.cfg.run.eval_every == 0:
                    self.evaluate()
                if self.cfg.run.checkpoint_every and self.step % self.cfg.run.checkpoint_every == 0:
                    self.save_checkpoint()
                budget = self.cfg.run.time_budget_s
                if budget and self.dist.broadcast_object(time.monotonic() - t_start >= budget):
                    self.sink.event(self.step, "time_budget_reached", {"seconds": budget})
                    break
            self.save_checkpoint()
            self.sink.event(self.step, "run_" + status, self.summary())
            return status
        except BaseException as e:
            self.sink.event(self.step, "error", {"message": f"{type(e).__name__}: {e}",
                                                 "traceback": traceback.format_exc(limit=8)})
            raise
        finally:
            if isinstance(self.rollout, AsyncRollout):
                self.rollout.close()  # no generation thread outlives run()
            if self.system is not None:
                self.system.close()
            self.sink.flush()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the engine, the reward processes and the telemetry thread."""
        if self.system is not None:
            self.system.close()
        self.rewards.close()
        self.engine.close()
        self.sink.flush()

    # --- controls ---------------------------------------------------------------------------------
    def _apply_controls(self) -> bool:
        """Apply pending commands at this step boundary; hold here while paused.
        Returns False when the run must stop."""
        paused = False
        while True:
            for cmd in self.dist.broadcast_object(self.controls.poll()):  # rank 0's commands
                if cmd.kind == SET_KNOBS:
                    self.apply_knobs(cmd)
                elif cmd.kind == PAUSE and not paused:
                    paused = True
                    if isinstance(self.rollout, AsyncRollout):
                        self.rollout.pause()
                    self.sink.event(self.step, "paused", {"requested_by": cmd.requested_by})
                    self.controls.acknowledge(cmd, self.step, True)
                elif cmd.kind == RESUME and paused:
                    paused = False
                    if isinstance(self.rollout, AsyncRollout):
                        self.rollout.resume()
                    self.sink.event(self.step, "resumed", {"requested_by": cmd.requested_by})
                    self.controls.acknowledge(cmd, self.step, True)
                elif cmd.kind == STOP:
                    if isinstance(self.rollout, AsyncRollout):
                        self.rollout.resume()  # a paused worker must reach the checkpoint
                    self.sink.event(self.step, "stop_requested", {"requested_by": cmd.requested_by})
                    self.controls.acknowledge(cmd, self.step, True)
                    return False
                else:
                    self.controls.acknowledge(cmd, self.step, True, "no effect in this state")
            if not paused:
                return True
            self.sink.flush()
            time.sleep(0.2)

    def apply_knobs(self, cmd: Command) -> None:
        """Validate and apply a knob change as a whole (all keys or none), and record it."""
        errors = {}
        for key, value in cmd.knobs.items():
            try:
                spec = config_mod.param_spec(key)
                if not spec.tunable:
                    raise config_mod.ConfigError({key: "cannot change during a run"})
                spec.coerce(value)
            except config_mod.ConfigError as e:
                errors.update(e.errors)
        if not errors:
            try:
                new_cfg = config_mod.apply_overrides(self.cfg, cmd.knobs)
                distributed.check_config(new_cfg, self.dist.size)
            except config_mod.ConfigError as e:
                errors.update(e.errors)
        if errors:
            self.sink.event(self.step, "knob_rejected", {"change_id": cmd.id, "errors": errors,
                                                         "requested_by": cmd.requested_by})
            self.controls.acknowledge(cmd, self.step, False, "; ".join(errors.values()))
            return
        changes = {k: {"old": self.cfg.get(k), "new": new_cfg.get(k)} for k in cmd.knobs}
        self.cfg = new_cfg
        if isinstance(self.rollout, AsyncRollout):
            self.rollout.set_config(new_cfg)
        self.sink.event(self.step, "knob_applied", {
            "change_id": cmd.id, "changes": changes, "requested_by": cmd.requested_by,
            "requested_at": cmd.requested_at, "applied_at": time.time()})
        self.controls.acknowledge(cmd, self.step, True)

    # --- one step -----------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        t_step = time.monotonic()
        stats0 = copy.copy(self.engine.stats)
        totals0 = dict(self.totals)
        self._reward_counts, self._reward_seconds = [0, 0], 0.0
        result = self.rollout.collect(self.dist.local_config(cfg), self.version)  # N/K groups
        engine_stats = self.engine.stats.minus(stats0)
        groups = result.groups
        self.rollout.after_step(cfg, engine_stats.idle_slot_frac())

        t0 = time.monotonic()
        seqs, adv_metrics, decoupled_loss = self._train_sequences(groups)
        train_metrics = {}
        n_seqs = self.dist.all_sum(len(seqs))  # every rank takes part in a data-parallel update
        if not n_seqs and self.learner.reference is not None and groups:
            # nothing to learn from this step (every group zero-variance): still report KL
            train_metrics = {"actor/kl": self._kl([s for g in groups for s in g.samples])}
        # sharing one GPU with the trainer: hand the engine's KV cache back while training
        release = (isinstance(self.engine, EmbeddedEngine) and self.device.type == "cuda"
                   and not isinstance(self.rollout, AsyncRollout) and self.engine.num_pending == 0)
        if release:
            self.engine.release_memory()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if n_seqs:
            train_metrics = self.learner.update(
                seqs, pad_id=self.tokenizer.pad_token_id, lr=cfg.optim.lr,
                grad_clip=cfg.optim.grad_clip, clip_low=cfg.algo.clip_low,
                clip_high=cfg.algo.clip_high, kl_coef=cfg.algo.kl_coef,
                micro_batch_tokens=cfg.optim.micro_batch_tokens, mini_batches=cfg.optim.mini_batches,
                decoupled_loss=decoupled_loss)
            if not all(map(_finite, train_metrics.values())):
                self.sink.event(self.step + 1, "warning", {"message": "non-finite loss or gradient; "
                                                           "the update was skipped"})
        train_s = time.monotonic() - t0
        if self.device.type == "cuda":
            train_metrics["system/cuda_peak_mem_gb"] = (
                torch.cuda.max_memory_allocated(self.device) / 2**30)
        if release:
            self.engine.reacquire_memory()

        t0 = time.monotonic()
        self.version += 1
        self.engine.update_weights(self.model.state_dict(), self.version,
                                   recompute_kv=cfg.rollout.recompute_kv_on_update)
        if isinstance(self.rollout, AsyncRollout):
            self.rollout.on_new_version(self.version)
        sync_s = time.monotonic() - t0
        self.step += 1

        m = self._step_metrics(result, self.engine.stats.minus(stats0), seqs)
        step_s = time.monotonic() - t_step
        trained_tokens = sum(len(s.response_ids) for s in seqs)
        m.update(adv_metrics)
        m.update(train_metrics)
        m.update({
            "perf/trained_tokens_per_s": trained_tokens / max(step_s, 1e-9),
            "perf/rollout_trained_tokens_per_s": trained_tokens / max(result.gen_seconds, 1e-9),
            "timing/reward_s": self._reward_seconds, "timing/train_s": train_s,
            "timing/weight_sync_s": sync_s, "timing/step_s": step_s, "actor/lr": cfg.optim.lr,
            "train/policy_version": self.version,
        })
        self.totals["trained_tokens"] += trained_tokens
        self.dist.sync_totals(totals0, self.totals)  # the counters count every rank's work
        m.update({f"train/{k}_total": v for k, v in self.totals.items()
                  if k in ("samples", "gen_tokens", "trained_tokens")})
        if isinstance(self.rollout, AsyncRollout):
            m.update(self._async_metrics(result, step_s, train_metrics, m["rollout/gen_tokens"]))
        if self.system is not None:
            m.update(self.system.summary())
        m = self.dist.reduce_metrics(m, [len(s.response_ids) for g in result.scored
                                         for s in g.samples])
        self.sink.scalars(self.step, m)
        return m

    def _async_metrics(self, result, step_s: float, train_metrics: dict,
                       gen_tokens: int) -> dict[str, float]:
        staleness = result.staleness
        busy = self.rollout.busy_s
        self.sink.histogram(self.step, "async/staleness",
                            histogram(staleness, [float(i) for i in range(
                                self.cfg.async_.max_staleness + 2)]))
        m = {"async/staleness/mean": sum(staleness) / max(len(staleness), 1),
             "async/staleness/max": max(staleness, default=0),
             "async/generator_idle_frac": max(0.0, 1.0 - (busy - self._last_busy_prev)
                                              / max(step_s, 1e-9)),
             "async/trainer_idle_frac": result.gen_seconds / max(step_s, 1e-9),
             # generation runs during the whole step here, not only while the trainer waits
             "perf/gen_tokens_per_s": gen_tokens / max(step_s, 1e-9)}
        self._last_busy_prev = busy
        if self.cfg.async_.auto_staleness and "actor/behave_imp_weight" in train_metrics:
            self._auto_staleness(train_metrics)
        return m

    def _auto_staleness(self, tm: dict) -> None:
        """Tighten eta when behaviour importance weights drift from 1 (data too stale), relax it
        after 5 steps near 1. Every change is an event."""
        a = self.cfg.async_
        drift = abs(tm["actor/behave_imp_weight"] - 1.0)
        capped = tm.get("actor/behave_capped_ratio", 0.0)
        new = a.max_staleness
        if drift > 0.05 or capped > 0.01:
            new, self._stable_steps = max(0, a.max_staleness - 1), 0
        elif drift < 0.01:
            self._stable_steps += 1
            if self._stable_steps >= 5:
                new, self._stable_steps = min(a.auto_staleness_max, a.max_staleness + 1), 0
        if new != a.max_staleness:
            self.sink.event(self.step, "auto_staleness", {
                "changes": {"async.max_staleness": {"old": a.max_staleness, "new": new}},
                "behave_imp_weight": tm["actor/behave_imp_weight"], "capped_ratio": capped})
            self.cfg.set("async.max_staleness", new)
            self.rollout.set_config(self.cfg)

    def _step_metrics(self, result, engine_stats, seqs) -> dict[str, float]:
        """Rollout, reward, APRIL and GRESO metrics of one step (and the histograms)."""
        cfg, c = self.cfg, result.counts
        scored = result.scored
        started = c.groups_started * cfg.rollout.n_samples_per_prompt  # samples generated
        self.totals["samples"] += started
        self.totals["gen_tokens"] += engine_stats.generated_tokens
        rewards = [r for g in scored for r in g.rewards]
        lengths = [len(s.response_ids) for g in scored for s in g.samples]
        n_groups = max(len(scored), 1)
        kinds = [classify(g.rewards) for g in scored]
        all_correct, all_wrong = kinds.count("all_correct"), kinds.count("all_wrong")
        m: dict[str, float] = dict(result.metrics)
        m.update({
            "reward/mean": sum(rewards) / max(len(rewards), 1),
            "reward/accuracy": sum(1 for g in scored for r in g.raw_scores if r >= 1.0)
            / max(len(rewards), 1),
            "reward/errors": self._reward_counts[0], "reward/timeouts": self._reward_counts[1],
            "rollout/response_len/mean": sum(lengths) / max(len(lengths), 1),
            "rollout/response_len/p50": percentile(lengths, 0.5),
            "rollout/response_len/p90": percentile(lengths, 0.9),
            "rollout/response_len/max": max(lengths, default=0),
            "rollout/truncated_ratio": sum(s.finish_reason == LENGTH for g in scored
                                           for s in g.samples) / max(len(lengths), 1),
            "rollout/zero_var_ratio": (all_correct + all_wrong) / n_groups,
            "rollout/zero_var_ratio/all_correct": all_correct / n_groups,
            "rollout/zero_var_ratio/all_wrong": all_wrong / n_groups,
            "rollout/idle_slot_frac": engine_stats.idle_slot_frac(),
            "rollout/decode_steps": engine_stats.decode_steps,
            "rollout/gen_tokens": engine_stats.generated_tokens,
            "rollout/samples": started,
            "perf/gen_tokens_per_s": engine_stats.generated_tokens / max(result.gen_seconds, 1e-9),
            "timing/gen_s": result.gen_seconds,
        })
        if cfg.greso.enabled:
            self.greso.adapt(len(scored), all_correct, all_wrong, cfg.greso)
        for g in scored:  # GRESO traces are kept even while GRESO is off, so it can start warm
            self.greso.record(g.problem.id, self.step, g.rewards)
        if cfg.greso.enabled:
            drawn = c.groups_started + c.skipped_easy + c.skipped_hard
            m.update({"greso/skip_rate": (c.skipped_easy + c.skipped_hard) / max(drawn, 1),
                      "greso/skip_rate/easy": c.skipped_easy / max(drawn, 1),
                      "greso/skip_rate/hard": c.skipped_hard / max(drawn, 1),
                      "greso/p_easy": self.greso.p_easy, "greso/p_hard": self.greso.p_hard,
                      "greso/prompts_sampled": drawn})
        trained_tokens = sum(len(s.response_ids) for s in seqs)
        if cfg.april.enabled:
            old = sum(1 for g in result.groups for s in g.samples for v in s.versions
                      if v < self.version - 1)
            total = sum(len(s.response_ids) for g in result.groups for s in g.samples)
            m["april/offpolicy_token_ratio"] = old / max(total, 1)
            spans = [max(s.versions) - min(s.versions) for g in result.groups
                     for s in g.samples if s.versions]
            self.sink.histogram(self.step, "april/version_span",
                                histogram(spans, [float(i) for i in range(0, 12)]))
            self.sink.histogram(self.step, "april/buffer_age",
                                histogram(self.rollout.buffer.ages(self.version),
                                          [float(i) for i in range(0, 12)]))
        m["rollout/trained_tokens"] = trained_tokens
        self.sink.histogram(self.step, "rollout/response_len",
                            self.dist.sum_histogram(
                                histogram(lengths, length_edges(cfg.rollout.max_response_len))))
        return m

    def _select_prompt(self, cfg, counts: StepCounts):
        """The next prompt to roll out; GRESO may skip some (bounded, so it always returns)."""
        for _ in range(max(1, self.task.train_size)):
            draw, problem = self.prompts.next()
            if not cfg.greso.enabled:
                return draw, problem
            d = self.greso.decide(problem.id, cfg.greso)
            if not d.skip:
                return draw, problem
            if d.kind == "easy":
                counts.skipped_easy += 1
            else:
                counts.skipped_hard += 1
        return draw, problem  # every prompt skippable: take the last one rather than loop

    def _logprobs(self, seqs: list[TrainSequence], reference: bool = False) -> list[list[float]]:
        """Per-token logprobs of `seqs` under the current policy (or the reference)."""
        return self.learner.logprobs(seqs, self.tokenizer.pad_token_id,
                                     self.cfg.optim.micro_batch_tokens, reference=reference)

    def _kl(self, samples) -> float:
        seqs = [TrainSequence(s.prompt_ids, s.response_ids, s.logprobs, 0.0, s.params.temperature)
                for s in samples]
        pol, ref = self._logprobs(seqs), self._logprobs(seqs, reference=True)
        flat_p = torch.tensor([x for lp in pol for x in lp])
        flat_r = torch.tensor([x for lp in ref for x in lp])
        return float(grpo.kl_k3(flat_p, flat_r).mean()) if flat_p.numel() else 0.0

    def _score(self, groups: list[Group]) -> None:
        """Rewards for every sample of complete groups (plus the optional overlong penalty)."""
        cfg = self.cfg
        t0 = time.monotonic()
        problems = [g.problem for g in groups for _ in g.samples]
        completions = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
                       for g in groups for s in g.samples]
        batch = self.rewards.score_batch(problems, completions)
        scores = list(batch.scores)
        raw = list(scores)
        if cfg.algo.overlong_penalty:
            lengths = torch.tensor([len(s.response_ids) for g in groups for s in g.samples])
            pen = grpo.overlong_penalty(lengths, cfg.rollout.max_response_len,
                                        cfg.algo.overlong_buffer, cfg.algo.overlong_penalty_factor)
            scores = [r + float(p) for r, p in zip(scores, pen)]
        i = 0
        for g in groups:
            g.rewards = scores[i:i + len(g.samples)]
            g.raw_scores = raw[i:i + len(g.samples)]
            i += len(g.samples)
        self._reward_counts[0] += batch.errors
        self._reward_counts[1] += batch.timeouts
        self.totals["reward_errors"] += batch.errors
        self.totals["reward_timeouts"] += batch.timeouts
        self._reward_seconds += time.monotonic() - t0

    def _train_sequences(self, groups: list[Group]
                         ) -> tuple[list[TrainSequence], dict[str, float], dict | None]:
        """Sequences to train on, their metrics, and the decoupled-loss settings (async)."""
        cfg = self.cfg
        if not groups:
            return [], {}, None
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        adv = grpo.group_advantages(rewards, scale_by_std=cfg.algo.scale_adv_by_std)
        seqs, samples = [], []
        for gi, g in enumerate(groups):
            if g.zero_variance and cfg.algo.skip_zero_adv:
                continue
            for si, s in enumerate(g.samples):
                seqs.append(TrainSequence(s.prompt_ids, s.response_ids, s.logprobs,
                                          float(adv[gi, si]), s.params.temperature))
                samples.append(s)
        m = {"actor/advantage_abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0}
        if cfg.async_.enabled:
            return seqs, m, self._decoupled(seqs, samples)
        # pi_old: the engine's behaviour logprobs, or recomputed; APRIL's off-policy tokens
        offpolicy = cfg.april.enabled and any(v < self.version for s in samples for v in s.versions)
        need_current = cfg.algo.recompute_old_logprobs or (offpolicy and cfg.april.offpolicy == "tis")
        current = None
        if need_current and seqs:
            current = self._logprobs(seqs)
        masked = 0
        for i, (seq, s) in enumerate(zip(seqs, samples)):
            cur = current[i] if current is not None else None
            if offpolicy:
                seq.weights, seq.old_logprobs = april_mod.token_weights(
                    s.versions, self.version, s.logprobs, cur, mode=cfg.april.offpolicy,
                    cap=cfg.april.tis_cap, decay=cfg.april.decay)
                masked += sum(1 for w in seq.weights if w == 0.0)
            elif cur is not None:
                seq.old_logprobs = cur
        seqs = [s for s in seqs if any(w > 0 for w in s.weights)]
        if offpolicy:
            m["april/masked_tokens"] = masked
        return seqs, m, None

    def _decoupled(self, seqs: list[TrainSequence], samples) -> dict:
        """Decoupled PPO inputs: behaviour logprobs and versions from the engine, pi_prox
        recomputed with the pre-update weights (or interpolated in the learner)."""
        a = self.cfg.async_
        for seq, s in zip(seqs, samples):
            seq.behave_logprobs, seq.versions = list(s.logprobs), list(s.versions)
        if a.prox_logp == "recompute" and seqs:
            for seq, p in zip(seqs, self._logprobs(seqs)):
                seq.old_logprobs = p
        return {"cap": a.behave_imp_cap, "cap_mode": a.behave_cap_mode, "prox": a.prox_logp,
                "version": self.version}

    # --- evaluation ---------------------------------------------------------------------------------
    def evaluate(self) -> float:
        cfg = self.cfg
        problems = self.task.eval_problems(cfg.run.eval_size)[self.dist.rank::self.dist.size]

        def score(ps, cs):
            with self.lock:
                return self.rewards.score_batch(ps, cs).scores

        hold = (self.rollout.suspended() if isinstance(self.rollout, AsyncRollout)
                and self.rollout.running_worker else contextlib.nullcontext())
        with hold:  # the async worker shares the engine: hold it while evaluating
            res = evaluate(self.engine, self.tokenizer, problems, score,
                           temperature=cfg.run.eval_temperature,
                           max_new_tokens=cfg.rollout.max_response_len)
        res = self.dist.reduce_eval(res)
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
        state = {"step": self.step, "version": self.version, "cursor": self.prompts.cursor,
                 "totals": self.totals, "best_eval": self.best_eval, "last_eval": self.last_eval,
                 "config": self.cfg.to_dict(), "knobs": self.cfg.knob_values()}
        tensors = {"optimizer": self.learner.state_dict(),
                   "rng": checkpoint.rng_state(self.engine.generator),
                   "rollout": self.rollout.state_dict(), "greso": self.greso.state_dict()}
        if self.dist.size > 1:  # each rank's sampling RNG, so each continues its own stream
            tensors["rng_ranks"] = self.dist.gather_list([tensors["rng"]])
        path = self.dist.main_only(lambda: checkpoint.save(  # rank 0 writes
            self.run_dir, self.step, model=self.model, tokenizer=self.tokenizer, state=state,
            tensors=tensors, keep=self.cfg.run.keep_checkpoints))
        self.sink.event(self.step, "checkpoint", {"path": str(path)})
        return path

    def _restore(self, state: dict, tensors: dict) -> None:
        self.step, self.version = state["step"], state["version"]
        self.prompts.cursor = state["cursor"]
        self.totals.update(state["totals"])
        self.best_eval, self.last_eval = state.get("best_eval"), state.get("last_eval")
        self.learner.load_state_dict(tensors["optimizer"])
        self.dist.restore_rng(tensors, self.engine.generator, self.cfg.run.seed, self.step)
        if isinstance(self.rollout, AsyncRollout):
            self.rollout.load_state_dict(tensors.get("rollout", {}), self.version,
                                         self.cfg.rollout.rollout_batch_size)
        else:
            self.rollout.load_state_dict(tensors.get("rollout", {}))
        if "greso" in tensors:
            self.greso.load_state_dict(tensors["greso"])
        self.engine.version = self.version


def _finite(v) -> bool:
    return not isinstance(v, float) or v == v and abs(v) != float("inf")


def prepare_run_dir(out: str | Path, overwrite: bool = False) -> Path:
    d = Path(out)
    if d.exists() and any(d.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{d} is not empty; pass --resume {d} to continue that run, "
                                  "or choose another --out")
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    return d
