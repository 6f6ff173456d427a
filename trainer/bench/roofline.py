"""The machine's limit for a decode step, measured by the bench itself (`bench engine`).

`peak(device, dtype)`: the FLOP/s of a large matrix product (n x n by n x n: 2 n^3 FLOPs) and the
bytes/s of a large copy (each byte read and written: 2 x its size), each the best of a few runs,
on the threads torch uses now: what this machine gives a decode step at best.

`decode_work(decoder, B, T)`: what one decode step of B rows at T cached positions must do,

    FLOPs = 2 B P + 4 B T L H D          (P: the weights the step multiplies by, the output head
                                          included; L layers, H query heads of size D: the
                                          attention's scores and weighted values)
    bytes = P s + 2 B T L Hkv D s        (the weights read once, the keys and values read; s: the
                                          element size)

and `against(work, seconds, peak)` the achieved FLOP/s and bytes/s, and `fraction_of_bound`: the
time the step needs at the machine's peak (the larger of FLOPs / peak FLOP/s and bytes / peak
bytes/s) over the time it took. Sampling, norms and activations are left out: small beside these.
"""
from __future__ import annotations

import time

import torch


def _best_seconds(fn, device, reps: int) -> float:
    best = float("inf")
    for _ in range(reps + 1):   # the first run warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def peak(device: torch.device, dtype: torch.dtype, *, n: int | None = None,
         copy_mb: int = 256, reps: int = 3) -> dict:
    """{"flops": FLOP/s of an n x n matrix product, "bytes_per_s": of a copy_mb MB copy, ...}."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    mm = _best_seconds(lambda: torch.mm(a, b, out=out), device, reps)
    elems = copy_mb * 2**20 // torch.empty((), dtype=dtype).element_size()
    src = torch.empty(elems, device=device, dtype=dtype).fill_(1)
    dst = torch.empty_like(src)
    cp = _best_seconds(lambda: dst.copy_(src), device, reps)
    return {"flops": 2 * n ** 3 / mm, "bytes_per_s": 2 * src.numel() * src.element_size() / cp,
            "matmul_n": n, "copy_mb": copy_mb, "dtype": str(dtype).removeprefix("torch.")}


def decode_work(decoder, B: int, T: int) -> dict:
    """FLOPs and bytes of one decode step of B rows at T cached positions (module docstring)."""
    names = ("qkv", "o", "gu", "down")
    P = sum(layer[k].numel() for layer in decoder.layers for k in names) + decoder.head.numel()
    size = torch.empty((), dtype=decoder.dtype).element_size()
    L, H, Hkv, D = decoder.n_layers, decoder.n_heads, decoder.n_kv, decoder.head_dim
    return {"flops": 2 * B * P + 4 * B * T * L * H * D,
            "bytes": P * size + 2 * B * T * L * Hkv * D * size}


def against(work: dict, seconds: float, machine: dict) -> dict:
    """Achieved GFLOP/s and GB/s of a step of `work` that took `seconds`, and its fraction of
    the bound the machine's peak sets."""
    compute = work["flops"] / machine["flops"]
    memory = work["bytes"] / machine["bytes_per_s"]
    return {"gflops": round(work["flops"] / seconds / 1e9, 2),
            "gbytes_per_s": round(work["bytes"] / seconds / 1e9, 2),
            "bound": "compute" if compute >= memory else "memory",
            "fraction_of_bound": round(max(compute, memory) / seconds, 3)}
