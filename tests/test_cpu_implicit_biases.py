"""No stored biases for symmetric types on the CPU kernels (cpu_kernels/scales.py ``implicit_biases``).

Q8_0, Q4_0, Q5_0, IQ4_NL, IQ4_XS, IQ2_XXS and IQ3_XXS store ``d * (q - zero)``: every bias is ``-zero``
times its scale. Such a layer keeps a one-element ``biases`` (the ratio) and the kernels compute each
bias as ratio * scale: every path must give bit for bit what the stored biases give (the product is
exact for a power of two), the layer reads half the overhead bytes, and a model's logits and lookup
are unchanged. Anything whose biases are not one fixed multiple (Q4_1's free minimums) keeps them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cpu_kernels.modules import CPUQuantizedEmbedding, use_cpu_kernels
from cpu_kernels.qmm import dequantize_rows
from cpu_kernels.scales import half_scales, implicit_biases
from tests.test_cpu_kernels import ext, variants  # noqa: F401
from tests.test_cpu_two_level_scales import quantized_llama

pytestmark = [
    pytest.mark.skipif(
        mx.metal.is_available(), reason="the CPU kernels are for CPU inference (Metal has its own)"
    ),
    pytest.mark.usefixtures("exact_math"),  # exact math is these tests' reference (conftest.py)
]


@pytest.mark.parametrize(("bits", "zero"), [(8, 128), (4, 8), (5, 16), (6, 32)])
def test_every_path_computes_the_ratio_s_biases_bit_for_bit(ext, bits, zero):  # noqa: F811
    rng = np.random.default_rng(bits)
    prefill = dequantize_rows()
    for isa in variants(ext):
        ext.set_isa(isa)
        for dtype in (mx.float16, mx.float32):
            for n, k in ((40, 256), (24, 96 * 32)):
                w = mx.array(rng.integers(0, 2**32, (n, k * bits // 32), dtype=np.uint32))
                s = mx.array((rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32)).astype(dtype)
                ratio = mx.array([-zero], dtype=dtype)
                for m in (1, 2, 3, 8, 17, 40, prefill):
                    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
                    for int8 in (False, True):
                        stored = ext.quantized_matmul(x, w, s, s * -zero, 32, bits, int8=int8)
                        implied = ext.quantized_matmul(x, w, s, ratio, 32, bits, int8=int8)
                        assert mx.array_equal(stored, implied).item(), (isa, dtype, n, k, m, int8)
                assert mx.array_equal(
                    ext.dequantize(w, s, s * -zero, 32, bits), ext.dequantize(w, s, ratio, 32, bits)
                ).item()
                experts = 4
                we = mx.array(rng.integers(0, 2**32, (experts, n, k * bits // 32), dtype=np.uint32))
                se = mx.array((rng.standard_normal((experts, n, k // 32)) * 0.01).astype(np.float32)).astype(
                    dtype
                )
                for tokens in (1, 5, 64):
                    x = mx.array(rng.standard_normal((tokens, 1, 1, k)).astype(np.float32))
                    idx = mx.array(rng.integers(0, experts, (tokens, 1, 2)).astype(np.uint32))
                    for int8 in (False, True):
                        stored = ext.gather_quantized_matmul(x, we, se, se * -zero, idx, 32, bits, int8=int8)
                        implied = ext.gather_quantized_matmul(x, we, se, ratio, idx, 32, bits, int8=int8)
                        assert mx.array_equal(stored, implied).item(), (isa, dtype, tokens, int8)
    ext.set_isa("")


def test_a_ratio_needs_float_scales(ext):  # noqa: F811
    w = mx.zeros((8, 256 * 4 // 32), dtype=mx.uint32)
    two_level = mx.zeros((8, 10), dtype=mx.uint8)
    with pytest.raises(ValueError, match="float scales"):
        ext.quantized_matmul(mx.zeros((1, 256)), w, two_level, mx.array([-8.0]), 32, 4)


def _symmetric_llama(zero: int, bits: int) -> nn.Module:
    model = quantized_llama(128, 256, bits, seed=5)
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m["biases"] = m["scales"] * -zero  # a symmetric type's biases (the weights change: no matter)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize(("bits", "zero"), [(8, 128), (6, 31)])
def test_a_symmetric_model_drops_its_biases_and_keeps_its_logits(ext, bits, zero):  # noqa: F811
    """Every kernel layer (the tied embedding too) keeps only the ratio; the logits of a prefill and a
    decode step, and the lookup, bit for bit the model's with its biases, before and after float16
    scales (-31, IQ3_XXS's zero, is no power of two: the ratio is exact in float32 only, so after
    float16 scales the logits stay within float16's rounding of the biases)."""
    ours, theirs = _symmetric_llama(zero, bits), _symmetric_llama(zero, bits)
    assert use_cpu_kernels(ours) > 0 and use_cpu_kernels(theirs) > 0
    layers = [m for _, m in ours.named_modules() if "scales" in m]
    overhead = sum(m["scales"].nbytes + m["biases"].nbytes for m in layers)
    assert implicit_biases(ours) == len(layers) == 2 * 7 + 1
    assert all(m["biases"].shape == (1,) and m["biases"].item() == -zero for m in layers)
    assert sum(m["scales"].nbytes + m["biases"].nbytes for m in layers) * 2 == overhead + 4 * len(layers) * 2
    tokens = mx.array([[5, 9, 200, 31, 7, 64, 3, 12, 290]])
    for step in range(2):
        if step == 1:
            assert half_scales(ours) == half_scales(theirs) == len(layers)  # then the same in float16
        for t in (tokens, tokens[:, :1]):
            a, b = ours(t), theirs(t)
            if zero == 128 or ours.model.embed_tokens["scales"].dtype == mx.float32:
                assert mx.array_equal(a, b).item()
            else:
                a64, b64 = np.array(a).astype(np.float64), np.array(b).astype(np.float64)
                assert np.abs(a64 - b64).max() <= 2e-3 * np.abs(b64).max()
        assert isinstance(ours.model.embed_tokens, CPUQuantizedEmbedding)
        emb = ours.model.embed_tokens(tokens)
        assert emb.dtype == mx.float32
        assert np.allclose(np.array(emb), np.array(theirs.model.embed_tokens(tokens)), rtol=0, atol=1e-3)


def test_free_minimums_keep_their_biases(ext):  # noqa: F811
    """Q4_1-style biases (each group's own minimum) are no multiple of the scale: nothing changes;
    nor does a layer where a single bias is off."""
    model = _symmetric_llama(8, 4)
    use_cpu_kernels(model)
    layer = model.model.layers[0].mlp.down_proj
    b = np.array(layer["biases"])
    b[3, 2] += 1e-3
    layer["biases"] = mx.array(b)
    free = model.model.layers[1].mlp.up_proj
    free["biases"] = mx.random.normal(free["biases"].shape) * 0.01
    layers = [m for _, m in model.named_modules() if "scales" in m]
    assert implicit_biases(model) == len(layers) - 2
    assert layer["biases"].shape == layer["scales"].shape and free["biases"].shape == free["scales"].shape


def test_a_gguf_s_symmetric_and_k_quant_layers_load_in_their_compact_forms(ext, tmp_path):  # noqa: F811
    """Through ``load_model`` on the CPU: Q8_0 layers keep no biases, Q6_K layers their own form (6-bit
    codes in groups of 16, the file's scales as bytes, the ratio -32 for biases), Q4_K layers two-level
    scales, Q4_1 (free minimums) float16 biases; the logits are the file's values' (the float32 model
    ``write_tiny_gguf`` returns) to float32 rounding: every layer holds the file's values exactly."""
    from cpu_kernels.modules import is_kernel_layer
    from mlx_engine.loading.loader import load_model
    from tests.gguf_quantize import TINY_IDS, Q, write_tiny_gguf

    path = tmp_path / "mixed.gguf"
    qtypes = {
        "token_embd": Q.Q8_0,
        "output": Q.Q6_K,
        "attn_q": Q.Q4_K,
        "attn_k": Q.Q4_1,
        "attn_v": Q.Q8_0,
        "attn_output": Q.Q4_K,
        "ffn_gate": Q.Q4_K,
        "ffn_up": Q.Q6_K,
        "ffn_down": Q.Q8_0,
    }
    config = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    expected = write_tiny_gguf(path, "llama", qtypes=qtypes, config=config)
    model = load_model(str(path)).model
    layer = model.model.layers[0]
    for m in (model.model.embed_tokens, layer.self_attn.v_proj, layer.mlp.down_proj):
        assert is_kernel_layer(m) and m["biases"].shape == (1,) and m["biases"].item() == -128
    for m in (model.lm_head, layer.mlp.up_proj):
        assert is_kernel_layer(m) and m["biases"].shape == (1,) and m["biases"].item() == -32
        assert (m.bits, m.group_size, m["scales"].dtype) == (6, 16, mx.uint8)
        assert m["scales"].shape == (m["weight"].shape[0], m["weight"].shape[1] * 32 // 6 // 256 * 18)
    for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj):
        assert m["scales"].dtype == m["biases"].dtype == mx.uint8
    assert layer.self_attn.k_proj["biases"].shape == layer.self_attn.k_proj["scales"].shape
    ours, want = np.array(model(TINY_IDS)), np.array(expected(TINY_IDS))
    # float32 accumulation only (the 8-bit re-coding of Q6_K this replaced was off by 0.7% of the range)
    assert np.abs(ours - want).max() <= 1e-4 * np.abs(want).max()
    assert (ours.argmax(-1) == want.argmax(-1)).all()
