"""Duet's CPU kernels (cpu_kernels/): the quantized matmul against float64 NumPy, on every variant and
thread count, inside mx.compile, in a model, and the fallback when the extension is missing.

The oracle is independent of the kernel and of MLX's quantized matmul: the packed words are unpacked
as a little-endian bit stream with NumPy, dequantized and multiplied in float64.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cpu_kernels import spec
from cpu_kernels.modules import CPUQuantizedEmbedding, CPUQuantizedLinear, use_cpu_kernels
from cpu_kernels.qmm import X3_GEMM_ROWS, dequantize, dequantize_rows, quantized_matmul, x3_gemm

pytestmark = [
    pytest.mark.skipif(
        mx.metal.is_available(), reason="the CPU kernels are for CPU inference (Metal has its own)"
    ),
    pytest.mark.usefixtures("exact_math"),  # exact math is these tests' reference (conftest.py)
]

BITS = (4, 5, 6, 8)
GROUPS = (32, 64, 128)
# Relative to |x| @ |w|.T: float32 accumulation over K <= 640 stays far below this (measured < 2e-6).
F32_TOL = 1e-5


@pytest.fixture(scope="module")
def ext():
    """The built extension; a missing one is a failed setup (``make setup`` builds it)."""
    module = spec.extension()
    assert module is not None, f"cpu_kernels._ext is not built: {spec.unavailable_reason()}"
    yield module
    module.set_isa("")
    spec.set_threads()


def variants(ext) -> list[str]:
    order = ["avx512", "avx2", "base"]
    return order[order.index(ext.isa()) :] if ext.isa() in order else ["base"]


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def dequantize_f64(
    wq: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> np.ndarray:
    rows = wq.shape[0]
    raw = np.array(wq).astype("<u4").view(np.uint8).reshape(rows, -1)
    stream = np.unpackbits(raw, axis=1, bitorder="little").reshape(rows, -1, bits)
    codes = stream.astype(np.int64) @ (1 << np.arange(bits, dtype=np.int64))
    s = np.repeat(f64(scales), group_size, axis=1)
    b = np.repeat(f64(biases), group_size, axis=1)
    return codes * s + b


def case(rng: np.random.Generator, m: int, n: int, k: int, group_size: int, bits: int, dtype=mx.float32):
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.1).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    return x, wq, scales, biases


def check(y: mx.array, x: mx.array, wq, scales, biases, group_size: int, bits: int, tol: float) -> float:
    w = dequantize_f64(wq, scales, biases, group_size, bits)
    ref = f64(x).reshape(-1, w.shape[1]) @ w.T
    mag = np.abs(f64(x)).reshape(-1, w.shape[1]) @ np.abs(w).T
    err = np.abs(f64(y).reshape(ref.shape) - ref) / (mag + 1e-30)
    assert y.shape == (*x.shape[:-1], wq.shape[0])
    assert float(err.max()) <= tol, f"max relative error {err.max():.3g} > {tol}"
    return float(err.max())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUPS)
def test_matches_float64_every_variant_shape_batch_and_thread_count(ext, bits, group_size):
    rng = np.random.default_rng(bits * 1000 + group_size)
    threads = max(2, spec.physical_cores())
    # Odd row counts (a thread's share ends mid 8-row block), K of 1-5 groups, 1..16 rows of x
    # (every tile size and tail), and enough rows that several threads share the work.
    # 20 groups: the bias term takes 16 groups as one vector, then 4 one by one.
    shapes = [
        (1, 1, group_size),
        (3, 37, 2 * group_size),
        (16, 67, 5 * group_size),
        (9, 1031, group_size),
        (2, 19, 20 * group_size),
        (1, 67, 64 * group_size),  # one row, K a multiple of 256: the integer kernels' 512-bit loops
    ]
    for isa in variants(ext):
        ext.set_isa(isa)
        for m, n, k in shapes:
            x, wq, scales, biases = case(rng, m, n, k, group_size, bits)
            outs = []
            for t in (1, threads):
                spec.set_threads(t)
                y = quantized_matmul(
                    x, wq, scales, biases, group_size=group_size, bits=bits, backend="native"
                )
                check(y, x, wq, scales, biases, group_size, bits, F32_TOL)
                outs.append(np.array(y))
            # each output row is computed by one thread whatever the split: bit-for-bit the same
            assert np.array_equal(outs[0], outs[1]), (isa, m, n, k)
    for m in range(1, 17):  # every batch size 1..16 on the best variant
        ext.set_isa("")
        x, wq, scales, biases = case(rng, m, 45, 2 * group_size, group_size, bits)
        y = quantized_matmul(x, wq, scales, biases, group_size=group_size, bits=bits, backend="native")
        check(y, x, wq, scales, biases, group_size, bits, F32_TOL)


def exact_on_1_and_n_threads(x, wq, scales, biases, group_size: int, bits: int) -> list[np.ndarray]:
    """The product on 1 thread and on several: each within F32_TOL of float64, and the same bits."""
    outs = []
    for t in (1, max(2, spec.physical_cores())):
        spec.set_threads(t)
        y = quantized_matmul(x, wq, scales, biases, group_size=group_size, bits=bits, backend="native")
        check(y, x, wq, scales, biases, group_size, bits, F32_TOL)
        outs.append(np.array(y))
    assert np.array_equal(outs[0], outs[1])
    return outs


@pytest.mark.parametrize("bits", BITS)
def test_integer_kernel_for_one_or_two_rows_keeps_float32_accuracy(ext, bits):
    """One or two rows of x (a decode step, a short verification) go through 8-bit integer dot
    products where the CPU has them (AVX-512 VNNI), with x split into three bytes per value. It must
    stay within the float kernel's tolerance when a block of x mixes an outlier with tiny values, when
    a block is all zeros, and with a NaN in x (NaN out, as in float arithmetic); K that is not a whole
    number of the integer kernel's steps takes the float kernel."""
    rng = np.random.default_rng(40 + bits)
    # one row of 4-bit codes with K a multiple of 256 takes the 512-bit loop (kernels_impl.inc)
    for group_size, m, k in ((32, 1, 384), (32, 1, 512), (64, 2, 384), (128, 1, 512), (32, 2, 384)):
        x, wq, scales, biases = case(rng, m, 71, k, group_size, bits)
        xs = np.array(x)
        xs[:, :32] *= 1e-4
        xs[:, 5] = 300.0  # an outlier beside values 1e6 times smaller
        xs[:, 64:96] = 0.0
        xs[:, 128:160] *= 1e-30  # tiny, still normal floats
        x = mx.array(xs)
        outs = exact_on_1_and_n_threads(x, wq, scales, biases, group_size, bits)
        xs[-1, 200] = np.nan
        y = quantized_matmul(
            mx.array(xs), wq, scales, biases, group_size=group_size, bits=bits, backend="native"
        )
        assert np.isnan(np.array(y)[..., -1, :]).all()
        if m == 2:
            assert np.array_equal(np.array(y)[0], outs[0][0])  # the other row is untouched
    x, wq, scales, biases = case(rng, 1, 33, 96, 32, bits)  # 4-bit: 96 is not a multiple of 64
    y = quantized_matmul(x, wq, scales, biases, group_size=32, bits=bits, backend="native")
    check(y, x, wq, scales, biases, 32, bits, F32_TOL)


