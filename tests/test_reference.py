"""The NumPy reference forward pass agrees with llama.cpp (CPU, F32 weights and cache, flash attention off)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import require_builds, run_py
from ridgefill_gguf.reference import ReferenceModel

DUMP = r"""
import json, sys
import numpy as np
from ridgefill_gguf import libs
llama_cpp = libs.use_build(sys.argv[2])
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True,
                      flash_attn=False, type_k=0, type_v=0, n_threads=2, verbose=False)
tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog, and then it naps in the warm sun.", add_bos=True)
llm.eval(tokens)
np.save(sys.argv[3], np.array(llm.scores[: llm.n_tokens], dtype=np.float32))
print(json.dumps(tokens))
"""


# gemma3's GELU is looked up for the half-precision gate: a gate within rounding of a half-precision step lands on
# the neighbouring entry in one computation or the other, so a few rows move by up to about 2e-4 of the largest value
TOLERANCE = {"gemma3": 5e-4}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_the_reference_forward_pass_matches_llama_cpp_logits(arch, tiny_models, tmp_path):
    require_builds("upstream")
    out = tmp_path / "logits.npy"
    code = f"import sys; sys.argv = ['x', {str(tiny_models[arch])!r}, 'upstream', {str(out)!r}]\n" + DUMP
    tokens = json.loads(run_py(code).stdout.strip().splitlines()[-1])
    ours, _ = ReferenceModel(tiny_models[arch]).forward(tokens)
    theirs = np.load(out)
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"{arch}: max |diff| / max |logit| = {rel:.2e}")
    assert rel < TOLERANCE.get(arch, 1e-5), rel
    assert (ours.argmax(1) == theirs.argmax(1)).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_captured_layer_inputs_match_the_reference_forward_pass_at_every_layer(arch, tiny_models, tmp_path):
    require_builds("ridgefill")
    out = tmp_path / "inputs.npz"
    code = f"""
import json, numpy as np
from ridgefill_gguf.fit.capture import Capturer
# an F32 KV cache: with F16 the rows of layers >= 1 move by about 4e-4
cap = Capturer({str(tiny_models[arch])!r}, 0, n_ctx=256, n_batch=64, n_threads=2, type_k=0, type_v=0)
tokens = cap.tokenize("A short text about capture: every layer's input, row by row, in two chunks. " * 4, 256)
rows = cap.run(tokens)
np.savez({str(out)!r}, **{{str(l): x for l, x in rows.items()}})
print(json.dumps(tokens))
"""
    tokens = json.loads(run_py(code, "ridgefill").stdout.strip().splitlines()[-1])
    assert len(tokens) > 64  # more than one chunk
    _, inputs = ReferenceModel(tiny_models[arch]).forward(tokens)
    with np.load(out) as captured:
        for layer, ref in enumerate(inputs):
            got = captured[str(layer)]
            assert np.abs(got - ref).max() / np.abs(ref).max() < TOLERANCE.get(arch, 1e-5), layer


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_the_reference_ridgefill_arm_reduces_to_the_exact_model_where_it_must(arch, tiny_models):
    ref = ReferenceModel(tiny_models[arch])
    tokens = list(range(100, 160))
    exact, _ = ref.forward(tokens)
    tail = exact[-16:]
    # the oracle fill writes the true K/V: the tail sees the exact cache
    assert np.abs(ref.ridgefill_forward(tokens, 1, 16, "oracle") - tail).max() < 1e-4
    # every prefix row exact: nothing is filled
    every = set(range(len(tokens)))
    assert np.abs(ref.ridgefill_forward(tokens, 1, 16, "none", exact_rows=every) - tail).max() < 1e-4
    # a split at the last layer leaves only that layer to fill, from x_S, its true input
    assert np.abs(ref.ridgefill_forward(tokens, ref.hp.n_layer - 1, 16, "identity") - tail).max() < 1e-4
    # a real fill changes the tail's logits, and hiding the prefix changes them more
    d = ref.hp.n_embd
    maps = {layer: (np.eye(d, dtype=np.float32) * 0.9, np.zeros(d, np.float32)) for layer in range(ref.hp.n_layer)}
    ridge = ref.ridgefill_forward(tokens, 1, 16, "ridge", maps)
    none = ref.ridgefill_forward(tokens, 1, 16, "none")
    assert 0 < np.abs(ridge - tail).max() and 0 < np.abs(none - tail).max()
