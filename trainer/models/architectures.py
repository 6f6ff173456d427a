"""The model families the embedded engine decodes (trainer/engine/decoder.py), by config.json's
`model_type`, each with the Hugging Face class it names (the model directory check's messages,
trainer/models/loading.py). No torch here: the engine's decoder and the check read one list."""
from __future__ import annotations

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED = tuple(ARCHITECTURES)
