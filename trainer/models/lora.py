"""LoRA: the policy trains low-rank adapters (PEFT) on frozen base weights.

For each adapted linear layer of weight W (out x in):

    W' = W + (alpha / r) * B @ A        A: r x in (random), B: out x r (zeros)

so the first policy is exactly the base model. Only A and B train (no optimizer state for W);
the KL reference is the same model with its adapters switched off (no second copy); the engines
decode W' (the embedded engine's fused kernels know no adapters). This module is the one place
that knows PEFT's names: `merged_weights` turns the adapted model's state into the plain Hugging
Face names the exports and SGLang use; `adapter_update` gives an engine that holds the base the
factors alone (W#lora_A = A, W#lora_B = (alpha/r) B), which it merges itself
(trainer/engine/decoder.py `Decoder.load`): a weight update the adapters' size, not the layers'.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from trainer.config.values import parse_target_modules

# PEFT's prefix of every name in the adapted model, and the frozen layer inside an adapted one
_PREFIX, _BASE = "base_model.model.", ".base_layer"
ADAPTER = "default"   # PEFT's name for a model's one adapter
# an adapter update's tensor names: the adapted weight's plain name and one of these
LORA_A, LORA_B = "#lora_A", "#lora_B"


def enabled(cfg) -> bool:
    return cfg.lora.rank > 0


def engine_holds_base(cfg) -> bool:
    """Whether a LoRA run's engine keeps the base and merges the factors it is sent (the
    embedded engine and its generation processes), rather than reloading merged models
    (SGLang servers)."""
    return enabled(cfg) and cfg.rollout.engine == "embedded"


target_modules = parse_target_modules   # lora.target_modules's parameter type (trainer/config/values.py)


def wrap(model, cfg):
    """`model` with fresh adapters of `cfg.lora` (PEFT's LoRA; the base weights frozen)."""
    from peft import LoraConfig, get_peft_model

    lc = cfg.lora
    config = LoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                        target_modules=target_modules(lc.target_modules), bias="none",
                        task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():   # PEFT asks transformers a deprecated question
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            return get_peft_model(model, config)
    except ValueError as e:   # PEFT names the modules it could not find
        raise ValueError(f"lora.target_modules={lc.target_modules!r}: {e}") from None


def load(model, folder: str | Path, trainable: bool = True):
    """`model` with the adapters saved in `folder` (a checkpoint's model/ or an export)."""
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        return PeftModel.from_pretrained(model, str(folder), is_trainable=trainable)


def set_dropout(model, p: float) -> None:
    """Dropout `p` on the adapters' input from now on (`lora.dropout`), recorded in the adapter's
    config (its next checkpoint's adapter_config.json). Dropout has no weights: a checkpoint's
    adapters load under any value, and PEFT's `from_pretrained` would keep the saved one."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"lora.dropout must be in [0, 1), not {p!r}")
    for _, layer in _lora_layers(model):   # as PEFT builds them: Identity for p = 0
        layer.lora_dropout[ADAPTER] = torch.nn.Dropout(p) if p > 0 else torch.nn.Identity()
    model.peft_config[ADAPTER].lora_dropout = p


def dropout_warning(cfg) -> str | None:
    """Why `lora.dropout` > 0 hurts RL (None when it is 0 or LoRA is off): the trainer's pi_theta
    is a dropout-noised network while pi_old and the engine's behaviour policy are not, so the
    PPO ratio moves by noise, not learning, and clipping and the mismatch figures see it."""
    if not enabled(cfg) or cfg.lora.dropout <= 0:
        return None
    return (f"lora.dropout = {cfg.lora.dropout:g}: the policy trains with dropout on its adapters "
            f"while pi_old and the engine sample without it, so the PPO ratio pi/pi_old carries "
            f"dropout noise (clipped tokens, a noisy KL); RL recipes train LoRA with dropout 0")


def dropout(model) -> float:
    """The adapters' dropout as their layers apply it (0 for none)."""
    ps = {getattr(layer.lora_dropout[ADAPTER], "p", 0.0) for _, layer in _lora_layers(model)}
    if len(ps) > 1:
        raise ValueError(f"the adapters' layers disagree on their dropout: {sorted(ps)}")
    return ps.pop() if ps else 0.0


def is_adapted(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def reference(model):
    """A context in which `model` is its base (adapters off): the KL reference."""
    return model.disable_adapter() if is_adapted(model) else contextlib.nullcontext()


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name, module


def _plain(name: str) -> str:
    return name.removeprefix(_PREFIX).replace(_BASE, "")


def scales(model) -> dict[str, tuple[float, bool]]:
    """Each adapted layer (PEFT's name): its alpha/r and whether it stores W transposed
    (fan_in_fan_out, GPT-2's Conv1D). With the state dict, all the merge needs: the sharded
    learner gathers the tensors (trainer/cluster/sharding.py), these stay on every rank."""
    return {name: (float(layer.scaling[ADAPTER]), bool(getattr(layer, "fan_in_fan_out", False)))
            for name, layer in _lora_layers(model)}


def is_factor(name: str) -> bool:
    """A parameter of the adapters (PEFT's name): what LoRA trains and an update sends."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def _factors(state: dict, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (state[f"{layer}.lora_A.{ADAPTER}.weight"].detach(),
            state[f"{layer}.lora_B.{ADAPTER}.weight"].detach())


def merged_weights(model) -> dict[str, torch.Tensor]:
    """The adapted `model`'s weights merged, under plain names (`merge_state`)."""
    return merge_state(model.state_dict(), scales(model))


def adapter_update(model) -> dict[str, torch.Tensor]:
    """The adapted `model`'s factors, as an engine holding the base takes them (`factor_state`)."""
    return factor_state(model.state_dict(), scales(model))


@torch.no_grad()
def merge_state(state: dict[str, torch.Tensor], layer_scales: dict) -> dict[str, torch.Tensor]:
    """The policy's weights (`state`: the adapted model's state dict, PEFT's names) under plain
    Hugging Face names, each adapted W as W + (alpha/r) B A. {} for {} (a rank that gathered
    nothing)."""
    out = {_plain(name): t.detach() for name, t in state.items() if "lora_" not in name}
    for layer, (scale, transposed) in layer_scales.items() if state else ():
        a, b = _factors(state, layer)
        w = _plain(layer) + ".weight"
        delta = (b.float() @ a.float()) * scale
        out[w] = (out[w].float() + (delta.T if transposed else delta)).to(out[w].dtype)
    return out


@torch.no_grad()
def factor_state(state: dict[str, torch.Tensor], layer_scales: dict) -> dict[str, torch.Tensor]:
    """Each adapted layer's factors (`state`: the adapters' tensors at least, PEFT's names)
    under its plain weight name W: W#lora_A = A (r x in), W#lora_B = (alpha/r) B (out x r). An
    engine holding the base weights decodes W + (W#lora_B) @ (W#lora_A). {} for {}."""
    out: dict[str, torch.Tensor] = {}
    for layer, (scale, transposed) in layer_scales.items() if state else ():
        if transposed:   # the engines' layouts are Linear's
            raise ValueError(f"{layer}: a fan_in_fan_out layer cannot be sent as factors")
        a, b = _factors(state, layer)
        w = _plain(layer) + ".weight"
        out[w + LORA_A], out[w + LORA_B] = a.clone(), b * scale
    return out


def merge_inputs(names) -> set[str]:
    """Of tensor `names` (an engine's weights and an adapter update's factors), what an engine
    that holds the base merges from: the factors and the base weight of each adapted layer. An
    engine keeps these at their own precision (a float32 trainer's, under a bfloat16 engine), so
    that W + B·A is rounded to the engine's precision once (`Decoder.load`)."""
    names = set(names)
    bases = {n[:-len(LORA_A)] for n in names if n.endswith(LORA_A)}
    return {n for n in names if n in bases or n.endswith((LORA_A, LORA_B))}


def with_bases(base_state: dict[str, torch.Tensor], factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`factors` (an adapter update) with the base weight of each adapted layer from
    `base_state`: an engine's first update, from which it keeps its base (`merge_inputs`)."""
    return {**{n: base_state[n] for n in merge_inputs([*base_state, *factors]) if n in base_state},
            **factors}


def adapter_weights(model) -> dict[str, torch.Tensor]:
    """The adapters' tensors alone (PEFT's names, as its adapter files hold them)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def merged_copy(model):
    """A plain copy of the policy with the adapters merged in (the base model is untouched)."""
    return _plain_copy(model, merge=True)


def base_copy(model):
    """A plain copy of the base model (the adapters left out)."""
    return _plain_copy(model, merge=False)


def _plain_copy(model, merge: bool):
    import copy

    plain = copy.deepcopy(model.get_base_model() if is_adapted(model) else model)
    if is_adapted(model):
        from peft.tuners.lora import LoraLayer

        for module in list(plain.modules()):
            if merge and isinstance(module, LoraLayer):
                module.merge(adapter_names=[ADAPTER])
        # unwrap: each adapted layer becomes its (merged) base layer again
        for module in list(plain.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, LoraLayer):
                    setattr(module, child_name, child.get_base_layer())
    return plain


def sizes(model) -> dict[str, int]:
    """Trainable parameters, all parameters, and the adapter's bytes (what its file holds)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    # counted from the parameters, not PEFT's state dict: since PEFT 0.22 that gathers sharded
    # (FSDP) factors, a collective only rank 0 would join (a sharded parameter's numel is whole)
    adapter = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if is_factor(name)) if is_adapted(model) else 0
    return {"trainable_params": trainable, "total_params": total, "adapter_bytes": adapter}