@pytest.mark.parametrize("bits", BITS)
def test_integer_kernel_on_long_rows_reads_several_weight_rows_per_pass_and_stays_exact(ext, bits):
    """Past K = 4096 one row of x in three bytes a value no longer stays in L1 beside the weights, so
    the integer kernel takes 4 weight rows (2 with two rows of x) per pass over it (Llama-3.2-1B's
    down_proj, K = 8192). Row counts that leave 1-3 rows over, one and two rows of x, float32 and
    float16 scales: within float32's tolerance of float64, the same bits on 1 and 2 threads, NaN in a
    row of x only in that row's outputs."""
    rng = np.random.default_rng(70 + bits)
    for group_size, m, n, dtype in (
        (32, 1, 43, mx.float32),
        (128, 2, 38, mx.float16),
        (64, 1, 41, mx.float16),
    ):
        k = 8192 + 256
        x, wq, scales, biases = case(rng, m, n, k, group_size, bits)
        scales, biases = scales.astype(dtype), biases.astype(dtype)
        outs = exact_on_1_and_n_threads(x, wq, scales, biases, group_size, bits)
        xs = np.array(x)
        xs[-1, 5000] = np.nan
        y = np.array(
            quantized_matmul(
                mx.array(xs), wq, scales, biases, group_size=group_size, bits=bits, backend="native"
            )
        )
        assert np.isnan(y[-1]).all()
        if m == 2:
            assert np.array_equal(y[0], outs[0][0])


needs_x3_gemm = pytest.mark.skipif(
    not x3_gemm(),
    reason="exact math's three-plane GEMM is the AVX-512 VNNI variant's (x86-64 with VNNI only)",
)


@needs_x3_gemm
@pytest.mark.parametrize("bits", BITS)
def test_exact_gemm_on_three_planes_of_x_keeps_float32_accuracy(ext, bits):
    """From 3 rows of x (a short prompt, a chat turn's new tokens) up to X3_GEMM_ROWS, exact math on
    AVX-512 VNNI multiplies by the int8 GEMM with x split into three int8 planes (3 GEMM rows a row of
    x, added): it must keep the float kernel's float32 accuracy where a block of x mixes an outlier
    with values 1e6 times smaller, is all zeros or tiny, for the GEMM's tails of 1-3 rows, float16
    scales and K of one or many panel stretches; a NaN or infinity in one row of x makes that row's
    outputs NaN and leaves the other rows' bits as they were."""
    rng = np.random.default_rng(90 + bits)
    for group_size, m, n, k, dtype in (
        (32, 3, 45, 384, mx.float32),
        (64, 7, 70, 1152, mx.float16),
        (128, 20, 33, 640, mx.float32),
        (32, X3_GEMM_ROWS - 1, 37, 512, mx.float16),
    ):
        x, wq, scales, biases = case(rng, m, n, k, group_size, bits)
        scales, biases = scales.astype(dtype), biases.astype(dtype)
        xs = np.array(x)
        xs[0, :32] *= 1e-4  # row 0 as the integer row kernel's test has it
        xs[0, 5] = 300.0
        xs[0, 64:96] = 0.0
        xs[0, 128:160] *= 1e-30
        x = mx.array(xs)
        outs = exact_on_1_and_n_threads(x, wq, scales, biases, group_size, bits)
        for bad in (np.nan, np.inf):
            xb = xs.copy()
            xb[1, 100] = bad
            y = np.array(
                quantized_matmul(
                    mx.array(xb), wq, scales, biases, group_size=group_size, bits=bits, backend="native"
                )
            )
            assert np.isnan(y[1]).all(), (m, bad)
            others = np.arange(m) != 1
            assert np.array_equal(y[others], outs[0][others]), (m, bad)


