"""The loss mask of an episode: the environment's tokens (version ENV_VERSION) get weight 0, so no
gradient and no advantage reaches them, they are left out of the mismatch figures and the token
counts, and the verifier reads only the last model turn. Hand-built episodes, hand-computed
values."""
from __future__ import annotations

import pytest
import torch

from trainer.algo import grpo, objective
from trainer.config import Config
from trainer.engine.base import ENV_VERSION, Sample, SamplingParams
from trainer.episode.engine import final_turn
from trainer.rollout.base import Group, episode_metrics
from trainer.tasks.base import Problem

E = ENV_VERSION
# an episode: 2 model tokens, 3 environment tokens, 2 model tokens
EPISODE_VERSIONS = [0, 0, E, E, E, 0, 0]
MODEL = [i for i, v in enumerate(EPISODE_VERSIONS) if v != E]
ENV = [i for i, v in enumerate(EPISODE_VERSIONS) if v == E]


def episode(reward: float, logp: float) -> Sample:
    s = Sample([1, 2, 3], SamplingParams(), response_ids=[10, 11, 20, 21, 22, 12, 13],
               logprobs=[0.0 if v == E else logp for v in EPISODE_VERSIONS],
               versions=list(EPISODE_VERSIONS), finish_reason="stop")
    s.meta["episode"] = {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_s": 0.25,
                         "end": "answer"}
    return s


def groups() -> list[Group]:
    g = Group(problem=Problem("p", "q", 1, "sum"), samples=[episode(1.0, -0.7), episode(0.0, -0.9)])
    g.rewards = g.raw_scores = [1.0, 0.0]
    return [g]


def trainer_logprobs(seqs):
    """The trainer's log-probabilities: the engine's on model tokens, something else entirely
    on the environment's (which the engine never sampled: its 0.0 is no probability)."""
    return [[lp if v != E else -5.0 for lp, v in zip(s.old_logprobs, EPISODE_VERSIONS)] for s in seqs]


@pytest.mark.parametrize("mode", ["sync", "april", "async"])
def test_environment_tokens_get_no_weight_no_gradient_and_no_mismatch(mode):
    cfg = Config()
    cfg.april.enabled = mode == "april"
    cfg.async_.enabled = mode == "async"
    obj = objective.train_sequences(groups(), cfg, version=0, logprobs=trainer_logprobs)
    assert len(obj.seqs) == 2
    for seq in obj.seqs:
        assert [seq.weights[i] for i in ENV] == [0.0, 0.0, 0.0]
        assert all(seq.weights[i] > 0 for i in MODEL)
        assert seq.env_tokens == 3
    # measured on the model's tokens alone: the engine and the trainer agree there exactly
    assert obj.metrics["mismatch/kl"] == pytest.approx(0.0, abs=1e-9)
    assert obj.metrics["mismatch/abs_logp_diff_max"] == pytest.approx(0.0, abs=1e-9)
    # GRPO's loss through those weights: the gradient reaches model tokens only
    seq = obj.seqs[0]
    logp = torch.tensor(trainer_logprobs([seq])[0], requires_grad=True)
    loss, _ = grpo.token_loss(logp, torch.tensor(seq.old_logprobs),
                              torch.full((7,), seq.advantage), torch.tensor(seq.weights),
                              clip_low=0.2, clip_high=0.2, total_tokens=sum(seq.weights))
    loss.backward()
    assert seq.advantage == pytest.approx(1 / 2 ** 0.5, rel=1e-4)   # (1 - 0.5) / std([1, 0])
    assert [float(logp.grad[i]) for i in ENV] == [0.0, 0.0, 0.0]
    # d/dlogp of -A * exp(logp - old) / 4 model tokens at logp = old: -A / 4
    assert float(logp.grad[MODEL[0]]) == pytest.approx(-seq.advantage / 4, rel=1e-5)


def test_a_correction_never_masks_or_counts_environment_tokens():
    cfg = Config()
    cfg.mismatch.correction = "mask"
    obj = objective.train_sequences(groups(), cfg, version=0, logprobs=trainer_logprobs)
    assert obj.metrics["mismatch/correction_zeroed_tokens"] == 0
    for seq in obj.seqs:
        assert [seq.is_weights[i] for i in MODEL] == [1.0] * 4
        assert seq.env_tokens == 3 and seq.is_weights.count(0.0) == 0


def test_the_verifier_reads_the_last_model_turn():
    s = episode(1.0, -0.5)
    assert final_turn(s) == [12, 13]
    assert s.model_tokens == 4 and s.policy_versions == [0, 0, 0, 0] and s.turn_start == 5


def test_episode_metrics_and_the_ledger_count_model_tokens():
    gs = groups()
    assert gs[0].tokens() == 8   # generated: 4 model tokens each, the environment's not
    m = episode_metrics(gs[0].samples)
    assert m["episode/turns"] == 2 and m["episode/tool_calls"] == 2
    assert m["episode/tool_use_rate"] == 1.0 and m["episode/env_tokens"] == 6
    assert m["episode/tool_s"] == pytest.approx(0.5)
