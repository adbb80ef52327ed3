"""A panel product reuses the rows of x the last product prepared only when they are the same rows.

A decode step multiplies one x by q_proj, k_proj and v_proj (and another by gate_proj and up_proj), so
the extension keeps the last rows of x it prepared for the panel kernel (``src/reused_rows.cpp``) and
takes them again for rows byte for byte equal, prepared the same way. These tests hold it to giving
every product exactly what it gives with nothing kept: for the same x through layers of different
formats, for x that differ in one value or only in dtype, and for the same x under each math.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cpu_kernels import spec
from tests.test_cpu_kernels import ext  # noqa: F401
from tests.test_cpu_panels import _layer, needs_vnni
from tests.test_cpu_q6k_scales import Q6K

K = 512


def _layers(ext, rng):  # noqa: F811
    """Q4_K, Q5_K and Q6_K panel layers of K inputs: (name, operands after x) each."""
    out = []
    for bits in (4, 5):
        rows, _ = _layer(rng, 32, K, bits)
        out.append((f"Q{bits}_K", (*ext.panel_layout(*rows, True), 32, bits)))
    m6 = Q6K(rng, 48, K)
    out.append(("Q6_K", (*ext.panel_layout(m6.w, m6.scales, m6.biases, True), 16, 6)))
    return out


def _cold(ext, x, layer, planes):  # noqa: F811
    """The product with nothing kept that x could match: another x's product first."""
    other = mx.array(np.full((3, K), 0.5, np.float32))
    mx.eval(ext.quantized_matmul(other, *layer, x_planes=planes))
    return _np(ext.quantized_matmul(x, *layer, x_planes=planes))


def _np(y: mx.array) -> np.ndarray:
    return np.array(y.astype(mx.float32))


@needs_vnni
def test_the_same_rows_through_layers_of_every_format_in_a_row(ext):  # noqa: F811
    rng = np.random.default_rng(0)
    layers = _layers(ext, rng)
    tiles = spec.panel_tiles()
    spec.set_panel_tiles(False)
    try:
        for m in (1, 2, 5):
            x = mx.array(rng.standard_normal((m, K)).astype(np.float32))
            for planes in (1, 2, 3):
                cold = {name: _cold(ext, x, layer, planes) for name, layer in layers}
                # q_proj, k_proj, v_proj: one x, back to back (the second and third reuse its rows)
                for name, layer in layers:
                    y = _np(ext.quantized_matmul(x, *layer, x_planes=planes))
                    assert np.array_equal(y, cold[name]), (m, planes, name)
    finally:
        spec.set_panel_tiles(tiles)


@needs_vnni
def test_rows_that_differ_in_one_value_or_in_dtype_are_prepared_again(ext):  # noqa: F811
    rng = np.random.default_rng(1)
    name, layer = _layers(ext, rng)[0]
    base = rng.standard_normal((1, K)).astype(np.float32)
    changed = base.copy()
    changed[0, K - 1] += 1.0  # the last run only
    xs = [mx.array(base), mx.array(changed), mx.array(base)]
    # the same bits read as float16 and as bfloat16 are other values
    half = mx.array(base).astype(mx.float16)
    xs += [half, mx.array(np.array(half).view(np.uint16)).view(mx.bfloat16)]
    for planes in (2, 3):
        want = [_cold(ext, x, layer, planes) for x in xs]
        got = [_np(ext.quantized_matmul(x, *layer, x_planes=planes)) for x in xs]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert np.array_equal(g, w), (name, planes, i)
        assert not np.array_equal(got[0], got[1])


@needs_vnni
def test_the_same_rows_under_each_math_in_turn(ext):  # noqa: F811
    rng = np.random.default_rng(2)
    _, layer = _layers(ext, rng)[1]
    x = mx.array(rng.standard_normal((1, K)).astype(np.float32) * 4)
    want = {p: _cold(ext, x, layer, p) for p in (1, 2, 3)}
    assert not np.array_equal(want[1], want[3])  # int8 math holds x coarser than exact math
    for p in (3, 1, 2, 2, 3, 1):
        assert np.array_equal(_np(ext.quantized_matmul(x, *layer, x_planes=p)), want[p]), p
