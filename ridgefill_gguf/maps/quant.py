"""Q8_0 and 16-bit encodings of map weights, bit-exact with ggml's reference code.

Q8_0 (ggml-quants.c, quantize_row_q8_0_ref): blocks of 32 values along a row; d = max|x| / 127 in
float32, stored as f16; q = roundf(x * (1/d)), rounding halves away from zero. A block is 2 bytes of d
then 32 int8 codes.
"""
from __future__ import annotations

import numpy as np

QK8_0 = 32
BLOCK_BYTES = 2 + QK8_0
INT8_GROUP = 128  # the int8 maps' scale group: one scale per 128 weights of a row


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Rows of float32 [n, k] (k a multiple of 32) -> Q8_0 bytes [n, k/32*34]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, k = x.shape
    blocks = x.reshape(n, k // QK8_0, QK8_0)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    scaled = (blocks * inv).astype(np.float32)
    # roundf: half away from zero (np.round is half-to-even); the +0.5 in float64 is exact for |v| <= 127,
    # where in float32 0.49999997 + 0.5 would round up to 1
    mag = np.floor(np.abs(scaled).astype(np.float64) + 0.5)
    q = (np.sign(scaled) * mag).astype(np.int8)
    return pack_q8_0(d[..., 0].astype(np.float16), q)


def pack_q8_0(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """f16 scales [n, nb] and int8 codes [n, nb, 32] -> Q8_0 bytes [n, nb*34]."""
    n, nb = d.shape
    out = np.empty((n, nb, BLOCK_BYTES), dtype=np.uint8)
    out[..., :2] = np.ascontiguousarray(d, dtype="<f2").view(np.uint8).reshape(n, nb, 2)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(n, nb * BLOCK_BYTES)


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (ggml_fp32_to_bf16; NaN kept quiet)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


F16_MAX = 65504.0


class Q8RangeError(ValueError):
    """Values too large for a Q8_0 block's f16 scale."""


def int8_groups_to_q8_0(codes: np.ndarray, scales_bf16: np.ndarray) -> tuple[np.ndarray, int]:
    """Repack int8 codes [n, k] with one bf16 scale per 128 columns [n, k/128] into Q8_0, losslessly.

    Every Q8_0 block keeps its 32 codes and takes its group's scale as f16. Where the bf16 scale has no
    exact f16 (too small or too large for f16), the block is requantized from codes*scale instead.
    Returns (Q8_0 bytes, number of requantized blocks)."""
    n, k = codes.shape
    scale32 = bf16_to_f32(scales_bf16)                     # [n, k/128]
    d32 = np.repeat(scale32, INT8_GROUP // QK8_0, axis=1)  # [n, k/32]
    d16 = d32.astype(np.float16)
    exact = d16.astype(np.float32) == d32
    q = np.ascontiguousarray(codes, dtype=np.int8).reshape(n, k // QK8_0, QK8_0)
    out = pack_q8_0(d16, q)
    bad = np.argwhere(~exact)
    if len(bad):
        rows = np.unique(bad[:, 0])
        # requantize whole rows' worth of blocks at once, then copy back only the inexact blocks
        deq = q[rows].astype(np.float32) * d32[rows][..., None]
        if np.abs(deq).max() / 127 > F16_MAX:
            raise Q8RangeError(f"a scale of {float(d32.max()):g} makes weights too large for Q8_0's f16 scale")
        fixed = quantize_q8_0(deq.reshape(len(rows), k)).reshape(len(rows), k // QK8_0, BLOCK_BYTES)
        view = out.reshape(n, k // QK8_0, BLOCK_BYTES)
        row_index = {r: i for i, r in enumerate(rows)}
        for r, b in bad:
            view[r, b] = fixed[row_index[r], b]
    return out, int(len(bad))
