"""The RidgeFill arm on the hybrid qwen35 and qwen3next architectures, in NumPy, over the stock `HybridReference`.

Layers [0, S) run every row exactly (with a cache, as stock). From S on, each prefix row is either filled (its
layer-l input is predicted from x_S: A_l x_S + b_l for "ridge" at l > S, x_S itself for "identity" and at l = S,
the true input for "oracle") or exact (row 0 always, and the given rows); the tail (the prompt's last T rows) is
always exact. Per late layer:
  - attention: every row writes K/V from its input (filled: the prediction; exact: its own stream), filled rows'
    V optionally scaled per KV head (the value rescale); exact prefix rows and the tail attend over that cache;
  - Gated DeltaNet: the conv and recurrent states are carried once over the prefix rows in position order, from
    the prediction on filled rows and the true input on exact rows; only exact rows go through the gated norm and
    ssm_out; the tail continues the carried states.
Exact rows then add the FFN; filled rows never need a layer output (the next layer predicts again from x_S).
The probe (which filled rows to make exact) runs the prompt's last n_probe rows through the late layers over the
filled cache, before any prefix row runs exactly: attention layers read every prefix row's K/V from its prediction
(row 0 and the given exact rows too) and the probe rows' own (the tail's other rows hidden); DeltaNet layers start
the probe rows from an empty conv and recurrent state and write nothing back. A prefix row's score is the attention
the probe rows pay it, summed over the late attention layers, heads and probe rows. Each late layer runs the
prefix, then the probe, then the tail; only the probe reads the filled K/V of the exact rows. The probe refuses the rescale (the
engine's probe reads the unscaled fill), and the rescale acts on layers after S only, as in reference.py.
The terminal-state correction (state_deltas) adds rho x the layer's offset to a late DeltaNet layer's state at the
prefix's end, rho being per value head the filled rows' share of the state (a row's weight: the product of the gates
after it within the prefix). Everything is float64; with fill="oracle", or every prefix row exact, the arm is the
stock forward.
"""
from __future__ import annotations

import numpy as np

from .reference_hybrid import HybridCache, HybridReference

Maps = dict[int, tuple[np.ndarray, np.ndarray]]
FILLS = ("ridge", "identity", "oracle")


