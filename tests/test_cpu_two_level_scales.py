"""Two-level scales for the CPU kernels (kernels.h ``kSuper``, cpu_kernels/scales.py ``two_level_scales``).

A Q4_K or Q5_K tensor's per-group scales are ``d * sc`` and its biases ``-dmin * m``: a float16 per 256
weights times a 6-bit whole number per 32. Held that way (a float16 step and a uint8 multiple per
group: 0.625 bits a weight instead of float16 scale and bias's 1), every kernel path must read them as
exactly those float32 values: bit for bit what it computes from the same values held in float16, on
every instruction set, with exact and int8 math, one row to a prefill, dequantize and the experts'
gather. The conversion holds only exact values, and a model converted keeps its logits.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cpu_kernels import spec
from cpu_kernels.modules import CPUQuantizedEmbedding, use_cpu_kernels
from cpu_kernels.qmm import dequantize_rows
from cpu_kernels.scales import half_scales, two_level_scales
from tests.test_cpu_kernels import F32_TOL, check, ext, variants  # noqa: F401

pytestmark = [
    pytest.mark.skipif(
        mx.metal.is_available(), reason="the CPU kernels are for CPU inference (Metal has its own)"
    ),
    pytest.mark.usefixtures("exact_math"),  # exact math is these tests' reference (conftest.py)
]


def _blocks(rng: np.random.Generator, lead: tuple[int, ...], sb: int, sign: float, exact16: bool):
    """Per super-block a float16 step (with ``exact16``: a power of two, so that every step * multiple
    is a float16 too) and 8 multiples, the largest 63 as llama.cpp's K-quants have it."""
    if exact16:
        d = (2.0 ** rng.integers(-14, -6, (*lead, sb))).astype(np.float16)
    else:
        d = (np.abs(rng.standard_normal((*lead, sb))) * 0.01).astype(np.float16)
    d = (d * np.float16(sign)).astype(np.float16)
    mult = rng.integers(0, 64, (*lead, sb, 8), dtype=np.uint8)
    mult[..., rng.integers(0, 8)] = 63
    values = (d.astype(np.float32)[..., None] * mult.astype(np.float32)).reshape(*lead, sb * 8)
    packed = np.concatenate([d[..., None].view(np.uint8).reshape(*lead, sb, 2), mult], axis=-1)
    return values, packed.reshape(*lead, sb * 10)


def test_k_quant_scales_convert_exactly_and_back(ext):  # noqa: F811
    rng = np.random.default_rng(0)
    for sign in (1.0, -1.0):  # Q4_K's scales are d * sc, its biases -dmin * m
        values, packed = _blocks(rng, (37,), 5, sign, exact16=False)
        values[3, :8] = 0.0  # an all-zero super-block: step 0
        packed[3, :10] = 0
        got = ext.two_level_scales(mx.array(values))
        assert got is not None and got.dtype == mx.uint8 and got.shape == (37, 50)
        assert (np.array(got) == packed).all()
    stacked, _ = _blocks(rng, (3, 4), 2, 1.0, exact16=False)  # expert stacks: any leading dims
    assert ext.two_level_scales(mx.array(stacked)).shape == (3, 4, 20)


def test_a_large_tensor_converts_on_every_thread_and_one_bad_value_anywhere_refuses_it(ext):  # noqa: F811
    """Past 65536 super-blocks the check runs on the pool's threads: the same bytes at 1 and 2
    threads, and an inexact value in the first, a middle or the last super-block refuses the whole
    tensor."""
    rng = np.random.default_rng(2)
    values, packed = _blocks(rng, (2048,), 48, 1.0, exact16=False)  # 98304 super-blocks
    try:
        for threads in (1, 2):
            spec.set_threads(threads)
            got = ext.two_level_scales(mx.array(values))
            assert got is not None and (np.array(got) == packed).all(), threads
            for row, col in ((0, 0), (1024, 200), (2047, 383)):
                broken = values.copy()
                broken[row, col] = np.float32(0.1) * (broken[row, col] + np.float32(1e-3))
                assert ext.two_level_scales(mx.array(broken)) is None, (threads, row, col)
    finally:
        spec.set_threads()


def test_values_that_are_not_two_level_are_refused(ext):  # noqa: F811
    """Anything not exactly step * multiple (a Q4_1 file's float16 per group, one value a float32 ulp
    off, a NaN, an infinity, a multiple past 255, mixed signs) gives None: the layer keeps its
    float scales."""
    rng = np.random.default_rng(1)
    assert ext.two_level_scales(mx.array(rng.standard_normal((8, 16)).astype(np.float32))) is None
    values, _ = _blocks(rng, (8,), 2, 1.0, exact16=False)
    for i, bad in (
        (5, np.nextafter(values[2, 5], np.float32(1))),
        (9, np.nan),
        (1, np.inf),
        (4, -values[2, 0]),
    ):
        broken = values.copy()
        broken[2, i] = bad
        assert ext.two_level_scales(mx.array(broken)) is None, (i, bad)
    with pytest.raises(ValueError, match="multiple of 8"):
        ext.two_level_scales(mx.zeros((4, 12)))


