"""The training side: logprobs agree with the engine, micro-batching is exact, updates move
the policy in the direction of the advantages."""
import copy

import pytest
import torch

from trainer.algo.learner import Learner, TrainSequence, micro_batches
from trainer.engine.base import Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine
from trainer.models.loading import load_model, load_tokenizer


def _setup():
    torch.manual_seed(0)
    model = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    tok = load_tokenizer("builtin")
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=8, max_seq_len=200,
                         seed=0)
    samples = [Sample(tok(t).input_ids, SamplingParams(temperature=0.8, max_new_tokens=60))
               for t in ["[1,2]=", "[3,4,5,6]=", "[9,9,9]=", "[5]="] * 2]
    eng.generate(samples)
    seqs = [TrainSequence(s.prompt_ids, s.response_ids, s.logprobs, advantage=a, temperature=0.8)
            for s, a in zip(samples, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5])]
    return model, tok, seqs


def test_learner_logprobs_equal_the_engine_logprobs():
    model, tok, seqs = _setup()
    learner = Learner(model, lr=1e-4, weight_decay=0.0, track_reference=False)
    for s, lp in zip(seqs, learner.logprobs(seqs, tok.pad_token_id, max_tokens=64)):
        assert torch.allclose(torch.tensor(lp), torch.tensor(s.old_logprobs), atol=1e-4)


def test_micro_batches_respect_the_token_budget_and_keep_every_sequence():
    _, _, seqs = _setup()
    mbs = micro_batches(seqs, max_tokens=80)
    assert sorted(id(s) for mb in mbs for s in mb) == sorted(id(s) for s in seqs)
    for mb in mbs:
        assert len(mb) == 1 or len(mb) * max(s.length for s in mb) <= 80


def _grads(model, tok, seqs, budget):
    m = copy.deepcopy(model)
    learner = Learner(m, lr=0.0, weight_decay=0.0, track_reference=False)
    learner.update(seqs, pad_id=tok.pad_token_id, lr=0.0, grad_clip=0.0, clip_low=0.2,
                   clip_high=0.2, kl_coef=0.0, micro_batch_tokens=budget)
    return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])


def test_gradient_accumulation_equals_one_big_batch():
    model, tok, seqs = _setup()
    g_small = _grads(model, tok, seqs, budget=64)
    g_big = _grads(model, tok, seqs, budget=100_000)
    assert torch.allclose(g_small, g_big, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_an_update_moves_likelihood_in_the_direction_of_the_advantage(sign):
    model, tok, seqs = _setup()
    for s in seqs:
        s.advantage = sign
    learner = Learner(model, lr=1e-4, weight_decay=0.0, track_reference=True)
    before = learner.logprobs(seqs, tok.pad_token_id, 4096)
    m = learner.update(seqs, pad_id=tok.pad_token_id, lr=1e-4, grad_clip=1.0, clip_low=0.2,
                       clip_high=0.28, kl_coef=0.0, micro_batch_tokens=4096)
    after = learner.logprobs(seqs, tok.pad_token_id, 4096)
    total_change = sum(sum(a) - sum(b) for a, b in zip(after, before))
    assert total_change * sign > 0
    assert m["actor/kl"] == 0.0  # measured before the step: policy == reference
    assert abs(m["actor/importance_weight"] - 1.0) < 1e-4 and m["actor/clip_ratio"] == 0.0
    m2 = learner.update(seqs, pad_id=tok.pad_token_id, lr=1e-4, grad_clip=1.0, clip_low=0.2,
                        clip_high=0.28, kl_coef=0.0, micro_batch_tokens=4096)
    assert m2["actor/kl"] > 0.0


@pytest.mark.parametrize("prox", ["recompute", "loglinear"])
@pytest.mark.parametrize("mode", ["mask", "clamp"])
def test_the_update_reports_each_sequences_applied_behaviour_weight(prox, mode):
    """pi_prox / pi_b per token = 1, 2, 10, then 1 (by construction); cap 5: masked, the mean is
    (n - 3 + 1 + 2 + 0) / n = 1; clamped, (n - 3 + 1 + 2 + 5) / n. With "loglinear" and one
    mini-batch pi_prox is the live policy, whose logprobs equal the engine's."""
    import math

    from trainer.algo.decoupled import DecoupledLoss

    model, tok, seqs = _setup()
    seq = next(s for s in seqs if len(s.response_ids) >= 3)
    n = len(seq.response_ids)
    delta = [0.0, math.log(2.0), math.log(10.0)] + [0.0] * (n - 3)
    engine = list(seq.old_logprobs)
    if prox == "recompute":   # old_logprobs hold pi_prox
        seq.behave_logprobs, seq.old_logprobs = engine, [a + d for a, d in zip(engine, delta)]
    else:
        seq.behave_logprobs = [a - d for a, d in zip(engine, delta)]
    seq.versions, seq.report = [3] * n, {}
    other = next(s for s in seqs if s is not seq)
    other.behave_logprobs, other.versions = list(other.old_logprobs), [3] * len(other.response_ids)
    learner = Learner(model, lr=0.0, weight_decay=0.0, track_reference=False)
    learner.update([seq, other], pad_id=tok.pad_token_id, lr=0.0, grad_clip=0.0, clip_low=0.2,
                   clip_high=0.2, kl_coef=0.0, micro_batch_tokens=10_000,
                   decoupled_loss=DecoupledLoss(cap=5.0, cap_mode=mode, prox=prox, version=3))
    expected = 1.0 if mode == "mask" else (n + 5) / n
    assert seq.report["is_weight"] == pytest.approx(expected, abs=1e-3)
    assert other.report is None   # nothing asked for it
