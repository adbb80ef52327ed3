"""Q6_K as its file holds it, for the CPU kernels (kernels.h ``kSuper16``).

A Q6_K weight is ``d * sc * (q - 32)``: a 6-bit code q, an int8 sub-scale sc per 16 weights and a
float16 d per 256. The kernels read exactly that (6-bit codes in MLX's bit stream, groups of 16, per
256 weights 18 bytes of scales: d, then the 16 sub-scales; biases a one-element ratio, -32): 6.5625
bits a weight, where the 8-bit re-code in groups of 32 it replaces on the CPU is 8.5 and not always
exact. Every path must compute with exactly those values: the exact kernels within float32 of a
float64 product, the int8 kernels within float32 of their own oracle (x rounded per 32 as llama.cpp
does), dequantize bit for bit, on every instruction set, one row to a prefill, one thread or two, and
the experts' gather per expert.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cpu_kernels import spec
from cpu_kernels.qmm import dequantize, quantized_matmul
from mlx_engine.loading.ggml_blocks import pack_codes
from tests.test_cpu_int8_path import quantize_q8
from tests.test_cpu_kernels import F32_TOL, ext, f64, variants  # noqa: F401

pytestmark = [
    pytest.mark.skipif(
        mx.metal.is_available(), reason="the CPU kernels are for CPU inference (Metal has its own)"
    ),
    pytest.mark.usefixtures("exact_math"),  # exact math is these tests' reference (conftest.py)
]

INT8_TOL = 1e-5  # tests/test_cpu_int8_path.py's bound: float32 accumulation against float64
ROWS = (1, 2, 3, 5, 8, 9, 16)


class Q6K:
    """A random Q6_K matrix (lead + (n, k)) in the kernels' form and as float64 values."""

    def __init__(self, rng: np.random.Generator, n: int, k: int, lead: tuple[int, ...] = ()):
        sb = k // 256
        self.codes = rng.integers(0, 64, (*lead, n, k), dtype=np.uint8)
        d = (np.abs(rng.standard_normal((*lead, n, sb))) * 1e-3 + 1e-5).astype(np.float16)
        d *= np.where(rng.random(d.shape) < 0.5, -1, 1).astype(np.float16)  # llama.cpp's d has a sign
        sub = rng.integers(-128, 128, (*lead, n, sb, 16), dtype=np.int8)
        flat = self.codes.reshape(-1, k)
        self.w = mx.array(pack_codes(flat, 6).reshape(*lead, n, -1))
        raw = np.concatenate([d[..., None].view(np.uint8), sub.view(np.uint8)], axis=-1)
        self.scales = mx.array(raw.reshape(*lead, n, sb * 18))
        self.biases = mx.array([-32.0], dtype=mx.float32)
        step = d.astype(np.float64)[..., None] * sub.astype(np.float64)  # (..., n, sb, 16)
        self.group_scales = step.reshape(*lead, n, k // 16)
        per_value = np.repeat(self.group_scales, 16, axis=-1)
        self.values = per_value * (self.codes.astype(np.float64) - 32.0)


def _exact_check(y: mx.array, x: mx.array, w: np.ndarray, what) -> None:
    xf = f64(x).reshape(-1, w.shape[-1])
    ref = xf @ w.T
    mag = np.abs(xf) @ np.abs(w).T
    err = np.abs(f64(y).reshape(ref.shape) - ref) / (mag + 1e-30)
    assert float(err.max()) <= F32_TOL, (what, float(err.max()))


def _int8_oracle(x: mx.array, m: Q6K) -> tuple[np.ndarray, np.ndarray]:
    """The int8 path's product in float64: per 16 values sc * d_x * dot(codes, q) plus the bias term
    -32 * sc times the half run's sum of d_x * q, and the magnitude of the terms."""
    xf = np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1])
    rows, k = xf.shape
    q, d = quantize_q8(xf)  # (rows, k / 32, 32), (rows, k / 32)
    q16 = q.reshape(rows, k // 16, 16)
    d16 = np.repeat(d.astype(np.float64), 2, axis=1)  # each half run's d
    codes = m.codes.reshape(-1, k // 16, 16).astype(np.int64)
    dot = np.einsum("mgk,ngk->mng", q16, codes).astype(np.float64)
    s = m.group_scales.reshape(-1, k // 16)
    xsum = q16.sum(-1) * d16  # (rows, groups)
    y = np.einsum("mng,ng,mg->mn", dot, s, d16) + xsum @ (-32.0 * s).T
    mag = np.einsum("mng,ng,mg->mn", np.abs(dot), np.abs(s), d16) + np.abs(xsum) @ np.abs(32.0 * s).T
    return y, mag


def test_matches_float64_every_variant_rows_and_threads(ext):  # noqa: F811
    """The exact kernels (the integer one for one or two rows of x, the float tiles, dequantize and a
    GEMM for a prefill) against float64, 1 and 2 threads bit for bit the same."""
    rng = np.random.default_rng(6)
    for isa in variants(ext):
        ext.set_isa(isa)
        for n, k in ((37, 256), (19, 768), (5, 4352)):  # 4352: 272 groups, past 16 super-blocks' worth
            m6 = Q6K(rng, n, k)
            for rows in (*ROWS, 150):  # 150: past dequantize_rows() on two threads
                x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
                outs = []
                for threads in (1, 2):
                    spec.set_threads(threads)
                    y = quantized_matmul(
                        x, m6.w, m6.scales, m6.biases, group_size=16, bits=6, backend="native"
                    )
                    _exact_check(y, x, m6.values, (isa, n, k, rows, threads))
                    outs.append(np.array(y))
                assert np.array_equal(outs[0], outs[1]), (isa, n, k, rows)
    ext.set_isa("")
    spec.set_threads()


def test_int8_math_matches_its_oracle_every_variant_rows_and_threads(ext):  # noqa: F811
    """One row (the 512-bit loop with the bias term as integer offsets), tiles of rows, and from 40
    rows on AVX-512 VNNI the int8 GEMM (each half run's dot products scaled on their own)."""
    rng = np.random.default_rng(7)
    spec.set_cpu_math("int8")
    try:
        for isa in variants(ext):
            ext.set_isa(isa)
            for n, k in ((37, 256), (11, 1280)):
                m6 = Q6K(rng, n, k)
                for rows in (*ROWS, 45, 130):
                    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
                    ref, mag = _int8_oracle(x, m6)
                    outs = []
                    for threads in (1, 2):
                        spec.set_threads(threads)
                        y = ext.quantized_matmul(x, m6.w, m6.scales, m6.biases, 16, 6, int8=True)
                        err = np.abs(f64(y) - ref) / (mag + 1e-30)
                        assert float(err.max()) <= INT8_TOL, (isa, n, k, rows, float(err.max()))
                        outs.append(np.array(y))
                    assert np.array_equal(outs[0], outs[1]), (isa, n, k, rows)
    finally:
        spec.set_cpu_math("exact")
        ext.set_isa("")
        spec.set_threads()


def test_dequantize_is_the_files_values_bit_for_bit(ext):  # noqa: F811
    """d * sc is exact in float32 (an 11-bit by an 8-bit number), times the level q - 32 once more:
    float64's value rounded once, on every variant."""
    rng = np.random.default_rng(8)
    for isa in variants(ext):
        ext.set_isa(isa)
        m6 = Q6K(rng, 300, 512)
        got = np.array(dequantize(m6.w, m6.scales, m6.biases, group_size=16, bits=6, backend="native"))
        assert got.dtype == np.float32 and np.array_equal(got, m6.values.astype(np.float32)), isa
    ext.set_isa("")


def test_gather_over_experts_matches_each_experts_product(ext):  # noqa: F811
    """A stack of Q6_K experts through the gather: each token's rows are its experts' products, for
    exact and int8 math, a few tokens (decode) and many (prefill)."""
    rng = np.random.default_rng(9)
    experts, n, k = 6, 24, 512
    stack = Q6K(rng, n, k, lead=(experts,))
    for math in ("exact", "int8"):
        spec.set_cpu_math(math)
        try:
            for tokens in (1, 3, 64):
                x = mx.array(rng.standard_normal((tokens, 1, 1, k)).astype(np.float32))
                idx = mx.array(rng.integers(0, experts, (tokens, 2)).astype(np.uint32))
                y = np.array(
                    ext.gather_quantized_matmul(
                        x, stack.w, stack.scales, stack.biases, idx, 16, 6, int8=math == "int8"
                    )
                )
                assert y.shape == (tokens, 2, 1, n)
                for t in range(tokens):
                    for j in range(2):
                        e = int(np.array(idx)[t, j])
                        one = mx.array(np.array(stack.w)[e])
                        sc = mx.array(np.array(stack.scales)[e])
                        want = np.array(
                            ext.quantized_matmul(x[t, 0], one, sc, stack.biases, 16, 6, int8=math == "int8")
                        )
                        np.testing.assert_allclose(
                            y[t, j, 0], want[0], rtol=0, atol=1e-5 * (np.abs(want).max() + 1e-30)
                        )
        finally:
            spec.set_cpu_math("exact")


def test_other_formats_in_groups_of_16_are_refused_with_a_reason(ext):  # noqa: F811
    rng = np.random.default_rng(10)
    m6 = Q6K(rng, 4, 256)
    x = mx.array(rng.standard_normal((1, 256)).astype(np.float32))
    wrong = [
        (m6.w, m6.scales, mx.zeros((4, 16)), 16, 6),  # biases per group
        (m6.w, m6.scales.astype(mx.float32), m6.biases, 16, 6),  # float scales
        (mx.zeros((4, 32), dtype=mx.uint32), m6.scales, m6.biases, 16, 4),  # 4-bit codes
        (m6.w, m6.scales[:, :17], m6.biases, 16, 6),  # a short row of scales
    ]
    for w, s, b, gs, bits in wrong:
        with pytest.raises(ValueError):
            mx.eval(ext.quantized_matmul(x, w, s, b, gs, bits))


_SHAPES = {"hidden_size": 256, "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2}


def _q6k_layers(model) -> list:
    return [m for _, m in model.named_modules() if getattr(m, "group_size", None) == 16]


def test_a_q6_k_llama_loads_as_the_file_holds_it(ext, tmp_path):  # noqa: F811
    """Every matrix Q6_K (a "Q6_K" file): llama.cpp's permuted attn_q/attn_k rows put back with their
    scales (the one-element biases left as it is), the embedding's rows looked up through the kernel's
    dequantize, the output layer a kernel product; through ``load_model`` on the CPU the logits are
    the file's values' to float32 rounding."""
    from mlx_engine.loading.loader import load_model
    from tests.gguf_quantize import TINY_IDS, Q, write_tiny_gguf

    path = tmp_path / "q6k.gguf"
    config = _SHAPES | {"intermediate_size": 512}
    expected = write_tiny_gguf(
        path, "llama", qtypes=lambda name: Q.F32 if "norm" in name else Q.Q6_K, config=config
    )
    loaded = load_model(str(path))
    assert "Q6_K as it is" in loaded.weight_format
    layers = _q6k_layers(loaded.model)
    assert len(layers) == 2 + 2 * 7  # embedding, output, 7 matrices a layer
    assert all(m["scales"].dtype == mx.uint8 and m["biases"].shape == (1,) for m in layers)
    ours, want = np.array(loaded.model(TINY_IDS)), np.array(expected(TINY_IDS))
    assert np.abs(ours - want).max() <= 1e-4 * np.abs(want).max()


def test_q6_k_experts_load_as_the_file_holds_them(ext, tmp_path):  # noqa: F811
    """A Qwen3-MoE whose experts (and every other matrix) are Q6_K: the expert stacks go through the
    gather kernel in their own form, the logits the file's values' to float32 rounding."""
    from cpu_kernels.modules import is_kernel_layer
    from mlx_engine.loading.loader import load_model
    from tests.gguf_families import write_family_gguf
    from tests.gguf_quantize import TINY_IDS, Q

    def qtype(name: str, shape: tuple[int, ...]) -> Q:
        return (
            Q.Q6_K if len(shape) >= 2 and name.endswith(".weight") and ".ffn_gate_inp" not in name else Q.F32
        )

    path = tmp_path / "moe-q6k.gguf"
    expected = write_family_gguf(path, "qwen3moe", qtype_of=qtype, moe_intermediate_size=256, **_SHAPES)
    model = load_model(str(path)).model
    experts = [m for m in _q6k_layers(model) if m["weight"].ndim == 3]
    assert len(experts) == 2 * 3 and all(is_kernel_layer(m) for m in experts)
    ours, want = np.array(model(TINY_IDS)), np.array(expected(TINY_IDS))
    assert np.abs(ours - want).max() <= 1e-4 * np.abs(want).max()