@needs_x3_gemm
def test_exact_gemm_takes_rows_in_chunks_against_a_huge_n(ext):
    """The three planes' products are held for a bounded number of bytes (48 MB): against 1.1M weight
    rows, 8 rows of x go as chunks of 3, 3 and 2, every row's outputs still within float32's
    tolerance (checked at both ends of N)."""
    rng = np.random.default_rng(97)
    n, k = 1_100_000, 64
    x, wq, scales, biases = case(rng, 8, n, k, 32, 4)
    y = quantized_matmul(x, wq, scales, biases, group_size=32, bits=4, backend="native")
    for part in (slice(0, 700), slice(n - 700, n)):
        check(y[:, part], x, wq[part], scales[part], biases[part], 32, 4, F32_TOL)


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_matches_float64_every_variant_and_thread_count(ext, bits):
    rng = np.random.default_rng(bits)
    threads = max(2, spec.physical_cores())
    for isa in variants(ext):
        ext.set_isa(isa)
        for group_size in GROUPS:
            for n, k in ((1, group_size), (37, 3 * group_size), (300, 2 * group_size)):
                _, wq, scales, biases = case(rng, 1, n, k, group_size, bits)
                outs = []
                for t in (1, threads):
                    spec.set_threads(t)
                    d = dequantize(wq, scales, biases, group_size, bits, backend="native")
                    assert d.shape == (n, k) and d.dtype == mx.float32
                    want = dequantize_f64(wq, scales, biases, group_size, bits)
                    # one float32 multiply-add per value
                    assert np.abs(f64(d) - want).max() <= 1e-6 * (np.abs(want).max() + 1e-30), (
                        isa,
                        group_size,
                    )
                    outs.append(np.array(d))
                assert np.array_equal(outs[0], outs[1])


def test_the_gemm_path_starts_later_with_more_kernel_threads(ext):
    """The float kernel's threads split its work, dequantize + GEMM gains less from them: the
    crossover scales with the kernels' thread count. Where exact math has the int8 GEMM on three
    planes of x (AVX-512 VNNI), both sides are GEMMs that scale alike: a fixed row count."""
    try:
        for isa in variants(ext):
            ext.set_isa(isa)
            spec.set_threads(1)
            one = dequantize_rows()
            spec.set_threads(2)
            if x3_gemm():
                assert one == dequantize_rows() == X3_GEMM_ROWS, isa
            else:
                assert dequantize_rows() == 2 * one, isa
    finally:
        ext.set_isa("")
        spec.set_threads()


def test_many_rows_go_through_dequantize_and_gemm(ext):
    """Prefill-sized x (>= dequantize_rows() rows): the weights are dequantized by the kernel and
    multiplied by MLX's GEMM; same results as the fused kernel within float32 rounding."""
    rng = np.random.default_rng(4)
    for bits in BITS:
        x, wq, scales, biases = case(rng, dequantize_rows() + 13, 70, 192, 64, bits)
        y = quantized_matmul(x, wq, scales, biases, group_size=64, bits=bits, backend="native")
        check(y, x, wq, scales, biases, 64, bits, F32_TOL)
        fused = ext.quantized_matmul(x, wq, scales, biases, 64, bits)
        check(fused, x, wq, scales, biases, 64, bits, F32_TOL)
        xh = x.astype(mx.bfloat16)
        yh = quantized_matmul(
            xh, wq, scales.astype(mx.bfloat16), biases.astype(mx.bfloat16), group_size=64, bits=bits
        )
        assert yh.dtype == mx.bfloat16 and yh.shape == y.shape


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_inputs_and_scales(ext, dtype):
    rng = np.random.default_rng(7)
    for isa in variants(ext):
        ext.set_isa(isa)
        for bits in BITS:
            # 2 groups, and 40 (the bias term is summed 16 groups at a time, then one by one)
            for m, k, group_size in ((4, 128, 64), (5, 1280, 32), (1, 1280, 32)):
                x, wq, scales, biases = case(rng, m, 50, k, group_size, bits, dtype)
                assert scales.dtype == dtype
                y = quantized_matmul(
                    x, wq, scales, biases, group_size=group_size, bits=bits, backend="native"
                )
                assert y.dtype == dtype
                # float32 inside; the only extra error is the output's rounding to dtype
                check(
                    y, x, wq, scales, biases, group_size, bits, 2.0**-7 if dtype == mx.bfloat16 else 2.0**-10
                )
    ext.set_isa("")


