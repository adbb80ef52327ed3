"""Quantized mat-vec kernel (emulated here, real on Apple Silicon) against a float64 oracle."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels import numpy_reference as ref
from metal_kernels.emulator import options
from metal_kernels.qmv import qmv
from metal_kernels.spec import metal_available

EPS = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-23}

KERNEL_BACKENDS = [
    "emulator",
    pytest.param(
        "metal",
        marks=[
            pytest.mark.apple,
            pytest.mark.skipif(not metal_available(), reason="needs Apple Silicon with Metal"),
        ],
    ),
]


def problem(m, n, k, dtype, group_size, bits, seed=0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    return x, wq, s, b


def assert_close(y, x, wq, s, b, group_size, bits):
    expected = ref.qmv(x, wq, s, b, group_size, bits)
    bound = ref.qmv_error_scale(x, wq, s, b, group_size, bits)
    got = ref.to_f64(y)
    assert y.dtype == x.dtype and got.shape == expected.shape
    assert np.isfinite(got).all()
    err = np.abs(got - expected)
    ok = err <= EPS[x.dtype] * np.abs(expected) + 2e-6 * bound
    assert ok.all(), f"{(~ok).sum()} bad outputs, max err {err.max()}"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize(
    "dtype,m,n,k,bits,group_size,order",
    [
        (mx.float16, 1, 44, 640, 4, 64, "forward"),  # K tail of 128 after a 512 step; last group 1 SIMD-group
        (mx.bfloat16, 3, 30, 96, 8, 32, "reverse"),  # K shorter than one step; rows past N
        (mx.float32, 8, 17, 384, 4, 128, "random"),
        (mx.float16, 2, 64, 1024, 8, 128, "random"),
        (mx.bfloat16, 5, 9, 224, 4, 32, "forward"),
    ],
)
def test_qmv_matches_float64(backend, dtype, m, n, k, bits, group_size, order):
    x, wq, s, b = problem(m, n, k, dtype, group_size, bits)
    with options(order=order, strict=True):
        y = qmv(x, wq, s, b, group_size, bits, backend=backend)
    assert_close(y, x, wq, s, b, group_size, bits)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_qmv_more_than_eight_vectors_and_leading_dims(backend):
    x, wq, s, b = problem(10, 17, 384, mx.float32, 128, 4, seed=1)
    y = qmv(x.reshape(2, 5, 384), wq, s, b, 128, 4, backend=backend)
    assert y.shape == (2, 5, 17)
    assert_close(y.reshape(10, 17), x, wq, s, b, 128, 4)


def test_reference_path_is_mlx_quantized_matmul():
    x, wq, s, b = problem(3, 32, 256, mx.float32, 64, 4, seed=2)
    assert_close(qmv(x, wq, s, b, 64, 4, backend="reference"), x, wq, s, b, 64, 4)


def test_qmv_validation():
    x, wq, s, b = problem(1, 8, 128, mx.float32, 32, 4)
    with pytest.raises(ValueError):
        qmv(x[:, :64], wq, s, b, 32, 4)
    with pytest.raises(ValueError):
        qmv(x, wq, s, b, 32, 3)
    with pytest.raises(ValueError):
        qmv(x, wq, s[:, :2], b, 32, 4)
