"""Training–inference mismatch: how far the engine that sampled a token and the trainer that
scores it disagree, and the importance weight that corrects it.

Per response token t of a sequence, with the engine's log-probability (pi_rollout, the
behaviour policy pi_b of asynchronous runs) and the trainer's under the weights the update starts
from (pi_old, pi_prox of asynchronous runs):

    d_t   = log pi_old(t) - log pi_rollout(t)           (log-ratio; 0 where they agree)
    rho_t = exp(d_t) = pi_old(t) / pi_rollout(t)

The figures (tokens drawn from pi_rollout, so these estimate KL(pi_rollout || pi_old)):

    k1     = -d_t                       (unbiased, either sign)
    k3     = rho_t - 1 - d_t            (non-negative, lower variance; grpo.kl_k3)
    |d_t|  mean and max, the sequence's sum of d_t, the share of tokens outside [lower, upper]

The correction: a weight per token from rho at one level, applied in one mode:

    level  token      w_t = rho_t
           sequence   w_t = prod_s rho_s = exp(sum_s d_s)       (every token of the sequence)
           geometric  w_t = exp(mean_s d_s)                     (the per-token geometric mean)
    mode   truncate   w := min(w, upper)                        (TIS)
           mask       w := w if lower <= w <= upper, else 0      (MIS: the token, or the whole
                                                                 sequence at sequence/geometric;
                                                                 at token level this is IcePop)
           band       w := 1 if lower <= w <= upper, else 0      (rejection alone: drop, never
                                                                 reweight; biased where rho != 1)

IcePop (double-sided masking) keeps the ratio inside [lower, upper] and zeroes it outside: that
is `mask` at token level. `band` is plain rejection: the tokens it keeps are trained as if
pi_old were pi_rollout (weight 1), as a rejection-sampling filter with no importance weight;
until 2026-12 the docs called it IcePop, which it is not.

The weights are constants (no gradient) on the surrogate alone: with the loss mask m, the
token-mean loss is sum(m * (w * surrogate + kl_coef * kl)) / sum(m). A non-finite ratio (a NaN
log-probability) gets weight 0 in every mode. `rejected` is what leaves the mask m (the loss and
its token count): the tokens outside the band in mask and band modes, and the non-finite ones;
truncate rejects nothing else (a weight that underflows to 0 stays a weight). How they compose
with APRIL's version TIS and AReaL's behaviour weight (both are this same ratio, for older
tokens) is docs/algorithms.md's "one weight per ratio".

Plain tensor math on [B, T] tensors padded per row with a 0/1 `mask` of the response tokens;
no model or config access (tests/test_rollout_correction.py, hand-computed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algo import grpo

LEVELS = ("token", "sequence", "geometric")
MODES = ("off", "truncate", "mask", "band")
# ages of the per-age figures: 0, 1, and everything older (APRIL and asynchronous runs)
AGE_BUCKETS = (("age0", 0, 0), ("age1", 1, 1), ("age2plus", 2, None))


@dataclass(frozen=True)
class Correction:
    """What the objective applies: `mode` at `level`, with the band [lower, upper]."""
    mode: str
    level: str
    lower: float
    upper: float

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"correction mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.level not in LEVELS:
            raise ValueError(f"correction level must be one of {', '.join(LEVELS)}, "
                             f"not {self.level!r}")
        if not 0.0 <= self.lower <= 1.0 <= self.upper:
            raise ValueError(f"the band must hold 1: lower {self.lower} <= 1 <= upper {self.upper}")

    @property
    def on(self) -> bool:
        return self.mode != "off"


def level_log_ratio(d: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log of the weight's ratio at `level`, per token [B, T] (0 off the mask; `where`, not a
    product, so an infinite log-ratio leaves no NaN in the padding)."""
    on = mask > 0
    d = torch.where(on, d, torch.zeros_like(d))
    if level == "token":
        return d
    total = d.sum(dim=1, keepdim=True)
    if level == "sequence":
        return torch.where(on, total.expand_as(d), torch.zeros_like(d))
    if level == "geometric":
        mean = total / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return torch.where(on, mean.expand_as(d), torch.zeros_like(d))
    raise ValueError(f"correction level must be one of {', '.join(LEVELS)}, not {level!r}")


def weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
            c: Correction) -> torch.Tensor:
    """The correction's weight per token [B, T] (1 where it is off; 0 off the mask)."""
    mask = mask.float()
    if not c.on:
        return mask.clone()
    log_w = level_log_ratio(old_logp - rollout_logp, mask, c.level)
    # compared in log space; a long sequence's product may be inf, which truncates to upper
    inside = (log_w >= _log(c.lower)) & (log_w <= _log(c.upper))
    if c.mode == "truncate":
        w = torch.exp(log_w).clamp(max=c.upper)
    elif c.mode == "mask":
        w = torch.where(inside, torch.exp(log_w), torch.zeros_like(log_w))
    else:  # band
        w = inside.float()
    keep = (mask > 0) & ~torch.isnan(log_w)
    return torch.where(keep, w, torch.zeros_like(w)).detach()


def rejected(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
             c: Correction) -> torch.Tensor:
    """The tokens the correction leaves out of the loss and its token count [B, T] (bool):
    outside [lower, upper] in modes mask and band (the whole sequence at the sequence and
    geometric levels), and any token whose ratio is not a number. Truncate rejects nothing
    else: a weight that underflows to 0 is a tiny weight, not a rejection."""
    on = mask > 0
    if not c.on:
        return torch.zeros_like(on)
    log_w = level_log_ratio(old_logp - rollout_logp, mask.float(), c.level)
    out = torch.isnan(log_w)
    if c.mode in ("mask", "band"):
        out = out | (log_w < _log(c.lower)) | (log_w > _log(c.upper))
    return out & on


def _log(x: float) -> float:
    return float("-inf") if x <= 0 else float(torch.log(torch.tensor(x, dtype=torch.float64)))


def figures(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *,
            lower: float, upper: float) -> dict[str, float]:
    """The step's mismatch figures over the masked tokens (empty when there are none)."""
    mask = mask.float()
    n = float(mask.sum())
    if n == 0:
        return {}
    d = (old_logp - rollout_logp) * mask
    rho = torch.exp(d)
    outside = ((rho < lower) | (rho > upper)).float() * mask
    k3 = grpo.kl_k3(rollout_logp, old_logp) * mask
    return {"kl": float(k3.sum()) / n, "kl_k1": float(-d.sum()) / n,
            "abs_logp_diff": float(d.abs().sum()) / n, "abs_logp_diff_max": float(d.abs().max()),
            "outside_band_ratio": float(outside.sum()) / n, "tokens": n}


def figures_by_age(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                   ages: torch.Tensor) -> dict[str, float]:
    """k3 KL, mean and largest |d| per policy-version age bucket ("age0/kl", ...): age 0 is the
    engine's mismatch alone; older tokens add the policy's drift since they were sampled."""
    out = {}
    for name, lo, hi in AGE_BUCKETS:
        sel = mask.float() * (ages >= lo).float()
        if hi is not None:
            sel = sel * (ages <= hi).float()
        n = float(sel.sum())
        if n == 0:
            continue
        d = (old_logp - rollout_logp) * sel
        out[f"{name}/kl"] = float((grpo.kl_k3(rollout_logp, old_logp) * sel).sum()) / n
        out[f"{name}/abs_logp_diff"] = float(d.abs().sum()) / n
        out[f"{name}/abs_logp_diff_max"] = float(d.abs().max())
    return out


def sequence_log_ratios(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                        mask: torch.Tensor) -> list[float]:
    """Each sequence's sum of d_t: the log of pi_old(y) / pi_rollout(y) for the whole response."""
    return ((old_logp - rollout_logp) * mask.float()).sum(dim=1).tolist()


def padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence lists as a right-padded [B, T] tensor and its 0/1 mask."""
    T = max((len(r) for r in rows), default=0)
    out, mask = torch.zeros(len(rows), T, dtype=torch.float64), torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, :len(r)] = 1
    return out, mask
