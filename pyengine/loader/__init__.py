"""Checkpoint loading: Hugging Face folders (safetensors), GGUF files, random weights."""
