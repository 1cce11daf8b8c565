"""The NumPy hybrid (Gated DeltaNet + gated attention) forward pass of qwen35 and qwen3next agrees with stock
llama.cpp (CPU, F32 weights and cache, flash attention off), and the checks can fail: wrong recurrences, head
orders, gate layouts and RoPE do not agree."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from conftest import require_builds, run_py
from ridgefill_gguf.gguf_io import read_gguf
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model
from ridgefill_gguf.reference_hybrid import (HybridCache, HybridReference, imrope_components, sigmoid, softplus,
                                             swiglu)

TOLERANCE = 1e-4   # max |diff| / max |logit|; measured 2e-6 .. 1.1e-5
WRONG = 1e-2       # a wrong variant must miss by at least this (measured: about 1)
N_BATCH = 32       # llama.cpp decodes the prompt in 3 calls: its conv and recurrent states cross 2 boundaries
TEXT = "The quick brown fox jumps over the lazy dog, and then it naps in the warm sun. " * 4

DUMP = r"""
import json, sys
import numpy as np
from ridgefill_gguf import libs
llama_cpp = libs.use_build("upstream")
paths, out, n_batch, text = json.loads(sys.argv[1])
for name, path in paths.items():
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_batch=n_batch, n_ubatch=n_batch, logits_all=True,
                          flash_attn=False, type_k=0, type_v=0, n_threads=2, verbose=False)
    tokens = llm.tokenize(text.encode(), add_bos=True)
    llm.eval(tokens)
    np.save(f"{out}/{name}.npy", np.array(llm.scores[: llm.n_tokens], dtype=np.float32))
    llm.close()
print(json.dumps(tokens))
"""

# the patched build's layer-input capture (bindings.capture_layer_input / layer_input_view), one decode per chunk
# as ridgefill_gguf.fit.capture does
CAPTURE = r"""
import json, sys
import numpy as np
from ridgefill_gguf import libs
from ridgefill_gguf.engine import bindings
llama_cpp = libs.use_build("ridgefill")
path, out, n_batch, text = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_batch=n_batch, n_ubatch=n_batch, flash_attn=False,
                      type_k=0, type_v=0, n_threads=2, verbose=False)
n_layer, n_embd = llama_cpp.llama_model_n_layer(llm.model), llm.n_embd()
for layer in range(n_layer):
    bindings.capture_layer_input(llm.ctx, layer, True)
tokens = llm.tokenize(text.encode(), add_bos=True)
rows = np.empty((n_layer, len(tokens), n_embd), np.float32)
for start in range(0, len(tokens), n_batch):
    chunk = tokens[start:start + n_batch]
    llm.eval(chunk)
    for layer in range(n_layer):
        rows[layer, start:start + len(chunk)] = bindings.layer_input_view(llm.ctx, layer, len(chunk), n_embd)
