"""Models and tokenizers: the built-in small model, and real Hugging Face models from a local
directory. Nothing here ever downloads: every load passes `local_files_only=True`.

The built-in model is a standard transformers Qwen2 architecture (~0.85M parameters) with a
character-level tokenizer over printable ASCII. It is created from scratch and given a short
supervised warm-up on the built-in task (`trainer.warmup`) so RL starts from a partly competent
policy; the warmed-up weights ship in `trainer/assets/builtin-sum/`.
"""
from __future__ import annotations

import string
from importlib import resources
from pathlib import Path

import torch
import transformers

# Loading a 1M-parameter model should not draw progress bars over the training display.
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

BUILTIN = "builtin"
BUILTIN_ASSET = "builtin-sum"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]


def builtin_dir() -> Path:
    return Path(str(resources.files("trainer").joinpath("assets", BUILTIN_ASSET)))


def build_char_tokenizer():
    """A fast, save_pretrained-able tokenizer that maps each printable ASCII character to a
    token (BPE with an empty merge list is exactly character-level)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def builtin_model_config(vocab_size: int, hidden: int = 128, layers: int = 4, heads: int = 4,
                         kv_heads: int = 2, max_positions: int = 512):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 3,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                       tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6,
                       pad_token_id=0, eos_token_id=1, bos_token_id=None)


def new_builtin_model(seed: int = 0):
    """A freshly initialised built-in model and its tokenizer (no warm-up)."""
    from transformers import AutoModelForCausalLM

    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(builtin_model_config(len(tok)),
                                             attn_implementation="sdpa")
    return model, tok


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device='cuda' but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def model_dir(path: str) -> Path:
    """The directory a `model.path` refers to, checked to look like a local HF model."""
    d = builtin_dir() if path == BUILTIN else Path(path).expanduser()
    if not d.is_dir():
        hint = (" (run `python -m trainer warmup` to rebuild the built-in model)"
                if path == BUILTIN else " (rlpilot only loads local directories, never from a hub)")
        raise FileNotFoundError(f"model.path: no model directory at {d}{hint}")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {d} has no config.json; expected a Hugging Face "
                                "model saved with save_pretrained()")
    return d


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir(path)), local_files_only=True)
    if tok.eos_token_id is None:
        raise ValueError(f"model.path: the tokenizer in {path} has no eos token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir(path)), local_files_only=True,
                                                 dtype=dtype, attn_implementation="sdpa")
    return model.to(device)
