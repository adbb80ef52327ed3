"""Float16 scales and biases for the CPU kernels' layers (cpu_kernels/scales.py).

A loaded quantized model on the CPU holds its kernel layers' scales and biases in float16 (1 bit a
weight instead of 2 to read per decoded token). With float32 x the kernels must still compute in
float32: every path (one row through the integer kernel, a few through the float kernel, a prefill
through dequantize + GEMM, int8 math, the experts' gather) within float32's tolerance of a float64
product with the float16 scales; the model's logits within what 11-bit scales can move them, its
greedy tokens the same, the lookup and the activations still float32.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cpu_kernels import spec
from cpu_kernels.gather_qmm import gather_qmm
from cpu_kernels.modules import CPUQuantizedEmbedding, CPUQuantizedLinear, use_cpu_kernels
from cpu_kernels.qmm import dequantize_rows, quantized_matmul
from cpu_kernels.scales import half_scales
from tests.test_cpu_kernels import BITS, F32_TOL, case, check, ext, f64, variants  # noqa: F401

pytestmark = [
    pytest.mark.skipif(
        mx.metal.is_available(), reason="the CPU kernels are for CPU inference (Metal has its own)"
    ),
    pytest.mark.usefixtures("exact_math"),  # exact math is these tests' reference (conftest.py)
]


def _half(scales: mx.array, biases: mx.array) -> tuple[mx.array, mx.array]:
    return scales.astype(mx.float16), biases.astype(mx.float16)


@pytest.mark.parametrize("bits", BITS)
def test_float32_x_with_float16_scales_is_float32_accurate_on_every_path(ext, bits):  # noqa: F811
    """1 and 2 rows (the integer kernel on VNNI), 5 and 16 (the float kernel), dequantize_rows() rows
    (dequantize + GEMM), on every instruction set: float32 out, within F32_TOL of float64 with the
    float16 scales; scales of both signs and tiny ones (float16's subnormals) included."""
    rng = np.random.default_rng(bits)
    prefill = dequantize_rows()
    for isa in variants(ext):
        ext.set_isa(isa)
        for m in (1, 2, 5, 16, prefill):
            x, wq, scales, biases = case(rng, m, 37, 20 * 32, 32, bits)
            s, b = np.array(scales), np.array(biases)
            s[0, :3] = [-s[0, 0], 3e-6, 6e-8]  # a negative scale and two below float16's normal range
            s16, b16 = _half(mx.array(s), mx.array(b))
            y = quantized_matmul(x, wq, s16, b16, group_size=32, bits=bits, backend="native")
            assert y.dtype == mx.float32
            check(y, x, wq, s16, b16, 32, bits, F32_TOL)
    ext.set_isa("")


def test_int8_math_and_the_gather_read_float16_scales(ext):  # noqa: F811
    rng = np.random.default_rng(5)
    x, wq, scales, biases = case(rng, 3, 64, 256, 32, 4)
    s16, b16 = _half(scales, biases)
    spec.set_cpu_math("int8")
    try:
        y16 = quantized_matmul(x, wq, s16, b16, group_size=32, bits=4, backend="native")
        y32 = quantized_matmul(
            x, wq, s16.astype(mx.float32), b16.astype(mx.float32), group_size=32, bits=4, backend="native"
        )
    finally:
        spec.set_cpu_math("exact")
    assert y16.dtype == mx.float32
    # the same values read from 16 bits (summed in another order: float32 rounding apart)
    assert np.abs(np.array(y16) - np.array(y32)).max() <= 1e-5 * np.abs(np.array(y32)).max()
    w = mx.stack([mx.array(rng.standard_normal((48, 256)).astype(np.float32) * 0.1) for _ in range(4)])
    wq3, sc3, bi3 = mx.quantize(w, group_size=32, bits=4)
    xs = mx.array(rng.standard_normal((2, 1, 256)).astype(np.float32))
    idx = mx.array([[3], [1]], dtype=mx.uint32)
    h = _half(sc3, bi3)
    g16 = gather_qmm(xs, wq3, *h, rhs_indices=idx, group_size=32, bits=4, backend="native")
    up = (h[0].astype(mx.float32), h[1].astype(mx.float32))
    g32 = gather_qmm(xs, wq3, *up, rhs_indices=idx, group_size=32, bits=4, backend="native")
    assert g16.dtype == mx.float32
    assert np.abs(np.array(g16) - np.array(g32)).max() <= 1e-5 * np.abs(np.array(g32)).max()


def _quantized(tiny_dirs, arch: str) -> nn.Module:
    from mlx_engine.loading.loader import load_model

    model = load_model(str(tiny_dirs(arch)), weights="dense").model
    nn.quantize(model, group_size=32, bits=4)
    assert use_cpu_kernels(model) > 0
    return model


def test_half_scales_halves_the_scale_bytes_and_keeps_the_logits(ext, tiny_dirs):  # noqa: F811
    """A tied-embedding model (its LM head is the embedding): every kernel layer's scales and biases
    become float16, the lookup and the logits stay float32, the logits move by no more than
    11-bit scales allow and the greedy choice not at all."""
    ours, theirs = _quantized(tiny_dirs, "qwen3"), _quantized(tiny_dirs, "qwen3")
    before = sum(m["scales"].nbytes + m["biases"].nbytes for _, m in ours.named_modules() if "scales" in m)
    changed = half_scales(ours)
    kernel = [
        m for _, m in ours.named_modules() if isinstance(m, (CPUQuantizedLinear, CPUQuantizedEmbedding))
    ]
    assert changed == len(kernel) > 0
    assert all(m["scales"].dtype == m["biases"].dtype == mx.float16 for m in kernel)
    after = sum(m["scales"].nbytes + m["biases"].nbytes for _, m in ours.named_modules() if "scales" in m)
    assert after * 2 == before
    tokens = mx.array([[5, 9, 200, 31, 7, 64, 3, 12]])
    assert ours.model.embed_tokens(tokens).dtype == mx.float32
    for t in (tokens[:, :1], tokens):  # decode and prefill
        a, b = ours(t), theirs(t)
        assert a.dtype == mx.float32
        a64, b64 = f64(a), f64(b)
        # each weight moves by at most code * 2^-11 of a step: the logits by a few 1e-4 of their size
        assert np.abs(a64 - b64).max() < 2e-3 * np.abs(b64).max()
        assert (a64.argmax(-1) == b64.argmax(-1)).all()


def test_a_layer_that_would_overflow_float16_keeps_float32(ext, tiny_dirs):  # noqa: F811
    model = _quantized(tiny_dirs, "llama")
    layer = model.model.layers[0].mlp.down_proj
    layer["scales"] = layer["scales"] * 0 + 1e5  # past float16's 65504
    changed = half_scales(model)
    assert layer["scales"].dtype == mx.float32
    kernel = [
        m for _, m in model.named_modules() if isinstance(m, (CPUQuantizedLinear, CPUQuantizedEmbedding))
    ]
    assert changed == len(kernel) - 1


def test_the_bundled_model_loads_with_float16_scales_and_decodes_the_same(ext, monkeypatch):  # noqa: F811
    """``load_model`` on the CPU: the kernel layers hold float16 scales, the model computes in float32,
    and 24 greedy tokens are those of the same file loaded with float32 scales."""
    import cpu_kernels.scales
    from mlx_engine.loading.loader import load_model

    loaded = load_model(None)
    assert loaded.dtype == mx.float32
    layers = [m for _, m in loaded.model.named_modules() if isinstance(m, CPUQuantizedLinear)]
    assert layers and all(m["scales"].dtype == mx.float16 for m in layers)
    monkeypatch.setattr(cpu_kernels.scales, "half_scales", lambda model: 0)
    ref = load_model(None)
    assert all(m["scales"].dtype == mx.float32 for _, m in ref.model.named_modules() if "scales" in m)

    def greedy(model: nn.Module, n: int) -> list[int]:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        x = mx.array([loaded.tokenizer.encode("The capital of France is a city where")])
        out: list[int] = []
        for _ in range(n):
            nxt = int(model(x, cache=cache)[0, -1].argmax().item())
            out.append(nxt)
            x = mx.array([[nxt]])
        return out

    assert greedy(loaded.model, 24) == greedy(ref.model, 24)


def test_the_experts_of_a_moe_hold_float16_scales_and_its_logits_stay(ext):  # noqa: F811
    """The switched expert layers (the gather kernel's) are kernel layers too: their scales and biases
    go to float16 with the rest, and the model's logits move by no more than 11-bit scales can."""
    from tests.test_cpu_gather_qmm import MOE_CONFIG, logits_and_step, tiny_moe

    model = tiny_moe()
    use_cpu_kernels(model)
    tokens = mx.array(np.random.default_rng(1).integers(0, 256, (1, 40)).astype(np.int32))
    before = logits_and_step(model, tokens)
    changed = half_scales(model)
    experts = [m for _, m in model.named_modules() if type(m).__name__ == "CPUQuantizedSwitchLinear"]
    assert len(experts) == 3 * MOE_CONFIG["num_hidden_layers"]
    assert all(m["scales"].dtype == mx.float16 and m["biases"].dtype == mx.float16 for m in experts)
    assert changed >= len(experts)
    after = logits_and_step(model, tokens)
    for a, b in zip(after, before, strict=True):
        assert a.dtype == b.dtype and np.abs(a - b).max() <= 2e-2 * np.abs(b).max()
