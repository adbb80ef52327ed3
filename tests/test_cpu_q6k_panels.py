"""Q6_K layers in 16-row panels (src/panels.h): the panel kernel on Q6_K's own form.

A Q6_K matrix (6-bit codes in groups of 16, a float16 d and 16 int8 sub-scales per 256, the bias -32
times each scale) regrouped by 16 rows, low nibbles laid out as Q4_K's panels and the top two bits of
each code in a third 64-byte step. The values do not change: the conversion goes there and back bit for
bit; dequantize reads the panels bit for bit as the row form on every instruction set; int8 math on the
panel kernel matches the int8 path's float64 oracle, exact math (x in three int8 planes) keeps float32's
accuracy against float64, at every row count, the same bits on one thread and two; the other
instruction sets read panels through the row form; a Q6_K model in panels keeps its logits.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cpu_kernels import spec
from cpu_kernels.panels import in_panels, use_panels
from tests.test_cpu_kernels import F32_TOL, ext, f64, variants  # noqa: F401
from tests.test_cpu_panels import check_hard_rows, greedy, same_logits
from tests.test_cpu_q6k_scales import _SHAPES, INT8_TOL, Q6K, _exact_check, _int8_oracle

pytestmark = [
    pytest.mark.skipif(
        mx.metal.is_available(), reason="the CPU kernels are for CPU inference (Metal has its own)"
    ),
    pytest.mark.usefixtures("exact_math"),  # exact math is these tests' reference (conftest.py)
]

needs_vnni = pytest.mark.skipif(
    spec.extension() is None or not spec.extension().panel_kernel(),
    reason="the int8 panel kernel needs AVX-512 VNNI",
)


def _q6k_llama(tmp_path):
    """A tiny llama GGUF with every matrix Q6_K (2 layers; 262 vocabulary rows)."""
    from tests.gguf_quantize import Q, write_tiny_gguf

    path = tmp_path / "q6k.gguf"
    write_tiny_gguf(
        path,
        "llama",
        qtypes=lambda name: Q.F32 if "norm" in name else Q.Q6_K,
        config=_SHAPES | {"intermediate_size": 512},
    )
    return path


def _rows(m6: Q6K) -> tuple[mx.array, mx.array, mx.array]:
    return m6.w, m6.scales, m6.biases


def test_the_layout_goes_there_and_back_bit_for_bit(ext):  # noqa: F811
    rng = np.random.default_rng(11)
    for n, k in ((16, 256), (48, 768), (1024, 2048)):  # the last on the pool's threads
        m6 = Q6K(rng, n, k)
        panels = ext.panel_layout(*_rows(m6), True)
        assert panels[0].shape == m6.w.shape
        assert panels[1].shape == (n // 16, k // 16 * 18) and panels[1].dtype == mx.uint8
        assert panels[2].shape == (1,) and panels[2].item() == -32.0  # the ratio, as it was
        assert not mx.array_equal(panels[0], m6.w).item()
        back = ext.panel_layout(*panels, False)
        for a, b in zip(back, _rows(m6), strict=True):
            assert a.shape == b.shape and mx.array_equal(a, b).item()


def test_what_the_panels_cannot_hold_is_refused(ext):  # noqa: F811
    rng = np.random.default_rng(12)
    m6 = Q6K(rng, 32, 512)
    with pytest.raises(ValueError, match="multiple of 16"):
        ext.panel_layout(m6.w[:24], m6.scales[:24], m6.biases, True)
    with pytest.raises(ValueError, match="-32"):  # another ratio is not Q6_K's
        ext.panel_layout(m6.w, m6.scales, mx.array([-16.0]), True)
    panels = ext.panel_layout(*_rows(m6), True)
    with pytest.raises(ValueError, match="multiple of 16"):  # back: the scales must be in panels
        ext.panel_layout(*_rows(m6), False)
    x = mx.zeros((1, 512))
    with pytest.raises(ValueError, match="16-row panels"):  # a product checks the panels' shapes
        ext.quantized_matmul(x, panels[0], panels[1][:, :-18], panels[2], 16, 6, int8=True)
    with pytest.raises(ValueError, match="one-element"):  # biases per group are not Q6_K's
        ext.quantized_matmul(x, panels[0], panels[1], mx.zeros((2, 576)), 16, 6, int8=True)


@needs_vnni
def test_int8_math_on_panels_matches_its_oracle_at_every_row_count_and_thread_count(ext):  # noqa: F811
    rng = np.random.default_rng(13)
    for n, k in ((16, 256), (48, 768), (32, 4352)):  # 4352: 17 super-blocks
        m6 = Q6K(rng, n, k)
        panels = ext.panel_layout(*_rows(m6), True)
        for rows in (1, 2, 3, 5, 7, 8, 9, 16, 45, 130):
            x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
            ref, mag = _int8_oracle(x, m6)
            outs = []
            for threads in (1, 2):
                spec.set_threads(threads)
                y = ext.quantized_matmul(x, *panels, 16, 6, int8=True)
                assert y.dtype == mx.float32 and y.shape == (rows, n)
                err = np.abs(f64(y) - ref) / (mag + 1e-30)
                assert float(err.max()) <= INT8_TOL, (n, k, rows, threads, float(err.max()))
                outs.append(np.array(y))
            assert np.array_equal(outs[0], outs[1]), (n, k, rows)
    spec.set_threads()


@needs_vnni
def test_exact_math_on_panels_keeps_float32_accuracy(ext):  # noqa: F811
    """x in three int8 planes through the panel kernel, each plane's bias term as integer offsets:
    within float32's tolerance of float64 at every row count (decode, verification, a prefill chunk's
    rows below the dequantize crossover), the same bits on one thread and several; a run mixing an
    outlier with values 1e6 times smaller, a zero run, a tiny one; NaN or infinity confined to its row."""
    rng = np.random.default_rng(14)
    m6 = Q6K(rng, 48, 768)
    panels = ext.panel_layout(*_rows(m6), True)
    for rows in (1, 2, 3, 8, 9, 40, 130):
        x = mx.array(rng.standard_normal((rows, 768)).astype(np.float32))
        outs = []
        for threads in (1, max(2, spec.physical_cores())):
            spec.set_threads(threads)
            y = ext.quantized_matmul(x, *panels, 16, 6, int8=False)
            _exact_check(y, x, m6.values, (rows, threads))
            outs.append(np.array(y))
        spec.set_threads()
        assert np.array_equal(outs[0], outs[1]), rows
    check_hard_rows(
        rng,
        768,
        lambda x: ext.quantized_matmul(x, *panels, 16, 6, int8=False),
        lambda y, x: _exact_check(y, x, m6.values, "outliers"),
    )


def test_dequantize_and_other_isas_read_panels_as_rows(ext):  # noqa: F811
    """dequantize reads Q6_K panels bit for bit as the row form on every variant (the exact prefill's
    dequantize + GEMM reads them so); without the panel kernel the products go through a row-form copy,
    bit for bit the row form's."""
    rng = np.random.default_rng(15)
    m6 = Q6K(rng, 48, 768)
    panels = ext.panel_layout(*_rows(m6), True)
    for isa in variants(ext):
        ext.set_isa(isa)
        assert mx.array_equal(ext.dequantize(*panels, 16, 6), ext.dequantize(*_rows(m6), 16, 6)).item(), isa
        if isa == "avx512" and ext.panel_kernel():
            continue  # the panel kernel itself (above)
        for rows in (1, 2, 5, 40):
            x = mx.array(rng.standard_normal((rows, 768)).astype(np.float32))
            for int8 in (False, True):
                yp = ext.quantized_matmul(x, *panels, 16, 6, int8=int8)
                yr = ext.quantized_matmul(x, *_rows(m6), 16, 6, int8=int8)
                assert mx.array_equal(yp, yr).item(), (isa, rows, int8)
    ext.set_isa("")
    big = Q6K(rng, 4096, 512)  # on the pool's threads
    assert mx.array_equal(
        ext.dequantize(*ext.panel_layout(*_rows(big), True), 16, 6), ext.dequantize(*_rows(big), 16, 6)
    ).item()


