# The model of the CPU state-update comparison (result.json): 8 layers of the 27B hybrid shape, 1,024 wide, with
# its DeltaNet heads (16 key, 48 value heads of 128); run from the checkout root.
import dataclasses
from ridgefill_gguf.random_gguf import REAL_SHAPES, write_random_model
shape = dataclasses.replace(REAL_SHAPES["qwen35-27b"], n_layer=8, n_embd=1024, n_ff=2048, n_vocab=248320, n_head=8, n_head_kv=2)
write_random_model("/tmp/cpuq/m.gguf", shape, dtype="q8_0", same_layers=True,
                   vocab="vendor/llama.cpp/models/ggml-vocab-qwen35.gguf")
