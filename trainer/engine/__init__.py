"""Rollout engines: the interface (`base`), the embedded torch engine (`embedded`), the same in
processes of its own (`process`, several behind one engine: `pool`) and the SGLang HTTP client
(`sglang`). Which one a run uses is assembled with the run (trainer/run/engines.py `build_engine`):
this package imports no config, model loading, episode or task."""
from __future__ import annotations


def engine_dtype(name: str, trainer_dtype):
    """The engine's torch dtype for `rollout.dtype` (auto: the trainer's)."""
    import torch

    return trainer_dtype if name == "auto" else getattr(torch, name)


def rollout_precision(engine, name: str, trainer_dtype) -> str:
    """The engine's precision as the run reports it (`run_started`'s "rollout_dtype"): what the
    SGLang servers serve, else `rollout.dtype` with auto resolved to the trainer's dtype."""
    served = getattr(engine, "served_dtype", None)
    if isinstance(served, str):
        return served
    return str(engine_dtype(name, trainer_dtype)).removeprefix("torch.")


def generation_device(device, index: int, size: int):
    """Where generation process `index` of `size` decodes: on CUDA, the GPU after this machine's
    training ranks' (cuda:LOCAL_WORLD_SIZE + index) when every generation process has one, else
    the trainer's device."""
    import os

    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device
    first = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if torch.cuda.device_count() >= first + size:
        return torch.device("cuda", first + index)
    return device
