"""Models and tokenizers: the built-in small model, and real Hugging Face models from a local
directory. Nothing here ever downloads: every load passes `local_files_only=True`.

The built-in model is a standard transformers Qwen2 architecture (~0.85M parameters) with a
character-level tokenizer over printable ASCII. It is created from scratch and given a short
supervised warm-up on the built-in task (`trainer.run.warmup`) so RL starts from a partly competent
policy; the warmed-up weights ship in `trainer/assets/builtin-sum/`. A second one, `builtin-tools`
(`trainer/assets/builtin-tools/`), is warmed up on the calculator task (trainer/tasks/calc.py): it
sometimes calls the tool and sometimes sums by hand, so RL on tool-using episodes has a choice to
improve.
"""
from __future__ import annotations

import json
import string
from importlib import resources
from pathlib import Path

import torch
import transformers

from trainer.config.sections import BUILTIN_MODELS
from trainer.models.architectures import ARCHITECTURES, SUPPORTED

# Loading a 1M-parameter model should not draw progress bars over the training display.
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

BUILTIN = "builtin"
BUILTIN_TOOLS = "builtin-tools"
# model.path names of the shipped models -> their folder in trainer/assets (declared with the config)
BUILTIN_ASSETS = BUILTIN_MODELS
# how each is rebuilt, for the message when its folder is missing
_REBUILD = {BUILTIN: "python -m trainer warmup", BUILTIN_TOOLS: "python -m trainer warmup --tools"}
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]


def builtin_dir(name: str = BUILTIN) -> Path:
    """The shipped folder of the built-in model `name` (a key of BUILTIN_ASSETS)."""
    return Path(str(resources.files("trainer").joinpath("assets", BUILTIN_ASSETS[name])))


def _local_dir(path: str) -> Path:
    """The directory a `model.path` names: a shipped model's folder, or the path itself."""
    return builtin_dir(path) if path in BUILTIN_ASSETS else Path(path).expanduser()


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


def _missing_hint(path: str) -> str:
    if path in BUILTIN_ASSETS:
        return f" (run `{_REBUILD[path]}` to rebuild the built-in model)"
    from trainer.models.gguf_import import import_hint

    hint = import_hint(path)
    if hint:
        return f" (create it with `{hint}`)"
    return " (rlpilot only loads local directories, never from a hub)"


def model_dir(path: str) -> Path:
    """The directory a `model.path` refers to, checked to look like a local HF model."""
    d = _local_dir(path)
    if not d.is_dir():
        raise FileNotFoundError(f"model.path: no model directory at {d}{_missing_hint(path)}")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {d} has no config.json; expected a Hugging Face "
                                "model saved with save_pretrained()")
    return d


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_model_dir(path: str, *, engine: str = "embedded") -> list[str]:
    """What is wrong with `model.path` (an empty list: nothing), checked before a run is
    queued (CLI, API, launch form): the directory exists, holds a config.json of an
    architecture the embedded engine supports (any causal LM with rollout.engine = "sglang"),
    weights, and a tokenizer that loads and can end a response (an eos token)."""
    d = _local_dir(path)
    if not d.is_dir():
        return [f"no model directory at {d}{_missing_hint(path)}"]
    if path in BUILTIN_ASSETS:
        return []  # shipped with rlpilot: checked by its own tests
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        return [f"{d} has no config.json; expected a Hugging Face model saved with "
                "save_pretrained() (or `python -m trainer import-gguf FILE.gguf DIR`)"]
    try:
        data = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return [f"{cfg_file} is not readable JSON: {e}"]
    if not isinstance(data, dict):
        return [f"{cfg_file}: expected a JSON object"]
    problems = []
    model_type = data.get("model_type")
    archs = data.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if engine == "embedded" and model_type not in SUPPORTED:
        supported = ", ".join(f"{ARCHITECTURES.get(t, t)} ({t})" for t in SUPPORTED)
        name = f"{arch} (model_type {model_type!r})" if arch else f"model_type {model_type!r}"
        problems.append(f"architecture {name} is not supported by the embedded engine; it runs "
                        f"{supported} (other causal LMs: rollout.engine = 'sglang')")
    if not any((d / f).is_file() for f in WEIGHT_FILES):
        problems.append(f"{d} has no weights (expected one of {', '.join(WEIGHT_FILES)})")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # whatever the tokenizer files are missing or broken with
        first = (str(e).strip().splitlines() or [""])[0][:300]
        problems.append(f"its tokenizer does not load ({type(e).__name__}: {first})")
    else:
        if tok.eos_token_id is None and not generation_eos_ids(d):
            problems.append("the tokenizer has no eos token and the model's config names none: "
                            "responses could never end")
    return problems


def require_model_dir(path: str, *, engine: str = "embedded") -> None:
    """check_model_dir, as a ConfigError on model.path (the CLI prints it; the web shows it as
    the field's error)."""
    problems = check_model_dir(path, engine=engine)
    if problems:
        from trainer.config import ConfigError

        raise ConfigError({"model.path": "; ".join(problems)})


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def generation_eos_ids(d: Path) -> list[int]:
    """The eos ids a model directory's generation_config.json and config.json name."""
    out: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            data = json.loads((d / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out += [i for i in _as_ids(data.get("eos_token_id")) if i not in out]
    return out


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a response: the tokenizer's eos and each id of the model's
    generation_config.eos_token_id and config.eos_token_id (an int or a list: Llama 3 and
    Qwen instruct models end turns with several), within the vocabulary."""
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None))
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        ids += _as_ids(getattr(source, "eos_token_id", None))
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    out = sorted({i for i in ids if vocab is None or i < vocab})
    if not out:
        raise ValueError("model.path: neither the tokenizer nor the model's generation config "
                         "names an eos token: responses could never end")
    return out


def _vocab_size(d: Path) -> int | None:
    try:
        n = json.loads((d / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return n if isinstance(n, int) else None


def load_tokenizer(path: str):
    """The tokenizer of `model.path`. One without a usable pad token (none, or one past the
    model's embedding table: some tokenizer classes invent "<|endoftext|>" as a new token) gets
    its eos token as pad. That is safe: the pad id only fills padded positions and never builds
    a mask (the learner and the engine mask by sequence length), so a response's own eos is
    still trained and scored."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    d = model_dir(path)
    if path in BUILTIN_ASSETS:
        # its own tokenizer.json, as built (build_char_tokenizer): AutoTokenizer picks the Qwen2
        # class from config.json, whose byte-level pre-tokenizer turns a space into a symbol the
        # character vocabulary lacks, so every space and newline would vanish
        tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), pad_token="<pad>",
                                      eos_token="<eos>", unk_token="<unk>")
    else:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    if tok.eos_token_id is None:
        ids = generation_eos_ids(d)
        if not ids:
            raise ValueError(f"model.path: the tokenizer in {path} has no eos token")
        tok.eos_token = tok.convert_ids_to_tokens(ids[0])
    vocab = _vocab_size(d)
    if tok.pad_token_id is None or (vocab is not None and tok.pad_token_id >= vocab):
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir(path)), local_files_only=True,
                                                 dtype=dtype, attn_implementation="sdpa")
    return model.to(device)
