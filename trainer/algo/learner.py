"""The training side: the policy, its frozen reference, the optimizer, and one GRPO update.

Sequences are packed into length-sorted micro-batches of at most `micro_batch_tokens` padded
tokens; gradients accumulate so that the loss is the token mean over the whole mini-batch
(see trainer/algo/grpo.py). With K training processes the model is replicated (DDP) or
sharded (FSDP2, trainer/cluster/sharding.py); sharded, every forward is a collective, so each rank runs
as many micro-batches as the rank with the most (`_matched`: empty ones fill the gap).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch

from trainer.algo import decoupled, grpo
from trainer.models import lora


@dataclass
class TrainSequence:
    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]     # behaviour policy, per response token
    advantage: float
    temperature: float
    weights: list[float] = field(default_factory=list)  # per response token; default all 1
    # decoupled PPO (async): behaviour logprobs and per-token versions; old_logprobs is then pi_prox
    behave_logprobs: list[float] | None = None
    versions: list[int] | None = None
    # where the update writes this sequence's figures ("is_weight": its mean applied behaviour
    # weight pi_prox / pi_b); objective.py points it at the sample's metadata, which the rollout
    # inspector shows
    report: dict | None = None
    # the rollout correction's weight per response token (trainer/algo/rollout_correction.py):
    # scales the token's surrogate, not its count in the token mean; None = 1
    is_weights: list[float] | None = None
    # response tokens the environment wrote (multi-turn episodes): weight 0, never trained
    env_tokens: int = 0
    # response tokens the rollout correction rejected: weight 0, the ledger's "mismatch" drop
    rejected: int = 0

    def __post_init__(self):
        if not self.weights:
            self.weights = [1.0] * len(self.response_ids)
        n = len(self.response_ids)
        if len(self.old_logprobs) != n or len(self.weights) != n:
            raise ValueError("response_ids, old_logprobs and weights must have one entry per token")
        for extra in (self.behave_logprobs, self.versions, self.is_weights):
            if extra is not None and len(extra) != n:
                raise ValueError("behave_logprobs, versions and is_weights must have one entry "
                                 "per token")

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def _padding(pad_id: int) -> TrainSequence:
    """An empty micro-batch's one sequence: a token of weight 0 (no loss, no gradient, no figure)."""
    return TrainSequence([pad_id], [pad_id], [0.0], 0.0, 1.0, weights=[0.0])


def micro_batches(seqs: list[TrainSequence], max_tokens: int) -> list[list[TrainSequence]]:
    """Length-sorted groups whose padded size (rows x longest) stays within max_tokens."""
    out, cur, longest = [], [], 0
    for s in sorted(seqs, key=lambda s: s.length):
        longest_new = max(longest, s.length)
        if cur and longest_new * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest_new = [], s.length
        cur.append(s)
        longest = longest_new
    if cur:
        out.append(cur)
    return out