def test_batch_dims_and_strided_inputs(ext):
    rng = np.random.default_rng(3)
    x, wq, scales, biases = case(rng, 6, 40, 96, 32, 4)
    y1 = quantized_matmul(x[0], wq, scales, biases, group_size=32, bits=4, backend="native")  # 1-D x
    check(y1, x[0], wq, scales, biases, 32, 4, F32_TOL)
    empty = quantized_matmul(x[:0], wq, scales, biases, group_size=32, bits=4, backend="native")
    assert empty.shape == (0, 40) and empty.size == 0
    x3 = x.reshape(2, 3, 96)
    y = quantized_matmul(x3, wq, scales, biases, group_size=32, bits=4, backend="native")
    check(y, x3, wq, scales, biases, 32, 4, F32_TOL)
    wide = mx.array(rng.standard_normal((96, 12)).astype(np.float32))
    xt = wide.T[::2]  # (6, 96), neither row- nor column-contiguous
    y = quantized_matmul(xt, wq, scales, biases, group_size=32, bits=4, backend="native")
    check(y, xt, wq, scales, biases, 32, 4, F32_TOL)
    ws = mx.concatenate([wq, wq], axis=1)[:, : wq.shape[1]]  # a strided view of the packed weights
    y = quantized_matmul(x, ws, scales, biases, group_size=32, bits=4, backend="native")
    check(y, x, wq, scales, biases, 32, 4, F32_TOL)


def test_composes_lazily_and_under_compile(ext):
    rng = np.random.default_rng(11)
    x, wq, scales, biases = case(rng, 5, 64, 128, 32, 4)

    def f(a):
        h = quantized_matmul(mx.maximum(a, 0) * 2, wq, scales, biases, group_size=32, bits=4)
        return mx.tanh(h).sum(axis=-1)

    eager = f(x)
    compiled = mx.compile(f)
    assert np.array_equal(np.array(compiled(x)), np.array(eager))
    shapeless = mx.compile(f, shapeless=True)
    for m in (1, 3, 5):  # one compiled graph, several batch sizes
        assert np.array_equal(np.array(shapeless(x[:m])), np.array(f(x[:m])))


def test_bad_arguments_are_one_line_errors_and_the_op_still_works(ext):
    rng = np.random.default_rng(5)
    x, wq, scales, biases = case(rng, 2, 16, 64, 32, 4)
    with pytest.raises(ValueError, match="K=32 but w packs 64"):
        ext.quantized_matmul(x[:, :32], wq, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="bits must be"):
        ext.quantized_matmul(x, wq, scales, biases, 32, 3)
    with pytest.raises(ValueError, match="group_size"):
        ext.quantized_matmul(x, wq, scales, biases, 16, 4)
    with pytest.raises(ValueError, match="scales and biases"):
        ext.quantized_matmul(x, wq, scales[:, :1], biases, 32, 4)
    with pytest.raises(ValueError):
        quantized_matmul(x, wq, scales, biases, group_size=32, bits=3, backend="native")
    check(
        quantized_matmul(x, wq, scales, biases, group_size=32, bits=4), x, wq, scales, biases, 32, 4, F32_TOL
    )


def test_unsupported_formats_take_mlx_path(ext):
    rng = np.random.default_rng(9)
    x, wq, scales, biases = case(rng, 2, 16, 64, 32, 3)  # 3-bit: not in the kernel
    y = quantized_matmul(x, wq, scales, biases, group_size=32, bits=3)
    ref = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=32, bits=3)
    assert np.allclose(np.array(y), np.array(ref))


def test_untransposed_and_bias_free_products_take_mlx_path(ext):
    """``transpose=False`` is x @ dequantize(w), which the kernel (x @ w.T) does not compute: a square w
    would give a wrong answer of the right shape. A missing bias (a non-affine mode) goes to MLX too."""
    rng = np.random.default_rng(11)
    x, wq, scales, biases = case(rng, 3, 64, 64, 32, 4)
    w = dequantize_f64(wq, scales, biases, 32, 4)
    assert not np.allclose(f64(x) @ w, f64(x) @ w.T, atol=1e-2)  # the two products differ here
    for rows in (3, dequantize_rows() + 1):  # the fused kernel's size and the dequantize + GEMM one
        xs = mx.array(rng.standard_normal((rows, 64)).astype(np.float32))
        y = quantized_matmul(xs, wq, scales, biases, transpose=False, group_size=32, bits=4)
        ref = mx.quantized_matmul(xs, wq, scales, biases, transpose=False, group_size=32, bits=4)
        assert np.allclose(np.array(y), np.array(ref), atol=1e-5)
        assert np.allclose(f64(y), f64(xs) @ w, atol=1e-4)
    with pytest.raises(ValueError, match="x @ w.T"):
        quantized_matmul(x, wq, scales, biases, transpose=False, group_size=32, bits=4, backend="native")
    with pytest.raises(ValueError, match="with biases"):
        quantized_matmul(x, wq, scales, None, group_size=32, bits=4, backend="native")


