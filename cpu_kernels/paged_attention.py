"""Attention over the paged KV pool on the CPU, in one op: decode, prefill chunks and verification.

The engine's reference path gathers each row's whole context out of the pool into a new
(B, Hkv, S, D) array, per layer and step, and runs ``mx.fast.scaled_dot_product_attention``, whose
CPU version is a composed fallback of ~10 ops. At a 1K-token context that gather copies ~1.5 MB per
layer for the bundled model and dominates a decode step's attention; for a prefill chunk over a long
cached history (a later turn of a chat) it is most of the chunk's time. The ``paged_attention`` kernel
(``src/paged_attention.cpp``) reads each token's K and V where it lives (slot
``table[b, t // block_size] * block_size + t % block_size`` of the pool's flat ``(slots, Hkv, D)``
arrays). Each row brings its last L tokens' queries (L = 1 in decode); query token i of row b sits at
position ``p = lens[b] - L + i`` and attends causally over the row's tokens ``[0, p]`` (the last
``window`` of them for a sliding-window layer), with ``sinks`` adding one logit per head to the
softmax's denominator: the reference's semantics. Work is split per (row, KV head, tile of 16 query
tokens); a tile reads each key and value once for all its query tokens and heads (GQA), one online
softmax per query in float32.

Unquantized pools only (float32, float16, bfloat16; the model's activation dtype); a quantized pool
keeps the reference path.
"""

from __future__ import annotations

import mlx.core as mx

from cpu_kernels.spec import FLOATS, KernelSpec, available, run

SPEC = KernelSpec("paged_attention", bits=(), group_sizes=())


def fits(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether the kernel takes these operands (q (B, Hq, L, D); k, v (slots, Hkv, D / Dv) of q's dtype)."""
    return (
        available()
        and q.ndim == 4
        and k.ndim == 3
        and v.ndim == 3
        and q.dtype in FLOATS
        and k.dtype in FLOATS
        and v.dtype == k.dtype
        and k.shape[1] > 0
        and q.shape[1] % k.shape[1] == 0
        and k.shape[2] == q.shape[3]
    )


def paged_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    table: mx.array,
    lens: mx.array,
    *,
    scale: float,
    block_size: int,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """(B, Hq, L, Dv): each row's last L queries over its paged K/V (module docstring); must fit."""
    return run(SPEC, q, k, v, table, lens, float(scale), int(block_size), int(window or 0), sinks)


def reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    table: mx.array,
    lens: mx.array,
    *,
    scale: float,
    block_size: int,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """The same through MLX's ops: gather each row's tokens, mask, ``scaled_dot_product_attention``."""
    B, _, L, _ = q.shape
    S = table.shape[1] * block_size
    pos = mx.arange(S)
    slots = table[:, pos // block_size] * block_size + pos % block_size  # (B, S)
    keys = k[slots].transpose(0, 2, 1, 3)  # (B, Hkv, S, D)
    values = v[slots].transpose(0, 2, 1, 3)
    q_pos = (lens - L)[:, None] + mx.arange(L)[None]  # (B, L)
    mask = pos[None, None, :] <= q_pos[:, :, None]
    if window:
        mask = mask & (pos[None, None, :] > q_pos[:, :, None] - window)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask[:, None], sinks=sinks)