@needs_vnni
def test_a_q6_k_model_in_panels_keeps_its_logits(ext, tmp_path):  # noqa: F811
    """Every matrix Q6_K: each linear layer goes into panels (the embedding, looked up by rows, stays), the logits under exact math within float32 rounding of the row form's and the same
    greedy tokens, under int8 math the same greedy tokens; back in rows bit for bit."""
    from mlx_engine.loading.loader import load_model
    from tests.gguf_quantize import TINY_IDS

    path = _q6k_llama(tmp_path)
    ours, theirs = load_model(str(path)).model, load_model(str(path)).model
    before = {id(m): (m["weight"], m["scales"]) for _, m in ours.named_modules() if "scales" in m}
    changed = use_panels(ours, True)
    # 7 matrices a layer; the output layer (262 rows, not a whole number of panels) stays in rows
    assert len(changed) == 2 * 7
    assert all(in_panels(m) and m["scales"].shape[-1] % 18 == 0 for m in changed)
    for t in (TINY_IDS, TINY_IDS[:, :1], TINY_IDS[:, :3]):
        same_logits(ours, theirs, t, 1e-5)
    spec.set_cpu_math("int8")
    try:
        for t in (TINY_IDS, TINY_IDS[:, :1]):
            same_logits(ours, theirs, t, 1e-2)
    finally:
        spec.set_cpu_math("exact")
    assert len(use_panels(ours, False)) == len(changed)
    for _, m in ours.named_modules():
        if "scales" in m:
            assert not in_panels(m)
            assert all(
                mx.array_equal(a, b).item()
                for a, b in zip((m["weight"], m["scales"]), before[id(m)], strict=True)
            )


