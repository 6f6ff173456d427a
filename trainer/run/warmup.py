"""Supervised warm-up of the built-in models on the built-in tasks.

RL needs a policy that is sometimes right. This trains a fresh built-in model on reference
answers (loss on the model's own tokens only), with length-sorted token-budget batches and a
cosine learning rate, then saves it with save_pretrained() so it loads like any local HF model.

- `warmup`: the sum task's scratchpads; ships in `trainer/assets/builtin-sum/`
  (`python -m trainer warmup` rebuilds it).
- `warmup_tools`: the calculator task (trainer/tasks/calc.py), a mix of by-hand scratchpads and
  calculator episodes whose environment text (`<result>N</result>`) is context, never a target,
  as RL never trains it; ships in `trainer/assets/builtin-tools/` (`warmup --tools`).

An example is (token ids, target flags): a flag says the token is the model's to predict.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.models.loading import load_model, new_builtin_model
from trainer.tasks.calc import CalcTask, calc_call, calc_result, sample_calc_list
from trainer.tasks.sum import SumTask, format_prompt, reference_solution, sample_list

Example = tuple[list[int], list[bool]]


def _segments(tok, parts: list[tuple[str, bool]], eos: bool = True) -> Example:
    """Token ids and target flags of consecutive (text, is the model's) parts, then EOS (a
    target). The tokenizer is character-level, so tokenizing parts apart equals the whole."""
    ids: list[int] = []
    flags: list[bool] = []
    for text, mine in parts:
        piece = tok(text).input_ids
        ids += piece
        flags += [mine] * len(piece)
    if eos:
        ids.append(tok.eos_token_id)
        flags.append(True)
    return ids, flags


def _example(tok, rng, task: SumTask) -> Example:
    values = sample_list(rng, task.max_len, task.alpha, task.max_operand)
    return _segments(tok, [(format_prompt(values), False), (reference_solution(values), True)])


def tools_parts(values: list[int], use_tool: bool, train_choice: bool = True) -> list[tuple[str, bool]]:
    """The calculator task's text as (text, is the model's) parts: the prompt, then either the
    by-hand scratchpad or the calculator call, the environment's result and the final answer.
    `train_choice` False leaves the call's first character ('<', where the model chooses the tool)
    out of the targets."""
    total = sum(values)
    if not use_tool:
        return [(format_prompt(values), False), (reference_solution(values), True)]
    call = calc_call(values)
    return [(format_prompt(values), False), (call[:1], train_choice), (call[1:], True),
            (calc_result(total), False), (f">{total}", True)]


def choice_keep(tool_share: float, tool_examples: float) -> float:
    """How often a calculator episode's choice of the tool is a target, so that the choice is
    learned at `tool_share` though `tool_examples` of the examples are episodes.

    The episodes are the skill the model can learn in a few minutes (copy the list, copy the
    result); the by-hand scratchpad with carries mostly is not. So the warm-up spends most
    examples on episodes, yet the first response token is '<' in only `tool_share` of the examples
    that train it: the warmed model calls the tool on about that share of prompts."""
    if not 0.0 <= tool_share <= tool_examples <= 1.0 or (tool_examples == 1.0 and tool_share < 1.0):
        raise ValueError(f"need 0 <= tool_share ({tool_share}) <= tool_examples ({tool_examples}) "
                         "<= 1, with some by-hand examples unless tool_share is 1")
    if tool_share == tool_examples:
        return 1.0
    return tool_share * (1.0 - tool_examples) / (tool_examples * (1.0 - tool_share))


def _tools_example(tok, rng, task: CalcTask, tool_examples: float, keep: float) -> Example:
    values = sample_calc_list(rng, task.max_len, task.max_operand)
    use_tool = rng.random() < tool_examples
    # no draw when every choice is trained: the shipped model's data stream (tool_examples 1) stays
    train_choice = use_tool and (keep >= 1.0 or rng.random() < keep)
    return _segments(tok, tools_parts(values, use_tool, train_choice=train_choice))


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
    for b, (seq, flags) in enumerate(batch):
        ids[b, :len(seq)] = torch.tensor(seq)
        attn[b, :len(seq)] = 1
        target_mask[b, :len(seq)] = torch.tensor(flags)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    targets = ids[:, 1:]
    mask = target_mask[:, 1:]
    return F.cross_entropy(logits[mask], targets[mask])


def _train(model, tok, make_example, rng, *, steps: int, lr: float, batch_tokens: int, log) -> float:
    """`steps` AdamW steps on examples from `make_example(rng)`, with a warm-up then cosine
    learning rate; returns the last batch's loss."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    t0, step, pool = time.monotonic(), 0, []
    while step < steps:
        if not pool:  # a chunk of examples, cut into length-sorted batches, shuffled
            pool = list(_batches([make_example(rng) for _ in range(2000)], batch_tokens))
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
    return loss.item()


