"""Models from local directories, never downloaded (loading.py), a GGUF file made one
(gguf_import.py), the families the embedded engine decodes (architectures.py), LoRA adapters
(lora.py), and tensors bound for a safetensors file (tensors.py)."""
