"""Float64 NumPy references for the kernels: the oracles the emulator and Metal tests compare against.

Independent of MLX's own kernels on purpose: MLX's CPU ``quantized_matmul`` rounds through fp16 and
is a poor oracle, so weights are unpacked and dequantized here and every product is float64.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def to_f64(x: mx.array) -> np.ndarray:
    """Exact float64 copy of an MLX array of any float dtype."""
    return np.array(x.astype(mx.float32)).astype(np.float64)


def unpack_affine(wq: np.ndarray, bits: int) -> np.ndarray:
    """Unpack MLX affine-quantized uint32 words along the last axis (element 0 in the low bits)."""
    if bits not in (2, 4, 8):
        raise ValueError("bits must be 2, 4 or 8")
    per_word = 32 // bits
    words = np.asarray(wq, dtype=np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    vals = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(*words.shape[:-1], words.shape[-1] * per_word).astype(np.int64)


def dequantize_affine(
    wq: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int, bits: int
) -> np.ndarray:
    q = unpack_affine(wq, bits).astype(np.float64)
    s = np.repeat(np.asarray(scales, dtype=np.float64), group_size, axis=-1)
    b = np.repeat(np.asarray(biases, dtype=np.float64), group_size, axis=-1)
    return s * q + b


def qmv(
    x: mx.array, wq: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> np.ndarray:
    """y = x @ dequantize(w).T in float64; x (..., K), w (N, K * bits / 32)."""
    w = dequantize_affine(np.array(wq), to_f64(scales), to_f64(biases), group_size, bits)
    return to_f64(x) @ w.T


def qmv_error_scale(
    x: mx.array, wq: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> np.ndarray:
    """|x| @ |w|.T: the natural magnitude for rounding errors of each output."""
    w = dequantize_affine(np.array(wq), to_f64(scales), to_f64(biases), group_size, bits)
    return np.abs(to_f64(x)) @ np.abs(w).T


def quantize_affine(x: np.ndarray, group_size: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX's affine quantization along the last axis, float32 arithmetic as the kernels do it.

    Returns ``(words uint32, scales float32, biases float32)``; scales and biases are the float32
    values before the cast to the activation dtype. Like ``mx.quantize`` on the CPU: the group's true
    min and max, levels rounded with ties to even (``rint``; MSL ``round`` would round ties away
    from zero, as MLX's own Metal quantize kernel does).
    """
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    g = x.reshape(-1, group_size)
    n_bins = np.float32((1 << bits) - 1)
    w_min = g.min(axis=1)
    w_max = g.max(axis=1)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7)).astype(np.float32)
    side = np.abs(w_min) > np.abs(w_max)
    scale = np.where(side, scale, -scale).astype(np.float32)
    edge = np.where(side, w_min, w_max).astype(np.float32)
    q0 = np.rint((edge / scale).astype(np.float32)).astype(np.float32)
    at_zero = q0 == 0
    scale = np.where(at_zero, scale, edge / np.where(at_zero, np.float32(1), q0)).astype(np.float32)
    bias = np.where(at_zero, np.float32(0), edge).astype(np.float32)
    return _pack(g, scale, bias, bits, shape, group_size)


def _pack(g, scale, bias, bits, shape, group_size):
    n_bins = (1 << bits) - 1
    q = np.rint(((g - bias[:, None]) / scale[:, None]).astype(np.float32))
    q = np.clip(q, 0, n_bins).astype(np.uint32)
    per_word = 32 // bits
    q = q.reshape(-1, per_word)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    words = np.bitwise_or.reduce(q << shifts, axis=1).astype(np.uint32)
    words = words.reshape(*shape[:-1], shape[-1] * bits // 32)
    groups = (*shape[:-1], shape[-1] // group_size)
    return words, scale.reshape(groups), bias.reshape(groups)


def paged_decode_attention(
    q: mx.array,
    k_pool: np.ndarray,
    v_pool: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
    window: int | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Decode attention in float64 over float64 K/V pools of shape (blocks, block_size, kv_heads, D).

    Sequence b attends to its tokens ``max(0, L - window) <= t < L`` (L = context_lens[b]), token t
    at ``pool[block_tables[b, t // block_size], t % block_size]``. Query head h reads KV head
    ``h // (n_q_heads // n_kv_heads)``. ``sinks`` (n_q_heads,) adds exp(sink) to each softmax
    denominator. A sequence with no visible token yields zeros.
    """
    qf = to_f64(q)
    batch, n_q, dim = qf.shape
    bs = k_pool.shape[1]
    n_kv = k_pool.shape[2]
    rep = n_q // n_kv
    out = np.zeros((batch, n_q, dim))
    for b in range(batch):
        length = int(context_lens[b])
        start = 0 if window is None else max(0, length - window)
        t = np.arange(start, length)
        if len(t) == 0:
            continue
        blocks = block_tables[b, t // bs]
        slots = t % bs
        for h in range(n_q):
            k = k_pool[blocks, slots, h // rep]
            v = v_pool[blocks, slots, h // rep]
            s = (k @ qf[b, h]) * scale
            m = s.max()
            if sinks is not None:
                m = max(m, float(sinks[h]))
            p = np.exp(s - m)
            denom = p.sum() + (np.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
            out[b, h] = (p @ v) / denom
    return out
