"""bench engine: the embedded engine (continuous batching) against Hugging Face `generate` with
a static batch, on the long-tailed sum workload, same model, same prompts, one process.
(`--engine sglang`: against a real SGLang server instead, trainer/bench/sglang_vs_embedded.py.)

Static batching runs consecutive batches of `--slots` prompts; every row of a batch runs until
the batch's longest row ends (finished rows are padded). The engine gets the same number of
slots and refills a slot as soon as its sequence ends. Both decode greedily by default, so on the
same model they produce the same tokens and the comparison is pure scheduling + kernels.

Useful tokens are the tokens of each response up to and including its end-of-sequence token.
Reported for each: useful tokens/s, the share of idle slots (static: padded row-steps after a row
finished / all row-steps; engine: empty slot-steps / all slot-steps) and the mean GPU utilisation
(NVML, sampled every 0.1 s; null without a GPU), plus `ratio.useful_throughput` =
engine / static.

Models: `builtin` (the warmed-up CPU model; responses end where the model writes <eos>), a local
HF directory, `qwen2.5-0.5b-random`: a Qwen2.5-0.5B-shaped model with random weights (no
download), or `builtin-43m-random`: the built-in model's architecture and tokenizer widened and
deepened to 43M parameters, random weights (the bigger CPU model of the rollout-dominated
workload below). A random model never chooses to stop, so with it each response is forced to a
length: the task's reference answer's (`--lengths reference`, the same long tail, by
construction) or one drawn from a heavy Pareto tail (`--lengths heavy`: `--tail-min` x
u^(-1/`--tail-alpha`), capped at `--max-new-tokens`; the defaults give a median near 22 tokens
and max/median of 50 and more at 1,536 tokens: the regime where rollout dominates, as in the
papers). `--model auto` = the Qwen-shaped model on CUDA, `builtin` on CPU.

Noise: a shared machine's timings move by several percent between runs, so each variant runs
`--reps` times (default 3), interleaved (static, engine, static, engine, ...), and the JSON
gives each one's median, its spread (min, max) and every run; `ratio.useful_throughput` is the
ratio of the medians, `ratio.useful_throughput_runs` the ratio within each interleaved pair.

`decode_step`: the cost of one engine decode step (sampling and bookkeeping included) at
`--step-batch` rows (default 128) with every row at ~`--step-short` cached tokens (default 30)
against the same batch with one row at `--step-long` (default 300): the ragged decode
attention should make the second cost about the first (`ratio`, target <= 1.3x), where a
padded attention costs B x the longest row (`one_long_padded_ms`, `padded_ratio`: the same
batch with a single padded bucket, as the engine decoded before). Measured interleaved too
(A B C A B C ...), each run the median of `--step-steps` decode steps.

`decode_cost.against_peak`: each batch's decode step against this machine's limit, measured
here (trainer/bench/roofline.py: a large matmul's FLOP/s, a large copy's bytes/s): achieved
GFLOP/s and GB/s and the fraction of the bound (compute or memory) the step reaches.

`decode_cost`: what a generated token costs in a decode step of B rows (every row at
~`--step-short` cached tokens), for each B of `--cost-batches` (default 8, 32, 128), and
`batching_gain` = the cost per token at the smallest B over that at the largest. This is what
filling idle slots (continuous batching, APRIL) can win on the device: near B x on a GPU, whose
decode step costs about the same at 8 and 128 rows; little on a CPU, whose matrix products are
already compute-bound at a few rows.

This module measures the throughput; the models are trainer/bench/engine_models.py's, the decode
step and its cost trainer/bench/decode_cost.py's.
"""
from __future__ import annotations

import math
import random
import statistics
import time

import torch

from trainer.bench import engine_models
from trainer.bench.decode_cost import decode_cost, decode_step
from trainer.bench.engine_models import QWEN_RANDOM, RANDOM_MODELS, WIDE_RANDOM
from trainer.bench.measure import Replaced, spread, sync

