"""Random-weight GGUF models that the vendored llama.cpp loads and runs.

Weights are random but the tokenizer is real: every ``tokenizer.*`` key is copied from one
of llama.cpp's ``models/ggml-vocab-*.gguf`` files, so real text tokenizes as it would with
the real model. Keys, tensor names and shapes follow ``src/models/{llama,qwen2,qwen3,qwen35}.cpp``
of the vendored llama.cpp; ``ModelShape`` can describe tiny test models as well as the exact
shapes of real ones, and tensors are generated and written in row chunks so big shapes never
sit in memory whole.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT, Keys

from .gguf_io import GGUFFile, RawField, read_gguf
from .kquants import quantize_q4_k, quantize_q6_k
from .paths import vendor_dir

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen35", "qwen3next", "gemma3")
HYBRID_ARCHS = ("qwen35", "qwen3next")  # Gated DeltaNet layers beside gated attention
QK_NORM_ARCHS = ("qwen3", "gemma3", *HYBRID_ARCHS)

DEFAULT_VOCABS = {
    "llama": "ggml-vocab-llama-bpe.gguf",
    "qwen2": "ggml-vocab-qwen2.gguf",
    "qwen3": "ggml-vocab-qwen2.gguf",
    "qwen35": "ggml-vocab-qwen35.gguf",
    "qwen3next": "ggml-vocab-qwen2.gguf",
    "gemma3": "ggml-vocab-gemma-4.gguf",  # the vendored Gemma tokenizer (262,144 tokens)
}

DTYPES = {"f32": (QT.F32, gguf.LlamaFileType.ALL_F32),
          "f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
          "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
          # llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the output and for attn_v and ffn_down in some layers
          "q4_k_m": (QT.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M)}

_CHUNK_ELEMS = 1 << 24  # rows are generated in chunks of about this many values (64 MiB of f32)


@dataclass(frozen=True)
class ModelShape:
    """Hyperparameters of one model; names follow llama.cpp's hparams."""

    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    n_rot: int | None = None          # rotary dims; None = head_dim (qwen35 rotates head_dim/4)
    n_vocab: int | None = None        # None = the tokenizer's size; more pads it with [PAD{i}] tokens
    tie_embeddings: bool = False      # no output.weight: llama.cpp reuses token_embd
    # qwen35 only: Gated DeltaNet layers, with full attention on every full_attention_interval-th
    full_attention_interval: int = 4
    rope_sections: tuple[int, int, int, int] = (11, 11, 10, 0)  # IMRoPE sections, in rotary pairs
    ssm_d_conv: int = 4
    ssm_d_state: int = 128            # head_k_dim; llama.cpp also takes it as head_v_dim
    ssm_n_group: int = 16             # number of key heads
    ssm_dt_rank: int = 32             # number of value heads
    # qwen3next only: a mixture of experts in every layer, beside one shared expert
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    # gemma3 only: sliding-window layers (window n_swa) with full attention on every swa_pattern-th, their RoPE base
    n_swa: int = 0
    swa_pattern: int = 6
    rope_theta_swa: float = 10000.0

    @classmethod
    def from_gguf(cls, model: str | Path | GGUFFile) -> "ModelShape":
        """The shape of a model GGUF, or of its parsed header (qwen35's recurrent settings too)."""
        g = model if isinstance(model, GGUFFile) else read_gguf(model, skip_arrays=("tokenizer.",))
        arch = g.get("general.architecture")
        get = lambda k, d=None: g.get(f"{arch}.{k}", d)  # noqa: E731
        n_embd, n_head = int(get("embedding_length")), int(get("attention.head_count"))
        n_rot = get("rope.dimension_count")
        recurrent = {}
        if arch in HYBRID_ARCHS:
            recurrent = dict(full_attention_interval=int(get("full_attention_interval", 4)),
                             rope_sections=tuple(int(x) for x in get("rope.dimension_sections", (11, 11, 10, 0))),
                             ssm_d_conv=int(get("ssm.conv_kernel")), ssm_d_state=int(get("ssm.state_size")),
                             ssm_n_group=int(get("ssm.group_count")), ssm_dt_rank=int(get("ssm.time_step_rank")))
        if arch == "gemma3":
            pattern = get("attention.sliding_window_pattern", 6)
            recurrent.update(n_swa=int(get("attention.sliding_window", 0)),
                             swa_pattern=pattern if isinstance(pattern, int) else 6,
                             rope_theta_swa=float(get("rope.freq_base_swa", 10000.0)))
        if get("expert_count"):
            recurrent.update(n_expert=int(get("expert_count")), n_expert_used=int(get("expert_used_count")),
                             n_ff_exp=int(get("expert_feed_forward_length")),
                             n_ff_shexp=int(get("expert_shared_feed_forward_length", 0)))
        return cls(arch, int(get("block_count")), n_embd, int(get("feed_forward_length")), n_head,
                   int(get("attention.head_count_kv", n_head)), int(get("attention.key_length", n_embd // n_head)),
                   n_ctx_train=int(get("context_length", 4096)), rope_theta=float(get("rope.freq_base", 10000.0)),
                   rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
                   n_rot=None if n_rot is None else int(n_rot), **recurrent)

    @property
    def rot_dims(self) -> int:
        return self.head_dim if self.n_rot is None else self.n_rot

    @property
    def head_v_dim(self) -> int:
        # qwen35.cpp sizes value heads with ssm_d_state when loading and with
        # ssm_d_inner / ssm_dt_rank in the graph, so the two must agree
        return self.ssm_d_state

    @property
    def ssm_d_inner(self) -> int:
        return self.head_v_dim * self.ssm_dt_rank

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """A Gated DeltaNet layer's recurrent state in NumPy order ([n_v_heads, head_v_dim, head_k_dim]), as
        llama.cpp lays it out and blk.N.rf_state_delta holds it."""
        return (self.ssm_dt_rank, self.head_v_dim, self.ssm_d_state)

    def is_recurrent(self, il: int) -> bool:
        return self.arch in HYBRID_ARCHS and (il + 1) % self.full_attention_interval != 0

    def is_swa(self, il: int) -> bool:
        """A sliding-window layer (llama_hparams::set_swa_pattern, not dense first)."""
        return self.n_swa > 0 and (self.swa_pattern == 0 or il % self.swa_pattern < self.swa_pattern - 1)

    def validate(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ValueError(f"invalid {self.arch} shape: {what}")

        need(self.arch in SUPPORTED_ARCHS, f"arch must be one of {SUPPORTED_ARCHS}")
        need(min(self.n_layer, self.n_embd, self.n_ff, self.n_head, self.n_head_kv, self.head_dim) > 0,
             "sizes must be positive")
        need(self.n_head % self.n_head_kv == 0, "n_head must be a multiple of n_head_kv")
        need(self.rot_dims % 2 == 0 and self.rot_dims <= self.head_dim, "n_rot must be even and <= head_dim")
        if self.arch in ("llama", "qwen2", "qwen3"):
            need(self.rot_dims == self.head_dim, "n_rot must equal head_dim")  # asserted by the graphs
        if self.arch == "qwen2":
            need(self.n_head * self.head_dim == self.n_embd, "n_head * head_dim must equal n_embd")
        if self.arch == "qwen3next":
            need(0 < self.n_expert_used <= self.n_expert and self.n_ff_exp > 0 and self.n_ff_shexp > 0,
                 "experts: 0 < n_expert_used <= n_expert, n_ff_exp and n_ff_shexp > 0")
        if self.arch == "gemma3":
            need(self.n_swa >= 0 and self.swa_pattern >= 0, "n_swa and swa_pattern must not be negative")
        if self.arch in HYBRID_ARCHS:
            need(self.full_attention_interval > 0, "full_attention_interval must be positive")
            need(len(self.rope_sections) == 4 and any(self.rope_sections)
                 and 2 * sum(self.rope_sections) <= self.rot_dims, "rope_sections must fit in n_rot/2")
            need(self.ssm_dt_rank % self.ssm_n_group == 0, "ssm_dt_rank must be a multiple of ssm_n_group")


def tiny_shape(arch: str) -> ModelShape:
    """A few-MB model of the given arch for unit tests (the vocab still comes from the vocab file)."""
    common = dict(arch=arch, n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16, n_ctx_train=2048)
    if arch == "llama":
        return ModelShape(**common, rope_theta=500000.0, rms_eps=1e-5)
    if arch == "qwen2":
        return ModelShape(**common, rope_theta=1000000.0)
    if arch == "qwen3":  # head_dim * n_head != n_embd, as in real Qwen3
        return ModelShape(**{**common, "head_dim": 32}, rope_theta=1000000.0)
    if arch == "qwen35":  # 3 Gated DeltaNet layers then 1 attention layer, 4 value heads over 2 key heads
        return ModelShape(**{**common, "n_layer": 4, "head_dim": 32}, rope_theta=10000000.0, n_rot=8,
                          full_attention_interval=4, rope_sections=(2, 1, 1, 0),
                          ssm_d_conv=4, ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4)
    if arch == "qwen3next":  # the same layers, with a mixture of 4 experts (2 used) and a shared one
        return dataclasses.replace(tiny_shape("qwen35"), arch=arch, n_rot=16, n_expert=4, n_expert_used=2,
                                   n_ff_exp=32, n_ff_shexp=48)
    if arch == "gemma3":  # two windowed layers then a global one, twice; a window a short prompt outgrows
        return ModelShape(**{**common, "n_layer": 6, "head_dim": 32}, rope_theta=1000000.0, tie_embeddings=True,
                          n_swa=32, swa_pattern=3, rope_theta_swa=10000.0)
    raise ValueError(f"unsupported arch {arch!r}; expected one of {SUPPORTED_ARCHS}")


# Real models' shapes, for timing (speed does not depend on the weights' values). Sources: the models'
# config.json (hidden_size, intermediate_size, num_hidden_layers, heads, head_dim, vocab_size, rope_theta).
REAL_SHAPES = {
    "qwen3-8b": ModelShape("qwen3", n_layer=36, n_embd=4096, n_ff=12288, n_head=32, n_head_kv=8, head_dim=128,
                           n_ctx_train=40960, rope_theta=1000000.0, rms_eps=1e-6, n_vocab=151936),
    "llama-3.1-8b": ModelShape("llama", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, head_dim=128,
                               n_ctx_train=131072, rope_theta=500000.0, rms_eps=1e-5, n_vocab=128256),
    # a 27B hybrid as the paper's deployment describes it (64 layers, d 5120, every fourth layer attention), its
    # other sizes those of Qwen3.5-27B as we recorded them: 24 query and 4 KV heads of 256 with a quarter of each
    # rotated, a 17,408-wide MLP, DeltaNet layers of 16 key and 48 value heads of 128 and a 4-wide conv
    "qwen35-27b": ModelShape("qwen35", n_layer=64, n_embd=5120, n_ff=17408, n_head=24, n_head_kv=4, head_dim=256,
                             n_ctx_train=262144, rope_theta=10000000.0, rms_eps=1e-6, n_rot=64,
                             full_attention_interval=4, rope_sections=(11, 11, 10, 0), ssm_d_conv=4,
                             ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=48, n_vocab=248320),
    # Qwen3-Next-80B-A3B's layers (48, d 2048, attention every fourth of 16 query and 2 KV heads of 256 with a
    # quarter rotated, DeltaNet layers of 16 key and 32 value heads of 128, 10 experts of 512 used per token beside a
    # shared one of 512) with 64 of its 512 experts, so that the random file (11.9 GiB in Q8_0) is written in a
    # call: a prefill reads every expert's weights once per batch, so this shape under-counts that part
    "qwen3next-80b-e64": ModelShape("qwen3next", n_layer=48, n_embd=2048, n_ff=5120, n_head=16, n_head_kv=2,
                                    head_dim=256, n_ctx_train=262144, rope_theta=10000000.0, rms_eps=1e-6, n_rot=64,
                                    full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16,
                                    ssm_dt_rank=32, n_expert=64, n_expert_used=10, n_ff_exp=512, n_ff_shexp=512,
                                    n_vocab=151936),
    # Gemma-3-12B's layers (48, d 3840, 16 query and 8 KV heads of 256, a 15,360-wide GELU MLP, five windowed layers
    # of 1,024 to each global one, local RoPE base 1e4, global 1e6, tied embeddings) and Gemma-3-270M's
    "gemma3-12b": ModelShape("gemma3", n_layer=48, n_embd=3840, n_ff=15360, n_head=16, n_head_kv=8, head_dim=256,
                             n_ctx_train=131072, rope_theta=1000000.0, rms_eps=1e-6, n_vocab=262208,
                             tie_embeddings=True, n_swa=1024, swa_pattern=6, rope_theta_swa=10000.0),
    "gemma3-270m": ModelShape("gemma3", n_layer=18, n_embd=640, n_ff=2048, n_head=4, n_head_kv=1, head_dim=256,
                              n_ctx_train=32768, rope_theta=1000000.0, rms_eps=1e-6, n_vocab=262144,
                              tie_embeddings=True, n_swa=512, swa_pattern=6, rope_theta_swa=10000.0),
}


# ---------------------------------------------------------------------------------------------
# tensor layout

@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: the reverse of llama.cpp's ggml {ne0, ne1}
    init: str               # "embed" | "linear" | "residual" | "norm" | "bias" | "ssm_a" | "dt_bias"
    float_only: bool        # kept F32 whatever the dtype, as convert_hf_to_gguf.py does

    @property
    def fan_in(self) -> int:
        return self.shape[-1]


def _spec(name: str, ne: tuple[int, ...], init: str) -> TensorSpec:
    """ne is written exactly as in the create_tensor calls of llama.cpp, to check them side by side."""
    float_only = len(ne) < 2 or not name.endswith(".weight") or name.endswith("_norm.weight") \
        or ".ssm_conv1d." in name  # ggml_ssm_conv takes only F32
    return TensorSpec(name, tuple(reversed(ne)), init, float_only)


def tensor_specs(shape: ModelShape, n_vocab: int) -> list[TensorSpec]:
    """Every tensor of the model, in file order."""
    s, E, F = shape, shape.n_embd, shape.n_ff
    q_dim, kv_dim = s.head_dim * s.n_head, s.head_dim * s.n_head_kv
    out = [_spec("token_embd.weight", (E, n_vocab), "embed"),
           _spec("output_norm.weight", (E,), "norm")]
    if not s.tie_embeddings:
        out.append(_spec("output.weight", (E, n_vocab), "embed"))

    for il in range(s.n_layer):
        def t(suffix: str, ne: tuple[int, ...], init: str) -> None:
            out.append(_spec(f"blk.{il}.{suffix}", ne, init))

        t("attn_norm.weight", (E,), "norm")
        if s.is_recurrent(il):
            key_dim, value_dim = s.ssm_d_state * s.ssm_n_group, s.head_v_dim * s.ssm_dt_rank
            t("attn_qkv.weight", (E, 2 * key_dim + value_dim), "linear")
            t("attn_gate.weight", (E, value_dim), "linear")
            t("ssm_conv1d.weight", (s.ssm_d_conv, 2 * key_dim + value_dim), "linear")
            t("ssm_dt.bias", (s.ssm_dt_rank,), "dt_bias")
            t("ssm_a", (s.ssm_dt_rank,), "ssm_a")
            if s.arch == "qwen3next":  # beta and alpha in one projection, interleaved per key head
                t("ssm_ba.weight", (E, 2 * s.ssm_dt_rank), "linear")
            else:
                t("ssm_beta.weight", (E, s.ssm_dt_rank), "linear")
                t("ssm_alpha.weight", (E, s.ssm_dt_rank), "linear")
            t("ssm_norm.weight", (s.head_v_dim,), "norm")
            t("ssm_out.weight", (value_dim, E), "residual")
        else:
            # qwen35's attention q projection carries a sigmoid output gate next to each head
            t("attn_q.weight", (E, q_dim * (2 if s.arch in HYBRID_ARCHS else 1)), "linear")
            t("attn_k.weight", (E, kv_dim), "linear")
            t("attn_v.weight", (E, kv_dim), "linear")
            if s.arch == "qwen2":
                t("attn_q.bias", (q_dim,), "bias")
                t("attn_k.bias", (kv_dim,), "bias")
                t("attn_v.bias", (kv_dim,), "bias")
            t("attn_output.weight", (q_dim, E), "residual")
            if s.arch in QK_NORM_ARCHS:
                t("attn_q_norm.weight", (s.head_dim,), "norm")
                t("attn_k_norm.weight", (s.head_dim,), "norm")
        if s.arch == "gemma3":  # norms after the attention and after the MLP, beside the one before the MLP
            t("post_attention_norm.weight", (E,), "norm")
            t("ffn_norm.weight", (E,), "norm")
            t("post_ffw_norm.weight", (E,), "norm")
        else:
            t("post_attention_norm.weight" if s.arch in HYBRID_ARCHS else "ffn_norm.weight", (E,), "norm")
        if s.n_expert:
            t("ffn_gate_inp.weight", (E, s.n_expert), "linear")
            t("ffn_gate_exps.weight", (E, s.n_ff_exp, s.n_expert), "linear")
            t("ffn_up_exps.weight", (E, s.n_ff_exp, s.n_expert), "linear")
            t("ffn_down_exps.weight", (s.n_ff_exp, E, s.n_expert), "residual")
            t("ffn_gate_inp_shexp.weight", (E,), "linear")
            t("ffn_gate_shexp.weight", (E, s.n_ff_shexp), "linear")
            t("ffn_up_shexp.weight", (E, s.n_ff_shexp), "linear")
            t("ffn_down_shexp.weight", (s.n_ff_shexp, E), "residual")
            continue
        t("ffn_gate.weight", (E, F), "linear")
        t("ffn_up.weight", (E, F), "linear")
        t("ffn_down.weight", (F, E), "residual")
    return out


def _q4_k_m_type(name: str, n_layer: int) -> QT:
    """Q6_K where llama.cpp's Q4_K_M puts it (llama_tensor_get_type's use_more_bits), else Q4_K."""
    if name == "output.weight":
        return QT.Q6_K
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        i = int(parts[1])
        if i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2:
            return QT.Q6_K
    return QT.Q4_K


def _tensor_type(spec: TensorSpec, qtype: QT, n_layer: int = 0) -> QT:
    if spec.float_only:
        return QT.F32
    if qtype == QT.Q4_K:
        qtype = _q4_k_m_type(spec.name, n_layer)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return qtype if spec.fan_in % block == 0 else QT.F16  # rows that don't fill whole blocks


def _nbytes(spec: TensorSpec, qtype: QT) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(spec.shape) // block * type_size


def _chunks(spec: TensorSpec, shape: ModelShape, seed: int) -> Iterator[np.ndarray]:
    """The tensor's values as float32 row chunks; the stream depends only on (seed, name)."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    rows, cols = math.prod(spec.shape[:-1]), spec.shape[-1]
    step = max(1, _CHUNK_ELEMS // cols)
    for r0 in range(0, rows, step):
        n = (min(rows, r0 + step) - r0, cols)
        if spec.init == "ssm_a":  # A = -exp(A_log) must be negative (state decay); HF draws A in U(0, 16)
            yield -rng.uniform(1.0, 16.0, n).astype(np.float32)
            continue
        x = rng.standard_normal(n, dtype=np.float32)
        if spec.init == "embed":
            x *= 0.02
        elif spec.init == "linear":
            x *= 1.0 / math.sqrt(spec.fan_in)
        elif spec.init == "residual":  # damped so the residual stream stays O(1) across many layers
            x *= 1.0 / math.sqrt(spec.fan_in * 2 * shape.n_layer)
        elif spec.init in ("norm", "dt_bias"):
            x = 1.0 + 0.02 * x
        elif spec.init == "bias":
            x *= 0.02
        else:
            raise AssertionError(spec.init)
        yield x


def _encode(x: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return x
    if qtype == QT.F16:
        return x.astype(np.float16)
    if qtype == QT.Q4_K:
        return quantize_q4_k(x)
    if qtype == QT.Q6_K:
        return quantize_q6_k(x)
    return gguf.quants.quantize(x, qtype)


# ---------------------------------------------------------------------------------------------
# tokenizer

Metadata = dict[str, RawField]  # key -> (type, value, array item type)

def read_gguf_metadata(path: str | Path) -> Metadata:
    """All key/values of a GGUF as {key: (type, value, array item type)}; strings stay bytes."""
    return read_gguf(path).fields


@functools.lru_cache(maxsize=8)
def _tokenizer_kv(path: str, _mtime_ns: int) -> Metadata:
    return {k: v for k, v in read_gguf_metadata(path).items() if k.startswith("tokenizer.")}


def tokenizer_kv(vocab: str | Path) -> Metadata:
    """The tokenizer.* keys of a vocab GGUF (cached per file version; treat as read-only)."""
    vocab = Path(vocab).resolve()
    return _tokenizer_kv(str(vocab), vocab.stat().st_mtime_ns)


def default_vocab(arch: str) -> Path:
    if arch not in DEFAULT_VOCABS:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {SUPPORTED_ARCHS}")
    return vendor_dir() / "models" / DEFAULT_VOCABS[arch]


def model_tokenizer(shape: ModelShape, vocab: str | Path | None = None) -> tuple[Metadata, int]:
    """(tokenizer key/values, n_vocab) for `shape`: the vocab file's tokenizer, padded to shape.n_vocab."""
    tok, n_vocab = tokenizer_kv(vocab or default_vocab(shape.arch)), shape.n_vocab
    n_tok = len(tok[Keys.Tokenizer.LIST][1])
    if n_vocab is None or n_vocab == n_tok:
        return tok, n_tok
    if n_vocab < n_tok:
        raise ValueError(f"n_vocab {n_vocab} is smaller than the tokenizer's {n_tok} tokens")
    # real checkpoints pad their embedding rows past the tokenizer; convert_hf_to_gguf.py names those [PAD{i}]
    pad = range(n_tok, n_vocab)
    tok = dict(tok)
    tok[Keys.Tokenizer.LIST] = (VT.ARRAY, tok[Keys.Tokenizer.LIST][1] + [f"[PAD{i}]".encode() for i in pad], VT.STRING)
    if Keys.Tokenizer.TOKEN_TYPE in tok:
        types = tok[Keys.Tokenizer.TOKEN_TYPE]
        tok[Keys.Tokenizer.TOKEN_TYPE] = (VT.ARRAY, types[1] + [gguf.TokenType.UNUSED.value] * len(pad), types[2])
    if Keys.Tokenizer.SCORES in tok:
        scores = tok[Keys.Tokenizer.SCORES]
        tok[Keys.Tokenizer.SCORES] = (VT.ARRAY, scores[1] + [-1000.0] * len(pad), scores[2])
    return tok, n_vocab


# ---------------------------------------------------------------------------------------------
# writing

def _add_hparams(w: gguf.GGUFWriter, s: ModelShape, n_vocab: int, ftype: gguf.LlamaFileType) -> None:
    w.add_name(f"ridgefill-random-{s.arch}")
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(n_vocab)
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_dimension_count(s.rot_dims)
    if s.arch == "qwen35":
        w.add_rope_dimension_sections(list(s.rope_sections))  # required, and exactly 4 long
    if s.arch == "gemma3" and s.n_swa:
        w.add_sliding_window(s.n_swa)
        w.add_sliding_window_pattern(s.swa_pattern)
        w.add_rope_freq_base_swa(s.rope_theta_swa)
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
        w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    if s.arch in HYBRID_ARCHS:
        w.add_full_attention_interval(s.full_attention_interval)
        w.add_ssm_conv_kernel(s.ssm_d_conv)
        w.add_ssm_state_size(s.ssm_d_state)
        w.add_ssm_group_count(s.ssm_n_group)
        w.add_ssm_time_step_rank(s.ssm_dt_rank)
        w.add_ssm_inner_size(s.ssm_d_inner)


def write_random_model(path: str | Path, shape: ModelShape, *, vocab: str | Path | None = None,
                       dtype: str = "f32", seed: int = 0, same_layers: bool = False) -> Path:
    """Write a random-weight GGUF of `shape` with the tokenizer of `vocab`; same seed, same bytes.
    same_layers: every layer holds the first layer of its kind's weights (drawn and quantized once), which writes a
    27B-sized model in about the time of its disk writes; for timings, which do not depend on the values."""
    shape.validate()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    qtype, ftype = DTYPES[dtype]
    tok, n_vocab = model_tokenizer(shape, vocab)
    specs = tensor_specs(shape, n_vocab)
    types = [_tensor_type(spec, qtype, shape.n_layer) for spec in specs]

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, shape.arch)
    try:
        _add_hparams(w, shape, n_vocab, ftype)
        for key, (vt, val, sub) in tok.items():
            w.add_key_value(key, val, vt, sub_type=sub)
        for spec, qt in zip(specs, types):
            w.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), _nbytes(spec, qt), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        # the data section is written here rather than by write_tensor_data so that one
        # tensor (a 248k x 5k embedding, say) never has to be in memory whole
        fout = w.fout[0]
        drawn: dict[tuple, list[np.ndarray]] = {}
        for spec, qt in zip(specs, types):
            w.write_padding(fout, fout.tell())
            key = (spec.name.split(".", 2)[-1], spec.shape, qt) if same_layers and spec.name.startswith("blk.") else None
            encoded = drawn.get(key) if key else None
            if encoded is None:
                encoded = [_encode(chunk, qt) for chunk in _chunks(spec, shape, seed)] if key else None
                if key:
                    drawn[key] = encoded
            for chunk in encoded if encoded is not None else (_encode(c, qt) for c in _chunks(spec, shape, seed)):
                chunk.tofile(fout)
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ridgefill_gguf.random_gguf",
                                description="Write a small random-weight GGUF with a real llama.cpp tokenizer.")
    p.add_argument("--arch", choices=SUPPORTED_ARCHS, help="a tiny model of this architecture")
    p.add_argument("--preset", choices=tuple(REAL_SHAPES), help="a real model's shape (random weights)")
    p.add_argument("-o", "--output", required=True, type=Path)
    p.add_argument("--dtype", default="f32", choices=tuple(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, help="number of layers (default: the tiny preset's)")
    p.add_argument("--embd", type=int, help="embedding width (default: the tiny preset's)")
    p.add_argument("--vocab", type=Path, help="vocab GGUF to copy the tokenizer from")
    p.add_argument("--same-layers", action="store_true",
                   help="every layer of a kind holds the same random weights (fast; for timings)")
    a = p.parse_args(argv)
    if bool(a.arch) == bool(a.preset):
        p.error("give exactly one of --arch and --preset")

    shape = REAL_SHAPES[a.preset] if a.preset else tiny_shape(a.arch)
    if a.layers is not None:
        shape = dataclasses.replace(shape, n_layer=a.layers)
    if a.embd is not None:
        # keep qwen2's n_head * head_dim == n_embd by moving the head size along
        extra = {"head_dim": a.embd // shape.n_head} if shape.arch == "qwen2" else {}
        shape = dataclasses.replace(shape, n_embd=a.embd, **extra)
    out = write_random_model(a.output, shape, vocab=a.vocab, dtype=a.dtype, seed=a.seed, same_layers=a.same_layers)
    n_params = sum(math.prod(t.shape) for t in tensor_specs(shape, model_tokenizer(shape, a.vocab)[1]))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {n_params / 1e6:.1f}M params): "
          f"{shape.arch} n_layer={shape.n_layer} n_embd={shape.n_embd} n_ff={shape.n_ff} "
          f"n_head={shape.n_head}/{shape.n_head_kv} head_dim={shape.head_dim} dtype={a.dtype} seed={a.seed}")


if __name__ == "__main__":
    main()