@pytest.mark.parametrize("bits", (4, 5))
def test_every_path_reads_two_level_scales_as_their_values(ext, bits):  # noqa: F811
    """quantized_matmul at 1, 2, 3, 8, 17, 40 rows and a prefill's, exact and int8 math, dequantize and
    the gather over experts, on every instruction set: bit for bit the results with the same values
    held in float16 (steps that are powers of two, so float16 holds every product)."""
    rng = np.random.default_rng(bits)
    prefill = dequantize_rows()
    for isa in variants(ext):
        ext.set_isa(isa)
        for n, k in ((40, 256), (24, 768), (16, 2304)):
            w = mx.array(rng.integers(0, 2**32, (n, k * bits // 32), dtype=np.uint32))
            s, s2 = _blocks(rng, (n,), k // 256, 1.0, exact16=True)
            b, b2 = _blocks(rng, (n,), k // 256, -1.0, exact16=True)
            two = (mx.array(s2), mx.array(b2))
            half = (mx.array(s.astype(np.float16)), mx.array(b.astype(np.float16)))
            for m in (1, 2, 3, 8, 17, 40, prefill):
                x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
                for int8 in (False, True):
                    y2 = ext.quantized_matmul(x, w, *two, 32, bits, int8=int8)
                    yh = ext.quantized_matmul(x, w, *half, 32, bits, int8=int8)
                    assert y2.dtype == mx.float32
                    assert mx.array_equal(y2, yh).item(), (isa, n, k, m, int8)
            assert mx.array_equal(
                ext.dequantize(w, *two, 32, bits), ext.dequantize(w, *half, 32, bits)
            ).item()
            experts = 4
            we = mx.array(rng.integers(0, 2**32, (experts, n, k * bits // 32), dtype=np.uint32))
            es, es2 = _blocks(rng, (experts, n), k // 256, 1.0, exact16=True)
            eb, eb2 = _blocks(rng, (experts, n), k // 256, -1.0, exact16=True)
            for tokens in (1, 5, 64):
                x = mx.array(rng.standard_normal((tokens, 1, 1, k)).astype(np.float32))
                idx = mx.array(rng.integers(0, experts, (tokens, 1, 2)).astype(np.uint32))
                for int8 in (False, True):
                    g2 = ext.gather_quantized_matmul(
                        x, we, mx.array(es2), mx.array(eb2), idx, 32, bits, int8=int8
                    )
                    gh = ext.gather_quantized_matmul(
                        x,
                        we,
                        mx.array(es.astype(np.float16)),
                        mx.array(eb.astype(np.float16)),
                        idx,
                        32,
                        bits,
                        int8=int8,
                    )
                    assert mx.array_equal(g2, gh).item(), (isa, tokens, int8)
    ext.set_isa("")


def test_one_row_past_4096_values_keeps_float32_accuracy(ext):  # noqa: F811
    """One row of x against a Q4_K layer in rows with K past 4096 (a 1B model's down_proj, 8192) takes
    the exact integer kernel's 512-bit loop, as Q6_K's does: within float32's tolerance of float64 (the
    float16-held twin goes another way there, so the bits may differ), on one thread and several."""
    rng = np.random.default_rng(12)
    for n, k in ((9, 4352), (24, 8192)):
        w = mx.array(rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32))
        s, s2 = _blocks(rng, (n,), k // 256, 1.0, exact16=False)
        b, b2 = _blocks(rng, (n,), k // 256, -1.0, exact16=False)
        x = mx.array(rng.standard_normal((1, k)).astype(np.float32))
        outs = []
        for threads in (1, max(2, spec.physical_cores())):
            spec.set_threads(threads)
            y = ext.quantized_matmul(x, w, mx.array(s2), mx.array(b2), 32, 4, int8=False)
            check(y, x, w, mx.array(s), mx.array(b), 32, 4, F32_TOL)
            outs.append(np.array(y))
        spec.set_threads()
        assert np.array_equal(outs[0], outs[1]), (n, k)


def test_two_level_scales_are_checked_against_the_weights(ext):  # noqa: F811
    w = mx.zeros((8, 256 * 4 // 32), dtype=mx.uint32)
    s = mx.zeros((8, 10), dtype=mx.uint8)
    x = mx.zeros((1, 256))
    with pytest.raises(ValueError, match="4- and 5-bit"):
        ext.quantized_matmul(x, mx.zeros((8, 256 * 8 // 32), dtype=mx.uint32), s, s, 32, 8)
    with pytest.raises(ValueError, match="groups of 32"):
        ext.quantized_matmul(x, w, s, s, 64, 4)
    with pytest.raises(ValueError, match=r"K / 256 \* 10"):
        ext.quantized_matmul(x, w, mx.zeros((8, 8), dtype=mx.uint8), mx.zeros((8, 8), dtype=mx.uint8), 32, 4)
    with pytest.raises(ValueError, match="multiple of 256"):
        ext.quantized_matmul(
            mx.zeros((1, 128)), mx.zeros((8, 16), dtype=mx.uint32), s[:, :5], s[:, :5], 32, 4
        )


def _k_quant_like(layer: nn.Module) -> None:
    """Round a quantized layer's float32 scales and biases to what a Q4_K tensor holds: per 8 groups a
    float16 d (dmin) and 6-bit multiples, scales d * sc and biases -dmin * m."""
    for name, sign in (("scales", 1.0), ("biases", -1.0)):
        v = np.array(layer[name]).reshape(-1, 8) * sign
        top = np.maximum(v.max(axis=1, keepdims=True), 0)
        d = (top / 63).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            mult = np.where(d > 0, np.rint(v / d), 0).clip(0, 63)
        layer[name] = mx.array((sign * d * mult).astype(np.float32).reshape(layer[name].shape))


def quantized_llama(hidden: int, intermediate: int, bits: int, seed: int, vocab: int = 300) -> nn.Module:
    """A 2-layer mlx-lm llama with a tied embedding, random weights, quantized in groups of 32."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=2,
        intermediate_size=intermediate,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=True,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=bits)
    return model


def _tiny_llama(vocab: int = 300) -> nn.Module:
    model = quantized_llama(256, 512, 4, seed=3, vocab=vocab)
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            _k_quant_like(m)
    mx.eval(model.parameters())
    return model


def test_a_k_quant_model_converts_and_keeps_its_logits(ext):  # noqa: F811
    """Every 4-bit kernel layer (the tied embedding too: its lookup dequantizes through the kernel)
    takes two-level scales; the scale bytes drop from float16's 1 bit a weight to 0.625; the lookup
    stays float32 and equal; logits of a prefill and a decode step within float32 rounding of the
    float32-scale model's, the greedy choice the same; half_scales then has nothing left to do."""
    ours, theirs = _tiny_llama(), _tiny_llama()
    assert use_cpu_kernels(ours) > 0 and use_cpu_kernels(theirs) > 0
    tokens = mx.array([[5, 9, 200, 31, 7, 64, 3, 12, 290]])
    emb_before = ours.model.embed_tokens(tokens)
    weights = sum(m["weight"].size * 32 for _, m in ours.named_modules() if "scales" in m)
    changed = two_level_scales(ours)
    layers = [m for _, m in ours.named_modules() if "scales" in m]
    assert changed == len(layers) == 2 * 7 + 1
    assert all(m["scales"].dtype == m["biases"].dtype == mx.uint8 for m in layers)
    scale_bits = sum(m["scales"].nbytes + m["biases"].nbytes for m in layers) * 8
    assert scale_bits / (weights / 4) == pytest.approx(0.625)  # weight.size * 32 / 4 = weights
    assert half_scales(ours) == 0
    emb = ours.model.embed_tokens(tokens)
    assert isinstance(ours.model.embed_tokens, CPUQuantizedEmbedding) and emb.dtype == mx.float32
    assert np.allclose(np.array(emb), np.array(emb_before), rtol=0, atol=1e-6)
    for t in (tokens, tokens[:, :1]):
        a, b = np.array(ours(t)).astype(np.float64), np.array(theirs(t)).astype(np.float64)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
        assert (a.argmax(-1) == b.argmax(-1)).all()
    spec.set_cpu_math("int8")
    try:
        a, b = np.array(ours(tokens)), np.array(theirs(tokens))
    finally:
        spec.set_cpu_math("exact")
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_the_bundled_q4_1_model_keeps_its_float_scales(ext, monkeypatch):  # noqa: F811
    """Q4_1 stores a float16 scale and minimum per 32 weights, no second level: nothing converts."""
    import cpu_kernels.scales
    from mlx_engine.loading.loader import load_model

    monkeypatch.setattr(cpu_kernels.scales, "half_scales", lambda model: 0)
    monkeypatch.setattr(cpu_kernels.scales, "two_level_scales", lambda model: 0)
    loaded = load_model(None)
    layers = [m for _, m in loaded.model.named_modules() if "scales" in m]
    assert layers and all(m["scales"].dtype == mx.float32 for m in layers)
    assert two_level_scales(loaded.model) == 0
    assert all(m["scales"].dtype == mx.float32 for m in layers)
