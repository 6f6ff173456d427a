"""The models `bench engine` decodes with: `builtin` or a local directory, or random weights in
a known shape (no download): `qwen2.5-0.5b-random`, Qwen2.5-0.5B's shape, and
`builtin-43m-random`, the built-in model's architecture widened and deepened to 43M parameters.
A random model never chooses to stop (no eos), so the bench forces each response's length."""
from __future__ import annotations

import torch

QWEN_RANDOM = "qwen2.5-0.5b-random"
WIDE_RANDOM = "builtin-43m-random"
RANDOM_MODELS = (QWEN_RANDOM, WIDE_RANDOM)


def qwen_random(device, dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                      pad_token_id=151643)  # no eos: random weights would stop by chance only
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def wide_random(device, dtype):
    """The built-in model's shape (Qwen2, character vocabulary of 100) at 43M parameters."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trainer.models.loading import BUILTIN, model_dir

    cfg = Qwen2Config.from_pretrained(model_dir(BUILTIN))
    cfg.update(dict(hidden_size=640, intermediate_size=1728, num_hidden_layers=10,
                    num_attention_heads=10, num_key_value_heads=2, max_position_embeddings=4096,
                    layer_types=["full_attention"] * 10,
                    eos_token_id=None))  # no eos: random weights would stop by chance only
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def load(args, device, dtype):
    """-> model, tokenizer (for prompts), eos id, pad id, model name."""
    from trainer.models.loading import BUILTIN, load_model, load_tokenizer

    name = args.model
    if name == "auto":
        name = QWEN_RANDOM if device.type == "cuda" else BUILTIN
    if name == QWEN_RANDOM:
        # no tokenizer ships with random weights: the char tokenizer's ids (all < 100) stand in
        # for Qwen's, which also spell digits and punctuation one token each
        tok = load_tokenizer(BUILTIN)
        return qwen_random(device, dtype), tok, 151643, 151643, name
    if name == WIDE_RANDOM:
        tok = load_tokenizer(BUILTIN)
        return wide_random(device, dtype), tok, tok.eos_token_id, tok.pad_token_id, name
    tok = load_tokenizer(name)
    return load_model(name, device, dtype).eval(), tok, tok.eos_token_id, tok.pad_token_id, name