def _tiny_quantized(tiny_dirs, arch: str, kernels: bool):
    from mlx_engine.loading.loader import load_model

    loaded = load_model(str(tiny_dirs(arch)), weights="dense")
    nn.quantize(loaded.model, group_size=32, bits=4)
    if kernels:
        assert use_cpu_kernels(loaded.model) > 0
    return loaded


def test_layers_switch_and_logits_match_mlx_quantized_path(ext, tiny_dirs):
    ours = _tiny_quantized(tiny_dirs, "qwen3", kernels=True)  # tied embeddings: the LM head too
    theirs = _tiny_quantized(tiny_dirs, "qwen3", kernels=False)
    kinds = {type(m) for _, m in ours.model.named_modules()}
    assert CPUQuantizedLinear in kinds and CPUQuantizedEmbedding in kinds
    assert nn.QuantizedLinear not in kinds and nn.QuantizedEmbedding not in kinds
    tokens = mx.array([[5, 9, 200, 31, 7, 64, 3, 12]])
    a, b = f64(ours.model(tokens)), f64(theirs.model(tokens))
    # MLX's CPU quantized matmul rounds through lower precision than our float32 accumulation;
    # measured max |diff| ~1e-5 on these logits (|logits| ~ 1).
    assert np.abs(a - b).max() < 1e-3
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_layers_of_a_format_the_kernel_lacks_keep_mlx_and_the_same_logits(ext, tiny_dirs):
    """3-bit weights (not a kernel format): ``use_cpu_kernels`` switches the norms, RoPEs and MLPs,
    never those layers, and the logits are MLX's own."""
    from mlx_engine.loading.loader import load_model

    def model(kernels: bool) -> nn.Module:
        m = load_model(str(tiny_dirs("qwen3")), weights="dense").model
        nn.quantize(m, group_size=32, bits=3)
        if kernels:
            assert use_cpu_kernels(m) > 0  # the norms, RoPEs and MLPs
        return m

    ours, theirs = model(True), model(False)
    kinds = {type(m) for _, m in ours.named_modules()}
    assert CPUQuantizedLinear not in kinds and CPUQuantizedEmbedding not in kinds
    assert nn.QuantizedLinear in kinds and nn.QuantizedEmbedding in kinds
    for tokens in (mx.array([[5]]), mx.array([[5, 9, 200, 31, 7, 64, 3, 12]])):  # decode and prefill
        assert np.abs(f64(ours(tokens)) - f64(theirs(tokens))).max() < 1e-3


def test_engine_paged_batched_matches_mlx_lm_with_quantized_cpu_weights(ext, tiny_dirs):
    """test_engine_tiny's equivalence (paged engine, alone and batched, vs mlx-lm's loop on the same
    model) with 4-bit weights through the kernel: batching changes how many rows the kernel takes at
    once, which must not change a greedy token."""
    from mlx_engine.engine import Engine, EngineConfig
    from tests.test_engine_tiny import prompts, reference_greedy, req, run_all

    loaded = _tiny_quantized(tiny_dirs, "llama", kernels=True)
    ps = prompts(loaded.tokenizer.vocab_size, [1, 5, 17, 33, 2, 64, 16, 40])
    expected = [reference_greedy(loaded.model, p, 12) for p in ps]
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=16))
    try:
        alone = [asyncio.run(run_all(engine, [req(p)]))[0] for p in ps[:3]]
        assert alone == expected[:3]
        assert asyncio.run(run_all(engine, [req(p) for p in ps])) == expected
    finally:
        engine.shutdown()