@needs_vnni
def test_the_engine_puts_q6_k_in_panels_and_says_so(ext, tmp_path):  # noqa: F811
    """An engine (exact math, the default) on a Q6_K model puts its linear layers in panels, names them
    in the weight format and the numerics profile, and replies as the row form does."""
    import asyncio

    from mlx_engine.config import EngineConfig
    from mlx_engine.engine import Engine
    from mlx_engine.loading.loader import load_model
    from mlx_engine.request import GenerationRequest, SamplingParams

    path = _q6k_llama(tmp_path)
    loaded = load_model(str(path))
    req = GenerationRequest(
        prompt=[5, 9, 20, 31, 7, 6], max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0)
    )

    async def go(engine: Engine) -> list[int]:
        return [t async for ev in engine.generate(req) for t in ev.token_ids]

    engine = Engine(loaded, EngineConfig(cpu_math="exact", speculative="off"))
    try:
        # where AMX tiles take its prefill chunks (test_cpu_panel_tiles), the profile names them
        tiles = "+tiles(bf16:Q6_K)" if spec.panel_tiles() else ""
        assert engine.numerics_profile()["cpu_math"] == "exact+panels(joined:Q6_K)" + tiles
        assert engine.stats().weight_format == loaded.weight_format + ", Q6_K in 16-row panels"
        reply = asyncio.run(go(engine))
    finally:
        engine.shutdown()
    use_panels(loaded.model, False)
    assert reply == greedy(loaded.model, req.prompt, 12)


