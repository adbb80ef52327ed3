"""Quantized matrix products on the CPU: y = x @ dequantize(w).T with w kept packed.

MLX affine format, exactly as ``mx.quantize`` returns it: ``w`` uint32 (N, K * bits / 32), a
little-endian bitstream per row (element 0 in the low bits), ``scales`` and ``biases``
(N, K / group_size). Bits 4, 5, 6 and 8; group sizes 32, 64 and 128; x float32/float16/bfloat16.

Kernel design (``src/kernels_impl.inc``): threads take blocks of output rows; within a row every group
is unpacked once into float lanes (16 at a time, 32 for 4-bit) and used by every row of x, the
group's scale applied once per group and its bias through the group sums of x, float32 throughout.
One copy per instruction set (AVX-512, AVX2, baseline/NEON) is chosen at run time. With
``spec.set_cpu_math("int8")`` x is instead quantized to int8 per 32 values and multiplied with the
weights' codes by integer dot products (``src/int8_impl.inc``).

From ``dequantize_rows()`` rows of x on (prefill), the fused kernel loses to a BLAS GEMM, so the
weights are dequantized by the ``dequantize`` kernel (~9 Gweights/s per core, a transient float32 copy
of one matrix) and multiplied by MLX's matmul; with int8 math and 4- or 8-bit weights on AVX-512 VNNI,
the int8 GEMM on packed panels (``src/kernels_gemm_avx512.cpp``) takes them instead.
"""

from __future__ import annotations

import mlx.core as mx

from cpu_kernels.spec import (
    KernelSpec,
    extension,
    int8_math,
    kernel_threads,
    panel_tiles,
    resolve_backend,
    run,
    x_planes,
)

SPEC = KernelSpec("quantized_matmul", bits=(4, 5, 6, 8), group_sizes=(16, 32, 64, 128))  # 16: Q6_K
DEQUANTIZE_SPEC = KernelSpec("dequantize", bits=(4, 5, 6, 8), group_sizes=(16, 32, 64, 128))
# Rows of x per kernel thread from which dequantize + GEMM beats the fused kernel. One thread, 1536 x
# 576, 4-bit: 16 rows 0.53 vs 0.70 ms, 32 rows 1.07 vs 1.00 ms, 256 rows 8.5 vs 5.3 ms. The fused
# kernel's threads split its work, the other path gains less from them: two threads (wall) 45 rows
# 0.61 vs 1.00 ms, 64 rows 0.90 vs 0.90 ms, 96 rows 1.39 vs 1.14 ms (docs/BENCHMARKS.md,
# bench/qmatmul.py --paths).
DEQUANTIZE_ROWS_PER_THREAD = 32


# With exact math where the int8 GEMM exists (AVX-512 VNNI), x split into three int8 planes goes
# through it (src/qmm.cpp: run_planes_gemm) up to this many rows, not the float kernel: two threads, a
# 4-bit 8192 x 2048 matrix (bench/qmatmul.py --paths), 16 rows 5.3 ms against the float kernel's 11.4,
# 64 rows 16 against the dequantize + GEMM path's 39, 128 rows 33 against 44, 256 rows 69 against 58
# (the GEMM's three passes of int8 products against OpenBLAS's float32 GEMM; both scale alike with
# threads).
X3_GEMM_ROWS = 128
# A Q4_K or Q5_K layer in panels stays on the panel kernel with exact math below this many rows of x
# (each row's three int8 planes joined per group: src/kernels_panel_avx512.cpp), where other layers
# dequantize from X3_GEMM_ROWS: two threads on a Zen 4, a 1B model's layers, panel kernel against
# dequantize + OpenBLAS (interleaved, medians of 5): gate_proj 8192 x 2048 128 rows 27 against 56 ms,
# 512 rows 111 against 119, 1024 rows 196 against 222; q_proj 2048 x 2048 128 rows 6.5 against 8.2,
# 512 rows 28.8 against 26.7 (docs/kernels.md). Q6_K's groups of 16 lose from ~256 rows (512: 191
# against 119), so Q6_K keeps X3_GEMM_ROWS.
PANEL_X3_ROWS = 1024
# With int16 math every layer stays on its integer kernel below this many rows: two planes of x beat
# dequantize + OpenBLAS on the held x (qmm.held_int16, MLX ops: 94 ms for 512 x 8192 values) at every
# 1B layer measured, two threads on a Zen 4, ms a product at 256 / 512 / 1024 rows (an ad-hoc script):
# panels gate_proj 26 / 59 / 117-127 against 68 / 125 / 240, Q6_K down_proj 32 / 65 / 147-156 against
# 110 / 200 / 374, q_proj 7.3 / 14.5 / 29 against 16 / 50 / 96; in rows (the GEMM on planes) gate_proj
# 39 / 82 / 164 against 72 / 132 / 248, down_proj 49 / 111 / 229 against 107 / 195 / 388, q_proj 19 / 22 / 41
# against 17 / 43 / 98.
INT16_ROWS = 1024


