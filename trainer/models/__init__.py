"""Models from local directories, never downloaded (loading.py), a GGUF file made one (gguf_import.py),
the built-in model's warm-up (warmup.py), and tensors bound for a safetensors file (tensors.py)."""