np.save(out, rows)
print(json.dumps(tokens))
"""


def long_memory_copy(src, dst, seed=0):
    """A copy whose ssm_a (the decay rate) is small. The random writer draws A in [1, 16], so the state keeps
    exp(-A softplus(.)) ~ 1e-5 of itself per token and the recurrence forgets at once; here it keeps 0.7-0.97."""
    shutil.copy(src, dst)
    g = read_gguf(dst, skip_arrays=("tokenizer.",))
    rng = np.random.default_rng(seed)
    with open(dst, "r+b") as f:
        for name, info in g.tensors.items():
            if name.endswith(".ssm_a"):
                f.seek(info.offset)
                f.write((-rng.uniform(0.02, 0.2, info.ne[0])).astype(np.float32).tobytes())
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen35")
    stock = write_random_model(folder / "stock.gguf", tiny_shape("qwen35"), seed=1)
    # a fourth RoPE section, which text tokens leave unrotated (position 0), and a theta that makes it count
    sections = dataclasses.replace(tiny_shape("qwen35"), rope_sections=(1, 1, 1, 1), rope_theta=100.0)
    four = write_random_model(folder / "four-sections.gguf", sections, seed=2)
    # qwen3next: the same layers with a mixture of experts, beta and alpha in one projection, grouped value heads;
    # a theta at which RoPE's kind shows
    next_shape = dataclasses.replace(tiny_shape("qwen3next"), rope_theta=100.0)
    next_stock = write_random_model(folder / "qwen3next.gguf", next_shape, seed=7)
    return {"stock": stock,
            "long-memory": long_memory_copy(stock, folder / "long-memory.gguf"),
            "four-sections": long_memory_copy(four, folder / "four-sections-long-memory.gguf", seed=1),
            "qwen3next": long_memory_copy(next_stock, folder / "qwen3next-long-memory.gguf", seed=2)}


@pytest.fixture(scope="module")
def llama_cpp_logits(models, tmp_path_factory):
    """(tokens, {model: llama.cpp's logits [n, n_vocab]}), one subprocess for all models."""
    require_builds("upstream")
    out = tmp_path_factory.mktemp("llama-logits")
    arg = json.dumps([{k: str(v) for k, v in models.items()}, str(out), N_BATCH, TEXT])
    tokens = json.loads(run_py(f"import sys; sys.argv = ['x', {arg!r}]\n" + DUMP).stdout.strip().splitlines()[-1])
    assert len(tokens) > 2 * N_BATCH
    return tokens, {name: np.load(out / f"{name}.npy") for name in models}


@pytest.fixture(scope="module")
def refs(models):
    return {name: HybridReference(path) for name, path in models.items()}


def variant(cls, base: HybridReference) -> HybridReference:
    """A subclass instance over the same file, sharing the already-widened weights."""
    v = cls(base.g.path)
    v._w = base._w
    return v


def rel(ours, theirs) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("name", ["stock", "long-memory", "four-sections", "qwen3next"])
def test_the_numpy_hybrid_forward_matches_llama_cpp_stock_logits(name, refs, llama_cpp_logits):
    tokens, theirs = llama_cpp_logits
    ours, inputs = refs[name].forward(tokens)
    err = rel(ours, theirs[name])
    print(f"{name}: max |diff| / max |logit| = {err:.2e} over {len(tokens)} tokens")
    assert ours.dtype == np.float32 and ours.shape == theirs[name].shape
    assert len(inputs) == refs[name].hp.n_layer and inputs[0].shape == (len(tokens), refs[name].hp.n_embd)
    assert err < TOLERANCE, err
    assert (ours.argmax(1) == theirs[name].argmax(1)).all()


@pytest.mark.parametrize("name", ["stock", "long-memory", "qwen3next"])
def test_each_layer_given_llama_cpp_s_own_input_reproduces_llama_cpp_s_output(name, models, refs, llama_cpp_logits):
    """Layer by layer through the layer inputs the patched build (RidgeFill off) captures: each layer alone is
    within float32 rounding; the last layer's output is judged through the stock build's logits."""
    require_builds("ridgefill")
    path, out = models[name], models[name].with_suffix(".inputs.npy")
    arg = json.dumps([str(path), str(out), N_BATCH, TEXT])
    code = f"import sys; sys.argv = ['x', {arg!r}]\n" + CAPTURE
    tokens = json.loads(run_py(code, "ridgefill").stdout.strip().splitlines()[-1])
    assert tokens == llama_cpp_logits[0]
    ref = refs[name]
    n_layer = ref.hp.n_layer
    _, inputs = ref.forward(tokens)
    pos = np.arange(len(tokens))
    got = np.load(out).astype(np.float64)
    assert rel(inputs[0], got[0]) == 0  # the token embeddings
    for layer in range(n_layer):
        y = ref.layer(layer, got[layer], pos)
        if layer + 1 < n_layer:
            chained, alone = rel(inputs[layer + 1], got[layer + 1]), rel(y, got[layer + 1])
        else:
            chained, alone = rel(ref.forward(tokens)[0], llama_cpp_logits[1][name]), rel(ref.logits(y),
                                                                                        llama_cpp_logits[1][name])
        kind = "DeltaNet" if ref.hp.recurrent[layer] else "attention"
        print(f"{name} layer {layer} ({kind}) output: from llama.cpp's input {alone:.1e}, chained {chained:.1e}")
        assert alone < 1e-5 and chained < TOLERANCE, (layer, alone, chained)


def test_chunks_that_carry_kv_conv_and_recurrent_states_reproduce_the_one_pass_forward(refs):
    ref = refs["long-memory"]
    tokens = list(range(1000, 1050))
    whole, inputs = ref.forward(tokens)
    chunked, chunked_inputs = ref.forward(tokens, chunk=7)
    assert rel(chunked, whole) < 1e-9
    assert all(rel(a, b) < 1e-9 for a, b in zip(chunked_inputs, inputs))
    # a cache filled by one prefill continues as if the rows had come in one pass; its final states are the
    # ones the DeltaNet layer returns for the whole sequence
    cache = HybridCache()
    ref.forward(tokens[:30], cache=cache)
    tail, _ = ref.forward(tokens[30:], cache=cache)
    assert cache.n_past == len(tokens) and rel(tail, whole[30:]) < 1e-9
    layer = 0
    h = ref.rms(inputs[layer].astype(np.float64), ref.w(f"blk.{layer}.attn_norm.weight"))
    _, conv_state, state = ref.gated_deltanet(layer, h)
    assert state.shape == (ref.hp.n_v_heads, ref.hp.head_v_dim, ref.hp.head_k_dim)
    assert conv_state.shape == (ref.hp.d_conv - 1, ref.hp.conv_dim)
    assert np.abs(cache.state[layer] - state).max() < 1e-9 * np.abs(state).max()
    assert np.abs(cache.conv[layer] - conv_state).max() < 1e-9 * np.abs(conv_state).max()


class Reversed(HybridReference):
    """Carries the delta rule from the last token to the first."""

    def delta_rule(self, q, k, v, log_decay, beta, state=None):
        out, state = super().delta_rule(q[::-1], k[::-1], v[::-1], log_decay[::-1], beta[::-1], state)
        return out[::-1], state


class ConvStateDropped(HybridReference):
    """Starts every chunk's conv from zeros, as if the conv state were not carried."""

    def conv(self, layer, qkv, conv_state=None):
        return super().conv(layer, qkv, None)


class RecurrentStateDropped(HybridReference):
    """Starts every chunk's delta rule from a zero state."""

    def delta_rule(self, q, k, v, log_decay, beta, state=None):
        return super().delta_rule(q, k, v, log_decay, beta, None)


class GroupedHeads(HybridReference):
    """HF's pairing of value heads with key heads, which the GGUF's tiled head order does not follow."""

    def value_to_key_heads(self):
        return np.arange(self.hp.n_v_heads) // (self.hp.n_v_heads // self.hp.n_k_heads)


class TiledHeads(HybridReference):
    """qwen35's tiled pairing, which qwen3next's graph (q and k repeated interleaved) does not follow."""

    def value_to_key_heads(self):
        return np.arange(self.hp.n_v_heads) % self.hp.n_k_heads


class BetaAlphaInHalves(HybridReference):
    """qwen3next's joint beta-alpha projection read as all betas then all alphas, not per key head."""

    def gdn_projections(self, layer, h):
        qkv, z, _, _ = super().gdn_projections(layer, h)
        p, n_v = f"blk.{layer}.", self.hp.n_v_heads
        ba = self.linear(h, p + "ssm_ba")
        log_decay = softplus(ba[:, n_v:] + self.w(p + "ssm_dt.bias")) * self.w(p + "ssm_a")
        return qkv, z, sigmoid(ba[:, :n_v]), log_decay


class MultiSectionRope(HybridReference):
    """qwen35's multi-section RoPE, where qwen3next rotates every pair with the position."""

    def rope_components(self):
        return imrope_components(self.hp.n_rot // 2, (1, 1, 1, 1))


class SharedExpertUngated(HybridReference):
    """qwen3next's shared expert added without its sigmoid gate."""

    def shared_expert(self, layer, h):
        p = f"blk.{layer}."
        return swiglu(h, *(self.w(p + f"ffn_{k}_shexp.weight") for k in ("gate", "up", "down")))


def test_carrying_the_recurrence_in_reverse_order_does_not_match_llama_cpp(refs, llama_cpp_logits):
    tokens, theirs = llama_cpp_logits
    for name in ("stock", "long-memory"):
        err = rel(variant(Reversed, refs[name]).forward(tokens)[0], theirs[name])
        print(f"{name}: reversed recurrence misses by {err:.2e}")
        assert err > WRONG, (name, err)


@pytest.mark.parametrize("wrong", [ConvStateDropped, RecurrentStateDropped])
def test_dropping_a_state_between_chunks_does_not_match_llama_cpp(wrong, refs, llama_cpp_logits):
    tokens, theirs = llama_cpp_logits
    ref = refs["long-memory"]
    assert rel(ref.forward(tokens, chunk=N_BATCH)[0], theirs["long-memory"]) < TOLERANCE  # carried: it matches
    err = rel(variant(wrong, ref).forward(tokens, chunk=N_BATCH)[0], theirs["long-memory"])
    print(f"{wrong.__name__}: misses by {err:.2e}")
    assert err > WRONG, err


def test_value_heads_read_key_heads_in_tiled_order_not_in_hf_grouped_order(refs, llama_cpp_logits):
    tokens, theirs = llama_cpp_logits
    ref = refs["long-memory"]
    assert ref.hp.n_v_heads > ref.hp.n_k_heads  # else both orders coincide
    err = rel(variant(GroupedHeads, ref).forward(tokens)[0], theirs["long-memory"])
    print(f"grouped heads: misses by {err:.2e}")
    assert err > WRONG, err


@pytest.mark.parametrize("wrong", [TiledHeads, BetaAlphaInHalves, MultiSectionRope, SharedExpertUngated])
def test_qwen3next_s_grouped_heads_joint_gates_plain_rope_and_gated_shared_expert_are_what_llama_cpp_computes(
        wrong, refs, llama_cpp_logits):
    tokens, theirs = llama_cpp_logits
    ref = refs["qwen3next"]
    assert ref.hp.n_v_heads > ref.hp.n_k_heads and ref.hp.n_expert > ref.hp.n_expert_used
    err = rel(variant(wrong, ref).forward(tokens)[0], theirs["qwen3next"])
    print(f"{wrong.__name__}: misses by {err:.2e}")
    assert err > WRONG, err


def test_the_fourth_rope_section_leaves_its_pairs_unrotated_for_text_tokens(refs, llama_cpp_logits):
    class EveryPairRotated(HybridReference):
        def rope_angles(self, pos):
            pos = np.asarray(pos)
            return super().rope_angles(np.stack([pos] * 4) if pos.ndim == 1 else pos)

    tokens, theirs = llama_cpp_logits
    ref = refs["four-sections"]
    assert ref.hp.rope_sections[3] > 0
    err = rel(variant(EveryPairRotated, ref).forward(tokens)[0], theirs["four-sections"])
    print(f"fourth section rotated with p: misses by {err:.2e}")
    assert err > WRONG, err
