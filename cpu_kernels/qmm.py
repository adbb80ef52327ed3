"""Quantized matrix products on the CPU: y = x @ dequantize(w).T with w kept packed.

MLX affine format, exactly as ``mx.quantize`` returns it: ``w`` uint32 (N, K * bits / 32), a
little-endian bitstream per row (element 0 in the low bits), ``scales`` and ``biases``
(N, K / group_size). Bits 4, 5, 6 and 8; group sizes 32, 64 and 128; x float32/float16/bfloat16.

Kernel design (``src/kernels_impl.inc``): threads take blocks of output rows; within a row every group
is unpacked once into float lanes (16 at a time, 32 for 4-bit) and used by every row of x, the
group's scale applied once per group and its bias through the group sums of x, float32 throughout.
One copy per instruction set (AVX-512, AVX2, baseline/NEON) is chosen at run time.
"""

from __future__ import annotations

import mlx.core as mx

from cpu_kernels.spec import KernelSpec, resolve_backend, run

SPEC = KernelSpec("quantized_matmul", bits=(4, 5, 6, 8), group_sizes=(32, 64, 128))


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    *,
    backend: str | None = None,
) -> mx.array:
    """``mx.quantized_matmul``'s signature; the CPU kernel takes the affine, transposed case (every
    ``QuantizedLinear``), anything else goes to MLX."""
    usable = transpose and mode == "affine" and biases is not None
    if not usable and backend == "native":
        raise ValueError("the CPU kernel computes x @ w.T for affine weights with biases")
    chosen = (
        resolve_backend(backend, SPEC, bits=bits, group_size=group_size, dtype=x.dtype)
        if usable
        else "reference"
    )
    if chosen == "native":
        return run(SPEC, x, w, scales, biases, group_size, bits)
    return reference(x, w, scales, biases, transpose, group_size, bits, mode)


def reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
) -> mx.array:
    """MLX's built-in quantized matmul: the path without the extension."""
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
    )
