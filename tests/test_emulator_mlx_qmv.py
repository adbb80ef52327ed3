"""Validate the emulator on a kernel proven on Apple hardware: MLX's own ``qmv_fast``.

The kernel text comes verbatim from the ``quantized.h`` shipped in the installed mlx wheel. It must
reproduce a float64 reference, and bugs injected into that text must be caught.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels import numpy_reference as ref
from metal_kernels.emulator import EmulatorError, metal_kernel, options
from metal_kernels.emulator import mlx_headers as mh

EPS = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-23}


def make_problem(dtype, group_size, bits, m=3, n=32, k=1024, seed=0):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    x = mx.random.normal((m, k)).astype(dtype)
    return x, wq, s, b


def run_qmv_fast(header, x, wq, s, b, group_size, bits, name="mlx_qmv_fast"):
    m, k = x.shape
    n = wq.shape[0]
    kernel = metal_kernel(name, list(mh.QMV_FAST_INPUTS), ["y"], mh.QMV_FAST_BODY, header=header)
    (y,) = kernel(
        inputs=[wq, s, b, x, mx.array(k, dtype=mx.int32), mx.array(n, dtype=mx.int32)],
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
        template=[("T", x.dtype), ("group_size", group_size), ("bits", bits)],
        **mh.qmv_fast_launch(m, n, k),
    )
    return y


def within_tolerance(y, x, wq, s, b, group_size, bits) -> np.ndarray:
    expected = ref.qmv(x, wq, s, b, group_size, bits)
    bound = ref.qmv_error_scale(x, wq, s, b, group_size, bits)
    err = np.abs(ref.to_f64(y) - expected)
    return err <= EPS[x.dtype] * np.abs(expected) + 1e-5 * bound


@pytest.mark.parametrize(
    "dtype,group_size,bits,order",
    [
        (mx.float16, 64, 4, "forward"),
        (mx.bfloat16, 32, 8, "reverse"),
        (mx.float32, 128, 4, "random"),
        (mx.float16, 128, 8, "random"),
    ],
)
def test_mlx_qmv_fast_matches_float64_reference(dtype, group_size, bits, order):
    x, wq, s, b = make_problem(dtype, group_size, bits)
    with options(order=order, strict=True):
        y = run_qmv_fast(mh.qmv_fast_header(), x, wq, s, b, group_size, bits)
    assert within_tolerance(y, x, wq, s, b, group_size, bits).all()


def inject(header: str, old: str, new: str) -> str:
    assert header.count(old) == 1, old
    return header.replace(old, new)


def test_injected_divergent_simd_sum_is_caught():
    header = inject(
        mh.qmv_fast_header(),
        "result[row] = simd_sum(result[row]);",
        "if (simd_lid < 16) { result[row] = simd_sum(result[row]); }",
    )
    x, wq, s, b = make_problem(mx.float16, 64, 4)
    with options(strict=True), pytest.raises(EmulatorError, match="divergent"):
        run_qmv_fast(header, x, wq, s, b, 64, 4, name="qmv_divergent")
    y = run_qmv_fast(header, x, wq, s, b, 64, 4, name="qmv_divergent")
    assert not within_tolerance(y, x, wq, s, b, 64, 4).all()


def test_injected_off_by_one_group_index_is_caught():
    header = inject(
        mh.qmv_fast_header(),
        "scales += out_row * in_vec_size_g + simd_lid / scale_step_per_thread;",
        "scales += out_row * in_vec_size_g + (simd_lid + 1) / scale_step_per_thread;",
    )
    x, wq, s, b = make_problem(mx.float16, 64, 4)
    y = run_qmv_fast(header, x, wq, s, b, 64, 4, name="qmv_off_by_one")
    assert not within_tolerance(y, x, wq, s, b, 64, 4).all()


def test_injected_row_overrun_is_caught():
    """Skipping the row-offset scaling writes rows of other threadgroups and leaves rows unwritten."""
    header = inject(
        mh.qmv_fast_header(),
        "y += tid.x * out_vec_size + out_row;",
        "y += tid.x * out_vec_size + out_row + 1;",
    )
    x, wq, s, b = make_problem(mx.float16, 64, 4)
    with pytest.raises(EmulatorError, match="out-of-bounds write"):
        run_qmv_fast(header, x, wq, s, b, 64, 4, name="qmv_overrun")