NAME = "engine"
HELP = "embedded engine vs static-batch HF generate: useful tokens/s on the long-tailed task"


def add_arguments(p) -> None:
    p.add_argument("--model", default="auto",
                   help=f"auto | builtin | {QWEN_RANDOM} | {WIDE_RANDOM} | a local HF model "
                   "directory")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--prompts", type=int, default=256, help="sum-task prompts (default 256)")
    p.add_argument("--slots", type=int, default=64,
                   help="engine slots = static batch size (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--lengths", default="auto", choices=["auto", "natural", "reference", "heavy"],
                   help="natural: rows end at <eos>; reference: each row is forced to the length "
                   "of the task's reference answer; heavy: to a length from a Pareto tail "
                   "(auto: reference for a random model)")
    p.add_argument("--tail-alpha", type=float, default=0.7,
                   help="--lengths heavy: the tail's exponent (smaller = heavier)")
    p.add_argument("--tail-min", type=int, default=8, help="--lengths heavy: the shortest length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--reps", type=int, default=3,
                   help="runs of each variant, interleaved (default 3; medians reported)")
    p.add_argument("--step-batch", type=int, default=128, help="decode_step: rows (default 128)")
    p.add_argument("--step-short", type=int, default=30,
                   help="decode_step: cached tokens of the short rows (default ~30)")
    p.add_argument("--step-long", type=int, default=300,
                   help="decode_step: cached tokens of the one long row (default 300)")
    p.add_argument("--step-steps", type=int, default=12,
                   help="decode_step: timed decode steps per run (default 12)")
    p.add_argument("--engine", default="static", choices=["static", "sglang"],
                   help="what the embedded engine is compared with: static-batch HF generate "
                   "(default) or a real SGLang server from `make sglang` (--engine sglang: see "
                   "trainer/bench/sglang_vs_embedded.py)")
    p.add_argument("--train-steps", type=int, default=2,
                   help="--engine sglang: training steps timed with each engine (0 = none)")
    p.add_argument("--cost-batches", default="8,32,128",
                   help="decode_cost: the batch sizes, comma-separated (empty: skip)")


class _RowLengths:
    """A stopping criterion: row i is done after targets[i] new tokens."""

    def __init__(self, targets, prompt_len):
        self.targets, self.prompt_len = targets, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.prompt_len) >= self.targets


def _run_engine(model, prompts, targets, eos, args, device, dtype, max_seq_len):
    from trainer.engine.base import Sample, SamplingParams
    from trainer.engine.embedded import EmbeddedEngine

    eng = EmbeddedEngine(model, eos_token_ids=eos, max_slots=args.slots, max_seq_len=max_seq_len,
                         seed=args.seed, device=device, dtype=dtype)
    samples = [Sample(list(p), SamplingParams(temperature=args.temperature,
                                              max_new_tokens=t or args.max_new_tokens))
               for p, t in zip(prompts, targets)]
    sync(device)
    t0 = time.perf_counter()
    eng.generate(samples)
    sync(device)
    seconds = time.perf_counter() - t0
    responses = [s.response_ids for s in samples]
    st = eng.stats
    eng.close()
    del eng
    return responses, seconds, {"decode_steps": st.decode_steps,
                                "idle_slot_frac": st.idle_slot_frac()}


