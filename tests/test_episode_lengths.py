"""An episode's length is the model's: every figure that measures a response (the length metrics
and histogram, DAPO's overlong penalty, APRIL's short_first history, evaluation's mean length)
counts the tokens the model wrote, and every figure that counts the loss's
tokens (`april/masked_tokens`, the inspector's mean weight) counts model tokens alone. The
environment's tokens (a tool's result, feedback: version ENV_VERSION) are context the model
never wrote. Hand-built episodes, hand-computed values."""
from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest

from trainer.algo import objective
from trainer.config import Config
from trainer.engine.base import ENV_VERSION, EngineStats, Sample, SamplingParams
from trainer.observe.metrics import MemorySink
from trainer.rewards.pool import RewardBatch
from trainer.rollout.base import Group, RolloutResult, StepCounts, sampling_params, step_metrics
from trainer.rollout.scoring import Scorer
from trainer.rollout.synchronous import SynchronousDriver
from trainer.run.evaluate import evaluate
from trainer.run.step_record import rollout_metrics
from trainer.tasks.base import Problem

E = ENV_VERSION
# a correct episode: 5 model tokens, a calculator's 30-token result, 5 model tokens (10 written)
TOOL_EPISODE = [0] * 5 + [E] * 30 + [0] * 5
PLAIN = [0] * 12           # a wrong single-turn answer: 12 model tokens


def sample(versions: list[int], logp: float = -0.5) -> Sample:
    s = Sample([1, 2, 3], SamplingParams(max_new_tokens=40), response_ids=[7] * len(versions),
               logprobs=[0.0 if v == E else logp for v in versions], versions=list(versions),
               finish_reason="stop")
    if E in versions:
        s.meta["episode"] = {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_s": 0.1,
                             "end": "answer"}
    return s


def group(*versions: list[int], rewards=(1.0, 0.0)) -> Group:
    g = Group(problem=Problem("p", "q", 1, "sum"), samples=[sample(v) for v in versions])
    g.rewards = g.raw_scores = list(rewards)
    g.reward_status = ["ok"] * len(versions)
    return g


def config() -> Config:
    """Responses up to 40 tokens (model and environment together), the overlong penalty's ramp
    over the last 8: from 32 tokens on a response loses reward, at 40 it loses 1."""
    cfg = Config()
    cfg.rollout.max_response_len = 40
    cfg.algo.overlong_penalty = True
    cfg.algo.overlong_buffer = 8
    cfg.algo.overlong_penalty_factor = 1.0
    return cfg


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)

    def batch_decode(self, batches):
        return [self.decode(b) for b in batches]


class Rewards:
    def score_batch(self, problems, completions):
        return RewardBatch([1.0, 0.0], 0, 0)


def test_the_overlong_penalty_counts_only_the_model_s_tokens():
    """10 model tokens are far from the 32 where the ramp starts: no penalty, though the response
    holds 40 tokens with the calculator's (which would cost the whole reward: 1 - 1 = 0)."""
    cfg = config()
    g = group(TOOL_EPISODE, PLAIN, rewards=())
    totals = {"reward_errors": 0, "reward_timeouts": 0}
    Scorer(Rewards(), Tokenizer(), lambda: cfg, totals, threading.RLock())([g])
    assert g.raw_scores == [1.0, 0.0]
    assert g.rewards == [1.0, 0.0]


def test_the_penalty_still_fires_on_the_model_s_own_long_answer():
    """36 model tokens and 4 environment tokens: 36 - 32 = 4 tokens into the 8-token ramp, -0.5."""
    cfg = config()
    g = group([0] * 18 + [E] * 4 + [0] * 18, PLAIN, rewards=())
    Scorer(Rewards(), Tokenizer(), lambda: cfg, {"reward_errors": 0, "reward_timeouts": 0},
           threading.RLock())([g])
    assert g.rewards == [pytest.approx(0.5), 0.0]


