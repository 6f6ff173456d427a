"""What the loss trains on, built from a step's scored groups, top to bottom:

1. rewards: the verifier's scores plus DAPO's overlong penalty (`shaped_rewards`);
2. advantages: group-normalised (GRPO, or Dr. GRPO without the std), zero-variance groups left
   out when `algo.skip_zero_adv`;
3. pi_old per token: the engine's behaviour log-probability, or the current policy's when
   `algo.recompute_old_logprobs` (or APRIL's truncated importance sampling) asks for it;
4. off-policy tokens (APRIL's partial rollouts carry tokens of older policies): kept, masked or
   weighted by truncated importance sampling, times decay^age (`token_weights`); a weight
   scales the token's clipped surrogate alone (`TrainSequence.is_weights`), never the KL
   penalty or the token count (`TrainSequence.weights`, the loss mask);
5. asynchronous training: the behaviour log-probabilities and per-token versions the decoupled
   PPO loss needs (trainer/algo/decoupled.py), and pi_prox recomputed or interpolated;
6. the training–inference mismatch (trainer/algo/rollout_correction.py): the engine's
   log-probabilities against the trainer's, measured (`mismatch.measure`) and, with
   `mismatch.correction`, corrected by the weight pi_old / pi_rollout, which then replaces
   APRIL's version TIS and AReaL's behaviour weight (the same ratio; never applied twice);
7. multi-turn episodes (trainer/episode/): the environment's tokens (tool results, feedback) are
   context, never trained: weight 0, left out of every figure (`_mask_environment`).

The loss itself is trainer/algo/grpo.py (or decoupled.py); the learner aggregates it.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from trainer.algo import grpo
from trainer.algo import rollout_correction as rc
from trainer.algo.decoupled import DecoupledLoss
from trainer.algo.learner import TrainSequence
from trainer.engine.base import ENV_VERSION

# current-policy log-probabilities of sequences (a forward pass of the model being trained)
Logprobs = Callable[[list[TrainSequence]], list[list[float]]]

# edges of the per-sequence log-ratio histogram (log pi_old(y) - log pi_rollout(y)), fixed so
# that every step's histogram lines up; values beyond them land in the end bins. Fine near 0: a
# bfloat16 engine's sequences spread over about +-0.1 (a float32 engine's sit in the middle bins)
SEQ_LOG_RATIO_EDGES = [round(-1.0 + 0.025 * i, 3) for i in range(81)]


class Objective(NamedTuple):
    """What the update trains on: the sequences, the step's metrics and histograms ({name:
    (values, edges)}), and the decoupled-loss settings (asynchronous runs; else None)."""
    seqs: list[TrainSequence]
    metrics: dict[str, float]
    decoupled: DecoupledLoss | None
    histograms: dict[str, tuple[list[float], list[float]]]


def correction(cfg) -> rc.Correction:
    """The config's rollout correction."""
    mm = cfg.mismatch
    return rc.Correction(mode=mm.correction, level=mm.level, lower=mm.lower, upper=mm.upper)


def shaped_rewards(scores: list[float], lengths: list[int], cfg) -> list[float]:
    """The verifier's scores plus the overlong penalty (when `algo.overlong_penalty`)."""
    if not cfg.algo.overlong_penalty:
        return list(scores)
    pen = grpo.overlong_penalty(torch.tensor(lengths), cfg.rollout.max_response_len,
                                cfg.algo.overlong_buffer, cfg.algo.overlong_penalty_factor)
    return [r + float(p) for r, p in zip(scores, pen)]


def token_weights(versions: list[int], version: int, behaviour_logp: list[float],
                  current_logp: list[float] | None, *, mode: str, cap: float,
                  decay: float) -> tuple[list[float], list[float], list[float]]:
    """The loss mask, the surrogate's weights and the logprobs to use as pi_old for one
    sample's tokens.

    `version` is the policy being updated; a token's age is version - its version.
    - as_is: mask 1; pi_old = the current policy's logprob when `current_logp` is given
             (algo.recompute_old_logprobs), else the behaviour logprob.
    - mask:  mask 0 on tokens with age > 0 (out of the loss and its token count); pi_old as for
             as_is.
    - tis:   pi_old = current policy logprob (needs `current_logp`), and tokens with age > 0
             weighted by min(pi_current / pi_behaviour, cap) (truncated importance sampling).
    Then every token's weight is multiplied by decay ** age. The weights scale the clipped
    surrogate alone (grpo.token_loss's `is_weights`): the KL penalty and the token count see the
    mask. An environment token (version ENV_VERSION: no policy sampled it, it has no age) gets
    mask 0 and weight 1: it is never in the loss, and never one of APRIL's masked tokens.
    """
    mask, weights, old = [], [], []
    for i, v in enumerate(versions):
        age = version - v
        w = 1.0
        if v == ENV_VERSION:
            mask.append(0.0)
            weights.append(1.0)
            old.append(behaviour_logp[i] if current_logp is None else current_logp[i])
            continue
        mask.append(0.0 if age > 0 and mode == "mask" else 1.0)
        if mode == "tis":
            if current_logp is None:
                raise ValueError("offpolicy='tis' needs the current policy's logprobs")
            if age > 0:
                w = min(math.exp(current_logp[i] - behaviour_logp[i]), cap)
            old.append(current_logp[i])
        else:
            old.append(behaviour_logp[i] if current_logp is None else current_logp[i])
        weights.append(w * decay ** max(age, 0))
    return mask, weights, old