def _save(model, tok, out_dir: str | Path, info: dict) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "warmup.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def warmup(out_dir: str | Path, *, steps: int = 1000, lr: float = 3e-3, batch_tokens: int = 2048,
           seed: int = 0, max_len: int = 24, alpha: float = 1.0, max_operand: int = 9,
           log=print) -> dict:
    """Train a new built-in model on the sum task for `steps` optimizer steps and save it to
    `out_dir`."""
    model, tok = new_builtin_model(seed)
    task = SumTask(max_len=max_len, alpha=alpha, max_operand=max_operand, seed=seed)
    t0 = time.monotonic()
    loss = _train(model, tok, lambda rng: _example(tok, rng, task), random.Random(f"warmup:{seed}"),
                  steps=steps, lr=lr, batch_tokens=batch_tokens, log=log)
    info = {"steps": steps, "lr": lr, "batch_tokens": batch_tokens, "seed": seed,
            "seconds": round(time.monotonic() - t0, 1), "final_loss": round(loss, 4),
            "task": {"max_len": max_len, "alpha": alpha, "max_operand": max_operand}}
    return _save(model, tok, out_dir, info)


def warmup_tools(out_dir: str | Path, *, steps: int = 1500, lr: float = 3e-3, batch_tokens: int = 2048,
                 seed: int = 0, max_len: int = 6, max_operand: int = 99, tool_share: float = 1.0,
                 tool_examples: float = 1.0, init: str | None = None, log=print) -> dict:
    """Train a built-in model on the calculator task: `tool_examples` of the examples are
    calculator episodes, the rest by-hand scratchpads, and the choice between them is trained at
    `tool_share` (choice_keep), so the warmed model calls the tool on about that share of prompts
    at temperature 1 and RL can move the share.

    It starts from a fresh model, or from the model `init` names (e.g. "builtin")."""
    keep = choice_keep(tool_share, tool_examples)
    model, tok = new_builtin_model(seed)
    if init is not None:
        model = load_model(init, torch.device("cpu"), torch.float32)
    task = CalcTask(max_len=max_len, max_operand=max_operand, seed=seed)
    t0 = time.monotonic()
    loss = _train(model, tok, lambda rng: _tools_example(tok, rng, task, tool_examples, keep),
                  random.Random(f"warmup-tools:{seed}"), steps=steps, lr=lr,
                  batch_tokens=batch_tokens, log=log)
    info = {"steps": steps, "lr": lr, "batch_tokens": batch_tokens, "seed": seed,
            "seconds": round(time.monotonic() - t0, 1), "final_loss": round(loss, 4),
            "task": {"name": CalcTask.name, "max_len": max_len, "max_operand": max_operand},
            "tool_share": tool_share, "tool_examples": tool_examples, "init": init,
            "format": {"call": calc_call([1, 2]), "result": calc_result(3), "answer": ">3"}}
    return _save(model, tok, out_dir, info)
