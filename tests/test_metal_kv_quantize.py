"""KV quantization kernel against the float32 formula in NumPy and against mx.quantize; in-place pool writes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels import numpy_reference as ref
from metal_kernels.emulator import options
from metal_kernels.kv_quantize import quantize_kv, write_quantized
from metal_kernels.spec import metal_available

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


def adversarial(shape, dtype, group_size, seed=0):
    """Random rows plus all-negative, all-positive, constant and zero groups."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    g = x.reshape(-1, group_size)
    g[0] = -np.abs(g[0])
    g[1] = np.abs(g[1])
    g[2] = 1.25
    g[3] = 0.0
    g[4] = np.linspace(-1, 1, group_size)
    return mx.array(x).astype(dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize(
    "dtype,shape,group_size,bits,order",
    [
        (mx.float16, (5, 3, 96), 32, 8, "forward"),  # 45 groups: a partial last threadgroup
        (mx.bfloat16, (4, 2, 128), 64, 4, "reverse"),
        (mx.float32, (3, 8, 128), 128, 4, "random"),
        (mx.float16, (7, 64), 32, 4, "random"),
    ],
)
def test_quantize_kv_matches_formula_and_mx_quantize(backend, dtype, shape, group_size, bits, order):
    x = adversarial(shape, dtype, group_size)
    with options(order=order, strict=True):
        q, s, b = quantize_kv(x, group_size, bits, backend=backend)
    words, scale, bias = ref.quantize_affine(ref.to_f64(x).astype(np.float32), group_size, bits)
    assert q.dtype == mx.uint32 and s.dtype == dtype and b.dtype == dtype
    assert q.shape == (*shape[:-1], shape[-1] * bits // 32) and s.shape == (
        *shape[:-1],
        shape[-1] // group_size,
    )
    eps = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-23}[dtype]
    levels = ref.unpack_affine(np.array(q), bits)
    expected_levels = ref.unpack_affine(words, bits)
    want_s = ref.to_f64(mx.array(scale).astype(dtype))
    want_b = ref.to_f64(mx.array(bias).astype(dtype))
    if backend == "emulator":  # same IEEE float32 operations: bit for bit
        np.testing.assert_array_equal(ref.to_f64(s), want_s)
        np.testing.assert_array_equal(ref.to_f64(b), want_b)
        np.testing.assert_array_equal(levels, expected_levels)
    else:  # a GPU division may differ in the last bit, moving an exact tie by one level
        np.testing.assert_allclose(ref.to_f64(s), want_s, rtol=2 * eps)
        np.testing.assert_allclose(ref.to_f64(b), want_b, rtol=2 * eps)
        assert np.abs(levels - expected_levels).max() <= 1
    # same words as MLX's own quantizer (CPU path), and a faithful reconstruction
    mq, ms, mb = mx.quantize(x, group_size=group_size, bits=bits)
    if backend == "emulator":
        assert mx.array_equal(q, mq).item() and mx.array_equal(s, ms).item() and mx.array_equal(b, mb).item()
    # reconstruction: half a level, up to a whole one at the far edge (MLX snaps the larger-magnitude
    # edge onto a level, which can push the other edge just past the last level, where it clamps),
    # plus the rounding of scale and bias to the activation dtype
    recon = ref.dequantize_affine(np.array(q), ref.to_f64(s), ref.to_f64(b), group_size, bits)
    step = np.repeat(np.abs(ref.to_f64(s)), group_size, axis=-1)
    edge = np.repeat(np.abs(ref.to_f64(b)), group_size, axis=-1)
    bound = step + eps * (edge + (2**bits - 1) * step) + 1e-6
    assert (np.abs(recon - ref.to_f64(x)) <= bound).all()


def test_reference_backend_is_mx_quantize():
    x = adversarial((4, 64), mx.float32, 32)
    for got, want in zip(
        quantize_kv(x, 32, 4, backend="reference"), mx.quantize(x, group_size=32, bits=4), strict=True
    ):
        assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_write_quantized_updates_pool_in_place(backend):
    """A step's write must not copy the pool: peak memory stays far below one pool size."""
    slots_total, n_kv, dim, bits, gs = 1 << 16, 8, 128, 8, 32
    pool = (
        mx.zeros((slots_total, n_kv, dim * bits // 32), dtype=mx.uint32),
        mx.zeros((slots_total, n_kv, dim // gs), dtype=mx.float16),
        mx.zeros((slots_total, n_kv, dim // gs), dtype=mx.float16),
    )
    mx.eval(pool)
    pool_bytes = sum(a.nbytes for a in pool)
    x = adversarial((3, n_kv, dim), mx.float16, gs)
    slots = mx.array([17, 4096, 65535])
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    pool = write_quantized(pool, slots, x, gs, bits, backend=backend)
    mx.eval(pool)
    assert mx.get_peak_memory() - base < pool_bytes // 4
    q, s, b = mx.quantize(x, group_size=gs, bits=bits)
    assert mx.array_equal(pool[0][slots], q).item()
    assert mx.array_equal(pool[1][slots], s).item() and mx.array_equal(pool[2][slots], b).item()
    assert int(mx.sum(pool[0][18] != 0).item()) == 0


def test_validation():
    x = mx.zeros((2, 48))
    with pytest.raises(ValueError):
        quantize_kv(x, 32, 8)
    with pytest.raises(ValueError):
        quantize_kv(mx.zeros((2, 64)), 32, 3)
