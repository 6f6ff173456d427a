"""Supervised warm-up of the built-in model on the built-in task.

RL needs a policy that is sometimes right. This trains a fresh built-in model on reference
scratchpads (loss on the response tokens only), with length-sorted token-budget batches and a
cosine learning rate, then saves it with save_pretrained() so it loads like any local HF model.
The result ships in `trainer/assets/builtin-sum/`; `python -m trainer warmup` rebuilds it.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.models.loading import new_builtin_model
from trainer.tasks.sum import SumTask, format_prompt, reference_solution, sample_list


def _example(tok, rng, task: SumTask) -> tuple[list[int], int]:
    values = sample_list(rng, task.max_len, task.alpha, task.max_operand)
    prompt = tok(format_prompt(values)).input_ids
    response = tok(reference_solution(values)).input_ids + [tok.eos_token_id]
    return prompt + response, len(prompt)


def _batches(examples, batch_tokens: int):
    """Group length-sorted examples into batches of about `batch_tokens` padded tokens."""
    examples = sorted(examples, key=lambda e: len(e[0]))
    batch, longest = [], 0
    for e in examples:
        longest_new = max(longest, len(e[0]))
        if batch and longest_new * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, longest_new = [], len(e[0])
        batch.append(e)
        longest = longest_new
    if batch:
        yield batch


def _loss(model, batch, pad_id: int) -> torch.Tensor:
    T = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    target_mask = torch.zeros((len(batch), T), dtype=torch.bool)
    attn = torch.zeros((len(batch), T), dtype=torch.long)
    for b, (seq, p) in enumerate(batch):
        ids[b, :len(seq)] = torch.tensor(seq)
        attn[b, :len(seq)] = 1
        target_mask[b, p:len(seq)] = True
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    targets = ids[:, 1:]
    mask = target_mask[:, 1:]
    return F.cross_entropy(logits[mask], targets[mask])


def warmup(out_dir: str | Path, *, steps: int = 1000, lr: float = 3e-3, batch_tokens: int = 2048,
           seed: int = 0, max_len: int = 24, alpha: float = 1.0, max_operand: int = 9,
           log=print) -> dict:
    """Train a new built-in model for `steps` optimizer steps and save it to `out_dir`."""
    model, tok = new_builtin_model(seed)
    model.train()
    task = SumTask(max_len=max_len, alpha=alpha, max_operand=max_operand, seed=seed)
    rng = random.Random(f"warmup:{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    t0, step, pool = time.monotonic(), 0, []
    while step < steps:
        if not pool:  # a chunk of examples, cut into length-sorted batches, shuffled
            pool = list(_batches([_example(tok, rng, task) for _ in range(2000)], batch_tokens))
            rng.shuffle(pool)
        loss = _loss(model, pool.pop(), tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % 100 == 0 or step == steps:
            log(f"warmup step {step}/{steps} loss {loss.item():.4f} ({time.monotonic() - t0:.0f}s)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    info = {"steps": steps, "lr": lr, "batch_tokens": batch_tokens, "seed": seed,
            "seconds": round(time.monotonic() - t0, 1), "final_loss": round(loss.item(), 4),
            "task": {"max_len": max_len, "alpha": alpha, "max_operand": max_operand}}
    (out / "warmup.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
