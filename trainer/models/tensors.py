"""Tensors bound for a safetensors file. safetensors refuses tensors that share memory, so every
writer of such a file (checkpoints, the SGLang engine's weight directories) passes its tensors
through `own_storage` with one `seen` set per file."""
from __future__ import annotations

import torch


def own_storage(t: torch.Tensor, seen: set[tuple[int, int]]) -> torch.Tensor:
    """`t`, cloned when its memory is not its own: a storage already in `seen` (another tensor
    written before it) or a larger one it is a view of. safetensors refuses tensors that share
    memory; every writer of a safetensors file (checkpoints, the SGLang engine's weights) passes
    its tensors through this, with one `seen` per file. Adds t's storage to `seen`."""
    if t.numel():
        storage = t.untyped_storage()
        if (storage.data_ptr(), storage.nbytes()) in seen or storage.nbytes() != t.nbytes:
            t = t.clone()
            storage = t.untyped_storage()
        seen.add((storage.data_ptr(), storage.nbytes()))
    return t