def test_missing_extension_logs_once_and_falls_back(monkeypatch, caplog):
    """Simulate an absent build: importing cpu_kernels._ext fails. One warning, the reference path
    computes the same product, and the loader expands the bundled GGUF to dense float32 (today's path)
    and generates."""
    from mlx_engine.loading import weight_policy
    from mlx_engine.loading.loader import load_model

    monkeypatch.setitem(sys.modules, "cpu_kernels._ext", None)  # `import` now raises ImportError
    monkeypatch.setattr(spec, "_state", {"loaded": False, "ext": None, "reason": None})
    monkeypatch.delenv("DUET_CPU_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING, logger="duet.cpu_kernels"):
        assert spec.extension() is None
        assert not spec.available()
        assert not weight_policy.keep_quantized("cpu")
        rng = np.random.default_rng(1)
        x, wq, scales, biases = case(rng, 3, 20, 64, 32, 4)
        y = quantized_matmul(x, wq, scales, biases, group_size=32, bits=4)
        check(y, x, wq, scales, biases, 32, 4, 1e-3)  # MLX's own CPU path
        with pytest.raises(RuntimeError, match="not available"):
            quantized_matmul(x, wq, scales, biases, group_size=32, bits=4, backend="native")
        loaded = load_model(None)
        assert loaded.weight_format.startswith("dense float32")
        from tests.test_engine_tiny import reference_greedy

        assert (
            len(reference_greedy(loaded.model, loaded.tokenizer.encode("The capital of France is"), 4)) == 4
        )
    lines = [r for r in caplog.records if r.name == "duet.cpu_kernels"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "CPU kernels unavailable" in lines[0].getMessage() and "cannot import" in lines[0].getMessage()


def test_stale_build_for_another_mlx_is_refused(monkeypatch, tmp_path, caplog):
    stamp = tmp_path / "_ext.stamp"
    stamp.write_text("0.0.1 0123456789abcdef\n")
    monkeypatch.setattr(spec, "STAMP", stamp)
    monkeypatch.setattr(spec, "_state", {"loaded": False, "ext": None, "reason": None})
    monkeypatch.delenv("DUET_CPU_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING, logger="duet.cpu_kernels"):
        assert spec.extension() is None
    assert "built for mlx 0.0.1" in spec.unavailable_reason()


# --- RMSNorm ------------------------------------------------------------------------------------

NORM_TOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}  # relative to |w|: a few ulps


def rms_norm_f64(x: mx.array, w: mx.array, eps: float) -> np.ndarray:
    xf, wf = f64(x), f64(w)
    return xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + eps) * wf


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 7), (2, 33), (1,), (4, 1), (2, 3, 4, 64), (0, 8)])
def test_rms_norm_matches_float64(ext, dtype, shape):
    from cpu_kernels.norm import rms_norm

    rng = np.random.default_rng(sum(shape) + len(shape))
    x = mx.array(rng.normal(0, 3, shape).astype(np.float32)).astype(dtype)
    w = mx.array(rng.normal(1, 0.5, shape[-1:]).astype(np.float32)).astype(dtype)
    y = rms_norm(x, w, 1e-5, backend="native")
    assert y.dtype == dtype and y.shape == x.shape
    err = np.abs(f64(y) - rms_norm_f64(x, w, 1e-5))
    assert (err <= NORM_TOL[dtype] * (np.abs(f64(w)) + 1e-3) * 4).all(), err.max()
    ref = mx.fast.rms_norm(x, w, 1e-5)
    assert (np.abs(f64(y) - f64(ref)) <= NORM_TOL[dtype] * 8).all()


def test_rms_norm_mixed_dtypes_views_threads_and_compile(ext):
    from cpu_kernels.norm import rms_norm

    rng = np.random.default_rng(3)
    x = mx.array(rng.normal(0, 1, (40, 300, 96)).astype(np.float32))  # enough rows to use the pool
    w = mx.array(rng.normal(1, 0.5, (96,)).astype(np.float32))
    want = rms_norm_f64(x, w, 1e-6)
    for threads in (1, 4):
        spec.set_threads(threads)
        assert np.abs(f64(rms_norm(x, w, 1e-6, backend="native")) - want).max() < 1e-5
    spec.set_threads()
    # a transposed view, a strided weight, and mx.compile
    xt = x.transpose(1, 0, 2)
    assert np.abs(f64(rms_norm(xt, w, 1e-6, backend="native")) - rms_norm_f64(xt, w, 1e-6)).max() < 1e-5
    w2 = mx.concatenate([w[:, None], w[:, None]], axis=1)[:, 0]
    assert np.abs(f64(rms_norm(x, w2, 1e-6, backend="native")) - want).max() < 1e-5
    compiled = mx.compile(lambda a, b: rms_norm(a, b, 1e-6, backend="native"))
    assert np.abs(f64(compiled(x, w)) - want).max() < 1e-5
    # float16 x with float32 w promotes to float32, as mx.fast.rms_norm does
    y = rms_norm(x[:2].astype(mx.float16), w, 1e-6, backend="native")
    assert y.dtype == mx.float32


def test_rms_norm_bad_input_is_a_clear_error(ext):
    from cpu_kernels.norm import rms_norm

    with pytest.raises(ValueError, match="w has 3 values"):
        rms_norm(mx.zeros((2, 4)), mx.ones((3,)), 1e-5, backend="native")
    with pytest.raises(ValueError, match="float"):
        rms_norm(mx.zeros((2, 4), dtype=mx.int32), mx.ones((4,)), 1e-5, backend="native")


def test_model_norms_switch_and_logits_match(ext, tiny_dirs):
    from cpu_kernels.modules import CPURMSNorm

    ours = _tiny_quantized(tiny_dirs, "llama", kernels=True)
    theirs = _tiny_quantized(tiny_dirs, "llama", kernels=False)
    kinds = [type(m) for _, m in ours.model.named_modules()]
    assert CPURMSNorm in kinds and nn.RMSNorm not in kinds
    assert nn.RMSNorm in {type(m) for _, m in theirs.model.named_modules()}
    tokens = mx.array([[5, 9, 200, 31, 7, 64, 3, 12]])
    a, b = f64(ours.model(tokens)), f64(theirs.model(tokens))
    assert np.abs(a - b).max() < 1e-3
    assert (a.argmax(-1) == b.argmax(-1)).all()


# --- RoPE ---------------------------------------------------------------------------------------


