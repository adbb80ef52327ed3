"""Quantized products over stacked experts on the CPU: mixture-of-experts layers without MLX's
``gather_qmm``.

``gather_qmm(x, w, scales, biases, rhs_indices=indices, ...)`` has ``mx.gather_qmm``'s signature and
semantics for the case mlx-lm's ``QuantizedSwitchLinear`` uses: ``out[b, m] = x[b, m] @
dequantize(w[indices[b]]).T`` with x ``(..., M, K)``, ``w`` uint32 ``(E, N, K * bits / 32)`` (each
expert as ``mx.quantize`` packs a matrix), ``scales`` and ``biases`` ``(E, N, K / group_size)`` and
indices whose shape broadcasts with x's batch dims; the result is ``(broadcast batch, M, N)``.
SwitchGLU passes gate/up as x ``(..., 1, 1, K)`` against indices ``(..., k)`` (one token's row for
its k experts) and down as ``(..., k, 1, F)`` (a row per token and slot), or both flattened to
``(T * k, 1, K)`` rows sorted by expert with indices ``(T * k,)`` when it sorts (64 or more pairs).

MLX's CPU ``gather_qmm`` reads the experts' weights at ~0.6 GB/s (one dequantized product per
(token, slot), each on its own); the kernel (``src/gather_qmm.cpp``) sorts the pairs by expert and
runs the quantized matmul's row kernel once per chosen expert over all of its rows, so an expert's
weights are read once per call however many tokens chose it (docs/kernels.md has the numbers).
``spec.set_cpu_math("int8")`` quantizes x to int8 per 32 values there too (the int8 kernel).
Bits 4, 5, 6 and 8, group sizes 32, 64 and 128, x float32/float16/bfloat16; anything else
(``mode`` other than affine, e.g. gpt-oss's mxfp4, no biases, ``transpose=False``, ``lhs_indices``,
a global scale) goes to ``mx.gather_qmm``.
"""

from __future__ import annotations

import mlx.core as mx

from cpu_kernels.spec import KernelSpec, resolve_backend, run, x_planes

SPEC = KernelSpec("gather_quantized_matmul", bits=(4, 5, 6, 8), group_sizes=(16, 32, 64, 128))  # 16: Q6_K


def fits(
    x: mx.array,
    w: mx.array,
    biases: mx.array | None,
    lhs_indices: mx.array | None,
    rhs_indices: mx.array | None,
    transpose: bool,
    mode: str,
) -> bool:
    """Whether the call is the kernel's case (format aside: SPEC checks bits, group size, dtype)."""
    return (
        transpose
        and mode == "affine"
        and biases is not None
        and lhs_indices is None
        and rhs_indices is not None
        and w.ndim == 3
        and x.ndim >= 2
    )


def gather_qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    lhs_indices: mx.array | None = None,
    rhs_indices: mx.array | None = None,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    sorted_indices: bool = False,
    *,
    backend: str | None = None,
) -> mx.array:
    """``mx.gather_qmm``'s signature; the CPU kernel takes the affine, transposed product with
    ``rhs_indices`` only (every ``QuantizedSwitchLinear``), anything else goes to MLX.
    ``sorted_indices`` is only a hint: the kernel groups the rows by expert itself."""
    usable = fits(x, w, biases, lhs_indices, rhs_indices, transpose, mode)
    if not usable and backend == "native":
        raise ValueError(
            "the CPU kernel computes x @ w[rhs_indices].T for affine weights with biases (no lhs_indices)"
        )
    chosen = (
        resolve_backend(backend, SPEC, bits=bits, group_size=group_size, dtype=x.dtype)
        if usable
        else "reference"
    )
    if chosen == "native":
        return run(SPEC, x, w, scales, biases, rhs_indices, group_size, bits, x_planes=x_planes())
    return reference(
        x, w, scales, biases, lhs_indices, rhs_indices, transpose, group_size, bits, mode, sorted_indices
    )


def reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    lhs_indices: mx.array | None = None,
    rhs_indices: mx.array | None = None,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    sorted_indices: bool = False,
) -> mx.array:
    """MLX's built-in gather_qmm: the path without the extension."""
    return mx.gather_qmm(
        x,
        w,
        scales,
        biases,
        lhs_indices=lhs_indices,
        rhs_indices=rhs_indices,
        transpose=transpose,
        group_size=group_size,
        bits=bits,
        mode=mode,
        sorted_indices=sorted_indices,
    )
