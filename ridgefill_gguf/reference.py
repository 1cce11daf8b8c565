"""An independent forward pass in NumPy, from a GGUF's weights, for dense llama/qwen2/qwen3 models.

The correctness ladder's rung 4 (DESIGN §4) compares the engine with it. It follows llama.cpp's arithmetic
where that matters at float32 precision: RMSNorm sums in float64, RoPE angles multiply up in float32 from
theta_scale = freq_base^(-2/n_rot) (NORM pairs for llama, NEOX pairs for qwen2/qwen3), softmax in float32.
With F32 weights, an F32 KV cache and flash attention off, logits agree with llama.cpp on the CPU to about
1e-5 relative.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .fit.score import tensor_f32
from .gguf_io import read_gguf

NEOX_ARCHS = ("qwen2", "qwen3")
SUPPORTED = ("llama", "qwen2", "qwen3")


@dataclass
class Hparams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    eps: float
    freq_base: float


class ReferenceModel:
    def __init__(self, path: str | Path):
        self.g = read_gguf(path, skip_arrays=("tokenizer.",))
        arch = self.g.get("general.architecture")
        if arch not in SUPPORTED:
            raise ValueError(f"the reference forward pass supports {SUPPORTED}, not '{arch}'")
        get = lambda k, d=None: self.g.get(f"{arch}.{k}", d)  # noqa: E731
        n_embd, n_head = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", n_embd // n_head))
        self.hp = Hparams(arch, int(get("block_count")), n_embd, n_head, int(get("attention.head_count_kv", n_head)),
                          head_dim, int(get("rope.dimension_count", head_dim)),
                          float(get("attention.layer_norm_rms_epsilon")), float(get("rope.freq_base", 10000.0)))
        self._w: dict[str, np.ndarray] = {}

    def w(self, name: str) -> np.ndarray | None:
        if name not in self._w:
            self._w[name] = tensor_f32(self.g, name) if name in self.g.tensors else None
        return self._w[name]

    # -- pieces -------------------------------------------------------------------------------

    def rms(self, x: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
        mean = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        y = x * (np.float32(1.0) / np.sqrt((mean + self.hp.eps).astype(np.float32)))
        return y if weight is None else y * weight

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x [n, heads, head_dim]; angles built as ggml does: theta = p, then theta *= theta_scale per pair."""
        n_rot = self.hp.n_rot
        theta_scale = np.float32(self.hp.freq_base) ** np.float32(-2.0 / n_rot)
        theta = np.empty((len(pos), n_rot // 2), np.float32)
        t = pos.astype(np.float32)
        for i in range(n_rot // 2):
            theta[:, i] = t
            t = (t * theta_scale).astype(np.float32)
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        out = x.copy()
        if self.hp.arch in NEOX_ARCHS:
            a, b = x[..., : n_rot // 2], x[..., n_rot // 2: n_rot]
            out[..., : n_rot // 2], out[..., n_rot // 2: n_rot] = a * cos - b * sin, a * sin + b * cos
        else:
            a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            out[..., 0:n_rot:2], out[..., 1:n_rot:2] = a * cos - b * sin, a * sin + b * cos
        return out

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w(name + ".weight").T
        b = self.w(name + ".bias")
        return y if b is None else y + b

    def attention(self, layer: int, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
        hp, p = self.hp, f"blk.{layer}."
        n = len(h)
        q = self.linear(h, p + "attn_q").reshape(n, hp.n_head, hp.head_dim)
        k = self.linear(h, p + "attn_k").reshape(n, hp.n_head_kv, hp.head_dim)
        v = self.linear(h, p + "attn_v").reshape(n, hp.n_head_kv, hp.head_dim)
        if self.w(p + "attn_q_norm.weight") is not None:
            q, k = self.rms(q, self.w(p + "attn_q_norm.weight")), self.rms(k, self.w(p + "attn_k_norm.weight"))
        q, k = self.rope(q, pos), self.rope(k, pos)
        group = hp.n_head // hp.n_head_kv
        mask = np.triu(np.full((n, n), -np.inf, np.float32), k=1)
        out = np.empty((n, hp.n_head, hp.head_dim), np.float32)
        scale = np.float32(1.0 / np.sqrt(hp.head_dim))
        for head in range(hp.n_head):
            kv = head // group
            s = (q[:, head] @ k[:, kv].T) * scale + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, head] = (s / s.sum(axis=1, keepdims=True)) @ v[:, kv]
        return self.linear(out.reshape(n, -1), p + "attn_output")

    def ffn(self, layer: int, h: np.ndarray) -> np.ndarray:
        p = f"blk.{layer}."
        gate = self.linear(h, p + "ffn_gate")
        silu = gate / (np.float32(1.0) + np.exp(-gate))
        return self.linear(silu * self.linear(h, p + "ffn_up"), p + "ffn_down")

    # -- whole model ------------------------------------------------------------------------

    def layer(self, layer: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        p = f"blk.{layer}."
        x = x + self.attention(layer, self.rms(x, self.w(p + "attn_norm.weight")), pos)
        return x + self.ffn(layer, self.rms(x, self.w(p + "ffn_norm.weight")))

    def forward(self, tokens: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """(logits [n, n_vocab], every layer's input [n, d]) for one sequence from position 0."""
        pos = np.arange(len(tokens))
        x = self.w("token_embd.weight")[np.asarray(tokens)].astype(np.float32)
        inputs = []
        for layer in range(self.hp.n_layer):
            inputs.append(x)
            x = self.layer(layer, x, pos)
        out = self.w("output.weight")
        out = self.w("token_embd.weight") if out is None else out
        return self.rms(x, self.w("output_norm.weight")) @ out.T, inputs