def _q6k_embedding(m6: Q6K):
    import mlx.nn as nn

    from cpu_kernels.modules import CPUQuantizedEmbedding

    emb = nn.QuantizedEmbedding(m6.w.shape[0], m6.w.shape[1] * 32 // 6, group_size=32, bits=6)
    emb.group_size = 16  # Q6_K's groups, as the GGUF loader makes them
    emb.weight, emb.scales, emb.biases = m6.w, m6.scales, m6.biases
    emb.__class__ = CPUQuantizedEmbedding
    return emb


@needs_vnni
def test_a_tied_q6_k_embedding_in_panels_looks_up_and_multiplies_as_rows(ext):  # noqa: F811
    """A Q6_K table (a tied LM head, as Llama 3.2's files hold it) in panels: lookups give the row
    form's rows bit for bit, the LM head's product keeps float32's accuracy under exact math."""
    import mlx.nn as nn

    rng = np.random.default_rng(16)
    m6 = Q6K(rng, 64, 512)
    ours, theirs = nn.Sequential(_q6k_embedding(m6)), _q6k_embedding(m6)
    assert len(use_panels(ours, True)) == 1 and in_panels(ours.layers[0])
    ids = mx.array([[0, 15, 16, 63, 40, 40]])
    assert mx.array_equal(ours.layers[0](ids), theirs(ids)).item()
    x = mx.array(rng.standard_normal((2, 512)).astype(np.float32))
    _exact_check(ours.layers[0].as_linear(x), x, m6.values, "tied head")


def test_q6_k_experts_in_panels_give_the_row_form_results(ext):  # noqa: F811
    """A stack of Q6_K experts in panels (converted as E * N rows): the gather per chosen expert, int8
    math within float32 rounding of the row form's, exact math within float32's tolerance of float64
    per token and expert (bit for bit the row form's where the panel kernel does not run)."""
    rng = np.random.default_rng(17)
    experts, n, k = 4, 48, 512
    stack = Q6K(rng, n, k, lead=(experts,))
    panels = ext.panel_layout(stack.w, stack.scales, stack.biases, True)
    assert panels[1].shape == (experts, n // 16, k // 16 * 18)
    back = ext.panel_layout(*panels, False)
    assert all(
        mx.array_equal(a, b).item() for a, b in zip(back, (stack.w, stack.scales, stack.biases), strict=True)
    )
    for tokens in (1, 3, 64):
        x = mx.array(rng.standard_normal((tokens, 1, 1, k)).astype(np.float32))
        idx = mx.array(rng.integers(0, experts, (tokens, 1, 2)).astype(np.uint32))
        for int8 in (False, True):
            yr = ext.gather_quantized_matmul(x, stack.w, stack.scales, stack.biases, idx, 16, 6, int8=int8)
            yp = ext.gather_quantized_matmul(x, *panels, idx, 16, 6, int8=int8)
            assert yp.shape == yr.shape == (tokens, tokens, 2, 1, n)
            if not ext.panel_kernel():
                assert mx.array_equal(yp, yr).item(), (tokens, int8)
            elif int8:
                assert float(mx.abs(yp - yr).max()) <= 1e-5 * float(mx.abs(yr).max()) * k / 32
            else:
                for t in range(tokens):
                    for j in range(2):
                        e = int(idx[t, 0, j].item())
                        _exact_check(yp[t, t, j], x[t].reshape(1, k), stack.values[e], (tokens, t, j))


@needs_vnni
def test_a_q6_k_mixture_of_experts_in_panels_keeps_its_logits(ext, tmp_path):  # noqa: F811
    """A Qwen3-MoE whose experts (and every other matrix) are Q6_K: the expert stacks go into panels
    with the linear layers, the logits within float32 rounding of the row form's (exact math), the same
    greedy tokens."""
    from mlx_engine.loading.loader import load_model
    from tests.gguf_families import write_family_gguf
    from tests.gguf_quantize import TINY_IDS, Q

    def qtype(name: str, shape: tuple[int, ...]) -> Q:
        return (
            Q.Q6_K if len(shape) >= 2 and name.endswith(".weight") and ".ffn_gate_inp" not in name else Q.F32
        )

    path = tmp_path / "moe-q6k.gguf"
    write_family_gguf(path, "qwen3moe", qtype_of=qtype, moe_intermediate_size=256, **_SHAPES)
    ours, theirs = load_model(str(path)).model, load_model(str(path)).model
    changed = use_panels(ours, True)
    assert sum(m["weight"].ndim == 3 for m in changed) == 2 * 3  # gate, up, down stacks of 2 layers
    for t in (TINY_IDS, TINY_IDS[:, :1]):
        same_logits(ours, theirs, t, 1e-5)