def rope_f64(x: mx.array, dims: int, traditional: bool, base: float, scale: float, offsets, freqs=None):
    xf = f64(x)
    B, T = xf.shape[0], xf.shape[-2]
    half = dims // 2
    theta = 1.0 / f64(freqs) if freqs is not None else base ** (-2.0 * np.arange(half) / dims)
    starts = np.broadcast_to(np.asarray(offsets, dtype=np.float64).reshape(-1), (B,))
    pos = (starts[:, None] + np.arange(T)[None, :]) * scale  # (B, T)
    ang = pos[..., None] * theta  # (B, T, half)
    shape = (B,) + (1,) * (xf.ndim - 3) + (T, half)
    c, s = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    y = xf.copy()
    if traditional:
        x1, x2 = xf[..., 0:dims:2], xf[..., 1:dims:2]
        y[..., 0:dims:2], y[..., 1:dims:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = xf[..., :half], xf[..., half:dims]
        y[..., :half], y[..., half:dims] = x1 * c - x2 * s, x1 * s + x2 * c
    return y


ROPE_TOL = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}  # x ~ N(0, 1): a few ulps of |y| <= 4


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(
    ("shape", "dims", "offset"),
    [
        ((1, 9, 1, 64), 64, 63),  # a decode step: one token, int offset
        ((2, 3, 5, 64), 64, [3, 900]),  # per-row offsets (the paged engine's batch)
        ((3, 2, 7, 40), 24, [0, 17, 8000]),  # partial rotation, odd T
        ((2, 4, 6), 6, 5),  # 3-D (B, T, D)
        ((1, 2, 3, 2, 10), 10, [11]),  # an extra axis, a one-element offset
    ],
)
def test_rope_matches_float64(ext, dtype, traditional, shape, dims, offset):
    from cpu_kernels.rope import rope

    rng = np.random.default_rng(len(shape) + dims)
    x = mx.array(rng.normal(0, 1, shape).astype(np.float32)).astype(dtype)
    off = offset if isinstance(offset, int) else mx.array(offset, dtype=mx.int32)
    y = rope(x, dims, traditional=traditional, base=10000.0, scale=1.0, offset=off, backend="native")
    assert y.dtype == dtype and y.shape == x.shape
    want = rope_f64(x, dims, traditional, 10000.0, 1.0, offset)
    assert np.abs(f64(y) - want).max() <= ROPE_TOL[dtype]


def test_rope_scale_freqs_views_and_compile(ext):
    from cpu_kernels.rope import rope

    rng = np.random.default_rng(5)
    x = mx.array(rng.normal(0, 1, (2, 4, 3, 32)).astype(np.float32))
    y = rope(x, 32, traditional=False, base=500000.0, scale=0.25, offset=40, backend="native")
    assert np.abs(f64(y) - rope_f64(x, 32, False, 500000.0, 0.25, 40)).max() < 2e-5
    freqs = mx.array(np.linspace(1.0, 300.0, 16).astype(np.float32))
    y = rope(x, 32, traditional=True, base=None, scale=1.0, offset=9, freqs=freqs, backend="native")
    assert np.abs(f64(y) - rope_f64(x, 32, True, 0.0, 1.0, 9, freqs)).max() < 2e-5
    # a transposed view ((B, T, H, D) -> (B, H, T, D)), as attention hands it over
    xt = x.transpose(0, 2, 1, 3)
    y = rope(xt, 32, traditional=False, base=10000.0, scale=1.0, offset=mx.array([2, 7]), backend="native")
    assert np.abs(f64(y) - rope_f64(xt, 32, False, 10000.0, 1.0, [2, 7])).max() < 2e-5
    compiled = mx.compile(
        lambda a, o: rope(a, 32, traditional=False, base=10000.0, scale=1.0, offset=o, backend="native")
    )
    for start in (0, 100):  # the offset is an input: one compiled graph serves every position
        o = mx.array([start, start + 1], dtype=mx.int32)
        assert (
            np.abs(f64(compiled(x, o)) - rope_f64(x, 32, False, 10000.0, 1.0, [start, start + 1])).max()
            < 2e-5
        )


def test_rope_bad_input_is_a_clear_error(ext):
    from cpu_kernels.rope import rope

    x = mx.zeros((2, 1, 3, 8))
    with pytest.raises(ValueError, match="dims must be even"):
        rope(x, 7, traditional=False, base=10000.0, scale=1.0, offset=0, backend="native")
    with pytest.raises(ValueError, match="one position per batch row"):
        rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=mx.array([1, 2, 3]), backend="native")
    with pytest.raises(ValueError, match="exactly one of base and freqs"):
        rope(x, 8, traditional=False, base=None, scale=1.0, offset=0, backend="native")


def test_model_rope_switches_and_logits_match(ext, tiny_dirs):
    from cpu_kernels.modules import CPURoPE

    ours = _tiny_quantized(tiny_dirs, "llama", kernels=True)
    theirs = _tiny_quantized(tiny_dirs, "llama", kernels=False)
    assert CPURoPE in {type(m) for _, m in ours.model.named_modules()}
    assert nn.RoPE not in {type(m) for _, m in ours.model.named_modules()}
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array([[5, 9, 200, 31, 7, 64, 3, 12]])
    for model_pair in ((ours.model, theirs.model),):
        caches = [make_prompt_cache(m) for m in model_pair]
        outs = [f64(m(tokens, cache=c)) for m, c in zip(model_pair, caches, strict=True)]
        assert np.abs(outs[0] - outs[1]).max() < 1e-3
        step = [f64(m(mx.array([[77]]), cache=c)) for m, c in zip(model_pair, caches, strict=True)]
        assert np.abs(step[0] - step[1]).max() < 1e-3  # a decode step at offset 8
        assert step[0].argmax() == step[1].argmax()


