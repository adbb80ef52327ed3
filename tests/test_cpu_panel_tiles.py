"""The panel kernel on AMX tiles (cpu_kernels/src/kernels_panel_amx.cpp): Q4_K and Q5_K layers in panels
(and with exact math Q6_K's) times 16 or more rows of x, where the CPU has AMX and Linux lets the process
use it.

With int8 math the tiles compute each group's integer sums and the vector units scale them in the VNNI
kernel's order, so the results are the VNNI kernel's bit for bit, at row counts around whole tiles of 16
(the rows past the last whole tile take the VNNI kernel), on 1 and 2 threads, for a stack of experts
too. With exact math each row of x goes on the tiles as three bfloat16 planes that sum to it exactly
(AMX-BF16): within float32's rounding of the sums of float64 (3e-7 of the terms' magnitude, where x
short of its last plane measures 5e-7 to 9e-7; outliers, zero, tiny and NaN rows within the suite's
float32 tolerance), the same bits on any thread count, across K longer than one span of prepared codes;
Q6_K's groups of 16 (its codes less 32 on half-width tiles) alike. The switch turns the path off and on; on, exact math never dequantizes such a
layer for a GEMM; a model in panels replies with the same greedy tokens with the tiles as without.
Skipped where the CPU or OS offers no AMX (test_cpu_panels.py covers the VNNI kernel there).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cpu_kernels import qmm, spec
from cpu_kernels.panels import use_panels
from tests.test_cpu_kernels import F32_TOL, ext, f64  # noqa: F401
from tests.test_cpu_kernels import check as check_f64
from tests.test_cpu_panels import K32_BITS, _k_quant_model, _layer, check_hard_rows, greedy
from tests.test_cpu_q6k_scales import Q6K, _exact_check

needs_tiles = pytest.mark.skipif(
    spec.extension() is None or not spec.extension().panel_tiles(),
    reason="the AMX panel kernel needs AMX-INT8 and AMX-BF16 tiles the OS lets this process use",
)


@pytest.fixture
def tiles_restored():
    yield
    spec.set_panel_tiles(True)
    spec.set_threads()


def _both(ext, x, panels, bits: int, int8: bool, gs: int = 32) -> tuple[np.ndarray, np.ndarray]:  # noqa: F811
    outs = []
    for on in (False, True):
        assert spec.set_panel_tiles(on) == on
        outs.append(np.array(ext.quantized_matmul(x, *panels, gs, bits, int8=int8)))
    return outs[0], outs[1]


@needs_tiles
@K32_BITS
def test_int8_on_the_tiles_gives_the_vnni_kernels_results_bit_for_bit(ext, bits, tiles_restored):  # noqa: F811
    rng = np.random.default_rng(21)
    for n, k in ((16, 256), (48, 768), (80, 2304)):
        rows, _ = _layer(rng, n, k, bits)
        panels = ext.panel_layout(*rows, True)
        for m in (15, 16, 17, 31, 32, 33, 47, 130):
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
            x[0, :32] = 1e6  # an outlier run beside ordinary ones
            for threads in (1, 2):
                spec.set_threads(threads)
                vnni, tiles = _both(ext, x, panels, bits, int8=True)
                assert np.isfinite(tiles).all()
                assert np.array_equal(vnni, tiles), (n, k, m, threads)


@needs_tiles
@K32_BITS
def test_exact_math_on_the_tiles_keeps_float32_accuracy(ext, bits, tiles_restored):  # noqa: F811
    rng = np.random.default_rng(25)
    tol = 3e-7  # float32's rounding of the sums alone (measured 0.6-1.4e-7; the VNNI planes' 1.0-1.7e-7)
    assert spec.set_panel_tiles(True)
    for k, rows in ((2304, (16, 40)), (768, (16, 17, 40, 130, 300))):  # 2304: three spans of K (1024 each)
        (w, s2, b2), (s, b) = _layer(rng, 48, k, bits)  # 300 rows: two chunks of rows on the tiles
        panels = ext.panel_layout(w, s2, b2, True)
        for m in rows:
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
            outs = []
            for threads in (1, 2):
                spec.set_threads(threads)
                y = ext.quantized_matmul(x, *panels, 32, bits, int8=False)
                check_f64(y, x, w, s, b, 32, bits, tol)
                outs.append(np.array(y))
            assert np.array_equal(outs[0], outs[1]), (k, m)
    spec.set_threads()
    check_hard_rows(  # outliers, zero, tiny and non-finite rows, repeated: a whole tile and a rest
        rng,
        768,
        lambda x: ext.quantized_matmul(mx.concatenate([x] * 8), *panels, 32, bits, int8=False)[: x.shape[0]],
        lambda y, x: check_f64(y, x, w, s, b, 32, bits, F32_TOL),
    )


@needs_tiles
def test_exact_math_on_the_tiles_keeps_float32_accuracy_for_q6_k(ext, tiles_restored):  # noqa: F811
    """Q6_K's groups of 16 on half-width bfloat16 tiles, its bias (-32 times each scale) in its codes:
    within float32's rounding of float64 (the same 3e-7 bound; measured 0.6-1.0e-7, the three int8
    planes on the VNNI kernel 0.6-1.4e-7), the same bits on 1 and 2 threads, across spans of K; hard
    rows within the suite's float32 tolerance."""
    rng = np.random.default_rng(26)
    assert spec.set_panel_tiles(True)
    for n, k, rows in ((48, 768, (16, 17, 130, 300)), (32, 2304, (16, 40))):
        m6 = Q6K(rng, n, k)
        panels = ext.panel_layout(m6.w, m6.scales, m6.biases, True)
        for m in rows:
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
            outs = []
            for threads in (1, 2):
                spec.set_threads(threads)
                y = ext.quantized_matmul(x, *panels, 16, 6, int8=False)
                xf = f64(x)
                err = np.abs(f64(y) - xf @ m6.values.T) / (np.abs(xf) @ np.abs(m6.values).T)
                assert float(err.max()) <= 3e-7, (n, k, m, threads, float(err.max()))
                outs.append(np.array(y))
            assert np.array_equal(outs[0], outs[1]), (k, m)
    spec.set_threads()
    m6 = Q6K(rng, 48, 768)
    panels = ext.panel_layout(m6.w, m6.scales, m6.biases, True)
    check_hard_rows(
        rng,
        768,
        lambda x: ext.quantized_matmul(mx.concatenate([x] * 8), *panels, 16, 6, int8=False)[: x.shape[0]],
        lambda y, x: _exact_check(y, x, m6.values, "hard rows"),
    )


