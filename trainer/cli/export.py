"""`python -m trainer export RUN (--adapter OUT | --merged OUT) [--step N]`: a run's policy as
files another tool can load. `--adapter`: a LoRA run's adapters in PEFT's format
(adapter_config.json + adapter_model.safetensors, with the tokenizer), for
`PeftModel.from_pretrained(base, OUT)` or a server's adapter loading. `--merged`: a Hugging Face
model directory (safetensors, config, tokenizer; LoRA merged into the base weights) that
`AutoModelForCausalLM.from_pretrained`, the embedded engine or SGLang serve as is."""
from __future__ import annotations

import sys
from pathlib import Path

from trainer import config as config_mod
from trainer.models import lora
from trainer.run import checkpoint
from trainer.run.fork import find_checkpoint, parent_config


class ExportError(ValueError):
    """What cannot be exported, and why."""


def export(run_dir: str | Path, out: str | Path, *, adapter: bool, step: int | None = None,
           overwrite: bool = False) -> Path:
    """Write the policy of `run_dir`'s checkpoint at `step` (default the latest) to `out`.
    Returns the checkpoint folder it read."""
    import torch

    from trainer.models.loading import load_tokenizer

    run_dir, out = Path(run_dir), Path(out)
    try:
        cfg = parent_config(run_dir)
        ckpt = checkpoint.latest(run_dir) if step is None else find_checkpoint(run_dir, step)
    except config_mod.ConfigError as e:
        raise ExportError("; ".join(e.errors.values())) from None
    except FileNotFoundError as e:
        raise ExportError(f"{run_dir}: {e}") from None
    if adapter and not lora.enabled(cfg):
        raise ExportError(f"{run_dir} trains the whole model (lora.rank = 0): it has no adapter; "
                          f"export --merged writes its model")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} is not empty (--overwrite replaces what is there)")
    out.mkdir(parents=True, exist_ok=True)
    cpu = torch.device("cpu")
    tokenizer = load_tokenizer(cfg.model.path)   # never trained: the base model's
    policy = _policy(cfg, ckpt, cpu)
    if adapter:
        policy.save_pretrained(out, safe_serialization=True)
    else:
        (lora.merged_copy(policy) if lora.is_adapted(policy) else policy).save_pretrained(
            out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return ckpt


def _policy(cfg, ckpt: Path, device):
    """Checkpoint `ckpt`'s policy in one process: its model folder, or its FSDP shards read
    whole onto the base model (a LoRA run's shards hold the adapters alone)."""
    import torch

    from trainer.cluster import sharding
    from trainer.models.loading import load_model

    if not sharding.is_sharded(ckpt):
        if lora.enabled(cfg):
            base = load_model(cfg.model.path, device, torch.float32)
            return lora.load(base, ckpt / "model", trainable=False)
        return load_model(str(ckpt / "model"), device, torch.float32)
    base = load_model(cfg.model.path, device, torch.float32)
    policy = lora.wrap(base, cfg) if lora.enabled(cfg) else base
    sharding.read_whole(ckpt, policy)
    return policy


def _cmd_export(args) -> int:
    if (args.adapter is None) == (args.merged is None):
        print("export: give one of --adapter OUT or --merged OUT", file=sys.stderr)
        return 2
    out = args.adapter if args.adapter is not None else args.merged
    try:
        ckpt = export(args.run_dir, out, adapter=args.adapter is not None, step=args.step,
                      overwrite=args.overwrite)
    except ExportError as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    what = "adapter" if args.adapter is not None else "merged model"
    print(f"wrote the {what} of {ckpt} to {out}")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("export", help="write a run's policy: a LoRA adapter (PEFT) or a merged "
                       "Hugging Face model")
    s.add_argument("run_dir", metavar="RUN", help="a run directory")
    s.add_argument("--adapter", metavar="OUT", help="a LoRA run's adapters, in PEFT's format")
    s.add_argument("--merged", metavar="OUT", help="a Hugging Face model directory (LoRA merged in)")
    s.add_argument("--step", type=int, help="the checkpoint's step (default the latest)")
    s.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    s.set_defaults(func=_cmd_export)
