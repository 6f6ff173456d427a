"""A STAND-IN for `sgl_kernel`, SGLang's compiled kernel package, for running SGLang on a CPU
without it. It is not sgl_kernel and it is not part of rlpilot's product: only the SGLang server
that `make sglang` builds for CPU-only machines imports it (it is first on that server's
PYTHONPATH, see docs/engines.md).

Why: with SGLANG_USE_CPU_ENGINE=1, SGLang imports a few CPU kernels from `sgl_kernel` at start-up,
but the CPU build of sgl_kernel is not published on PyPI (the package there is CUDA-only and
needs a CUDA torch). On a CPU without AMX, and with the launch flags rlpilot uses (torch_native
attention, no CUDA graphs, no overlap scheduling), SGLang calls exactly one of them,
`assign_req_to_token_pool_cpu`, and falls back to its plain-torch layers for everything else.
That one is written here in torch, following SGLang's own Triton kernel of the same job
(`assign_req_to_token_pool` in sglang/srt/mem_cache/allocation.py). Any other name imports as a
function that raises a clear error when called, so a code path that needs a real kernel fails
loudly instead of computing something else.
"""
from __future__ import annotations

import torch

__version__ = "0.0.0+rlpilot-cpu-standin"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                  start_offset: torch.Tensor, end_offset: torch.Tensor,
                                  out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table:
    req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the next
    end_offset[i] - start_offset[i] entries of out_cache_loc (requests in order)."""
    del pool_len  # the row length; torch indexing knows it
    starts, ends = start_offset.tolist(), end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is rlpilot's CPU stand-in for sgl_kernel "
            "(tools/sglang/cpu_path/sgl_kernel), which provides assign_req_to_token_pool_cpu only. "
            "Launch the server with the flags of trainer/engine/sglang/server.py, or install the real "
            "sgl_kernel (a CUDA machine: make sglang installs it there).")
    kernel.__name__ = name
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
