"""Decoupled PPO (AReaL) against hand-computed values."""
import math

import torch

from trainer.algo import decoupled, grpo


def test_behaviour_weight_mask_and_clamp_by_hand():
    prox = torch.log(torch.tensor([0.5, 0.6, 0.9]))
    behave = torch.log(torch.tensor([0.5, 0.1, 0.3]))  # weights 1, 6, 3
    w, over = decoupled.behaviour_weights(prox, behave, cap=5.0, mode="mask")
    assert torch.allclose(w, torch.tensor([1.0, 0.0, 3.0])) and over.tolist() == [False, True, False]
    w, _ = decoupled.behaviour_weights(prox, behave, cap=5.0, mode="clamp")
    assert torch.allclose(w, torch.tensor([1.0, 5.0, 3.0]))


def test_clipping_is_centred_on_the_proximal_policy():
    # behaviour 0.2, proximal 0.4 (w_b = 2), theta 0.6: r = 1.5 -> clipped at 1.28 for A = 1
    logp, prox, behave = (torch.log(torch.tensor([x])) for x in (0.6, 0.4, 0.2))
    loss, stats = decoupled.token_loss(logp, prox, behave, torch.tensor([1.0]), torch.tensor([1.0]),
                                       clip_low=0.2, clip_high=0.28, cap=5.0, cap_mode="mask",
                                       total_tokens=1.0)
    assert abs(loss.item() - (-2.0 * 1.28)) < 1e-5
    assert abs(stats["behave_imp_weight"].item() - 2.0) < 1e-5
    assert stats["behave_capped"].item() == 0.0


def test_on_policy_decoupled_loss_equals_grpo_loss():
    torch.manual_seed(0)
    logp = torch.randn(3, 5, requires_grad=True)
    old = logp.detach() + 0.05 * torch.randn(3, 5)
    adv, w = torch.randn(3, 5), (torch.rand(3, 5) > 0.2).float()
    ref = logp.detach() - 0.1
    kw = dict(clip_low=0.2, clip_high=0.28, total_tokens=float(w.sum()), ref_logp=ref, kl_coef=0.1)
    g_loss, _ = grpo.token_loss(logp, old, adv, w, **kw)
    # eta = 0: the behaviour policy is the proximal one
    d_loss, _ = decoupled.token_loss(logp, old, old, adv, w, cap=5.0, cap_mode="mask", **kw)
    assert torch.equal(g_loss, d_loss)
    g_grad, = torch.autograd.grad(g_loss, logp)
    d_grad, = torch.autograd.grad(d_loss, logp)
    assert torch.equal(g_grad, d_grad)


def test_loglinear_prox_by_hand():
    behave = torch.tensor([math.log(0.2), math.log(0.5)])
    live = torch.tensor([math.log(0.8), math.log(0.5)])
    # token 0 from version 2, prox version 4, live version 6: alpha = (4-2)/(6-2) = 0.5
    # token 1 from version 4 == prox == live: alpha = 1
    prox = decoupled.loglinear_prox(behave, live, torch.tensor([2.0, 4.0]), 4.0, 6.0)
    expected0 = math.log(0.2) + 0.5 * (math.log(0.8) - math.log(0.2))
    assert abs(prox[0].item() - expected0) < 1e-6 and abs(prox[1].item() - math.log(0.5)) < 1e-6
    # before any optimizer step the live policy is the proximal one: alpha = 1
    prox = decoupled.loglinear_prox(behave, live, torch.tensor([2.0, 4.0]), 4.0, 4.0)
    assert torch.allclose(prox, live)


def test_the_behaviour_weight_scales_the_policy_gradient_not_the_kl_penalty():
    """AReaL weighs the policy-gradient term alone: with kl_coef > 0 the KL penalty and the token
    count are those of the loss mask, whatever w_b is (it scaled the KL penalty too before).
    Two tokens, A = 1, r = pi_theta / pi_prox inside the clip range:
      token 0: theta 0.5, prox 0.5, behave 0.25 -> w_b = 2,  r = 1
      token 1: theta 0.3, prox 0.3, behave 0.05 -> w_b = 6 > cap 5: masked (w_b 0) or clamped (5)
    ref 0.25 for both: k3 = e^(ref - logp) - (ref - logp) - 1."""
    logp, prox = (torch.log(torch.tensor(x)) for x in ([0.5, 0.3], [0.5, 0.3]))
    behave, ref = torch.log(torch.tensor([0.25, 0.05])), torch.log(torch.tensor([0.25, 0.25]))
    k3 = [0.25 / 0.5 - math.log(0.25 / 0.5) - 1, 0.25 / 0.3 - math.log(0.25 / 0.3) - 1]
    kw = dict(clip_low=0.2, clip_high=0.28, cap=5.0, total_tokens=2.0, ref_logp=ref, kl_coef=0.1)
    adv, mask = torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0])
    loss, _ = decoupled.token_loss(logp, prox, behave, adv, mask, cap_mode="mask", **kw)
    # token 1 is over the cap: no policy gradient, but it still counts and pays its KL penalty
    want = (-2.0 * 1.0 + 0.1 * k3[0] + 0.0 + 0.1 * k3[1]) / 2
    assert abs(loss.item() - want) < 1e-6
    loss, _ = decoupled.token_loss(logp, prox, behave, adv, mask, cap_mode="clamp", **kw)
    want = (-2.0 + 0.1 * k3[0] - 5.0 + 0.1 * k3[1]) / 2
    assert abs(loss.item() - want) < 1e-6
    # with the rollout correction's weights (is_weights) on top: both scale the surrogate alone
    isw = torch.tensor([0.5, 1.0])
    loss, _ = decoupled.token_loss(logp, prox, behave, adv, mask, cap_mode="clamp",
                                   is_weights=isw, **kw)
    want = (-2.0 * 0.5 + 0.1 * k3[0] - 5.0 + 0.1 * k3[1]) / 2
    assert abs(loss.item() - want) < 1e-6
