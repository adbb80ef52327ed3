"""Single-token decode attention over the paged KV pool on the CPU, in one op.

The engine's reference path for a decode step gathers each row's whole context out of the pool
into a new (B, Hkv, S, D) array, per layer and step, and runs ``mx.fast.scaled_dot_product_attention``,
whose CPU version is a composed fallback of ~10 ops. At a 1K-token context that gather copies
~1.5 MB per layer for the bundled model and dominates the step's attention. The
``paged_decode_attention`` kernel (``src/paged_attention.cpp``) reads each token's K and V where it
lives (slot ``table[b, t // block_size] * block_size + t % block_size`` of the pool's flat
``(slots, Hkv, D)`` arrays), one online softmax per (row, KV head) in float32 for all of that KV
head's query heads, with the same semantics as the reference: a row attends over its ``lens[b]``
tokens (the last ``window`` of them for a sliding-window layer), and ``sinks`` add one logit per head
to the softmax's denominator.

Unquantized pools only (float32, float16, bfloat16; the model's activation dtype); a quantized pool
keeps the reference path.
"""

from __future__ import annotations

import mlx.core as mx

from cpu_kernels.spec import KernelSpec, available, run

SPEC = KernelSpec("paged_decode_attention", bits=(), group_sizes=())
FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def fits(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether the kernel takes these operands (q (B, Hq, D); k, v (slots, Hkv, D / Dv) of q's dtype)."""
    return (
        available()
        and q.ndim == 3
        and k.ndim == 3
        and v.ndim == 3
        and q.dtype in FLOATS
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and k.shape[1] > 0
        and q.shape[1] % k.shape[1] == 0
        and k.shape[2] == q.shape[2]
    )


def paged_decode_attention(
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
    """(B, Hq, Dv): each row's one query over its paged K/V (module docstring); the kernel must fit."""
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
    B = q.shape[0]
    S = table.shape[1] * block_size
    pos = mx.arange(S)
    slots = table[:, pos // block_size] * block_size + pos % block_size  # (B, S)
    keys = k[slots].transpose(0, 2, 1, 3)  # (B, Hkv, S, D)
    values = v[slots].transpose(0, 2, 1, 3)
    last = (lens - 1)[:, None]
    mask = pos[None, :] <= last
    if window:
        mask = mask & (pos[None, :] > last - window)
    out = mx.fast.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, scale=scale, mask=mask.reshape(B, 1, 1, S), sinks=sinks
    )
    return out[:, :, 0, :]
