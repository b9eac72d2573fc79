"""Q4_K and Q6_K block writers for test and benchmark files (gguf-py quantizes Q8_0 and Q4_0, not these).

They write ggml's block layouts (block_q4_K, block_q6_K in ggml-common.h) with a plain choice of
scales, not llama-quantize's search: a file written this way reads in llama.cpp and in kvscope
alike, which is what tests need, but quantizes less well than llama-quantize would.
"""
from __future__ import annotations

import numpy as np


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x [n, k] -> block_q4_K bytes (per 32: step d*sc, offset dmin*m; not ggml's search, same layout)."""
    n = x.shape[0]
    sub = x.reshape(n, -1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=-1), 0)
    span = sub.max(axis=-1) - lo
    d = (span.max(axis=-1) / 15 / 63).astype(np.float16)
    dmin = ((-lo).max(axis=-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(span / 15 / np.where(d32 > 0, d32, 1)[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / np.where(dmin32 > 0, dmin32, 1)[..., None]), 0, 63).astype(np.uint8)
    step = (d32[..., None] * sc)[..., None]
    q = np.clip(np.rint((sub + (dmin32[..., None] * m)[..., None]) / step), 0, 15).astype(np.uint8)
    scales = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6), (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, -1, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8).reshape(n, -1, 2), scales, qs],
                          axis=-1).reshape(n, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x [n, k] -> block_q6_K bytes (per 16: scale = amax/31 as d * int8 sc; not ggml's search, same layout)."""
    n = x.shape[0]
    sub = x.reshape(n, -1, 16, 16).astype(np.float32)
    sub_scale = np.abs(sub).max(axis=-1) / 31
    d = (sub_scale.max(axis=-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    sc = np.clip(np.rint(sub_scale / np.where(d32 > 0, d32, 1)[..., None]), 1, 127).astype(np.int8)
    step = (d32[..., None] * sc)[..., None]
    q = (np.clip(np.rint(sub / step), -32, 31) + 32).astype(np.uint8).reshape(n, -1, 2, 4, 32)
    ql = np.concatenate([q[..., 0, :] & 15 | (q[..., 2, :] & 15) << 4, q[..., 1, :] & 15 | (q[..., 3, :] & 15) << 4],
                        axis=-1)
    qh = q[..., 0, :] >> 4 | (q[..., 1, :] >> 4) << 2 | (q[..., 2, :] >> 4) << 4 | (q[..., 3, :] >> 4) << 6
    nb = ql.shape[1]
    return np.concatenate([ql.reshape(n, nb, 128), qh.reshape(n, nb, 64), sc.view(np.uint8),
                           d.view(np.uint8).reshape(n, nb, 2)], axis=-1).reshape(n, -1)
