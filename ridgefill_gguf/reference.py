"""An independent forward pass in NumPy, from a GGUF's weights, for dense llama/qwen2/qwen3/gemma3 models.

The correctness ladder's rung 4 (DESIGN §4) compares the engine with it. It follows llama.cpp's arithmetic
where that matters at float32 precision: RMSNorm sums in float64, RoPE angles multiply up in float32 from
theta_scale = freq_base^(-2/n_rot) (NORM pairs for llama, NEOX pairs for qwen2/qwen3), softmax in float32.
With F32 weights, an F32 KV cache and flash attention off, logits agree with llama.cpp on the CPU to about
1e-5 relative. gemma3 adds its embedding scale, Q/K norms with the query scaled, a RoPE base and a window per
layer (windowed layers see the n_swa positions up to their own), norms after the attention and after the MLP, and
GELU as the CPU computes it (through a table over half-precision inputs).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .gguf_io import read_gguf, tensor_f32
from .random_gguf import ModelShape

NEOX_ARCHS = ("qwen2", "qwen3", "gemma3")
SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3")


class ReferenceModel:
    def __init__(self, path: str | Path):
        self.g = read_gguf(path, skip_arrays=("tokenizer.",))
        arch = self.g.get("general.architecture")
        if arch not in SUPPORTED:
            raise ValueError(f"the reference forward pass supports {SUPPORTED}, not '{arch}'")
        self.hp = ModelShape.from_gguf(self.g)
        self._w: dict[str, np.ndarray] = {}

    def w(self, name: str) -> np.ndarray | None:
        if name not in self._w:
            self._w[name] = tensor_f32(self.g, name) if name in self.g.tensors else None
        return self._w[name]

    # -- pieces -------------------------------------------------------------------------------

    def rms(self, x: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
        mean = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        y = x * (np.float32(1.0) / np.sqrt((mean + self.hp.rms_eps).astype(np.float32)))
        return y if weight is None else y * weight

    def embed(self, tokens) -> np.ndarray:
        x = self.w("token_embd.weight")[np.asarray(tokens)].astype(np.float32)
        if self.hp.arch == "gemma3":
            x = x * np.float32(np.sqrt(np.float32(self.hp.n_embd)))
        return x

    def rope(self, x: np.ndarray, pos: np.ndarray, layer: int | None = None) -> np.ndarray:
        """x [n, heads, head_dim]; angles built as ggml does: theta = p, then theta *= theta_scale per pair. A
        windowed layer takes its own base."""
        n_rot = self.hp.rot_dims
        base = self.hp.rope_theta_swa if layer is not None and self.hp.is_swa(layer) else self.hp.rope_theta
        theta_scale = np.float32(base) ** np.float32(-2.0 / n_rot)
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

    def kv(self, layer: int, h: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s K (normed, roped) and V of normalized inputs h: [n, n_head_kv, head_dim] each."""
        hp, p = self.hp, f"blk.{layer}."
        k = self.linear(h, p + "attn_k").reshape(len(h), hp.n_head_kv, hp.head_dim)
        v = self.linear(h, p + "attn_v").reshape(len(h), hp.n_head_kv, hp.head_dim)
        if self.w(p + "attn_k_norm.weight") is not None:
            k = self.rms(k, self.w(p + "attn_k_norm.weight"))
        return self.rope(k, pos, layer), v

    def attention(self, layer: int, h: np.ndarray, pos: np.ndarray, queries: np.ndarray | None = None,
                  visible: np.ndarray | None = None, weights: np.ndarray | None = None,
                  kv_scale: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Causal attention of the `queries` rows (default: all) over the `visible` rows (default: all) of h,
        the normalized inputs of every row; returns the attention output of the query rows. `weights`, when given
        ([len(queries), n] float64), receives the attention probabilities summed over the heads. kv_scale = (rows,
        k factors, v factors): the K and V of those rows times per-KV-head factors (the rescales)."""
        hp, p = self.hp, f"blk.{layer}."
        n = len(h)
        queries = np.arange(n) if queries is None else queries
        q = self.linear(h[queries], p + "attn_q").reshape(len(queries), hp.n_head, hp.head_dim)
        k = self.linear(h, p + "attn_k").reshape(n, hp.n_head_kv, hp.head_dim)
        v = self.linear(h, p + "attn_v").reshape(n, hp.n_head_kv, hp.head_dim)
        if self.w(p + "attn_q_norm.weight") is not None:
            q, k = self.rms(q, self.w(p + "attn_q_norm.weight")), self.rms(k, self.w(p + "attn_k_norm.weight"))
        q, k = self.rope(q, pos[queries], layer), self.rope(k, pos, layer)
        scale = np.float32(1.0 / np.sqrt(hp.head_dim))
        if hp.arch == "gemma3":  # the query is scaled before the attention, which then scales by 1
            q, scale = q * scale, np.float32(1.0)
        if kv_scale is not None:
            rows, fk, fv = kv_scale
            k[rows] *= fk[None, :, None]
            v[rows] *= fv[None, :, None]
        group = hp.n_head // hp.n_head_kv
        allowed = pos[None, :] <= pos[queries][:, None]
        if hp.is_swa(layer):  # a windowed layer sees the n_swa positions up to the query's
            allowed &= pos[queries][:, None] - pos[None, :] < hp.n_swa
        if visible is not None:
            allowed &= visible[None, :] | (np.arange(n)[None, :] == queries[:, None])
        mask = np.where(allowed, np.float32(0), np.float32(-np.inf))
        out = np.empty((len(queries), hp.n_head, hp.head_dim), np.float32)
        for head in range(hp.n_head):
            kv = head // group
            s = (q[:, head] @ k[:, kv].T) * scale + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            prob = s / s.sum(axis=1, keepdims=True)
            if weights is not None:
                weights += prob
            out[:, head] = prob @ v[:, kv]
        return self.linear(out.reshape(len(queries), -1), p + "attn_output")

    @staticmethod
    def gelu(x: np.ndarray) -> np.ndarray:
        """ggml's CPU GELU: the tanh form, looked up for the half-precision input, in half precision."""
        x16 = x.astype(np.float16).astype(np.float32)
        g = np.float32(0.5) * x16 * (np.float32(1) + np.tanh(np.float32(0.7978845608028654) * x16 *
                                                             (np.float32(1) + np.float32(0.044715) * x16 * x16)))
        g = g.astype(np.float16).astype(np.float32)
        return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, g)).astype(np.float32)

    def ffn(self, layer: int, h: np.ndarray) -> np.ndarray:
        p = f"blk.{layer}."
        gate = self.linear(h, p + "ffn_gate")
        act = self.gelu(gate) if self.hp.arch == "gemma3" else gate / (np.float32(1.0) + np.exp(-gate))
        return self.linear(act * self.linear(h, p + "ffn_up"), p + "ffn_down")

    def post_norm(self, layer: int, y: np.ndarray, which: str) -> np.ndarray:
        """gemma3's norm on a mixer's or an MLP's output (which: post_attention_norm, post_ffw_norm)."""
        w = self.w(f"blk.{layer}.{which}.weight")
        return y if w is None else self.rms(y, w)

    def mlp(self, layer: int, y: np.ndarray) -> np.ndarray:
        """The residual stream y after the mixer through the MLP and its residual."""
        h = self.rms(y, self.w(f"blk.{layer}.ffn_norm.weight"))
        return y + self.post_norm(layer, self.ffn(layer, h), "post_ffw_norm")

    # -- whole model ------------------------------------------------------------------------

    def layer(self, layer: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        p = f"blk.{layer}."
        att = self.attention(layer, self.rms(x, self.w(p + "attn_norm.weight")), pos)
        return self.mlp(layer, x + self.post_norm(layer, att, "post_attention_norm"))

    def logits(self, x: np.ndarray) -> np.ndarray:
        out = self.w("output.weight")
        out = self.w("token_embd.weight") if out is None else out
        return self.rms(x, self.w("output_norm.weight")) @ out.T

    # -- RidgeFill's pieces ------------------------------------------------------------------------

    def _early(self, tokens: list[int], split: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, x_S): every row through the layers below the split."""
        pos = np.arange(len(tokens))
        x = self.embed(tokens)
        for layer in range(split):
            x = self.layer(layer, x, pos)
        return pos, x

    @staticmethod
    def _predicted(layer: int, split: int, x_split: np.ndarray, fill: str, maps, truth=None) -> np.ndarray:
        """The input layer `layer` gets for rows whose x_S is given: A_l x_S + b_l (ridge, after the split), x_S
        (identity, and ridge at the split) or the true input (oracle; `truth` holds it for those rows)."""
        if fill == "ridge" and layer > split:
            a, b = maps[layer]
            return x_split @ a.T + b
        return truth if fill == "oracle" else x_split

    def _late_layer(self, layer: int, x: np.ndarray, inp: np.ndarray, pos: np.ndarray, rows: np.ndarray,
                    **attention) -> np.ndarray:
        """Layer `layer` for `rows` (their stream in x) over every row's K/V from `inp`; the other rows of x stay."""
        p = f"blk.{layer}."
        att = self.attention(layer, self.rms(inp, self.w(p + "attn_norm.weight")), pos, queries=rows, **attention)
        y = x[rows] + self.post_norm(layer, att, "post_attention_norm")
        x = x.copy()
        x[rows] = self.mlp(layer, y)
        return x

    def ridgefill_forward(self, tokens: list[int], split: int, tail: int, fill: str = "ridge",
                          maps: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
                          exact_rows: set[int] | None = None, rescale: tuple[int, bool, bool] | None = None
                          ) -> np.ndarray:
        """The RidgeFill arm (paper §2.1), row-exact: logits of the tail rows.

        Layers below `split` run every row. From `split` on, prefix rows that are not exact (row 0 always is)
        only write K/V, from a predicted input: A_l x_S + b_l (fill="ridge", l > split; layer `split` reads
        x_S), x_S ("identity"), the true input ("oracle"), or nothing, hidden from later rows ("none").
        The tail and the exact rows run every layer over that cache. rescale = (c, values, keys): in each late layer
        after the split, per KV head, the mean norm of V (K) of the tail's first c rows from their true input over
        the one from their prediction scales the filled rows' V (K) (paper §2.3)."""
        if fill not in ("ridge", "identity", "oracle", "none"):
            raise ValueError(f"fill must be ridge, identity, oracle or none, not {fill!r}")
        n = len(tokens)
        exact = np.zeros(n, bool)
        exact[max(n - tail, 0):] = True
        exact[0] = True
        for r in exact_rows or ():
            exact[r] = True
        filled = ~exact
        truth = self.forward(tokens)[1] if fill == "oracle" else None
        pos, x = self._early(tokens, split)
        x_split = x
        rows = np.flatnonzero(exact)
        for layer in range(split, self.hp.n_layer):
            inp = x.copy()  # exact rows carry their own stream; filled rows get the prediction
            if fill != "none":
                inp[filled] = self._predicted(layer, split, x_split[filled], fill, maps,
                                              truth[layer][filled] if truth is not None else None)
            kv_scale = None
            if rescale and layer > split and fill in ("ridge", "identity"):
                c, values, keys = rescale
                first = np.arange(max(n - tail, 0), n)[:c]
                norm = self.w(f"blk.{layer}.attn_norm.weight")
                kt, vt = self.kv(layer, self.rms(x[first], norm), pos[first])
                kp, vp = self.kv(layer, self.rms(self._predicted(layer, split, x_split[first], fill, maps), norm),
                                 pos[first])
                ratio = lambda t, q: np.linalg.norm(t, axis=2).mean(0) / np.linalg.norm(q, axis=2).mean(0)  # noqa: E731
                ones = np.ones(self.hp.n_head_kv, np.float32)
                kv_scale = (filled, ratio(kt, kp).astype(np.float32) if keys else ones,
                            ratio(vt, vp).astype(np.float32) if values else ones)
            x = self._late_layer(layer, x, inp, pos, rows, visible=exact if fill == "none" else None,
                                 kv_scale=kv_scale)
        return self.logits(x[max(n - tail, 0):])

    def probe_scores(self, tokens: list[int], split: int, tail: int, n_probe: int,
                     maps: dict[int, tuple[np.ndarray, np.ndarray]], blind: bool = False,
                     exact: set[int] | frozenset[int] = frozenset()) -> np.ndarray:
        """The probe's ranking (paper §2.4) as the engine computes it, for fill="ridge": per row, the attention
        the last n_probe rows pay it, summed over their rows, the heads and the late layers. In each late layer the
        prefix rows other than row 0 hold their predicted K/V, row 0 runs exactly, and the probe rows run exactly
        over that cache with the tail's other rows hidden. blind: the probe rows are the prefix's last rows (exact
        in this pass), and the tail is hidden. exact: prefix rows that also run exactly in this pass (the lexical
        net's, chosen before the probe)."""
        n = len(tokens)
        prefix_end = max(n - tail, 0)
        end = prefix_end if blind else n
        probe = np.arange(end - n_probe, end)
        filled = np.zeros(n, bool)
        filled[1:prefix_end] = True
        filled[probe] = False
        known = sorted(r for r in exact if 0 < r < prefix_end and r not in set(probe.tolist()))
        filled[known] = False
        visible = np.ones(n, bool)
        visible[prefix_end:] = False
        visible[probe] = True
        rows = np.concatenate([[0], known, probe]).astype(int)
        pos, x = self._early(tokens, split)
        x_split = x
        score = np.zeros(n)
        for layer in range(split, self.hp.n_layer):
            inp = x.copy()
            inp[filled] = self._predicted(layer, split, x_split[filled], "ridge", maps)
            w = np.zeros((len(rows), n))
            x = self._late_layer(layer, x, inp, pos, rows, visible=visible, weights=w)
            score += w[len(rows) - len(probe):].sum(axis=0)
        return score

    def attention_scores(self, tokens: list[int], layers: list[int], n_query: int, end: int | None = None) -> np.ndarray:
        """The attention selector's ranking (paper §2.4): per row, the attention the n_query rows before `end`
        (default: the prompt's last rows) pay it in the exact forward, summed over those rows, the heads and the
        given layers."""
        n = len(tokens)
        pos = np.arange(n)
        end = n if end is None else end
        queries = np.arange(max(end - n_query, 0), end)
        x = self.embed(tokens)
        score = np.zeros(n)
        for layer in range(max(layers) + 1):
            if layer in layers:
                w = np.zeros((len(queries), n))
                self.attention(layer, self.rms(x, self.w(f"blk.{layer}.attn_norm.weight")), pos, queries=queries,
                               weights=w)
                score += w.sum(axis=0)
            x = self.layer(layer, x, pos)
        return score

    def forward(self, tokens: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """(logits [n, n_vocab], every layer's input [n, d]) for one sequence from position 0."""
        pos = np.arange(len(tokens))
        x = self.embed(tokens)
        inputs = []
        for layer in range(self.hp.n_layer):
            inputs.append(x)
            x = self.layer(layer, x, pos)
        return self.logits(x), inputs