# --- SwiGLU -------------------------------------------------------------------------------------

# Relative to |g * up|: float32 within a few ulps; half precision outputs are rounded to their dtype
# (plus float16's subnormal spacing, 2^-24, where a tiny product leaves its normal range).
SWIGLU_TOL = {mx.float32: 1e-6, mx.float16: 1e-3, mx.bfloat16: 8e-3}
SWIGLU_FLOOR = {mx.float32: 0.0, mx.float16: 2.0**-24, mx.bfloat16: 0.0}


def swiglu_f64(g: mx.array, u: mx.array) -> np.ndarray:
    gf, uf = f64(g), f64(u)
    return gf / (1.0 + np.exp(-gf)) * uf


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1536), (16, 1, 1536), (3, 5, 7), (13,), (2, 0, 4)])
def test_swiglu_matches_float64_on_every_variant(ext, dtype, shape):
    """silu(g) * up over the whole range of gates a model produces (|g| up to 100: exp(-|g|) underflows
    instead of overflowing), whole 8-lane vectors and tails, on every instruction set."""
    from cpu_kernels.swiglu import swiglu

    rng = np.random.default_rng(sum(shape) + len(shape))
    g = rng.normal(0, 4, shape).astype(np.float32)
    g.reshape(-1)[: min(g.size, 4)] = [100.0, -100.0, 0.0, -0.0][: min(g.size, 4)]
    gate = mx.array(g).astype(dtype)
    up = mx.array(rng.normal(0, 1, shape).astype(np.float32)).astype(dtype)
    want = swiglu_f64(gate, up)
    scale = np.abs(f64(gate) * f64(up)) + 1e-30
    for isa in variants(ext):
        ext.set_isa(isa)
        y = swiglu(gate, up, backend="native")
        assert y.dtype == dtype and y.shape == gate.shape
        err = np.abs(f64(y) - want)
        assert (err <= SWIGLU_TOL[dtype] * scale + SWIGLU_FLOOR[dtype]).all(), (isa, (err / scale).max())
    ext.set_isa("")


def test_swiglu_threads_views_and_compile(ext):
    from cpu_kernels.swiglu import swiglu

    rng = np.random.default_rng(7)
    gate = mx.array(rng.normal(0, 3, (64, 3000)).astype(np.float32))  # enough elements to use the pool
    up = mx.array(rng.normal(0, 1, (64, 3000)).astype(np.float32))
    outs = []
    for threads in (1, 4):
        spec.set_threads(threads)
        outs.append(np.array(swiglu(gate, up, backend="native")))
    spec.set_threads()
    assert np.array_equal(outs[0], outs[1])  # elementwise: the split cannot change a value
    want = swiglu_f64(gate, up)
    assert (np.abs(outs[0] - want) <= 1e-6 * (np.abs(f64(gate) * f64(up)) + 1e-30)).all()
    gt, ut = gate.T, up.T  # transposed views
    assert np.allclose(np.array(swiglu(gt, ut, backend="native")), outs[0].T, rtol=0, atol=0)
    compiled = mx.compile(lambda a, b: swiglu(a, b, backend="native"))
    assert np.array_equal(np.array(compiled(gate, up)), outs[0])


def test_swiglu_bad_input_is_a_clear_error(ext):
    from cpu_kernels.swiglu import swiglu

    with pytest.raises(ValueError, match="one shape"):
        swiglu(mx.zeros((2, 4)), mx.zeros((2, 5)), backend="native")
    with pytest.raises(ValueError, match="float"):
        swiglu(mx.zeros((2, 4), dtype=mx.int32), mx.zeros((2, 4), dtype=mx.int32), backend="native")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_mlps_switch_and_logits_match(ext, tiny_dirs, arch):
    """Llama's and Qwen3's MLPs (exactly down(swiglu(gate(x), up(x)))) take the kernel; Gemma's GELU
    MLP does not match and keeps its own."""
    ours = _tiny_quantized(tiny_dirs, arch, kernels=True)
    theirs = _tiny_quantized(tiny_dirs, arch, kernels=False)
    mlps = [m for _, m in ours.model.named_modules() if hasattr(m, "gate_proj")]
    assert mlps and all(type(m).__name__.startswith("CPU") for m in mlps)
    assert all(
        not type(m).__name__.startswith("CPU")
        for _, m in theirs.model.named_modules()
        if hasattr(m, "gate_proj")
    )
    tokens = mx.array([[5, 9, 200, 31, 7, 64, 3, 12]])
    a, b = f64(ours.model(tokens)), f64(theirs.model(tokens))
    assert np.abs(a - b).max() < 1e-3
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_gelu_mlps_keep_their_own_activation(ext, tiny_dirs):
    gemma = _tiny_quantized(tiny_dirs, "gemma3_text", kernels=True)
    mlps = [m for _, m in gemma.model.named_modules() if hasattr(m, "gate_proj")]
    assert mlps and not any(type(m).__name__.startswith("CPU") for m in mlps)
