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

Long because it holds its several measurements (throughput, decode step, decode cost) with
the workloads they share.
"""
from __future__ import annotations

import math
import random
import statistics
import time

import torch

NAME = "engine"
HELP = "embedded engine vs static-batch HF generate: useful tokens/s on the long-tailed task"

QWEN_RANDOM = "qwen2.5-0.5b-random"
WIDE_RANDOM = "builtin-43m-random"
RANDOM_MODELS = (QWEN_RANDOM, WIDE_RANDOM)


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


def _qwen_random(device, dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                      pad_token_id=151643)  # no eos: random weights would stop by chance only
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _wide_random(device, dtype):
    """The built-in model's shape (Qwen2, character vocabulary of 100) at 43M parameters."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trainer.models.loading import BUILTIN, model_dir

    cfg = Qwen2Config.from_pretrained(model_dir(BUILTIN))
    cfg.update(dict(hidden_size=640, intermediate_size=1728, num_hidden_layers=10,
                    num_attention_heads=10, num_key_value_heads=2, max_position_embeddings=4096,
                    layer_types=["full_attention"] * 10,
                    eos_token_id=None))  # no eos: random weights would stop by chance only
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _load(args, device, dtype):
    """-> model, tokenizer (for prompts), eos id, pad id, model name."""
    from trainer.models.loading import BUILTIN, load_model, load_tokenizer

    name = args.model
    if name == "auto":
        name = QWEN_RANDOM if device.type == "cuda" else BUILTIN
    if name == QWEN_RANDOM:
        # no tokenizer ships with random weights: the char tokenizer's ids (all < 100) stand in
        # for Qwen's, which also spell digits and punctuation one token each
        tok = load_tokenizer(BUILTIN)
        return _qwen_random(device, dtype), tok, 151643, 151643, name
    if name == WIDE_RANDOM:
        tok = load_tokenizer(BUILTIN)
        return _wide_random(device, dtype), tok, tok.eos_token_id, tok.pad_token_id, name
    tok = load_tokenizer(name)
    return load_model(name, device, dtype).eval(), tok, tok.eos_token_id, tok.pad_token_id, name


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    _sync(device)
    t0 = time.perf_counter()
    eng.generate(samples)
    _sync(device)
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
    _sync(device)
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
    _sync(device)
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


def _spread(xs: list[float], nd: int = 3) -> dict:
    """Median, min, max and every run of a measured quantity."""
    return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd),
            "max": round(max(xs), nd), "runs": [round(x, nd) for x in xs]}