def dequantize_rows(w: mx.array | None = None, scales: mx.array | None = None, bits: int = 0) -> int:
    """Rows of x from which ``quantized_matmul`` dequantizes and multiplies by a GEMM (never for a layer
    on AMX tiles: ``on_tiles``); given the layer, a Q4_K or Q5_K layer in panels keeps exact math on the
    panel kernel up to ``PANEL_X3_ROWS``; int16 math keeps every layer on its kernel up to ``INT16_ROWS``."""
    if x3_gemm():
        if x_planes() == 2:
            return INT16_ROWS
        if w is not None and scales is not None and bits in (4, 5) and panel_form(w, scales):
            return PANEL_X3_ROWS
        return X3_GEMM_ROWS
    return DEQUANTIZE_ROWS_PER_THREAD * kernel_threads()


# Weight rows a panel of the panel form holds (``src/panels.h``, ``cpu_kernels.panels``)
PANEL_ROWS = 16


def panel_form(w: mx.array, scales: mx.array) -> bool:
    """Whether (w, scales) are a layer (or expert stack) in 16-row panels: one row of uint8 scales per
    16 weight rows (``src/panels.h``; the kernels read the form from the same shapes)."""
    return scales.dtype == mx.uint8 and scales.ndim == w.ndim and scales.shape[-2] * PANEL_ROWS == w.shape[-2]


def on_tiles(w: mx.array, scales: mx.array, bits: int) -> bool:
    """Whether a layer's products of many rows run on AMX tiles (``src/kernels_panel_amx.cpp``): a Q4_K,
    Q5_K or Q6_K layer in panels, where the extension's tiles are on (``spec.panel_tiles``). Exact math
    then never dequantizes it for a GEMM: x's three bfloat16 planes on the tiles beat dequantize +
    OpenBLAS at every row count measured (two threads, an 8192 x 2048 Q4_K matrix, medians of one hour:
    128 rows 14 against 39 ms, 256 rows 54 against 103, 512 rows 80 against 142, 1024 rows 176 against
    253; Q6_K's groups of 16 on half-width tiles: docs/kernels.md), and hold no float32 copy of the
    matrix. (Int8 math takes the int8 GEMM or the panel kernel whatever this says.)"""
    return bits in (4, 5, 6) and panel_form(w, scales) and panel_tiles()


def x3_gemm() -> bool:
    """Whether exact (int16) math multiplies 3 or more rows of x by the int8 GEMM on three (two) planes
    of x."""
    if int8_math():
        return False
    ext = extension()
    return ext is not None and ext.isa() == "avx512"


def held_int16(x: mx.array) -> mx.array:
    """x (..., K) as int16 math holds it, float32: per run of 32, d * (x1 + x2 / 2^7) with d = max|x| / 127,
    x1 = rint(x / d) and x2 = rint((x - x1 d) * 2^7 / d), the first two pieces of the kernels' split
    (``quantize_x``, src/kernels_impl.inc; ``hold_two_pieces`` in src/qmm.cpp), so the dequantize + GEMM
    path multiplies the same x as the integer paths. A run with a NaN or infinity becomes NaN."""
    shape = x.shape
    v = x.astype(mx.float32).reshape(-1, shape[-1] // 32, 32)
    amax = mx.max(mx.abs(v), axis=-1, keepdims=True)
    d = amax / 127.0
    inv = mx.where(amax > 0, 127.0 / amax, 0.0)
    x1 = mx.clip(mx.round(v * inv), -127, 127)
    # the kernel's fma(-x1, d, v): exact in float64 (x1 d has at most 32 significant bits)
    r1 = (v.astype(mx.float64) - x1.astype(mx.float64) * d.astype(mx.float64)).astype(mx.float32)
    x2 = mx.clip(mx.round((r1 * inv) * 128.0), -127, 127)
    held = (x1 * 128.0 + x2) * (d / 128.0)
    return mx.where(amax <= 3.4e38, held, mx.nan).reshape(shape)


def int8_gemm(bits: int) -> bool:
    """Whether many rows of x with int8 math take the extension's int8 GEMM (AVX-512 VNNI; 4- to 8-bit
    weights: src/kernels_gemm_avx512.cpp) instead of dequantize + a float32 GEMM."""
    if bits not in SPEC.bits or not int8_math():
        return False
    ext = extension()
    return ext is not None and ext.isa() == "avx512"


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
        assert biases is not None
        k = x.shape[-1]
        if (
            k
            and x.size // k >= dequantize_rows(w, scales, bits)
            and not int8_gemm(bits)
            and not on_tiles(w, scales, bits)
        ):
            dense = run(DEQUANTIZE_SPEC, w, scales, biases, group_size, bits)
            out = x.dtype if x.dtype == scales.dtype or scales.dtype == mx.uint8 else mx.float32
            xf = held_int16(x) if x_planes() == 2 and x3_gemm() else x.astype(mx.float32)
            return (xf @ dense.T).astype(out)
        return run(SPEC, x, w, scales, biases, group_size, bits, x_planes=x_planes())
    return reference(x, w, scales, biases, transpose, group_size, bits, mode)


def dequantize(
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int = 64,
    bits: int = 4,
    *,
    backend: str | None = None,
) -> mx.array:
    """The float32 (N, K) weights: ``mx.dequantize``'s result, computed by the CPU kernel (the only
    one that reads two-level uint8 scales, ``scales.two_level_scales``)."""
    dtype = mx.float32 if scales.dtype == mx.uint8 else scales.dtype
    if resolve_backend(backend, DEQUANTIZE_SPEC, bits=bits, group_size=group_size, dtype=dtype) == "native":
        return run(DEQUANTIZE_SPEC, w, scales, biases, group_size, bits)
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(mx.float32)


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
