"""Models: loading local Hugging Face directories and the built-in model, never downloading
(loading.py); a GGUF file to a local directory (gguf_import.py); the built-in model's warm-up
(warmup.py); tensors bound for a safetensors file (tensors.py)."""