def train_sequences(groups, cfg, version: int, logprobs: Logprobs) -> Objective:
    """The sequences to train on, their metrics and histograms, and the decoupled-loss settings."""
    if not groups:
        return Objective([], {}, None, {})
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
    _mask_environment(seqs, samples)   # before any weight or count reads the mask
    m = {"actor/advantage_abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0}
    hists: dict = {}
    fix = correction(cfg)
    if cfg.async_.enabled:
        decoupled_loss = _decoupled(seqs, samples, cfg, version, logprobs, fix, m, hists)
        return Objective([s for s in seqs if any(w > 0 for w in s.weights)], m, decoupled_loss,
                         hists)
    # pi_old: the engine's behaviour logprobs, or the trainer's; APRIL's off-policy tokens
    stale = [any(v < version for v in s.policy_versions) for s in samples]
    offpolicy = cfg.april.enabled and any(stale)
    trainers_old = cfg.algo.recompute_old_logprobs or fix.on   # pi_old := the trainer's
    current = measured = None
    if seqs and (trainers_old or cfg.mismatch.measure):
        current = logprobs(seqs)
        measured = _measure(samples, current, version, cfg, m, hists)
    elif offpolicy and cfg.april.offpolicy == "tis":
        # TIS needs the current policy's logprobs only where a token is stale: a sample made
        # wholly by the current policy has them already, its behaviour logprobs (taken to equal
        # a forward pass: with mismatch.measure off nothing checks it), so the trainer's extra
        # forward runs over the stale ones alone
        which = [i for i, st in enumerate(stale) if st]
        current = [list(s.logprobs) for s in samples]
        for i, lp in zip(which, logprobs([seqs[i] for i in which])):
            current[i] = lp
    # the correction owns pi_old / pi_rollout for every token: APRIL's TIS (that ratio, for old
    # tokens) steps aside, its mask and decay stay
    mode = "as_is" if fix.on and cfg.april.offpolicy == "tis" else cfg.april.offpolicy
    masked = 0
    for i, (seq, s) in enumerate(zip(seqs, samples)):
        cur = current[i] if current is not None else None
        if offpolicy:
            # measuring only observes: unless pi_old is the trainer's, TIS takes the trainer's
            # logprobs for stale samples alone, a fresh one's pi_old stays the engine's
            if not trainers_old and mode == "tis" and not stale[i]:
                cur = list(s.logprobs)
            seq.weights, pg, seq.old_logprobs = token_weights(
                s.versions, version, s.logprobs, cur if trainers_old or mode == "tis" else None,
                mode=mode, cap=cfg.april.tis_cap, decay=cfg.april.decay)
            seq.is_weights = pg if any(w != 1.0 for w in pg) else None
            model = [v != ENV_VERSION for v in s.versions]   # the environment's are not APRIL's
            masked += sum(1 for x, own in zip(seq.weights, model) if own and x == 0.0)
            s.meta["is_weight"] = (sum(x * w for x, w, own in zip(seq.weights, pg, model) if own)
                                   / max(sum(model), 1))   # the inspector's: over model tokens
        elif trainers_old and cur is not None:
            seq.old_logprobs = cur
    if fix.on and seqs:   # pi_old is the trainer's, as measured
        _correct(seqs, samples, measured, fix, m)
    seqs = [s for s in seqs if any(w > 0 for w in s.weights)]
    if offpolicy:
        m["april/masked_tokens"] = masked
    return Objective(seqs, m, None, hists)


def _measure(samples, trainer_logp: list[list[float]], version: int, cfg, m: dict, hists: dict):
    """The mismatch figures of the step's trained samples (mismatch/*), per version age where
    the rollout mixes versions, and the histogram of each sequence's log-ratio. Returns the
    padded (trainer, engine, mask) log-probabilities, which the correction weighs."""
    old, mask = rc.padded(trainer_logp)
    engine, _ = rc.padded([list(s.logprobs) for s in samples])
    if any(ENV_VERSION in s.versions for s in samples):   # the environment's tokens: no engine logp
        model, _ = rc.padded([[float(v != ENV_VERSION) for v in s.versions] for s in samples])
        mask = mask * model
    mm = cfg.mismatch
    m.update({f"mismatch/{k}": v for k, v in
              rc.figures(old, engine, mask, lower=mm.lower, upper=mm.upper).items()})
    if cfg.april.enabled or cfg.async_.enabled:
        ages, _ = rc.padded([[version - v for v in s.versions] for s in samples])
        m.update({f"mismatch/{k}": v for k, v in rc.figures_by_age(old, engine, mask, ages).items()})
    hists["mismatch/seq_log_ratio"] = (rc.sequence_log_ratios(old, engine, mask),
                                       SEQ_LOG_RATIO_EDGES)
    return old, engine, mask


def _correct(seqs, samples, padded, fix: rc.Correction, m: dict) -> None:
    """The correction's weights on each sequence's surrogate (pi_old / pi_rollout from `padded`,
    _measure's (trainer, engine, mask)), times what APRIL left there (its decay), and what they
    did: mean weight, share of tokens rejected (out of the loss and its token count), share
    truncated."""
    old, engine, mask = padded
    w = rc.weights(old, engine, mask, fix)
    out = rc.rejected(old, engine, mask, fix)
    n = float(mask.sum()) or 1.0
    m["mismatch/correction_weight"] = float(w.sum()) / n
    zeroed = int(out.sum())
    m["mismatch/correction_zeroed_ratio"] = zeroed / n
    m["mismatch/correction_zeroed_tokens"] = zeroed   # the token ledger's "mismatch" drop
    if fix.mode == "truncate":   # the tokens whose weight the cap lowered
        raw = rc.weights(old, engine, mask, rc.Correction("mask", fix.level, 0.0, math.inf))
        m["mismatch/correction_truncated_ratio"] = float((raw > w).sum()) / n
    for i, (seq, s) in enumerate(zip(seqs, samples)):
        n_i = len(seq.response_ids)
        prior = seq.is_weights or [1.0] * n_i
        # the environment's tokens are outside the mask: weight 1 (their loss mask is 0)
        seq.is_weights = [x * p if v != ENV_VERSION else 1.0
                          for x, p, v in zip(w[i, :n_i].tolist(), prior, s.versions)]
        s.meta["is_weight"] = (sum(a * b for a, b in zip(seq.is_weights, seq.weights))
                               / max(sum(seq.weights), 1e-9))
        seq.report = None   # the inspector's weight is this one (asynchronous runs)
        # a rejected token leaves the loss and the token count (a whole sequence: it is not
        # trained); a truncated weight that is 0 in floating point is a weight, not a rejection
        rows = out[i, :n_i].tolist()
        seq.weights = [0.0 if r else x for x, r in zip(seq.weights, rows)]
        seq.rejected = sum(rows)


def _decoupled(seqs, samples, cfg, version: int, logprobs: Logprobs, fix: rc.Correction,
               m: dict, hists: dict) -> DecoupledLoss:
    """Decoupled PPO inputs: behaviour logprobs and versions from the engine, pi_prox
    recomputed with the pre-update weights (or interpolated in the learner). The learner
    reports each sample's mean applied behaviour weight into its metadata (the inspector).
    pi_prox / pi_b is the mismatch measured (one more forward pass with loglinear); with a
    correction on, the correction's weight replaces the behaviour weight's cap."""
    a = cfg.async_
    for seq, s in zip(seqs, samples):
        # an environment token has no version: it counts as current (its weight is 0 anyway)
        seq.behave_logprobs = list(s.logprobs)
        seq.versions = [v if v != ENV_VERSION else version for v in s.versions]
        seq.report = s.meta
    trainer = measured = None
    if seqs and (a.prox_logp == "recompute" or cfg.mismatch.measure):
        trainer = logprobs(seqs)
        measured = _measure(samples, trainer, version, cfg, m, hists)
    if a.prox_logp == "recompute" and trainer is not None:
        for seq, p in zip(seqs, trainer):
            seq.old_logprobs = p
    cap_mode = a.behave_cap_mode
    if fix.on and trainer is not None:   # checks.py refuses a correction with loglinear
        _correct(seqs, samples, measured, fix, m)
        cap_mode = "none"
    return DecoupledLoss(cap=a.behave_imp_cap, cap_mode=cap_mode, prox=a.prox_logp,
                         version=version)


def _mask_environment(seqs, samples) -> None:
    """Weight 0 on the environment's tokens (tool results, feedback): the loss, its token count
    and its advantage never see them; `env_tokens` counts them (not trained, in the ledger)."""
    for seq, s in zip(seqs, samples):
        if ENV_VERSION in s.versions:
            seq.weights = [0.0 if v == ENV_VERSION else w for w, v in zip(seq.weights, s.versions)]
            seq.env_tokens = s.versions.count(ENV_VERSION)
