"""The patched engine, seen from Python: ctypes bindings for the llama_ridgefill_* API."""