def stock_forward(ref: HybridReference, tokens: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """(logits [n, n_vocab], every layer's input [n, d]) of the stock forward, kept in float64 (ref.forward rounds
    both to float32)."""
    pos = np.arange(len(tokens))
    x, inputs = ref.w("token_embd.weight")[np.asarray(tokens)], []
    for layer in range(ref.hp.n_layer):
        inputs.append(x)
        x = ref.layer(layer, x, pos)
    return ref.logits(x), inputs


def attention_probabilities(ref: HybridReference, q: np.ndarray, pos: np.ndarray, k: np.ndarray,
                            kv_pos: np.ndarray) -> np.ndarray:
    """The causal softmax [n_head, n, m] that `ref.attend` applies: q [n, n_head, hd] over k [m, n_head_kv, hd]."""
    hp = ref.hp
    kh = np.arange(hp.n_head) // (hp.n_head // hp.n_head_kv)
    s = np.einsum("nhd,mhd->hnm", q, k[:, kh]) / np.sqrt(hp.head_dim)
    s = np.where(kv_pos[None, None, :] <= pos[None, :, None], s, -np.inf)
    s = np.exp(s - s.max(axis=2, keepdims=True))
    return s / s.sum(axis=2, keepdims=True)


class HybridRidgeFill:
    """The arm for one (split, tail, fill, maps, rescale); `forward` runs it on a prompt. The methods are the
    seams the tests' wrong variants override."""

    def __init__(self, ref: HybridReference, split: int, tail: int, fill: str = "ridge", maps: Maps | None = None,
                 rescale_rows: int = 0, rescale_values: bool = False,
                 state_deltas: dict[int, np.ndarray] | None = None):
        if fill not in FILLS:
            raise ValueError(f"fill must be one of {FILLS}, not {fill!r}")
        if fill == "ridge" and any(layer not in (maps or {}) for layer in range(split + 1, ref.hp.n_layer)):
            raise ValueError(f"fill=ridge needs maps for layers {split + 1}..{ref.hp.n_layer - 1}")
        self.ref, self.split, self.tail, self.fill, self.maps = ref, split, tail, fill, maps
        self.rescale = rescale_rows if rescale_values and fill != "oracle" else 0
        self.state_deltas = state_deltas or {}  # the terminal-state correction's offsets, by late DeltaNet layer

    # -- the seams --------------------------------------------------------------------------------

    def predicted(self, layer: int, x_split: np.ndarray, truth: np.ndarray | None) -> np.ndarray:
        """A filled row's layer input from its x_S: A_l x_S + b_l (ridge, l > S), x_S (identity; ridge at S), or
        its true input (oracle; `truth` holds it)."""
        if self.fill == "oracle":
            return truth
        if self.fill == "ridge" and layer > self.split:
            a, b = self.maps[layer]
            return x_split @ np.asarray(a, np.float64).T + np.asarray(b, np.float64)
        return x_split

    def layer_input(self, layer: int, x: np.ndarray, x_split: np.ndarray, filled: np.ndarray,
                    truth: list[np.ndarray] | None) -> np.ndarray:
        """Every row's input to late layer `layer`: the prediction on filled rows, the row's own stream elsewhere."""
        inp = x.copy()
        inp[filled] = self.predicted(layer, x_split[filled], None if truth is None else truth[layer][filled])
        return inp

    def carry(self, layer: int, h: np.ndarray, out_rows: np.ndarray, conv: np.ndarray | None,
              state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The DeltaNet layer over normalized rows h in position order, from (conv, state) (None: empty):
        (the output [len(out_rows), d] of out_rows only, through the gated norm and ssm_out; conv; state)."""
        ref = self.ref
        qkv, z, beta, log_decay = ref.gdn_projections(layer, h)
        mixed, conv = ref.conv(layer, qkv, conv)
        q, k, v = ref.split_qkv(mixed)
        o, state = ref.delta_rule(q, k, v, log_decay, beta, state)
        out = ref.linear(ref.gated_norm(layer, o[out_rows], z[out_rows]), f"blk.{layer}.ssm_out")
        return out, conv, state

    def probe_state(self, cache: HybridCache, layer: int) -> tuple[None, None]:
        """The DeltaNet states the probe rows start from (the cache holds the prefix's carried ones): empty."""
        return None, None

    def probe_end(self, cache: HybridCache, layer: int, conv: np.ndarray, state: np.ndarray) -> None:
        """What the probe does with its final DeltaNet states: nothing; the cache keeps the prefix's."""

    def value_factors(self, layer: int, x_first: np.ndarray, x_split_first: np.ndarray) -> np.ndarray:
        """Per KV head: mean |V| of the tail's first c rows from their true input over mean |V| from their
        prediction (the value rescale)."""
        ref, norm = self.ref, self.ref.w(f"blk.{layer}.attn_norm.weight")
        pos = np.zeros(len(x_first), int)  # V carries no RoPE
        v_true = ref.kv(layer, ref.rms(x_first, norm), pos)[1]
        v_pred = ref.kv(layer, ref.rms(self.predicted(layer, x_split_first, None), norm), pos)[1]
        return np.linalg.norm(v_true, axis=2).mean(0) / np.linalg.norm(v_pred, axis=2).mean(0)

    # -- one late layer ---------------------------------------------------------------------------

    def _ffn(self, layer: int, x: np.ndarray, out: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The stream after layer `layer` for `rows` (their mixer output in out); the other rows stay."""
        y = x[rows] + out
        x = x.copy()
        x[rows] = y + self.ref.ffn(layer, self.ref.rms(y, self.ref.w(f"blk.{layer}.post_attention_norm.weight")))
        return x

    def _deltanet_prefix(self, layer: int, h: np.ndarray, exact: np.ndarray, p: int, cache: HybridCache,
                         info: dict) -> np.ndarray:
        """The carry over the prefix rows, left in the cache: the outputs of the exact prefix rows."""
        out, cache.conv[layer], cache.state[layer] = self.carry(layer, h[:p], np.flatnonzero(exact[:p]), None, None)
        if layer in self.state_deltas and self.fill != "oracle" and not exact[:p].all():
            rho = info["rho"][layer] = self.filled_share(self.ref.gdn_projections(layer, h[:p])[3], ~exact[:p])
            cache.state[layer] = cache.state[layer] + rho[:, None, None] * self.state_deltas[layer]
        info["prefix_states"][layer] = (cache.conv[layer], cache.state[layer])
        return out

    @staticmethod
    def filled_share(log_decay: np.ndarray, filled: np.ndarray) -> np.ndarray:
        """rho per value head: the filled rows' share of the state at the prefix's end, a row's weight being the
        product of the gates after it (log_decay [p, n_v_heads])."""
        after = np.concatenate([np.cumsum(log_decay[::-1], axis=0)[::-1][1:], np.zeros((1, log_decay.shape[1]))])
        w = np.exp(after)
        return w[filled].sum(axis=0) / w.sum(axis=0)

    def _deltanet_tail(self, layer: int, h: np.ndarray, p: int, cache: HybridCache) -> np.ndarray:
        """The tail rows continuing the cache's carried states (updated): their outputs."""
        out, cache.conv[layer], cache.state[layer] = self.carry(layer, h[p:], np.arange(len(h) - p),
                                                                cache.conv[layer], cache.state[layer])
        return out

    def _write_kv(self, layer: int, h: np.ndarray, x: np.ndarray, x_split: np.ndarray, exact: np.ndarray,
                  p: int, cache: HybridCache, info: dict) -> None:
        """Every row's K/V into the cache, filled rows' V times the value factors when the rescale is on."""
        k, v = self.ref.kv(layer, h, np.arange(len(h)))
        info["fill_v"][layer] = v.copy()
        if self.rescale and layer > self.split:
            first = np.arange(p, len(h))[: self.rescale]
            factors = info["value_factors"][layer] = self.value_factors(layer, x[first], x_split[first])
            v[~exact] *= factors[None, :, None]
        cache.k[layer], cache.v[layer] = k, v

    def _attend(self, layer: int, h: np.ndarray, rows: np.ndarray, cache: HybridCache) -> np.ndarray:
        """The exact rows (normalized inputs h[rows]) over the cache's K/V: their outputs."""
        q, gate = self.ref.query(layer, h[rows], rows)
        return self.ref.attend(layer, q, gate, rows, cache.k[layer], cache.v[layer], np.arange(len(h)))

    def _probe(self, layer: int, xq: np.ndarray, probe: np.ndarray, p: int, cache: HybridCache,
               score: np.ndarray, x_split: np.ndarray) -> np.ndarray:
        """The probe rows (stream xq) through layer `layer` over the prefix's filled K/V, which they only read:
        their stream after it. Their attention to the prefix rows is added to `score`."""
        ref, idx = self.ref, np.arange(len(probe))
        h = ref.rms(xq, ref.w(f"blk.{layer}.attn_norm.weight"))
        if ref.hp.recurrent[layer]:
            out, conv, state = self.carry(layer, h, idx, *self.probe_state(cache, layer))
            self.probe_end(cache, layer, conv, state)
            return self._ffn(layer, xq, out, idx)
        q, gate = ref.query(layer, h, probe)
        kq, vq = ref.kv(layer, h, probe)
        filled = ref.rms(self.predicted(layer, x_split[:p], None), ref.w(f"blk.{layer}.attn_norm.weight"))
        kf, vf = ref.kv(layer, filled, np.arange(p))
        k, v = np.concatenate([kf, kq]), np.concatenate([vf, vq])
        kv_pos = np.concatenate([np.arange(p), probe])  # the tail's other rows hidden
        score += attention_probabilities(ref, q, probe, k, kv_pos)[:, :, :p].sum(axis=(0, 1))
        return self._ffn(layer, xq, ref.attend(layer, q, gate, probe, k, v, kv_pos), idx)

    # -- the whole arm ----------------------------------------------------------------------------

    def forward(self, tokens: list[int], exact_rows=(), n_probe: int = 0) -> tuple[np.ndarray, dict]:
        """(logits of the tail rows [T, n_vocab], info). info: "cache" (a HybridCache after the whole prompt:
        every layer's K/V or conv and recurrent state, n_past = n), "prefix_states" ({late DeltaNet layer: (conv,
        state) after the prefix}), "inputs" ({late layer: every row's input}), "fill_v" ({late attention layer: V
        before the rescale}), "value_factors", "exact" (row mask), and with n_probe > 0 "probe_scores" [prefix]."""
        ref, n = self.ref, len(tokens)
        if n_probe and self.rescale:
            raise ValueError("the probe reads the unscaled fill: run it without the rescale")
        if n_probe and self.fill == "oracle":
            raise ValueError("the probe reads the filled cache: the oracle has none")
        if not 0 <= n_probe <= min(self.tail, n):
            raise ValueError(f"n_probe must be within the tail, not {n_probe}")
        p = max(n - self.tail, 0)
        exact = np.zeros(n, bool)
        exact[p:] = exact[0] = True
        exact[list(exact_rows)] = True
        truth = stock_forward(ref, tokens)[1] if self.fill == "oracle" else None
        cache, pos = HybridCache(), np.arange(n)
        x = ref.w("token_embd.weight")[np.asarray(tokens)]
        for layer in range(self.split):
            x = ref.layer(layer, x, pos, cache)
        cache.n_past = n
        x_split, rows, probe = x, np.flatnonzero(exact), np.arange(n - n_probe, n)
        xq, score = x_split[probe], np.zeros(p)
        info = {"cache": cache, "exact": exact, "inputs": {}, "prefix_states": {}, "fill_v": {}, "value_factors": {},
                "rho": {}}
        for layer in range(self.split, ref.hp.n_layer):  # each: the prefix, the probe, then the tail
            inp = info["inputs"][layer] = self.layer_input(layer, x, x_split, ~exact, truth)
            h = ref.rms(inp, ref.w(f"blk.{layer}.attn_norm.weight"))
            if ref.hp.recurrent[layer]:
                out = self._deltanet_prefix(layer, h, exact, p, cache, info)
            else:
                self._write_kv(layer, h, x, x_split, exact, p, cache, info)
            if n_probe:
                xq = self._probe(layer, xq, probe, p, cache, score, x_split)
            if ref.hp.recurrent[layer]:
                out = np.concatenate([out, self._deltanet_tail(layer, h, p, cache)])
            else:
                out = self._attend(layer, h, rows, cache)
            x = self._ffn(layer, x, out, rows)
        if n_probe:
            info["probe_scores"] = score
        return ref.logits(x[p:]), info


def hybrid_ridgefill_forward(ref: HybridReference, tokens: list[int], split: int, tail: int, fill: str = "ridge",
                             maps: Maps | None = None, exact_rows=(), rescale_rows: int = 0,
                             rescale_values: bool = False,
                             state_deltas: dict[int, np.ndarray] | None = None) -> tuple[np.ndarray, dict]:
    """The hybrid RidgeFill arm: (logits of the tail rows [T, n_vocab] float64, info as HybridRidgeFill.forward).
    state_deltas: the terminal-state correction, rho x the offset added to each listed late DeltaNet layer's state
    at the prefix's end."""
    arm = HybridRidgeFill(ref, split, tail, fill, maps, rescale_rows, rescale_values, state_deltas)
    return arm.forward(tokens, exact_rows)


def hybrid_probe_scores(ref: HybridReference, tokens: list[int], split: int, tail: int, n_probe: int,
                        maps: Maps, exact_rows=()) -> np.ndarray:
    """The probe's score of every prefix row [n - tail] (fill=ridge; exact: row 0 and `exact_rows`, where the
    caller lists the special tokens): the attention the prompt's last n_probe rows pay it in the late attention
    layers, summed over those layers, the heads and the probe rows. Rank only the filled rows by it."""
    return HybridRidgeFill(ref, split, tail, "ridge", maps).forward(tokens, exact_rows, n_probe)[1]["probe_scores"]
