"""A training step's metric record: the scalars the sink, the trackers and the pilot get for it.

    step_record.advance(runner, cfg, results)   # the state the step's results feed
    m = step_record.record(runner, cfg, results)

`advance` moves what the step's results feed on: GRESO observes the step's scored groups (its
traces and exploration probabilities), the token ledger counts the trained, masked and
zero-variance tokens, the run's totals add the step's. `record` then reads, from the results and
that state: the rollout's metrics (common, the driver's own, the scorer's, GRESO's) and
histograms, the objective's and the update's, throughput and timings, the other ranks' share,
the engine's report, the token ledger, the run's totals, the system's and each process's CPU and
memory.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from trainer.engine.base import EngineStats
from trainer.observe import clock
from trainer.observe.metrics import histogram, length_edges
from trainer.observe.timeline import CONTROLLER, rank_lane
from trainer.rollout.base import RolloutResult, response_lengths, step_metrics


@dataclass
class StepResults:
    """What one step produced, for its record."""
    rollout: RolloutResult      # the driver's groups (and every group it scored)
    engine_stats: EngineStats   # the engine's counters over the step (EngineStats.minus)
    seqs: list                  # the objective's train sequences
    adv_metrics: dict
    train_metrics: dict
    ranks: list                 # the other training ranks' reports (training_ranks.gather_reports)
    train_s: float
    samples_s: float
    sync_s: float
    step_s: float
    histograms: dict            # the objective's: {name: (values, edges)}
    version: int                # the policy version the step's update started from

    @property
    def trained_tokens(self) -> int:
        """The tokens the loss saw: the mismatch correction's masked tokens are dropped, not
        trained, and the environment's tokens (episodes) were never generated."""
        return sum(len(s.response_ids) - s.env_tokens - s.rejected for s in self.seqs)

    @property
    def masked_tokens(self) -> int:
        """The tokens the mismatch correction masked out."""
        return int(self.adv_metrics.get("mismatch/correction_zeroed_tokens", 0))


def advance(run, cfg, results: StepResults) -> None:
    """Feed the step's results to the state that counts them (`run.step` is the step's number by
    now; before `record`, which reads that state): GRESO observes the scored groups, the ledger
    counts the trained tokens and drops the masked and the zero-variance ones (the complete
    groups the objective left out, algo.skip_zero_adv), the totals add the step's."""
    result, trained, masked = results.rollout, results.trained_tokens, results.masked_tokens
    run.selector.observe(cfg, run.step, result.scored)
    observe_generation(run)
    ledger = run.rollout.ledger
    ledger.train(trained)
    ledger.drop("mismatch", masked)
    ledger.drop("zero_variance", sum(g.tokens() for g in result.groups) - trained - masked)
    with run.lock:  # the async worker adds reward counts to the totals
        run.totals["samples"] += result.counts.groups_started * cfg.rollout.n_samples_per_prompt
        run.totals["gen_tokens"] += results.engine_stats.generated_tokens
        run.totals["trained_tokens"] += trained


def record(run, cfg, results: StepResults) -> dict[str, float]:
    """The step's metric record (`run.step` is the step's number by now; after `advance`)."""
    result, step_s = results.rollout, results.step_s
    m = rollout_metrics(run, cfg, result, results.engine_stats, step_s)
    trained_tokens = results.trained_tokens
    m.update(results.adv_metrics)
    for name, (values, edges) in results.histograms.items():
        run.sink.histogram(run.step, name, histogram(values, edges))
    m.update(results.train_metrics)
    m.update({
        "perf/trained_tokens_per_s": trained_tokens / max(step_s, 1e-9),
        "perf/rollout_trained_tokens_per_s": trained_tokens / max(result.gen_seconds, 1e-9),
        "timing/train_s": results.train_s, "timing/samples_s": results.samples_s,
        "timing/weight_sync_s": results.sync_s, "timing/step_s": step_s, "actor/lr": cfg.optim.lr,
        # what the update copied to the generators (0: the in-process engine shares them)
        "perf/weight_sync_bytes": getattr(run.engine, "last_sync_bytes", 0),
        "train/policy_version": run.version, "rollout/trained_tokens": trained_tokens,
    })
    if run.dist.size > 1:
        m.update({"dist/world_size": run.dist.size,
                  "dist/train_share_imbalance": run.ranks.imbalance})
    if hasattr(run.engine, "generators_alive"):  # generation processes (engine/pool.py)
        m.update(run.engine.report())
    m.update(run.rollout.ledger.step_metrics())
    with run.lock:  # the async worker adds reward counts to the totals
        m.update({f"train/{k}_total": v for k, v in run.totals.items()
                  if k in ("samples", "gen_tokens", "trained_tokens")})
    if run.system is not None:
        m.update(run.system.summary())
        m.update(process_metrics(run, results.ranks))
    return m


def rollout_metrics(run, cfg, result, engine_stats, step_s: float) -> dict[str, float]:
    """The rollout's metrics (common, the driver's own, GRESO's) and its histograms."""
    m = step_metrics(cfg, result, engine_stats)
    m.update(run.scorer.metrics())
    gen_time = step_s if run.rollout.concurrent else result.gen_seconds
    decoder = getattr(run.engine, "decoder", None)   # the embedded engine's: its cache layout
    if decoder is not None:
        m["engine/parked_kv_mb"] = engine_stats.parked_kv_tokens * decoder.kv_bytes_per_token() / 1e6
    m["perf/gen_tokens_per_s"] = engine_stats.generated_tokens / max(gen_time, 1e-9)
    m.update(run.selector.report(cfg, result.counts))

    def hist(name: str, values: list, edges: list) -> None:
        run.sink.histogram(run.step, name, histogram(values, edges))

    m.update(run.rollout.report(cfg, result, run.version, step_s, hist))
    lengths = response_lengths(result.scored)
    if lengths:
        hist("rollout/response_len", lengths, length_edges(cfg.rollout.max_response_len))
    return m


def observe_generation(run) -> None:
    """Hand the ledger the engine's count of rollout tokens (evaluations' taken out)."""
    run.rollout.ledger.observe_engine(run.engine.stats.generated_tokens - run.eval_tokens)


def process_metrics(run, ranks) -> dict[str, float]:
    """proc/<lane>/cpu_pct and rss_gb: this process, the engine's processes, the ranks'."""
    lanes = {CONTROLLER: os.getpid(), **getattr(run.engine, "lane_pids", dict)()}
    m = run.meter.local(lanes, clock.now())
    for rank, _, end, cpu_s, rss in ranks:
        m.update(run.meter.observe(rank_lane(rank), cpu_s, rss, end))
    return m