@needs_tiles
@K32_BITS
def test_experts_on_the_tiles_give_the_vnni_kernels_results(ext, bits, tiles_restored):  # noqa: F811
    rng = np.random.default_rng(22)
    experts, n, k = 3, 32, 512
    rows, _ = _layer(rng, experts * n, k, bits)
    pw, ps, pb = ext.panel_layout(*rows, True)
    panels = (pw.reshape(experts, n, -1), ps.reshape(experts, n // 16, -1), pb.reshape(experts, n // 16, -1))
    tokens = 40  # ~27 rows an expert: a whole tile and a rest
    x = mx.array(rng.standard_normal((tokens, 1, 1, k)).astype(np.float32))
    idx = mx.array(rng.integers(0, experts, (tokens, 1, 2)).astype(np.uint32))
    for int8 in (True, False):
        outs = []
        for on in (False, True):
            spec.set_panel_tiles(on)
            outs.append(np.array(ext.gather_quantized_matmul(x, *panels, idx, 32, bits, int8=int8)))
        assert np.array_equal(outs[0], outs[1]), int8


@needs_tiles
def test_the_switch_and_exact_maths_routing(ext, tiles_restored):  # noqa: F811
    """On, a layer in panels (Q4_K, Q5_K, Q6_K) is on the tiles (a row-form layer is not) and exact
    math's product of many rows is the tiles' own (no dequantize + GEMM); off, it is dequantized again."""
    rng = np.random.default_rng(23)
    rows, _ = _layer(rng, 32, 512, 4)
    w, s, b = ext.panel_layout(*rows, True)
    x = mx.array(rng.standard_normal((qmm.dequantize_rows() + 40, 512)).astype(np.float32))
    spec.set_cpu_math("exact")
    try:
        assert spec.set_panel_tiles(True) is True and ext.panel_tiles()
        assert qmm.on_tiles(w, s, 4) and qmm.on_tiles(w, s, 5)
        assert qmm.on_tiles(w, s, 6) and not qmm.on_tiles(*rows[:2], 4)
        tiles = qmm.quantized_matmul(x, w, s, b, group_size=32, bits=4)
        assert mx.array_equal(tiles, ext.quantized_matmul(x, w, s, b, 32, 4, int8=False)).item()
        # a Q6_K layer too: the tiles' own product (its bits are not the VNNI kernel's int8 planes')
        m6 = Q6K(rng, 32, 512)
        p6 = ext.panel_layout(m6.w, m6.scales, m6.biases, True)
        q6 = qmm.quantized_matmul(x, *p6, group_size=16, bits=6)
        assert mx.array_equal(q6, ext.quantized_matmul(x, *p6, 16, 6, int8=False)).item()
        spec.set_panel_tiles(False)
        assert not mx.array_equal(q6, ext.quantized_matmul(x, *p6, 16, 6, int8=False)).item()
        spec.set_panel_tiles(True)
        assert spec.set_panel_tiles(False) is False and not ext.panel_tiles()
        assert not qmm.on_tiles(w, s, 4)
        gemm = qmm.quantized_matmul(x, w, s, b, group_size=32, bits=4)
        dense = qmm.dequantize(w, s, b, group_size=32, bits=4)
        assert mx.array_equal(gemm, x @ dense.T).item()
    finally:
        spec.set_cpu_math()


@needs_tiles
@pytest.mark.parametrize("math", ["exact", "int8"])
def test_a_model_in_panels_decodes_the_same_tokens_on_the_tiles(ext, math, tiles_restored):  # noqa: F811
    """A random-weight K-quant model in panels, a 40-token prompt (a prefill of whole tiles and a rest):
    the same greedy tokens with the tiles as without, int8 math's logits bit for bit, exact math's within
    float32's rounding."""
    model = _k_quant_model()
    assert use_panels(model, True)
    prompt = [int(t) for t in np.random.default_rng(24).integers(0, 300, 40)]
    spec.set_cpu_math(math)
    try:
        out, logits = [], []
        for on in (False, True):
            spec.set_panel_tiles(on)
            logits.append(np.array(model(mx.array([prompt]))))
            out.append(greedy(model, prompt, 6))
        if math == "int8":
            assert np.array_equal(logits[0], logits[1])
        else:
            assert np.abs(logits[0] - logits[1]).max() <= 1e-5 * np.abs(logits[0]).max()
        assert out[0] == out[1]
    finally:
        spec.set_cpu_math()
