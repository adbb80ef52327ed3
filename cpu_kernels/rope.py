"""Rotary position embedding on the CPU in one op, ``mx.fast.rope``'s semantics.

On MLX's CPU backend ``mx.fast.rope`` runs as a composed fallback of ~25 ops (aranges, exp, cos, sin,
slices, concatenates and their broadcasts), twice per layer. The ``rope`` kernel (``src/rope.cpp``)
does it in one op: the first ``dims`` features rotate in pairs ``(i, i + dims/2)`` (or ``(2i, 2i+1)``
when ``traditional``) by ``(offset + t) * scale * theta_i``, ``theta_i = base ** (-2i / dims)`` or
``1 / freqs[i]``; ``offset`` is an int or an integer array, a scalar or one start position per batch
row (Duet's paged attention passes one per sequence). Angles in double, products in float32.
"""

from __future__ import annotations

import mlx.core as mx

from cpu_kernels.spec import FLOATS, KernelSpec, choose_backend, run

SPEC = KernelSpec("rope", bits=(), group_sizes=())
OFFSET_DTYPES = (mx.int32, mx.int64, mx.uint32)


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
    backend: str | None = None,
) -> mx.array:
    """``mx.fast.rope(x, dims, ...)``; the CPU kernel when it is built (``backend=None``)."""
    off = offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
    fits = (
        x.ndim >= 3
        and x.dtype in FLOATS
        and off.dtype in OFFSET_DTYPES
        and (base is None) == (freqs is not None)
    )
    requirement = (
        "rope's kernel takes float x (B, *, T, D), an integer offset, and exactly one of base and freqs"
    )
    if choose_backend(backend, fits, requirement) == "native":
        return run(SPEC, x, dims, traditional, 0.0 if base is None else base, scale, off, freqs)
    return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
