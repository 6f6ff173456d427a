"""What the loss trains on, built from a step's scored groups, top to bottom:

1. rewards: the verifier's scores plus DAPO's overlong penalty (`shaped_rewards`);
2. advantages: group-normalised (GRPO, or Dr. GRPO without the std), zero-variance groups left
   out when `algo.skip_zero_adv`;
3. pi_old per token: the engine's behaviour log-probability, or the current policy's when
   `algo.recompute_old_logprobs` (or APRIL's truncated importance sampling) asks for it;
4. off-policy tokens (APRIL's partial rollouts carry tokens of older policies): kept, masked or
   weighted by truncated importance sampling, times decay^age (`token_weights`);
5. asynchronous training: the behaviour log-probabilities and per-token versions the decoupled
   PPO loss needs (trainer/algo/decoupled.py), and pi_prox recomputed or interpolated.

The loss itself is trainer/algo/grpo.py (or decoupled.py); the learner aggregates it.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from trainer.algo import grpo
from trainer.algo.decoupled import DecoupledLoss
from trainer.algo.learner import TrainSequence

# current-policy log-probabilities of sequences (a forward pass of the model being trained)
Logprobs = Callable[[list[TrainSequence]], list[list[float]]]


def shaped_rewards(scores: list[float], lengths: list[int], cfg) -> list[float]:
    """The verifier's scores plus the overlong penalty (when `algo.overlong_penalty`)."""
    if not cfg.algo.overlong_penalty:
        return list(scores)
    pen = grpo.overlong_penalty(torch.tensor(lengths), cfg.rollout.max_response_len,
                                cfg.algo.overlong_buffer, cfg.algo.overlong_penalty_factor)
    return [r + float(p) for r, p in zip(scores, pen)]


def token_weights(versions: list[int], version: int, behaviour_logp: list[float],
                  current_logp: list[float] | None, *, mode: str, cap: float,
                  decay: float) -> tuple[list[float], list[float]]:
    """Loss weights and the logprobs to use as pi_old for one sample's tokens.

    `version` is the policy being updated; a token's age is version - its version.
    - as_is: weight 1; pi_old = the current policy's logprob when `current_logp` is given
             (algo.recompute_old_logprobs), else the behaviour logprob.
    - mask:  weight 0 on tokens with age > 0; pi_old as for as_is.
    - tis:   pi_old = current policy logprob (needs `current_logp`), and tokens with age > 0
             weighted by min(pi_current / pi_behaviour, cap) (truncated importance sampling).
    Then every token is multiplied by decay ** age.
    """
    weights, old = [], []
    for i, v in enumerate(versions):
        age = version - v
        w = 1.0
        if age > 0 and mode == "mask":
            w = 0.0
        if mode == "tis":
            if current_logp is None:
                raise ValueError("offpolicy='tis' needs the current policy's logprobs")
            if age > 0:
                w = min(math.exp(current_logp[i] - behaviour_logp[i]), cap)
            old.append(current_logp[i])
        else:
            old.append(behaviour_logp[i] if current_logp is None else current_logp[i])
        weights.append(w * decay ** max(age, 0))
    return weights, old


def train_sequences(groups, cfg, version: int, logprobs: Logprobs
                    ) -> tuple[list[TrainSequence], dict[str, float], DecoupledLoss | None]:
    """The sequences to train on, their metrics, and the decoupled-loss settings (async)."""
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
        return seqs, m, _decoupled(seqs, samples, cfg, version, logprobs)
    # pi_old: the engine's behaviour logprobs, or recomputed; APRIL's off-policy tokens
    stale = [any(v < version for v in s.versions) for s in samples]
    offpolicy = cfg.april.enabled and any(stale)
    current = None
    if cfg.algo.recompute_old_logprobs and seqs:
        current = logprobs(seqs)
    elif offpolicy and cfg.april.offpolicy == "tis":
        # TIS needs the current policy's logprobs only where a token is stale: a sample made
        # wholly by the current policy has them already, its behaviour logprobs (the engine
        # equals a forward pass), so the trainer's extra forward runs over the stale ones alone
        which = [i for i, st in enumerate(stale) if st]
        current = [list(s.logprobs) for s in samples]
        for i, lp in zip(which, logprobs([seqs[i] for i in which])):
            current[i] = lp
    masked = 0
    for i, (seq, s) in enumerate(zip(seqs, samples)):
        cur = current[i] if current is not None else None
        if offpolicy:
            seq.weights, seq.old_logprobs = token_weights(
                s.versions, version, s.logprobs, cur, mode=cfg.april.offpolicy,
                cap=cfg.april.tis_cap, decay=cfg.april.decay)
            masked += sum(1 for w in seq.weights if w == 0.0)
            s.meta["is_weight"] = sum(seq.weights) / max(len(seq.weights), 1)  # rollout inspector
        elif cur is not None:
            seq.old_logprobs = cur
    seqs = [s for s in seqs if any(w > 0 for w in s.weights)]
    if offpolicy:
        m["april/masked_tokens"] = masked
    return seqs, m, None


def _decoupled(seqs, samples, cfg, version: int, logprobs: Logprobs) -> DecoupledLoss:
    """Decoupled PPO inputs: behaviour logprobs and versions from the engine, pi_prox
    recomputed with the pre-update weights (or interpolated in the learner). The learner
    reports each sample's mean applied behaviour weight into its metadata (the inspector)."""
    a = cfg.async_
    for seq, s in zip(seqs, samples):
        seq.behave_logprobs, seq.versions = list(s.logprobs), list(s.versions)
        seq.report = s.meta
    if a.prox_logp == "recompute" and seqs:
        for seq, p in zip(seqs, logprobs(seqs)):
            seq.old_logprobs = p
    return DecoupledLoss(cap=a.behave_imp_cap, cap_mode=a.behave_cap_mode, prox=a.prox_logp,
                         version=version)
