"""Held-out scores of a prediction: what each late layer would write to its cache, predicted against true.

For an attention layer the score is the cosine between the K (and V) rows computed from the predicted
input and from the true input, through the layer's own norm, projections, biases and K norm, with the
weights read from the model GGUF (dequantized). RoPE rotates both the same way, so it leaves the cosine
unchanged and is skipped. Layers without attention (Gated DeltaNet) are scored by the input cosine.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..gguf_io import read_gguf, tensor_f32


def rows_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of the cosine between matching rows."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return float(np.mean(num / np.maximum(den, 1e-30)))


@dataclass
class AttnWeights:
    norm: np.ndarray
    wk: np.ndarray            # [n_k, d]
    wv: np.ndarray            # [n_v, d]
    bk: np.ndarray | None
    bv: np.ndarray | None
    k_norm: np.ndarray | None  # [head_dim], applied per head


class CacheProjector:
    """K and V of late attention layers from given layer inputs, as llama.cpp computes them (before RoPE)."""

    def __init__(self, model_path: str | Path):
        self.g = read_gguf(model_path, skip_arrays=("tokenizer.",))
        arch = self.g.get("general.architecture")
        self.arch = arch
        self.eps = float(self.g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))
        n_embd = int(self.g.get(f"{arch}.embedding_length"))
        n_head = int(np.max(self.g.get(f"{arch}.attention.head_count")))
        self.head_dim = int(self.g.get(f"{arch}.attention.key_length", n_embd // n_head))
        self._cache: dict[int, AttnWeights | None] = {}

    def weights(self, layer: int) -> AttnWeights | None:
        if layer not in self._cache:
            self._cache[layer] = self._load(layer)
        return self._cache[layer]

    def _load(self, layer: int) -> AttnWeights | None:
        t = self.g.tensors
        p = f"blk.{layer}."
        if p + "attn_k.weight" not in t or p + "attn_norm.weight" not in t:
            return None  # a recurrent (DeltaNet) layer, or a fused QKV layout: scored by the input cosine
        opt = lambda name: tensor_f32(self.g, p + name) if p + name in t else None  # noqa: E731
        return AttnWeights(tensor_f32(self.g, p + "attn_norm.weight"), tensor_f32(self.g, p + "attn_k.weight"),
                           tensor_f32(self.g, p + "attn_v.weight"), opt("attn_k.bias"), opt("attn_v.bias"),
                           opt("attn_k_norm.weight"))

    def kv(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        w = self.weights(layer)
        if w is None:
            return None
        h = self._rms(x) * w.norm
        k, v = h @ w.wk.T, h @ w.wv.T
        if w.bk is not None:
            k = k + w.bk
        if w.bv is not None:
            v = v + w.bv
        if w.k_norm is not None:
            kh = k.reshape(len(k), -1, self.head_dim)
            k = (self._rms(kh) * w.k_norm).reshape(len(k), -1)
        return k, v

    def _rms(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(self.eps))


@dataclass
class LayerScore:
    layer: int
    input_cos: float
    k_cos: float | None = None
    v_cos: float | None = None

    @property
    def cache_cos(self) -> float:
        """The selection score: K/V cosine where the layer writes K/V, else the input cosine."""
        return self.input_cos if self.k_cos is None else (self.k_cos + self.v_cos) / 2


def score_layer(proj: CacheProjector, layer: int, pred: np.ndarray, true: np.ndarray) -> LayerScore:
    s = LayerScore(layer, rows_cosine(pred, true))
    kv_pred, kv_true = proj.kv(layer, pred), proj.kv(layer, true)
    if kv_pred is not None:
        s.k_cos, s.v_cos = rows_cosine(kv_pred[0], kv_true[0]), rows_cosine(kv_pred[1], kv_true[1])
    return s
