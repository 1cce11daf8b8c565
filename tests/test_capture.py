"""Layer-input capture through the patched library's C entry points (patches 0002, 0003)."""
from __future__ import annotations

import json

import pytest

from conftest import require_builds, run_py

CAPTURE = r"""
import json, sys
import numpy as np
from ridgefill_gguf import libs
from ridgefill_gguf.engine import bindings
from ridgefill_gguf.gguf_io import read_gguf
llama_cpp = libs.use_build("ridgefill")
path = sys.argv[1] if len(sys.argv) > 1 else {model!r}
llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_batch=64, n_ubatch=64, verbose=False)
ctx, model = llm.ctx, llm.model
out = {{"supported": bindings.capture_supported(model)}}
n_layer, n_embd = llama_cpp.llama_model_n_layer(model), llm.n_embd()
try:
    bindings.capture_layer_input(ctx, n_layer, True)
except ValueError as e:
    out["out_of_range"] = str(e)
for layer in (0, 1):
    bindings.capture_layer_input(ctx, layer, True)
try:
    bindings.get_layer_input(ctx, 0, 1, n_embd)
except RuntimeError as e:
    out["before_decode"] = str(e)
tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog", add_bos=True)
llm.eval(tokens)
x0 = bindings.get_layer_input(ctx, 0, len(tokens), n_embd)
x1 = bindings.get_layer_input(ctx, 1, len(tokens), n_embd)
g = read_gguf(path)
info = g.tensors["token_embd.weight"]
emb = np.asarray(g.raw("token_embd.weight").view(np.float32)).reshape(info.ne[1], info.ne[0])
# gemma3 scales its embeddings by sqrt(n_embd) before the first layer (ggml_scale of the F32 rows)
scale = np.float32(np.sqrt(np.float32(n_embd))) if g.get("general.architecture") == "gemma3" else np.float32(1)
out["layer0_equals_embeddings"] = bool(np.array_equal(x0, emb[tokens] * scale))
out["layer1_finite_and_different"] = bool(np.isfinite(x1).all() and not np.allclose(x1, x0))
out["n_rows"] = int(x0.shape[0]) == len(tokens)
print(json.dumps(out))
"""


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen35", "qwen3next", "gemma3"])
def test_captured_layer_zero_rows_are_the_token_embeddings_and_later_layers_are_captured_too(arch, tiny_models):
    require_builds("ridgefill")
    proc = run_py(CAPTURE.format(model=str(tiny_models[arch])), "ridgefill")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["supported"] is True
    assert "outside the model's layers" in out["out_of_range"]
    assert "enable capture, then decode" in out["before_decode"]
    assert out["layer0_equals_embeddings"] and out["layer1_finite_and_different"] and out["n_rows"]
