"""FSDP2 for the training ranks (`cluster.sharding = "fsdp"`): the policy and its reference
sharded over the K ranks with `torch.distributed.fsdp.fully_shard`, checkpoints written and read
through torch.distributed.checkpoint (DCP), one shard file per rank.

Each rank holds 1/K of every parameter, gradient and AdamW moment; a layer's forward gathers its
full weights for the moment it runs, its backward reduce-scatters the gradients. Consequences the
rest of the trainer lives with:
- every forward is a collective: every rank runs the same number of forwards of each model at the
  same time (trainer/algo/learner.py pads a rank's micro-batches with empty ones; rank 0's log-prob
  recomputes are shared out: trainer/run/training_ranks.py);
- no rank holds the whole model, so generation runs off the training ranks (generation processes
  or SGLang servers: the config check refuses an in-process engine), and their weights come from
  `full_state_dict` -- a collective that leaves the full tensors on rank 0's CPU only;
- a checkpoint's model and optimizer are DCP shards (`sharded/`) written by every rank at once;
  DCP re-shards on load, so a run resumes with another K, and one process (or DDP's rank 0)
  reads them whole with `no_dist`. A checkpoint of an unsharded run (save_pretrained + one
  optimizer state) is spread from rank 0 instead.

The optimizer state of an unsharded run is keyed by parameter index (torch.optim); DCP's and
FSDP's by parameter name. `named_optimizer_state` translates: the indices follow the trainable
parameters of `model.named_parameters()`, the order the optimizer was given them in.

LoRA (trainer/models/lora.py) shards the same way: the frozen base and the adapters in each
block's unit. Its checkpoints' shards hold what trains (the adapters and their moments): the
frozen base is model.path's, read again on resume. An update gathers only the adapters
(`full_parameters`) for engines that hold the base, the whole model for those that do not.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

SHARDED_DIR = "sharded"   # a checkpoint's DCP folder


def shard(model: torch.nn.Module, world) -> torch.nn.Module:
    """`fully_shard` every transformer block (the classes Hugging Face lists as not to be split
    across devices), then the whole model: one all-gather per block keeps the peak at one block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def spread_from_rank0(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Every rank's shards of rank 0's `full` state dict (the other ranks pass {}): what DDP's
    wrap does for a replicated model. Loading the same files on every rank is not enough: a
    resumed rank 0 holds the checkpoint's weights, the others the base model's."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, full, options=_options(full_state_dict=True, broadcast_from_rank0=True))


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's tensors on rank 0's CPU ({} on the other ranks). A collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def full_parameters(model: torch.nn.Module, keep) -> dict[str, torch.Tensor]:
    """The parameters whose names `keep` accepts, whole on rank 0's CPU ({} on the other
    ranks). A collective: every rank gathers the same parameters in the same order."""
    import torch.distributed as dist

    out = {}
    for name, p in model.named_parameters():
        if keep(name):
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            if dist.get_rank() == 0:
                out[name] = whole.detach().cpu()
    return out


def spread_optimizer_from_rank0(model, optimizer, indexed: dict | None) -> None:
    """Rank 0's optimizer state of an unsharded run (`indexed`, keyed by parameter index; None on
    the other ranks) shared out as each rank's shards. A collective."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    named = named_optimizer_state(indexed, model) if indexed is not None else {}
    set_optimizer_state_dict(model, optimizer, named,
                             options=_options(full_state_dict=True, broadcast_from_rank0=True))


def save(folder: Path, model, optimizer) -> None:
    """Every rank writes its shards of the model and the optimizer into `folder`/sharded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": _trained(model, get_model_state_dict(model)),
              "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=Path(folder) / SHARDED_DIR)


def load(folder: Path, model, optimizer, *, alone: bool = False) -> None:
    """The model and optimizer of checkpoint `folder`'s shards, whatever K wrote them: sharded
    ranks each read their part (a collective); `alone`: this one process reads all of it into
    an unsharded model (one process, or DDP's rank 0 before its wrap spreads the weights)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    whole = get_model_state_dict(model)
    state = {"model": _trained(model, whole), "optim": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():   # DCP warns that `no_dist` reads in one process: meant
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=Path(folder) / SHARDED_DIR, no_dist=alone)
    # a LoRA checkpoint holds the adapters alone: the frozen base stays as loaded
    set_model_state_dict(model, state["model"],
                         options=_options(strict=len(state["model"]) == len(whole)))
    set_optimizer_state_dict(model, optimizer, state["optim"])


def read_whole(folder: Path, model) -> dict:
    """Checkpoint `folder`'s shards read whole by this process alone: the weights into `model`
    (unsharded), the optimizer state returned as torch.optim keeps it (by parameter index)."""
    # its hyperparameters come with the state
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    load(folder, model, optimizer, alone=True)
    return optimizer.state_dict()


def is_sharded(folder: Path) -> bool:
    return (Path(folder) / SHARDED_DIR / ".metadata").is_file()


def _names(model) -> list[str]:
    """The optimizer's parameters, in its order: the trainable ones (LoRA: the adapters)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _trained(model, state: dict) -> dict:
    """`state`'s trainable parameters where some are frozen (LoRA: the adapters; model.path
    holds the base, its buffers and tied aliases), else all of it."""
    params = dict(model.named_parameters())
    if all(p.requires_grad for p in params.values()):
        return state
    return {k: v for k, v in state.items() if k in params and params[k].requires_grad}


def named_optimizer_state(indexed: dict, model) -> dict:
    """torch.optim's state dict (keys 0..n-1) keyed by parameter name instead."""
    names = _names(model)
    return {"state": {names[i]: s for i, s in indexed["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in indexed["param_groups"]]}