def test_response_length_metrics_and_histogram_count_model_tokens():
    cfg = config()
    g = group(TOOL_EPISODE, PLAIN)
    result = RolloutResult(groups=[g], scored=[g], gen_seconds=1.0, counts=StepCounts())
    m = step_metrics(cfg, result, EngineStats())
    assert m["rollout/response_len/mean"] == 11.0         # (10 + 12) / 2, not (40 + 12) / 2
    assert m["rollout/response_len/max"] == 12
    assert m["rollout/response_len/p50"] == 11.0
    assert m["episode/env_tokens"] == 30                  # counted apart
    sink = MemorySink()
    run = SimpleNamespace(step=1, version=0, sink=sink, engine=None, scorer=SimpleNamespace(metrics=dict),
                          rollout=SimpleNamespace(concurrent=False, report=lambda *a: {}),
                          selector=SimpleNamespace(observe=lambda *a: None, report=lambda *a: {}))
    rollout_metrics(run, cfg, result, EngineStats(), 1.0)
    (hist,) = [h for h in sink.histograms if h["name"] == "rollout/response_len"]
    # bins 2 tokens wide over 0..40: 10 falls in bin 5, 12 in bin 6, nothing in the last
    assert hist["counts"][5] == 1 and hist["counts"][6] == 1 and sum(hist["counts"]) == 2


def test_short_first_history_is_the_model_s_mean_length():
    cfg = config()
    driver = SynchronousDriver(None, Tokenizer(), None, None)
    step = driver._new_step(cfg, sampling_params(cfg))
    g = group(TOOL_EPISODE, PLAIN)
    step.scored, step.ready = [g], [g]
    driver._finish(step, [g], 1.0)
    assert driver.length_history == {"p": 11.0}


class _EvalTokenizer(Tokenizer):
    def __call__(self, text):
        return SimpleNamespace(input_ids=[1, 2])


def test_evaluation_s_mean_length_counts_model_tokens():
    class Engine:
        def generate(self, samples):
            for s in samples:
                s.response_ids, s.versions = [7] * 40, list(TOOL_EPISODE)
                s.logprobs, s.finish_reason = [0.0] * 40, "stop"

    res = evaluate(Engine(), _EvalTokenizer(), [Problem("p", "q", 1, "sum")],
                   lambda problems, texts: [1.0], temperature=0.0, max_new_tokens=40)
    assert res["response_len_mean"] == 10.0


def april_config(mode: str) -> Config:
    cfg = config()
    cfg.april.enabled = True
    cfg.april.offpolicy = mode
    return cfg


# trained at version 1: the first model token was sampled by version 0 (age 1), the others by 1
MIXED = [0, 1, E, E, E, 1, 1]


def test_april_masked_tokens_count_only_model_tokens():
    """Mask mode: 1 stale model token per sample is masked; the environment's 3 tokens (version
    -1, "age 2") were never in the loss and are not APRIL's masking."""
    g = group(MIXED, MIXED)
    obj = objective.train_sequences([g], april_config("mask"), version=1,
                                    logprobs=lambda seqs: [list(s.old_logprobs) for s in seqs])
    assert obj.metrics["april/masked_tokens"] == 2
    for seq in obj.seqs:
        assert seq.weights == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        assert seq.env_tokens == 3


def test_the_inspector_s_weight_is_the_mean_over_model_tokens():
    """Mask mode: of 4 model tokens 1 is masked, the mean weight 3/4 (not 3/7 over 7 tokens)."""
    g = group(MIXED, MIXED)
    objective.train_sequences([g], april_config("mask"), version=1,
                              logprobs=lambda seqs: [list(s.old_logprobs) for s in seqs])
    assert [s.meta["is_weight"] for s in g.samples] == [0.75, 0.75]


def test_the_inspector_s_weight_under_a_correction_is_over_model_tokens():
    """truncate at 2: the trainer's log-probability is the engine's + log 0.5 on every model
    token, so each model token's weight pi_old / pi_rollout is 0.5; the mean is 0.5, not
    (4 * 0.5 + 3 * 1) / 7 with the environment's tokens."""
    cfg = config()
    cfg.mismatch.correction = "truncate"
    cfg.mismatch.upper = 2.0
    g = group(MIXED, MIXED)

    def trainer(seqs):
        return [[lp + math.log(0.5) for lp in s.old_logprobs] for s in seqs]

    g.samples[0].versions = g.samples[1].versions = [0, 0, E, E, E, 0, 0]
    objective.train_sequences([g], cfg, version=0, logprobs=trainer)
    assert [s.meta["is_weight"] for s in g.samples] == [pytest.approx(0.5), pytest.approx(0.5)]
