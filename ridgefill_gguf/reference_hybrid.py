"""An independent NumPy forward pass, from a GGUF's weights, for the hybrid qwen35 and qwen3next architectures
(stock llama.cpp).

qwen35 stacks Gated DeltaNet (linear attention) layers, with a gated full-attention layer on every
`full_attention_interval`-th one (src/models/qwen35.cpp, src/models/delta-net-base.cpp of the vendored tree).
Every layer: x += mixer(rms(x) * attn_norm); x += ffn(rms(x) * post_attention_norm).
qwen3next (src/models/qwen3next.cpp) has the same layers but for four things: a mixture of experts with a gated
shared expert in place of the MLP; beta and alpha in one projection, interleaved per key head; value heads in
grouped order (value head h reads key head h // (n_v_heads / n_k_heads): its graph repeats q and k interleaved);
plain NEOX RoPE over n_rot dims instead of multi-section RoPE.

Where llama.cpp departs from the textbook (HF) Gated DeltaNet, this file follows llama.cpp:
  - value heads sit in tiled order in the GGUF (the converter reorders them), so value head h reads key head
    h % n_k_heads (ggml_repeat / the fused op's `iv1 % neq1`), not h // (n_v_heads / n_k_heads);
  - the recurrent state is stored value-major: state[h, i, j] couples value dim i with key dim j (HF: [k, v]);
  - the l2 norm of q and k is x / sqrt(sum x^2 + eps) with eps = the model's rms epsilon (HF: a fixed 1e-6);
  - the GGUF's ssm_a is already -exp(A_log), and its RMS norm weights but ssm_norm already hold HF's 1 + w;
  - the full-attention layers rotate only n_rot dims, NEOX pairs, with interleaved multi-section RoPE (IMROPE);
    text tokens get positions (p, p, p, 0), so pairs of the fourth section stay unrotated.
The arithmetic is float64 (weights are read as float32 and widened); the RoPE angles are built in float32 as
ggml builds them. With F32 weights, an F32 KV cache and flash attention off, each layer given llama.cpp's own
input agrees with llama.cpp's output to about 1e-6 relative, and the logits to about 1e-5: the gated RMS norm
divides the DeltaNet output o by sqrt(mean(o^2) + eps), and where o is small (rms(o) down to 4e-5 with random
weights, against sqrt(eps) = 1e-3) the float32 rounding of the layers below is amplified.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .gguf_io import GGUFFile, read_gguf, tensor_f32


ARCHS = ("qwen35", "qwen3next")  # the architectures this forward pass computes


@dataclass(frozen=True)
class HybridShape:
    """The hyperparameters the qwen35 and qwen3next graphs read (names as in llama.cpp's hparams)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_theta: float
    rope_sections: tuple[int, int, int, int]
    rms_eps: float
    recurrent: tuple[bool, ...]   # per layer: a Gated DeltaNet layer (else full attention)
    d_conv: int                   # ssm.conv_kernel
    head_k_dim: int               # ssm.state_size
    n_k_heads: int                # ssm.group_count
    n_v_heads: int                # ssm.time_step_rank
    head_v_dim: int               # ssm.inner_size / n_v_heads (the graph asserts it equals head_k_dim)
    n_expert: int = 0             # qwen3next: routed experts, n_expert_used of them per row
    n_expert_used: int = 0
    expert_weights_scale: float = 0.0

    @property
    def key_dim(self) -> int:
        return self.head_k_dim * self.n_k_heads

    @property
    def value_dim(self) -> int:
        return self.head_v_dim * self.n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "HybridShape":
        arch = g.get("general.architecture")
        if arch not in ARCHS:
            raise ValueError(f"the hybrid reference supports {' and '.join(ARCHS)}, not '{arch}'")
        get = lambda k, d=None: g.get(f"{arch}.{k}", d)  # noqa: E731
        n_layer, n_head = int(get("block_count")), int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", int(get("embedding_length")) // n_head))
        recurrent = get("attention.recurrent_layers")
        if recurrent is None:  # qwen35.cpp's default when the per-layer array is absent
            interval = int(get("full_attention_interval", 4))
            recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
        sections = list(get("rope.dimension_sections", [0, 0, 0, 0]))
        n_v_heads = int(get("ssm.time_step_rank"))
        return cls(arch=arch, n_layer=n_layer, n_embd=int(get("embedding_length")), n_head=n_head,
                   n_head_kv=int(get("attention.head_count_kv", n_head)), head_dim=head_dim,
                   n_rot=int(get("rope.dimension_count", head_dim)), rope_theta=float(get("rope.freq_base", 10000.0)),
                   rope_sections=tuple(int(s) for s in (sections + [0, 0, 0, 0])[:4]),
                   rms_eps=float(get("attention.layer_norm_rms_epsilon")),
                   recurrent=tuple(bool(r) for r in recurrent[:n_layer]), d_conv=int(get("ssm.conv_kernel")),
                   head_k_dim=int(get("ssm.state_size")), n_k_heads=int(get("ssm.group_count")),
                   n_v_heads=n_v_heads, head_v_dim=int(get("ssm.inner_size")) // n_v_heads,
                   n_expert=int(get("expert_count", 0)), n_expert_used=int(get("expert_used_count", 0)),
                   expert_weights_scale=float(get("expert_weights_scale", 0.0)))


@dataclass
class HybridCache:
    """What a sequence leaves behind after its rows: per attention layer K/V (and their positions), per Gated
    DeltaNet layer the conv state [d_conv - 1, conv_dim] (the last raw qkv rows, oldest first; llama.cpp's r_l
    holds its transpose) and the recurrent state [n_v_heads, head_v_dim, head_k_dim] (llama.cpp's s_l layout)."""

    n_past: int = 0
    k: dict[int, np.ndarray] = field(default_factory=dict)
    v: dict[int, np.ndarray] = field(default_factory=dict)
    conv: dict[int, np.ndarray] = field(default_factory=dict)
    state: dict[int, np.ndarray] = field(default_factory=dict)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """The SiLU-gated MLP of rows h with weights in numpy order: down(silu(gate h) * up h)."""
    return (silu(h @ gate.T) * (h @ up.T)) @ down.T


def imrope_components(n_pairs: int, sections: tuple[int, ...]) -> np.ndarray:
    """The position component (t, h, w, e) each rotary pair of multi-section RoPE takes: pair i from sector
    i % sum(sections), interleaved t, h, w (ggml_mrope_cache_init with is_imrope), the rest from e."""
    s, comp = sections, np.empty(n_pairs, int)
    for i in range(n_pairs):
        sector = i % sum(s)
        if sector % 3 == 1 and sector < 3 * s[1]:
            comp[i] = 1
        elif sector % 3 == 2 and sector < 3 * s[2]:
            comp[i] = 2
        elif sector % 3 == 0 and sector < 3 * s[0]:
            comp[i] = 0
        else:
            comp[i] = 3
    return comp


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """ggml's softplus: log(1 + e^x), and x itself above 20."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


class HybridReference:
    def __init__(self, path: str | Path):
        self.g = read_gguf(path, skip_arrays=("tokenizer.",))
        self.hp = HybridShape.from_gguf(self.g)
        if self.hp.head_v_dim != self.hp.head_k_dim:
            raise ValueError(f"{self.hp.arch}'s graph needs head_v_dim == head_k_dim (ssm.inner_size / time_step_rank)")
        self._w: dict[str, np.ndarray | None] = {}

    def w(self, name: str) -> np.ndarray | None:
        """A tensor as float64 in numpy order, or None when the file lacks it."""
        if name not in self._w:
            self._w[name] = tensor_f32(self.g, name).astype(np.float64) if name in self.g.tensors else None
        return self._w[name]

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.w(name + ".weight").T

    # -- norms ---------------------------------------------------------------------------------------

    def rms(self, x: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
        """RMSNorm over the last axis, times `weight` when given (ggml_rms_norm then ggml_mul)."""
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.hp.rms_eps)
        return y if weight is None else y * weight

    def l2norm(self, x: np.ndarray) -> np.ndarray:
        """x / sqrt(sum x^2 + eps) over the last axis: build_gdn_l2_norm's rms_norm(x, eps/n) / sqrt(n)."""
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + self.hp.rms_eps)

    def gated_norm(self, layer: int, o: np.ndarray, z: np.ndarray) -> np.ndarray:
        """rms(o) * ssm_norm * silu(z), per value head: o and z [n, n_v_heads, head_v_dim] -> [n, value_dim]."""
        out = self.rms(o, self.w(f"blk.{layer}.ssm_norm.weight")) * silu(z)
        return out.reshape(len(o), -1)

    # -- full attention --------------------------------------------------------------------------

    def rope_components(self) -> np.ndarray:
        """The position component each rotary pair takes: qwen35's multi-section layout, or for qwen3next's plain
        NEOX RoPE the position itself (component 0) for every pair."""
        n_pairs = self.hp.n_rot // 2
        if self.hp.arch == "qwen35":
            return imrope_components(n_pairs, self.hp.rope_sections)
        return np.zeros(n_pairs, int)

    def rope_angles(self, pos: np.ndarray) -> np.ndarray:
        """RoPE angles [n, n_rot/2] for positions [n] (text: (p, p, p, 0)) or [4, n] (t, h, w, e): pair i takes
        component rope_components()[i] of the position; each component's angle is p * theta_scale^i, multiplied
        up pair by pair in float32 as ggml does."""
        hp = self.hp
        pos = np.asarray(pos)
        if pos.ndim == 1:
            pos = np.stack([pos, pos, pos, np.zeros_like(pos)])
        comp = self.rope_components()
        theta_scale = np.float32(hp.rope_theta) ** np.float32(-2.0 / hp.n_rot)
        theta = np.empty((pos.shape[1], len(comp)), np.float32)
        t = pos.astype(np.float32)  # [4, n]
        for i in range(len(comp)):
            theta[:, i] = t[comp[i]]
            t = (t * theta_scale).astype(np.float32)
        return theta.astype(np.float64)

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x [n, heads, head_dim]: NEOX pairs (i, i + n_rot/2) over the first n_rot dims; the rest pass through."""
        half = self.hp.n_rot // 2
        theta = self.rope_angles(pos)
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        out = x.copy()
        a, b = x[..., :half], x[..., half: 2 * half]
        out[..., :half], out[..., half: 2 * half] = a * cos - b * sin, a * sin + b * cos
        return out

    def query(self, layer: int, h: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(Q normed and roped, output gate), both [n, n_head, head_dim], from normalized inputs h.

        attn_q is twice as wide: per head, head_dim query values then head_dim gate values."""
        hp, p = self.hp, f"blk.{layer}."
        qg = self.linear(h, p + "attn_q").reshape(len(h), hp.n_head, 2 * hp.head_dim)
        q, gate = qg[..., : hp.head_dim], qg[..., hp.head_dim:]
        return self.rope(self.rms(q, self.w(p + "attn_q_norm.weight")), pos), gate

    def kv(self, layer: int, h: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s K (normed, roped) and V of normalized inputs h: [n, n_head_kv, head_dim] each."""
        hp, p = self.hp, f"blk.{layer}."
        k = self.linear(h, p + "attn_k").reshape(len(h), hp.n_head_kv, hp.head_dim)
        v = self.linear(h, p + "attn_v").reshape(len(h), hp.n_head_kv, hp.head_dim)
        return self.rope(self.rms(k, self.w(p + "attn_k_norm.weight")), pos), v

    def attend(self, layer: int, q: np.ndarray, gate: np.ndarray, pos: np.ndarray, k: np.ndarray, v: np.ndarray,
               kv_pos: np.ndarray) -> np.ndarray:
        """Causal softmax attention of q [n, n_head, hd] (at positions pos) over k, v [m, n_head_kv, hd] (at
        kv_pos), times sigmoid(gate), through attn_output: [n, n_embd]. Query head h reads KV head
        h // (n_head / n_head_kv), as ggml_mul_mat broadcasts."""
        hp = self.hp
        group = hp.n_head // hp.n_head_kv
        kh = np.arange(hp.n_head) // group
        s = np.einsum("nhd,mhd->hnm", q, k[:, kh]) / np.sqrt(hp.head_dim)
        s = np.where(kv_pos[None, None, :] <= pos[None, :, None], s, -np.inf)
        s = np.exp(s - s.max(axis=2, keepdims=True))
        prob = s / s.sum(axis=2, keepdims=True)
        out = np.einsum("hnm,mhd->nhd", prob, v[:, kh]) * sigmoid(gate)
        return self.linear(out.reshape(len(q), -1), f"blk.{layer}.attn_output")

    def attention(self, layer: int, h: np.ndarray, pos: np.ndarray,
                  cache: HybridCache | None = None) -> np.ndarray:
        """The gated attention layer's output for normalized rows h at positions pos; with a cache, over its
        earlier K/V too, and the new K/V appended to it."""
        q, gate = self.query(layer, h, pos)
        k, v = self.kv(layer, h, pos)
        kv_pos = pos
        if cache is not None:
            if layer in cache.k:
                k, v = np.concatenate([cache.k[layer], k]), np.concatenate([cache.v[layer], v])
            cache.k[layer], cache.v[layer] = k, v
            kv_pos = np.arange(len(k))  # the cache holds one sequence from position 0
        return self.attend(layer, q, gate, pos, k, v, kv_pos)

    # -- Gated DeltaNet ---------------------------------------------------------------------------

    def gdn_projections(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, ...]:
        """(qkv [n, conv_dim] before the conv, z [n, n_v_heads, head_v_dim], beta [n, n_v_heads],
        log_decay [n, n_v_heads]) from normalized inputs h. beta = sigmoid(h W_beta); the decay is
        exp(log_decay) with log_decay = softplus(h W_alpha + dt_bias) * ssm_a (ssm_a = -exp(A_log) < 0)."""
        hp, p = self.hp, f"blk.{layer}."
        qkv = self.linear(h, p + "attn_qkv")
        z = self.linear(h, p + "attn_gate").reshape(len(h), hp.n_v_heads, hp.head_v_dim)
        if hp.arch == "qwen3next":  # per key head: its value heads' beta, then their alpha
            ba = self.linear(h, p + "ssm_ba").reshape(len(h), hp.n_k_heads, 2, hp.n_v_heads // hp.n_k_heads)
            b, a = ba[:, :, 0].reshape(len(h), -1), ba[:, :, 1].reshape(len(h), -1)
        else:
            b, a = self.linear(h, p + "ssm_beta"), self.linear(h, p + "ssm_alpha")
        log_decay = softplus(a + self.w(p + "ssm_dt.bias")) * self.w(p + "ssm_a")
        return qkv, z, sigmoid(b), log_decay

    def conv(self, layer: int, qkv: np.ndarray, conv_state: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """Causal depthwise conv over time, then silu: (out [n, conv_dim], new conv state [d_conv - 1, conv_dim]).

        The conv state (zeros for a fresh sequence) holds the previous d_conv - 1 raw rows; it is put in front of
        the new rows (build_conv_state's concat), and out[t, c] = sum_i x[t + i, c] w[c, i] over that window
        (ggml_ssm_conv). The new state is the window's last d_conv - 1 rows."""
        w = self.w(f"blk.{layer}.ssm_conv1d.weight")  # [conv_dim, d_conv]
        d_conv = w.shape[1]
        if conv_state is None:
            conv_state = np.zeros((d_conv - 1, qkv.shape[1]))
        x = np.concatenate([conv_state, qkv])
        n = len(qkv)
        out = sum(x[i: i + n] * w[:, i] for i in range(d_conv))
        return silu(out), x[len(x) - (d_conv - 1):].copy()

    def split_qkv(self, mixed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The conv output's q and k (l2-normed, [n, n_k_heads, head_k_dim]) and v ([n, n_v_heads, head_v_dim])."""
        hp, n = self.hp, len(mixed)
        q = mixed[:, : hp.key_dim].reshape(n, hp.n_k_heads, hp.head_k_dim)
        k = mixed[:, hp.key_dim: 2 * hp.key_dim].reshape(n, hp.n_k_heads, hp.head_k_dim)
        v = mixed[:, 2 * hp.key_dim:].reshape(n, hp.n_v_heads, hp.head_v_dim)
        return self.l2norm(q), self.l2norm(k), v

    def value_to_key_heads(self) -> np.ndarray:
        """The key head each value head reads. qwen35: h % n_k_heads; the converter reorders value heads from HF's
        grouped order (h // (n_v_heads / n_k_heads)) to this tiled one so that ggml_repeat can broadcast q and k,
        and the grouped pairing would not match the GGUF's weights. qwen3next keeps the grouped order."""
        h = np.arange(self.hp.n_v_heads)
        return h // (self.hp.n_v_heads // self.hp.n_k_heads) if self.hp.arch == "qwen3next" else h % self.hp.n_k_heads

    def delta_rule(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, log_decay: np.ndarray, beta: np.ndarray,
                   state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The gated delta rule, carried token by token in position order: (out [n, n_v_heads, head_v_dim],
        final state [n_v_heads, head_v_dim, head_k_dim]).

        Per token t and value head h (key head value_to_key_heads()[h]):
            S = exp(log_decay[t, h]) * S                 decay before the read, as the fused op does
            S += beta[t, h] * (v[t, h] - S k) k^T        the delta update: replace what S recalls for k
            out[t, h] = (S q) / sqrt(head_k_dim)"""
        hp = self.hp
        kh = self.value_to_key_heads()
        S = np.zeros((hp.n_v_heads, hp.head_v_dim, hp.head_k_dim)) if state is None else state.astype(np.float64)
        out = np.empty(v.shape)
        scale = 1.0 / np.sqrt(hp.head_k_dim)
        for t in range(len(v)):
            kt, qt = k[t, kh], q[t, kh]  # [n_v_heads, head_k_dim]
            S = S * np.exp(log_decay[t])[:, None, None]
            delta = (v[t] - np.einsum("hij,hj->hi", S, kt)) * beta[t][:, None]
            S = S + delta[:, :, None] * kt[:, None, :]
            out[t] = np.einsum("hij,hj->hi", S, qt) * scale
        return out, S

    def gated_deltanet(self, layer: int, h: np.ndarray, conv_state: np.ndarray | None = None,
                       state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The Gated DeltaNet layer over normalized rows h that follow (conv_state, state) (None: a fresh
        sequence): (output [n, n_embd] through ssm_out, new conv state, new recurrent state)."""
        qkv, z, beta, log_decay = self.gdn_projections(layer, h)
        mixed, conv_state = self.conv(layer, qkv, conv_state)
        q, k, v = self.split_qkv(mixed)
        o, state = self.delta_rule(q, k, v, log_decay, beta, state)
        return self.linear(self.gated_norm(layer, o, z), f"blk.{layer}.ssm_out"), conv_state, state

    # -- FFN and the whole model -------------------------------------------------------------------

    def ffn(self, layer: int, h: np.ndarray) -> np.ndarray:
        """SiLU-gated MLP: ffn_down(silu(ffn_gate h) * ffn_up h); qwen3next: its mixture of experts."""
        if self.hp.n_expert:
            return self.routed_experts(layer, h) + self.shared_expert(layer, h)
        p = f"blk.{layer}."
        return swiglu(h, *(self.w(p + f"ffn_{k}.weight") for k in ("gate", "up", "down")))

    def routed_experts(self, layer: int, h: np.ndarray) -> np.ndarray:
        """build_moe_ffn as qwen3next calls it: softmax over the router's logits, the n_expert_used most probable
        experts, their probabilities renormalised to sum to one (and scaled when the file says so), each a SiLU
        MLP."""
        hp, p = self.hp, f"blk.{layer}."
        logits = self.linear(h, p + "ffn_gate_inp")
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        chosen = np.argsort(-probs, axis=1, kind="stable")[:, : hp.n_expert_used]
        weights = np.take_along_axis(probs, chosen, axis=1)
        weights /= np.maximum(weights.sum(axis=1, keepdims=True), 6.103515625e-5)
        if hp.expert_weights_scale not in (0.0, 1.0):
            weights *= hp.expert_weights_scale
        gate, up, down = (self.w(p + f"ffn_{k}_exps.weight") for k in ("gate", "up", "down"))
        out = np.zeros_like(h)
        for e in range(hp.n_expert):
            rows, slot = np.nonzero(chosen == e)
            out[rows] += weights[rows, slot, None] * swiglu(h[rows], gate[e], up[e], down[e])
        return out

    def shared_expert(self, layer: int, h: np.ndarray) -> np.ndarray:
        """qwen3next's shared expert: its SiLU MLP times sigmoid(h . ffn_gate_inp_shexp)."""
        p = f"blk.{layer}."
        mlp = swiglu(h, *(self.w(p + f"ffn_{k}_shexp.weight") for k in ("gate", "up", "down")))
        return mlp * sigmoid(h @ self.w(p + "ffn_gate_inp_shexp.weight"))[:, None]

    def layer(self, layer: int, x: np.ndarray, pos: np.ndarray, cache: HybridCache | None = None) -> np.ndarray:
        """One block on the residual stream x [n, n_embd]; a cache is read and updated in place."""
        p = f"blk.{layer}."
        h = self.rms(x, self.w(p + "attn_norm.weight"))
        if self.hp.recurrent[layer]:
            conv_state = state = None
            if cache is not None:
                conv_state, state = cache.conv.get(layer), cache.state.get(layer)
            out, conv_state, state = self.gated_deltanet(layer, h, conv_state, state)
            if cache is not None:
                cache.conv[layer], cache.state[layer] = conv_state, state
        else:
            out = self.attention(layer, h, pos, cache)
        x = x + out
        return x + self.ffn(layer, self.rms(x, self.w(p + "post_attention_norm.weight")))

    def logits(self, x: np.ndarray) -> np.ndarray:
        out = self.w("output.weight")
        out = self.w("token_embd.weight") if out is None else out
        return self.rms(x, self.w("output_norm.weight")) @ out.T

    def forward(self, tokens: list[int], chunk: int | None = None, cache: HybridCache | None = None
                ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(logits [n, n_vocab] float32, every layer's input [n, n_embd] float32) for tokens that follow `cache`
        (None: one sequence from position 0). chunk: run the rows `chunk` at a time, as llama.cpp's ubatches,
        carrying K/V, conv and recurrent states between chunks (the cache, when given, is updated in place)."""
        n = len(tokens)
        if chunk is None and cache is None:
            starts, cache = [0], None
            chunk = n
        else:
            cache = HybridCache() if cache is None else cache
            chunk = n if chunk is None else chunk
            starts = list(range(0, n, chunk))
        embd = self.w("token_embd.weight")
        logits, inputs = [], [[] for _ in range(self.hp.n_layer)]
        for s in starts:
            rows = np.asarray(tokens[s: s + chunk])
            n_past = cache.n_past if cache is not None else 0
            pos = np.arange(n_past, n_past + len(rows))
            x = embd[rows]
            for layer in range(self.hp.n_layer):
                inputs[layer].append(x)
                x = self.layer(layer, x, pos, cache)
            if cache is not None:
                cache.n_past += len(rows)
            logits.append(self.logits(x))
        return (np.concatenate(logits).astype(np.float32),
                [np.concatenate(xs).astype(np.float32) for xs in inputs])
