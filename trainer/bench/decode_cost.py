"""`bench engine`'s decode-step measurements, each a few engines run side by side:

- `decode_step`: one decode step at `--step-batch` rows, every row at ~`--step-short` cached
  tokens, against the same batch with one row at `--step-long` (ragged attention: about the same
  cost), and against that batch with a padded attention (B x the longest row);
- `decode_cost`: the cost per generated token of a decode step at each of `--cost-batches` rows,
  and each step against this machine's measured peak (trainer/bench/roofline.py).

Interleaved over `--reps` runs after a warm-up round; each run the median of `--step-steps`
decode steps.
"""
from __future__ import annotations

import random
import statistics
import time

from trainer.bench.measure import Replaced, spread, sync


def step_engine(model, args, device, dtype, vocab: int, long_row: bool, padded: bool = False):
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


def time_steps(eng, steps: int, device) -> tuple[float, list[int]]:
    """Median ms of `steps` decode steps, and the cached lengths at the first one."""
    lens = list(eng.cached)
    ts = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        eng.step()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, lens


def decode_step(model, args, device, dtype, vocab: int, log) -> dict:
    """decode_step: B rows at ~short vs the same with one row at long, interleaved; and, for
    reference, the one-long batch with a padded attention (a single bucket, as before)."""
    runs: dict[str, list[float]] = {"uniform": [], "one_long": [], "one_long_padded": []}
    lens_at = {}
    for rep in range(max(args.reps, 1) + 1):  # the first round is a warm-up, not reported
        for name in runs:
            eng = step_engine(model, args, device, dtype, vocab, name != "uniform",
                               padded=name == "one_long_padded")
            ms, lens = time_steps(eng, args.step_steps, device)
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
           "uniform_ms": spread(runs["uniform"]), "one_long_ms": spread(runs["one_long"]),
           "ratio": round(med["one_long"] / med["uniform"], 3),
           "ratio_runs": spread(ratios), "target_ratio_max": 1.3,
           "one_long_padded_ms": spread(runs["one_long_padded"]),
           "padded_ratio": round(med["one_long_padded"] / med["uniform"], 3)}
    log(f"  decode step, B={args.step_batch}: every row ~{args.step_short} tokens "
        f"{med['uniform']:.2f} ms, one row at {args.step_long} {med['one_long']:.2f} ms: "
        f"{out['ratio']}x (runs {out['ratio_runs']['runs']}); padded attention "
        f"{med['one_long_padded']:.2f} ms = {out['padded_ratio']}x")
    return out


def decode_cost(model, args, device, dtype, vocab: int, log) -> dict | None:
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
            eng = step_engine(model, Replaced(args, step_batch=b), device, dtype, vocab, False)
            ms, lens = time_steps(eng, args.step_steps, device)
            work[b] = roofline.decode_work(eng.decoder, b, round(sum(lens) / len(lens)))
            eng.close()
            if rep:
                runs[b].append(ms / b)
    per_token = {b: statistics.median(v) for b, v in runs.items()}
    lo, hi = min(batches), max(batches)
    machine = roofline.peak(device, dtype)   # this machine's limit, measured now
    out = {"cached_tokens": args.step_short,
           "per_token_ms": {str(b): spread(v, 4) for b, v in runs.items()},
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
