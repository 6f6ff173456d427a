"""GRPO/DAPO math against values computed by hand."""
import math

import torch

from trainer.algo import grpo


def test_group_advantages_by_hand():
    # rewards 1,0,0,1: mean 0.5, sample std sqrt(((.5^2)*4)/3) = 0.57735
    a = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    assert torch.allclose(a, torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025]]), atol=1e-5)
    # Dr. GRPO: centred only
    a = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), scale_by_std=False)
    assert torch.allclose(a, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_zero_variance_group_has_zero_advantage():
    a = grpo.group_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(a, torch.zeros(2, 3))


def test_overlong_penalty_by_hand():
    # max 100, buffer 20: no penalty up to 80, -0.5 at 90, -1 at 100 and beyond
    pen = grpo.overlong_penalty(torch.tensor([10, 80, 90, 100, 120]), 100, 20, 1.0)
    assert pen.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]


def test_kl_k3_by_hand():
    # logp = log 0.5, ref = log 0.25: d = log(0.5) => exp(d) - d - 1 = 0.5 + 0.693147 - 1
    kl = grpo.kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert abs(kl.item() - (0.5 + math.log(2) - 1)) < 1e-6
    assert grpo.kl_k3(torch.tensor([0.3]), torch.tensor([0.3])).item() == 0.0


def test_clipping_uses_separate_low_and_high_ranges():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))  # ratios 1.5, 1.5, 0.5, 0.5
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped = grpo.clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # A>0, r=1.5: min(1.5, 1.28) * 1 -> loss -1.28 (clipped)
    # A<0, r=1.5: max(1.5, 1.28) * -(-1) -> loss 1.5 (unclipped: pessimistic branch)
    # A>0, r=0.5: min(0.5, 0.8) -> loss -0.5 (unclipped)
    # A<0, r=0.5: loss max(-(-1)*0.5, -(-1)*0.8) = 0.8 (clipped)
    assert torch.allclose(loss, torch.tensor([-1.28, 1.5, -0.5, 0.8]))
    assert clipped.tolist() == [True, False, False, True]


def test_token_loss_is_a_token_mean_over_the_whole_batch():
    # on-policy (ratio 1): loss per token = -A; two micro-batches, 3 + 1 tokens
    logp = torch.zeros(2, 2, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
    w = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss_a, _ = grpo.token_loss(logp, torch.zeros(2, 2), adv, w, clip_low=0.2, clip_high=0.2,
                                total_tokens=4.0)
    loss_b, _ = grpo.token_loss(torch.zeros(1), torch.zeros(1), torch.tensor([3.0]),
                                torch.tensor([1.0]), clip_low=0.2, clip_high=0.2, total_tokens=4.0)
    # tokens: -1, -1, +2, -3 => mean -0.75
    assert abs((loss_a + loss_b).item() - (-0.75)) < 1e-6


def test_kl_penalty_is_added_with_its_coefficient():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    loss, stats = grpo.token_loss(logp, logp, torch.tensor([0.0]), torch.tensor([1.0]),
                                  clip_low=0.2, clip_high=0.2, ref_logp=ref, kl_coef=0.1,
                                  total_tokens=1.0)
    assert abs(loss.item() - 0.1 * (0.5 + math.log(2) - 1)) < 1e-6
    assert abs(stats["kl"].item() - (0.5 + math.log(2) - 1)) < 1e-6
