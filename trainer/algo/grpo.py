"""GRPO with DAPO's refinements, top to bottom.

1. Rewards -> advantages, per group: A_i = (r_i - mean(r)) / (std(r) + eps). `std` is the
   sample standard deviation (Bessel-corrected, as torch.std). With scale_by_std=False
   (Dr. GRPO) the group-centred reward is used as is. Groups with equal rewards get A = 0.
2. Optional overlong penalty (DAPO soft punishment): responses within `buffer` tokens of the
   limit lose up to `factor` reward, linearly; a response at the limit loses `factor`.
3. Per-token clipped surrogate with separate clip ranges (DAPO clip-higher):
       ratio = exp(logp - logp_old)
       loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
4. Optional KL penalty to a frozen reference, k3 estimator (always non-negative):
       kl = exp(ref - logp) - (ref - logp) - 1
5. Optional importance weights on the surrogate (the rollout correction,
   trainer/algo/rollout_correction.py): loss_t := w_t * loss_t for the policy-gradient term only
   (not the KL penalty, not the token count).
6. Token-level aggregation (DAPO): the sum of weighted per-token losses divided by the number
   of loss tokens in the whole batch, so long answers are not down-weighted per token.

Everything here is plain tensor math with no model or config access, so it is unit-tested with
hand-computed values (tests/test_grpo_math.py).
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards: [groups, G] -> advantages [groups, G]."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int,
                     factor: float) -> torch.Tensor:
    """Non-positive reward adjustment for each response length (DAPO)."""
    start = max_len - buffer
    over = (lengths.float() - start).clamp(min=0)
    return -(over / buffer).clamp(max=1.0) * factor


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref), from samples of pi."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss and a boolean mask of tokens where the clipped branch was taken."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, clipped > unclipped


def token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
               weights: torch.Tensor, *, clip_low: float, clip_high: float,
               ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
               is_weights: torch.Tensor | None = None,
               total_tokens: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one micro-batch, scaled so that summing over micro-batches gives the
    token mean of the whole batch.

    All tensors are per token with one shape ([B, T] padded, or flat). `weights` is the loss
    mask (0 on prompt and padding; APRIL/async may put fractional weights on old tokens).
    `total_tokens` is sum(weights) over the whole batch. `is_weights` (default 1) scale each
    token's surrogate. Returns (loss, sums of statistics)."""
    pg, clipped = clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high)
    if is_weights is not None:
        pg = pg * is_weights
    loss_tokens = pg
    stats = {"pg_loss": (pg * weights).sum().detach(),
             "clipped": (clipped.float() * weights).sum().detach(),
             "ratio": (torch.exp(logp - old_logp) * weights).sum().detach()}
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp)
        stats["kl"] = (kl * weights).sum().detach()
        if kl_coef > 0:
            loss_tokens = loss_tokens + kl_coef * kl
    loss = (loss_tokens * weights).sum() / total_tokens
    return loss, stats