def _step_engine(model, args, device, dtype, vocab: int, long_row: bool, padded: bool = False):
    """An engine whose `--step-batch` slots all run: rows at ~step_short cached tokens (28..32
    at the first timed step, growing one per step), one of them at ~step_long if `long_row`.
    Responses never end (no eos) within the measurement."""
    from trainer.engine.base import Sample, SamplingParams
    from trainer.engine.embedded import EmbeddedEngine

    B, warm = args.step_batch, 2
    rng = random.Random(args.seed)
    lens = [args.step_short - 2 + i % 5 for i in range(B)]
    if long_row:
        lens[B // 2] = args.step_long
    budget = warm + args.step_steps + 2
    eng = EmbeddedEngine(model, eos_token_ids=[], max_slots=B, max_seq_len=max(lens) + budget + 2,
                         seed=args.seed, device=device, dtype=dtype,
                         attn_bucket_overhead=float("inf") if padded else None)
    # prefill caches prompt - 1 tokens, the first step's decode and `warm` more add one each
    samples = [Sample([rng.randrange(3, vocab) for _ in range(n - warm)],
                      SamplingParams(temperature=1.0, max_new_tokens=budget)) for n in lens]
    eng.submit(samples)
    for _ in range(warm + 1):  # admission + prefill, then warm decode steps
        eng.step()
    return eng


def _time_steps(eng, steps: int, device) -> tuple[float, list[int]]:
    """Median ms of `steps` decode steps, and the cached lengths at the first one."""
    lens = list(eng.cached)
    ts = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        eng.step()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, lens


def _decode_step(model, args, device, dtype, vocab: int, log) -> dict:
    """decode_step: B rows at ~short vs the same with one row at long, interleaved; and, for
    reference, the one-long batch with a padded attention (a single bucket, as before)."""
    runs: dict[str, list[float]] = {"uniform": [], "one_long": [], "one_long_padded": []}
    lens_at = {}
    for rep in range(max(args.reps, 1) + 1):  # the first round is a warm-up, not reported
        for name in runs:
            eng = _step_engine(model, args, device, dtype, vocab, name != "uniform",
                               padded=name == "one_long_padded")
            ms, lens = _time_steps(eng, args.step_steps, device)
            eng.close()
            if rep:
                runs[name].append(ms)
                lens_at[name] = lens
    ratios = [b / a for a, b in zip(runs["uniform"], runs["one_long"])]
    med = {k: statistics.median(v) for k, v in runs.items()}
    out = {"batch": args.step_batch,
           "cached_tokens_first_step": {k: {"min": min(v), "max": max(v)}
                                        for k, v in lens_at.items()},
           "steps_per_run": args.step_steps,
           "uniform_ms": _spread(runs["uniform"]), "one_long_ms": _spread(runs["one_long"]),
           "ratio": round(med["one_long"] / med["uniform"], 3),
           "ratio_runs": _spread(ratios), "target_ratio_max": 1.3,
           "one_long_padded_ms": _spread(runs["one_long_padded"]),
           "padded_ratio": round(med["one_long_padded"] / med["uniform"], 3)}
    log(f"  decode step, B={args.step_batch}: every row ~{args.step_short} tokens "
        f"{med['uniform']:.2f} ms, one row at {args.step_long} {med['one_long']:.2f} ms: "
        f"{out['ratio']}x (runs {out['ratio_runs']['runs']}); padded attention "
        f"{med['one_long_padded']:.2f} ms = {out['padded_ratio']}x")
    return out


def _decode_cost(model, args, device, dtype, vocab: int, log) -> dict | None:
    """decode_cost: ms per generated token of a decode step at each of --cost-batches rows,
    the batch sizes interleaved over --reps runs after a warm-up round."""
    batches = [int(b) for b in args.cost_batches.split(",") if b.strip()]
    if not batches:
        return None
    from trainer.bench import roofline

    runs: dict[int, list[float]] = {b: [] for b in batches}
    work = {}
    for rep in range(max(args.reps, 1) + 1):
        for b in batches:
            eng = _step_engine(model, _Args(args, step_batch=b), device, dtype, vocab, False)
            ms, lens = _time_steps(eng, args.step_steps, device)
            work[b] = roofline.decode_work(eng.decoder, b, round(sum(lens) / len(lens)))
            eng.close()
            if rep:
                runs[b].append(ms / b)
    per_token = {b: statistics.median(v) for b, v in runs.items()}
    lo, hi = min(batches), max(batches)
    machine = roofline.peak(device, dtype)   # this machine's limit, measured now
    out = {"cached_tokens": args.step_short,
           "per_token_ms": {str(b): _spread(v, 4) for b, v in runs.items()},
           "step_ms": {str(b): round(per_token[b] * b, 3) for b in batches},
           "batching_gain": round(per_token[lo] / per_token[hi], 2),
           "batching_gain_batches": [lo, hi],
           "machine_peak": {**machine, "gflops": round(machine["flops"] / 1e9, 1),
                            "gbytes_per_s": round(machine["bytes_per_s"] / 1e9, 1)},
           "against_peak": {str(b): roofline.against(work[b], per_token[b] * b / 1e3, machine)
                            for b in batches}}
    log("  decode cost per token: " + ", ".join(f"B={b} {per_token[b]:.4f} ms" for b in batches)
        + f"; B={lo} -> B={hi}: {out['batching_gain']}x cheaper per token")
    log(f"  machine peak: {machine['flops'] / 1e9:.1f} GFLOP/s (matmul), "
        f"{machine['bytes_per_s'] / 1e9:.1f} GB/s (copy); decode step at "
        + ", ".join(f"B={b} {v['gflops']} GFLOP/s {v['gbytes_per_s']} GB/s = "
                    f"{v['fraction_of_bound']:.0%} of the {v['bound']} bound"
                    for b, v in out["against_peak"].items()))
    return out


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
    model, tok, eos_id, pad, name = _load(args, device, dtype)
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
                _Args(args, max_new_tokens=8), device, dtype, max_seq_len)
    _run_static(model, prompts[:w], [8 if t is not None else None for t in targets[:w]], eos, pad,
                _Args(args, max_new_tokens=8), device)

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
             "useful_throughput_runs": _spread(pair, 2),
             "seconds": round(s["seconds"] / max(e["seconds"], 1e-9), 2)}
    log(f"  ratio: {ratio['useful_throughput']}x useful tokens/s (medians; per pair "
        f"{ratio['useful_throughput_runs']['runs']})")
    vocab = int(getattr(model.config, "vocab_size", 100))
    step = _decode_step(model, args, device, dtype, min(vocab, len(tok)), log)
    cost = _decode_cost(model, args, device, dtype, min(vocab, len(tok)), log)
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
            "useful_tokens_per_s_runs": _spread([r["useful_tokens_per_s"] for r in runs], 1),
            "idle_slot_frac": round(med["idle_slot_frac"], 4), **opt, **rest}


class _Args:
    """args with some fields replaced (for the warm-up)."""

    def __init__(self, base, **over):
        self.__dict__.update(vars(base))
        self.__dict__.update(over)
