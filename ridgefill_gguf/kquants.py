"""Q4_K and Q6_K encoders for random-weight models (gguf-py can read these types but not write them).

Simple round-to-nearest per sub-block: the bytes are valid blocks that llama.cpp and gguf-py decode, close to the
input, not llama.cpp's error-minimizing search. Speed does not depend on the values, and the benchmarks' models are
random anyway. Layouts as gguf-py's dequantizers read them (gguf/quants.py).
"""
from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(len(x), 2)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., k*256] -> uint8 blocks [n, 144]: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 of quants."""
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = b.min(axis=2), b.max(axis=2)
    mn = np.maximum(-lo, 0.0)                                   # value = d*sc*q - dmin*m
    rng = hi + mn
    d = (rng.max(axis=1) / 15.0 / 63.0).astype(np.float16).astype(np.float32)
    dmin = (mn.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(rng / 15.0 / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mn / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    q = np.round((b + (dmin[:, None] * m)[:, :, None]) / np.where(step > 0, step, 1)[:, :, None])
    q = np.clip(q, 0, 15).astype(np.uint8)                      # [n, 8, 32]
    scales = np.zeros((len(b), 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(len(b), 128)  # sub-blocks 2g (low) and 2g+1 (high)
    return np.concatenate([_f16(d), _f16(dmin), scales, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., k*256] -> uint8 blocks [n, 210]: 128 bytes of low nibbles, 64 of high bits, 16 int8 scales, d."""
    b = x.reshape(-1, 16, 16).astype(np.float32)
    amax = np.abs(b).max(axis=2)                                # value = d*scale*(q - 32)
    d = (amax.max(axis=1) / 31.0 / 127.0).astype(np.float16).astype(np.float32)
    scale = np.clip(np.round(amax / 31.0 / np.where(d > 0, d, 1)[:, None]), 0, 127).astype(np.int8)
    step = d[:, None] * scale
    q = np.clip(np.round(b / np.where(step > 0, step, 1)[:, :, None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(len(b), 256).astype(np.uint8)
    halves = q.reshape(len(b), 2, 128)                          # value v: half v // 128, w = v % 128
    ql = (halves[:, :, :64] & 0x0F) | ((halves[:, :, 64:] & 0x0F) << 4)        # [n, 2, 64]
    hb = halves >> 4                                                             # 2 high bits
    qh = hb[:, :, 0:32] | (hb[:, :, 32:64] << 2) | (hb[:, :, 64:96] << 4) | (hb[:, :, 96:128] << 6)  # [n, 2, 32]
    return np.concatenate([ql.reshape(len(b), 128), qh.reshape(len(b), 64), scale.view(np.uint8),
                           _f16(d)], axis=1)
