"""ridgefill-gguf: RidgeFill long-prompt prefill for llama.cpp."""

__version__ = "0.1.0.dev0"