def _run_static(model, prompts, targets, eos, pad, args, device):
    from transformers import StoppingCriteriaList

    responses, row_steps, batches = [], 0, 0
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.slots):
        batch, tgt = prompts[i:i + args.slots], targets[i:i + args.slots]
        P = max(len(p) for p in batch)
        ids = torch.full((len(batch), P), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), P), dtype=torch.long)
        for b, p in enumerate(batch):  # left padding
            ids[b, P - len(p):] = torch.tensor(p)
            mask[b, P - len(p):] = 1
        kw = dict(max_new_tokens=args.max_new_tokens, pad_token_id=pad, use_cache=True)
        if tgt[0] is not None:
            kw["max_new_tokens"] = max(tgt)
            kw["stopping_criteria"] = StoppingCriteriaList(
                [_RowLengths(torch.tensor(tgt, device=device), P)])
            kw["eos_token_id"] = None
        else:
            kw["eos_token_id"] = eos
        if args.temperature > 0:
            kw.update(do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0)
        else:
            kw.update(do_sample=False)
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kw)
        gen = out[:, P:].tolist()
        steps = len(gen[0]) if gen else 0
        row_steps += steps * len(batch)
        batches += 1
        for row, t in zip(gen, tgt):
            if t is not None:
                responses.append(row[:t])
            else:
                cut = next((k + 1 for k, tok in enumerate(row) if tok in eos), len(row))
                responses.append(row[:cut])
    sync(device)
    seconds = time.perf_counter() - t0
    return responses, seconds, {"row_steps": row_steps, "batches": batches}


def _workload(args, tok):
    from trainer.tasks.sum import SumTask, reference_solution

    task = SumTask(seed=args.seed)
    problems = [task.problem(i) for i in range(args.prompts)]
    prompts = [tok(p.prompt).input_ids for p in problems]
    ref_len = [min(len(tok(reference_solution(_values(p.prompt))).input_ids) + 1,
                   args.max_new_tokens) for p in problems]  # + <eos>
    return prompts, ref_len


def _values(prompt: str) -> list[int]:
    return [int(x) for x in prompt.strip("[]=").split(",")]


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


def heavy_tail_lengths(n: int, args) -> list[int]:
    """n response lengths from a Pareto tail: tail_min * u^(-1/alpha), capped at
    --max-new-tokens (seeded; the same lengths for every variant and run)."""
    rng = random.Random(args.seed)
    return [min(args.max_new_tokens, math.ceil(args.tail_min * (1.0 - rng.random())
                                                ** (-1.0 / args.tail_alpha)))
            for _ in range(n)]