class Learner:
    def __init__(self, model, *, lr: float, weight_decay: float, track_reference: bool,
                 reference=None, dist=None, sharded: bool = False):
        self.model = model
        self.device = next(model.parameters()).device
        # data parallel (trainer/cluster/distributed.py): a World of K > 1 processes; token counts and
        # gradients are summed over them so the loss is the token mean of the global batch
        self.dist = dist if dist is not None and dist.size > 1 else None
        # the reference is this process's model as given, copied before DDP's wrap replaces a
        # training rank's weights with rank 0's (which, resumed, are no longer the reference);
        # with LoRA it is the model itself with its adapters off (no copy)
        self.reference = None
        self.adapted = lora.is_adapted(model)
        self.has_reference = bool(track_reference)
        if track_reference and not self.adapted:
            self.reference = reference if reference is not None else copy.deepcopy(model)
            self.reference.eval().requires_grad_(False)
        self.ddp = None  # the DistributedDataParallel wrapper the update's forward runs through
        self.sharded = sharded and self.dist is not None
        if self.sharded:
            from trainer.cluster import sharding

            full = model.state_dict() if self.dist.is_main else {}  # rank 0's, before sharding
            sharding.shard(model, self.dist)
            if self.reference is not None:   # the base weights on every rank: nothing to spread
                sharding.shard(self.reference, self.dist)
            sharding.spread_from_rank0(model, full)
            del full
        elif self.dist is not None:
            from torch.nn.parallel import DistributedDataParallel

            # DDP broadcasts rank 0's weights and all-reduces the gradients, bucketed and
            # overlapped with the backward pass, at the last micro-batch of each mini-batch
            self.ddp = DistributedDataParallel(model, device_ids=self.dist.ddp_device_ids())
        # the trainable parameters only (LoRA: the adapters; full fine-tuning: every one)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                           lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999),
                                           eps=1e-8)

    def _pack(self, batch: list[TrainSequence], pad_id: int):
        """Right-padded ids plus per-position tensors aligned with the shifted targets."""
        B, T = len(batch), max(s.length for s in batch)
        ids = torch.full((B, T), pad_id, dtype=torch.long)
        attn = torch.zeros((B, T), dtype=torch.long)
        old = torch.zeros((B, T - 1))
        adv = torch.zeros((B, T - 1))
        w = torch.zeros((B, T - 1))
        behave = torch.zeros((B, T - 1))
        vers = torch.zeros((B, T - 1))
        isw = torch.ones((B, T - 1))
        for b, s in enumerate(batch):
            seq = s.prompt_ids + s.response_ids
            ids[b, :len(seq)] = torch.tensor(seq)
            attn[b, :len(seq)] = 1
            start, end = len(s.prompt_ids) - 1, len(seq) - 1  # logits at t predict token t+1
            old[b, start:end] = torch.tensor(s.old_logprobs)
            adv[b, start:end] = s.advantage
            w[b, start:end] = torch.tensor(s.weights)
            behave[b, start:end] = torch.tensor(s.behave_logprobs if s.behave_logprobs is not None
                                                else s.old_logprobs)
            if s.versions is not None:
                vers[b, start:end] = torch.tensor(s.versions, dtype=torch.float32)
            if s.is_weights is not None:
                isw[b, start:end] = torch.tensor(s.is_weights, dtype=torch.float32)
        temps = torch.tensor([s.temperature for s in batch]).view(B, 1, 1)
        dev = self.device
        return (ids.to(dev), attn.to(dev), old.to(dev), adv.to(dev), w.to(dev), temps.to(dev),
                behave.to(dev), vers.to(dev), isw.to(dev))

    def _accumulating(self, last: bool):
        """The gradients' all-reduce (DDP) or reduce-scatter (FSDP) runs once per mini-batch, at
        its last micro-batch's backward."""
        if self.sharded:
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()

    def _matched(self, mbs: list[list[TrainSequence]], pad_id: int) -> list[list[TrainSequence]]:
        """Sharded: `mbs` padded with empty micro-batches to the most any rank has (every forward
        and backward of an FSDP model is a collective every rank takes part in)."""
        if not self.sharded:
            return mbs
        most = self.dist.all_max(len(mbs))
        return mbs + [[_padding(pad_id)] for _ in range(most - len(mbs))]

    def _empty_backward(self, pad_id: int) -> None:
        ids = torch.full((1, 1), pad_id, dtype=torch.long, device=self.device)
        (self.ddp(input_ids=ids).logits.sum() * 0.0).backward()

    def _micro_batch_loss(self, mb, pad_id, mb_index, mini_batches, decoupled_loss, total, *,
                          clip_low, clip_high, kl_coef):
        """One micro-batch's share of the loss (GRPO, or decoupled PPO for asynchronous runs)."""
        ids, attn, old, adv, w, temps, behave, vers, isw = self._pack(mb, pad_id)
        logp, entropy = self._token_logprobs(self.ddp or self.model, ids, attn, temps, True)
        ref = None
        if self.has_reference:
            with torch.no_grad():
                ref = self._reference_logprobs(ids, attn, temps)
        if decoupled_loss is None:
            loss, stats = grpo.token_loss(logp, old, adv, w, clip_low=clip_low, clip_high=clip_high,
                                          ref_logp=ref, kl_coef=kl_coef, is_weights=isw,
                                          total_tokens=total)
        else:
            prox = old
            if decoupled_loss.prox == "loglinear":
                V = float(decoupled_loss.version)
                prox = decoupled.loglinear_prox(behave, logp, vers, V, V + mb_index / mini_batches)
            loss, stats = decoupled.token_loss(
                logp, prox, behave, adv, w, clip_low=clip_low, clip_high=clip_high,
                cap=decoupled_loss.cap, cap_mode=decoupled_loss.cap_mode,
                total_tokens=total, ref_logp=ref, kl_coef=kl_coef, is_weights=isw)
            if any(s.report is not None for s in mb):
                w_b, _ = decoupled.behaviour_weights(prox, behave, decoupled_loss.cap,
                                                     decoupled_loss.cap_mode)
                means = ((w_b * w).sum(1) / w.sum(1).clamp(min=1e-9)).tolist()
                for s, mean in zip(mb, means):
                    if s.report is not None:
                        s.report["is_weight"] = mean
        return loss, stats, entropy, w

    def _reference_logprobs(self, ids, attn, temps):
        if self.reference is not None:
            return self._token_logprobs(self.reference, ids, attn, temps)[0]
        with lora.reference(self.model):   # the base: adapters off
            return self._token_logprobs(self.model, ids, attn, temps)[0]

    @staticmethod
    def _token_logprobs(model, ids, attn, temps, with_entropy=False):
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temps
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    @torch.no_grad()
    def logprobs(self, seqs: list[TrainSequence], pad_id: int, max_tokens: int,
                 reference: bool = False) -> list[list[float]]:
        """Per-response-token log-probabilities under the policy (or the reference)."""
        out: dict[int, list[float]] = {}
        for mb in self._matched(micro_batches(seqs, max_tokens), pad_id):
            ids, attn, _, _, _, temps, _, _, _ = self._pack(mb, pad_id)
            if reference:
                logp = self._reference_logprobs(ids, attn, temps)
            else:
                logp, _ = self._token_logprobs(self.model, ids, attn, temps)
            for b, s in enumerate(mb):
                start = len(s.prompt_ids) - 1
                out[id(s)] = logp[b, start:start + len(s.response_ids)].tolist()
        return [out[id(s)] for s in seqs]

    def full_state_dict(self, only_changed: bool = False) -> dict[str, torch.Tensor]:
        """The policy's tensors whole, for the generators (sharded: a collective that leaves
        them on rank 0's CPU, {} elsewhere), under the model's plain names; LoRA: the adapted
        layers merged (W + alpha/r B A). With `only_changed`, for an engine that holds the base
        and merges LoRA's factors itself: the factors alone (lora.factor_state)."""
        if self.sharded:
            from trainer.cluster import sharding

            if self.adapted and only_changed:   # gather the adapters, not the frozen base
                state = sharding.full_parameters(self.model, lora.is_factor)
            else:
                state = sharding.full_state_dict(self.model)
        else:
            state = self.model.state_dict()
        if not self.adapted:
            return state
        scales = lora.scales(self.model)
        return lora.factor_state(state, scales) if only_changed else lora.merge_state(state, scales)

    def kl_to_reference(self, samples, pad_id: int, max_tokens: int) -> float:
        """Mean k3 KL of the policy to the reference over the samples' response tokens."""
        seqs = [TrainSequence(s.prompt_ids, s.response_ids, s.logprobs, 0.0, s.params.temperature)
                for s in samples]
        pol = self.logprobs(seqs, pad_id, max_tokens)
        ref = self.logprobs(seqs, pad_id, max_tokens, reference=True)
        flat_p = torch.tensor([x for lp in pol for x in lp])
        flat_r = torch.tensor([x for lp in ref for x in lp])
        return float(grpo.kl_k3(flat_p, flat_r).mean()) if flat_p.numel() else 0.0

    def train(self, seqs: list[TrainSequence], cfg, pad_id: int, samples: list,
              decoupled_loss: decoupled.DecoupledLoss | None = None, *,
              chunks: list[list[TrainSequence]] | None = None) -> dict[str, float]:
        """The step's update with the config's settings. Every rank takes part while any rank has
        sequences; with none anywhere (every group zero-variance) only the KL to the reference
        of `samples` is measured, so the KL chart has no holes. `chunks`: this rank's share of
        each optimizer mini-batch (trainer/run/training_ranks.py), else `seqs` split here."""
        total = self.dist.all_sum(len(seqs)) if self.dist is not None else len(seqs)
        if not total:
            # sharded, the KL's forwards are collectives: the other ranks (no samples) join in
            measured = self.dist.all_sum(len(samples)) if self.sharded else len(samples)
            if not self.has_reference or not measured:
                return {}
            return {"actor/kl": self.kl_to_reference(samples, pad_id, cfg.optim.micro_batch_tokens)}
        return self.update(seqs, pad_id=pad_id, lr=cfg.optim.lr, grad_clip=cfg.optim.grad_clip,
                           clip_low=cfg.algo.clip_low, clip_high=cfg.algo.clip_high,
                           kl_coef=cfg.algo.kl_coef, micro_batch_tokens=cfg.optim.micro_batch_tokens,
                           mini_batches=cfg.optim.mini_batches, decoupled_loss=decoupled_loss,
                           chunks=chunks)

    def update(self, seqs: list[TrainSequence], *, pad_id: int, lr: float, grad_clip: float,
               clip_low: float, clip_high: float, kl_coef: float, micro_batch_tokens: int,
               mini_batches: int = 1, decoupled_loss: decoupled.DecoupledLoss | None = None,
               chunks: list[list[TrainSequence]] | None = None) -> dict[str, float]:
        """One GRPO step over `seqs` (split into `mini_batches` optimizer updates, or as
        `chunks` gives them: one list per mini-batch).

        `decoupled_loss` switches to AReaL's decoupled PPO (trainer/algo/decoupled.py; the
        sequences come from trainer/algo/objective.py)."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.model.train()
        sums = {"pg_loss": 0.0, "clipped": 0.0, "ratio": 0.0, "kl": 0.0, "entropy": 0.0,
                "behave_imp_weight": 0.0, "behave_capped": 0.0}
        tokens_total, grad_norms = 0.0, []
        if chunks is None:
            chunks = [seqs[i::mini_batches] for i in range(mini_batches)]
        elif len(chunks) != mini_batches:
            raise ValueError(f"{len(chunks)} chunks for {mini_batches} mini-batches")
        for mb_index, chunk in enumerate(c for c in chunks if c or self.dist):  # every rank, every chunk
            total = sum(sum(s.weights) for s in chunk)
            if self.dist is not None:  # the global token count: each rank's loss is its share
                total = self.dist.all_sum(float(total))
            if total <= 0:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            mbs = self._matched(micro_batches(chunk, micro_batch_tokens), pad_id)
            if self.ddp is not None and not mbs:
                # this rank holds no sequence of the mini-batch: one empty backward keeps it in
                # step with the others' gradient all-reduce
                self._empty_backward(pad_id)
            for i, mb in enumerate(mbs):
                with self._accumulating(last=i == len(mbs) - 1):
                    loss, stats, entropy, w = self._micro_batch_loss(
                        mb, pad_id, mb_index, mini_batches, decoupled_loss, total,
                        clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef)
                    # DDP and FSDP average the ranks' gradients; each rank's loss is its share of the
                    # global token mean, so the sum is wanted: scale by K
                    (loss * (self.dist.size if self.dist is not None else 1)).backward()
                for name, v in stats.items():
                    sums[name] += float(v)
                sums["entropy"] += float((entropy * w).sum())
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                  grad_clip if grad_clip > 0 else float("inf"))
            if hasattr(norm, "full_tensor"):   # sharded: a replicated DTensor
                norm = norm.full_tensor()
            grad_norms.append(float(norm))
            if torch.isfinite(norm):
                self.optimizer.step()
            tokens_total += total
        self.model.eval()
        if self.dist is not None:
            sums = self.dist.all_sum_dict(sums)
        n = max(tokens_total, 1e-9)
        metrics = {"actor/pg_loss": sums["pg_loss"] / n, "actor/clip_ratio": sums["clipped"] / n,
                   "actor/importance_weight": sums["ratio"] / n, "actor/entropy": sums["entropy"] / n,
                   "actor/grad_norm": max(grad_norms) if grad_norms else 0.0, "actor/lr": lr,
                   "actor/loss_tokens": tokens_total}
        if self.has_reference:
            metrics["actor/kl"] = sums["kl"] / n
        if decoupled_loss is not None:
            metrics["actor/behave_imp_weight"] = sums["behave_imp_weight"] / n
            metrics["actor/behave_capped_ratio"] = sums["behave_capped"] / n
        return metrics

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