def run(args, log=print) -> dict:
    from trainer.models.loading import resolve_device, resolve_dtype
    from trainer.observe.system import SystemSampler

    if args.engine == "sglang":
        from trainer.bench import sglang_vs_embedded

        return sglang_vs_embedded.run(args, log)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tok, eos_id, pad, name = engine_models.load(args, device, dtype)
    lengths = args.lengths
    if lengths == "auto":
        lengths = "reference" if name in RANDOM_MODELS else "natural"
    prompts, ref_len = _workload(args, tok)
    targets = {"reference": ref_len, "heavy": heavy_tail_lengths(len(prompts), args),
               "natural": [None] * len(prompts)}[lengths]
    eos = [eos_id] if lengths == "natural" else []
    max_seq_len = max(len(p) for p in prompts) + args.max_new_tokens + 1
    reps = max(args.reps, 1)
    log(f"bench engine: {name} on {device} ({str(dtype).replace('torch.', '')}), "
        f"{len(prompts)} prompts, {args.slots} slots, lengths={lengths}, {reps} interleaved runs")

    # warm-up: first calls pay for allocations and kernel selection
    w = min(4, len(prompts))
    _run_engine(model, prompts[:w], [min(t or 8, 8) for t in targets[:w]], eos,
                Replaced(args, max_new_tokens=8), device, dtype, max_seq_len)
    _run_static(model, prompts[:w], [8 if t is not None else None for t in targets[:w]], eos, pad,
                Replaced(args, max_new_tokens=8), device)

    variants = ("static_generate", "engine")
    sampler = SystemSampler(interval_s=0.1, use_gpu=device.type == "cuda").start()
    try:
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for rep in range(reps):
            for variant in variants:  # interleaved: static, engine, static, engine, ...
                sampler.summary()  # reset
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                if variant == "engine":
                    resp, secs, extra = _run_engine(model, prompts, targets, eos, args, device,
                                                    dtype, max_seq_len)
                else:
                    resp, secs, extra = _run_static(model, prompts, targets, eos, pad, args,
                                                    device)
                sys_m = sampler.summary()
                useful = sum(len(r) for r in resp)
                if variant == "static_generate":
                    extra["idle_slot_frac"] = 1.0 - useful / max(extra["row_steps"], 1)
                runs[variant].append({
                    "useful_tokens": useful, "seconds": secs,
                    "useful_tokens_per_s": useful / max(secs, 1e-9),
                    "gpu_util": sys_m.get("system/gpu_util") if sampler.has_gpu else None,
                    "cpu_util": None if sampler.has_gpu else sys_m.get("system/cpu_util", 0),
                    "peak_mem_gb": (torch.cuda.max_memory_allocated(device) / 2**30
                                    if device.type == "cuda" else None),
                    **extra, "_responses": resp})
                log(f"  run {rep + 1}/{reps} {variant}: {useful} useful tokens in {secs:.2f}s = "
                    f"{useful / max(secs, 1e-9):.0f}/s, idle slots {extra['idle_slot_frac']:.1%}")
    finally:
        sampler.close()
    results = {v: _summarise(runs[v]) for v in variants}
    e, s = results["engine"], results["static_generate"]
    re_, rs = runs["engine"][0]["_responses"], runs["static_generate"][0]["_responses"]
    lens = [len(r) for r in re_]
    pair = [a["useful_tokens_per_s"] / max(b["useful_tokens_per_s"], 1e-9)
            for a, b in zip(runs["engine"], runs["static_generate"])]
    ratio = {"useful_throughput": round(e["useful_tokens_per_s"]
                                        / max(s["useful_tokens_per_s"], 1e-9), 2),
             "useful_throughput_runs": spread(pair, 2),
             "seconds": round(s["seconds"] / max(e["seconds"], 1e-9), 2)}
    log(f"  ratio: {ratio['useful_throughput']}x useful tokens/s (medians; per pair "
        f"{ratio['useful_throughput_runs']['runs']})")
    vocab = int(getattr(model.config, "vocab_size", 100))
    step = decode_step(model, args, device, dtype, min(vocab, len(tok)), log)
    cost = decode_cost(model, args, device, dtype, min(vocab, len(tok)), log)
    return {"model": name, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "prompts": len(prompts), "slots": args.slots, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "lengths": lengths, "reps": reps,
            "response_len": {"mean": round(sum(lens) / max(len(lens), 1), 1),
                             "p50": _pct(lens, 0.5), "p90": _pct(lens, 0.9),
                             "max": max(lens, default=0),
                             "max_over_median": round(max(lens, default=0)
                                                      / max(_pct(lens, 0.5), 1), 1)},
            "outputs_agree": round(sum(a == b for a, b in zip(re_, rs)) / max(len(re_), 1), 3),
            "engine": e, "static_generate": s, "ratio": ratio, "decode_step": step,
            "decode_cost": cost,
            "threads": torch.get_num_threads() if device.type == "cpu" else None}


def _summarise(runs: list[dict]) -> dict:
    """One variant's runs: medians of the timings, spread of its throughput, the rest from the
    first run (the same tokens every run when greedy)."""
    first = runs[0]
    med = {k: statistics.median([r[k] for r in runs])
           for k in ("seconds", "useful_tokens_per_s", "idle_slot_frac")}
    opt = {}
    for k in ("gpu_util", "cpu_util", "peak_mem_gb"):
        xs = [r[k] for r in runs if r[k] is not None]
        opt[k] = round(statistics.median(xs), 3 if k == "peak_mem_gb" else 1) if xs else None
    rest = {k: v for k, v in first.items() if k not in med and k not in opt
            and k not in ("useful_tokens", "_responses")}
    return {"useful_tokens": first["useful_tokens"], "seconds": round(med["seconds"], 3),
            "useful_tokens_per_s": round(med["useful_tokens_per_s"], 1),
            "useful_tokens_per_s_runs": spread([r["useful_tokens_per_s"] for r in runs], 1),
            "idle_slot_frac": round(med["idle_slot_frac"], 4), **opt, **rest}

