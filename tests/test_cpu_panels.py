"""Q4_K and Q5_K layers in 16-row panels (cpu_kernels/panels.py, src/panels.h): the int8 panel kernel.

The layout regroups a 4- or 5-bit layer with two-level scales by 16 rows (Q5_K: Q4_K's nibbles and a
step of fifth bits); nothing about the values changes. Each kernel-level test runs for both.
So: the conversion goes there and back bit for bit; the int8 panel kernel matches the int8 path's
float64 oracle at every row count and thread count (each output computed by one thread); exact math
on the panel kernel (x in three int8 planes) keeps float32's accuracy against float64; dequantize
reads panels bit for bit as the row form, and the other instruction sets read a panel layer through
the row form, bit for bit what the row form gives; a model converted keeps its int8 logits and greedy
tokens; the engine puts a K-quant model in panels for either math and says so in its numerics
profile.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from cpu_kernels import spec
from cpu_kernels.modules import use_cpu_kernels
from cpu_kernels.panels import in_panels, use_panels
from cpu_kernels.scales import two_level_scales
from tests.test_cpu_int8_path import check, oracle
from tests.test_cpu_kernels import F32_TOL, ext, variants  # noqa: F401
from tests.test_cpu_kernels import check as check_f64
from tests.test_cpu_two_level_scales import _blocks, _tiny_llama

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


def _layer(rng: np.random.Generator, n: int, k: int, bits: int = 4):
    """A random 4- or 5-bit layer with two-level scales (Q4_K's or Q5_K's form): (w, scales, biases) and
    the float32 values of its scales and biases."""
    w = mx.array(rng.integers(0, 2**32, (n, k * bits // 32), dtype=np.uint32))
    s, s2 = _blocks(rng, (n,), k // 256, 1.0, exact16=False)
    b, b2 = _blocks(rng, (n,), k // 256, -1.0, exact16=False)
    return (w, mx.array(s2), mx.array(b2)), (mx.array(s), mx.array(b))


K32_BITS = pytest.mark.parametrize("bits", [4, 5], ids=["Q4_K", "Q5_K"])


@K32_BITS
def test_the_layout_goes_there_and_back_bit_for_bit(ext, bits):  # noqa: F811
    rng = np.random.default_rng(1)
    for n, k in ((16, 256), (48, 768), (1024, 2048)):  # the last on the pool's threads
        rows, _ = _layer(rng, n, k, bits)
        panels = ext.panel_layout(*rows, True)
        assert panels[0].shape == rows[0].shape
        assert panels[1].shape == panels[2].shape == (n // 16, k // 16 * 10)
        assert not mx.array_equal(panels[0], rows[0]).item()
        back = ext.panel_layout(*panels, False)
        for a, b in zip(back, rows, strict=True):
            assert a.shape == b.shape and mx.array_equal(a, b).item()


@K32_BITS
def test_shapes_the_panels_cannot_hold_are_refused(ext, bits):  # noqa: F811
    rng = np.random.default_rng(2)
    (w, s, b), (fs, fb) = _layer(rng, 32, 512, bits)
    with pytest.raises(ValueError, match="multiple of 16"):
        ext.panel_layout(w[:24], s[:24], b[:24], True)
    with pytest.raises(ValueError, match="two-level"):
        ext.panel_layout(w, fs, fb, True)
    panels = ext.panel_layout(w, s, b, True)
    with pytest.raises(ValueError, match="multiple of 16"):  # back: the scales must be in panels
        ext.panel_layout(w, s, b, False)
    # a product checks the panel form's shapes as the row form's
    x = mx.zeros((1, 512))
    with pytest.raises(ValueError, match="16-row panels"):
        ext.quantized_matmul(x, panels[0], panels[1][:, :-10], panels[2][:, :-10], 32, bits, int8=True)
    with pytest.raises(ValueError, match="panel_layout needs"):  # codes of neither width for the scales
        ext.panel_layout(w[:, :-1], s, b, True)


@needs_vnni
@K32_BITS
def test_the_panel_kernel_matches_the_int8_oracle_at_every_row_count_and_thread_count(ext, bits):  # noqa: F811
    rng = np.random.default_rng(3)
    for n, k in ((16, 256), (48, 768), (64, 2304)):
        rows, floats = _layer(rng, n, k, bits)
        panels = ext.panel_layout(*rows, True)
        for m in (1, 2, 3, 7, 8, 9, 16, 20, 45, 130):
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
            ref, mag = oracle(x, rows[0], *floats, 32, bits)
            outs = []
            for threads in (1, 2):
                spec.set_threads(threads)
                y = ext.quantized_matmul(x, *panels, 32, bits, int8=True)
                assert y.dtype == mx.float32 and y.shape == (m, n)
                check(y, ref, mag, (n, k, m, threads))
                outs.append(np.array(y))
            assert np.array_equal(outs[0], outs[1]), (n, k, m)
        # float16 x: its float32 values' product, rounded to float16 once
        x16 = mx.array(rng.standard_normal((3, k)).astype(np.float16))
        y16 = ext.quantized_matmul(x16, *panels, 32, bits, int8=True)
        y32 = ext.quantized_matmul(x16.astype(mx.float32), *panels, 32, bits, int8=True)
        assert y16.dtype == mx.float16 and mx.array_equal(y16, y32.astype(mx.float16)).item()
    spec.set_threads()


@K32_BITS
def test_dequantize_and_other_isas_read_panels_as_rows(ext, bits):  # noqa: F811
    """Bit for bit the row form's results: dequantize reads the panels as they are on every variant;
    the products without the panel kernel go by way of a row-form copy."""
    rng = np.random.default_rng(4)
    rows, _ = _layer(rng, 48, 768, bits)
    panels = ext.panel_layout(*rows, True)
    for isa in variants(ext):
        ext.set_isa(isa)
        assert mx.array_equal(ext.dequantize(*panels, 32, bits), ext.dequantize(*rows, 32, bits)).item(), isa
        for m in (1, 2, 5, 40):
            x = mx.array(rng.standard_normal((m, 768)).astype(np.float32))
            for int8 in (False, True):
                if isa == "avx512" and ext.panel_kernel():
                    continue  # the panel kernel itself (above, and exact math below)
                yp = ext.quantized_matmul(x, *panels, 32, bits, int8=int8)
                yr = ext.quantized_matmul(x, *rows, 32, bits, int8=int8)
                assert mx.array_equal(yp, yr).item(), (isa, m, int8)
    ext.set_isa("")
    big, _ = _layer(rng, 4096, 512, bits)  # on the pool's threads
    assert mx.array_equal(
        ext.dequantize(*ext.panel_layout(*big, True), 32, bits), ext.dequantize(*big, 32, bits)
    ).item()


@needs_vnni
@K32_BITS
def test_exact_math_on_panels_keeps_float32_accuracy(ext, bits):  # noqa: F811
    """Exact math on a panel layer: x in three int8 planes through the panel kernel, within float32's
    tolerance of float64 as the row form's exact paths are, at every row count (decode, verification,
    a prefill chunk's rows, which the engine sends here below the dequantize crossover), and the same
    bits on one thread and several."""
    rng = np.random.default_rng(6)
    (w, s2, b2), (s, b) = _layer(rng, 48, 768, bits)
    panels = ext.panel_layout(w, s2, b2, True)
    for m in (1, 2, 3, 8, 9, 40, 130):
        x = mx.array(rng.standard_normal((m, 768)).astype(np.float32))
        outs = []
        for threads in (1, max(2, spec.physical_cores())):
            spec.set_threads(threads)
            y = ext.quantized_matmul(x, *panels, 32, bits, int8=False)
            check_f64(y, x, w, s, b, 32, bits, F32_TOL)
            outs.append(np.array(y))
        spec.set_threads()
        assert np.array_equal(outs[0], outs[1]), m
    check_hard_rows(
        rng,
        768,
        lambda x: ext.quantized_matmul(x, *panels, 32, bits, int8=False),
        lambda y, x: check_f64(y, x, w, s, b, 32, bits, F32_TOL),
    )


@needs_vnni
@K32_BITS
def test_exact_math_keeps_a_prefill_chunk_of_a_q4k_layer_on_the_panel_kernel(ext, bits, monkeypatch):  # noqa: F811
    """A prefill chunk (128 up to PANEL_X3_ROWS rows) of a Q4_K or Q5_K layer in panels stays on the panel
    kernel with exact math, no float32 copy of the matrix (it beats dequantize + BLAS there), within
    float32's tolerance of float64; the same layer in rows still dequantizes from X3_GEMM_ROWS. (AMX
    tiles, which take such chunks where they are on, are turned off here: test_cpu_panel_tiles.py.)"""
    from cpu_kernels import qmm

    rng = np.random.default_rng(8)
    (w, s2, b2), (s, b) = _layer(rng, 32, 512, bits)
    panels = ext.panel_layout(w, s2, b2, True)
    tiles = spec.panel_tiles()
    spec.set_panel_tiles(False)
    try:
        assert qmm.x3_gemm() and not qmm.on_tiles(panels[0], panels[1], bits)
        assert qmm.dequantize_rows(*panels[:2], bits) == qmm.PANEL_X3_ROWS > qmm.X3_GEMM_ROWS
        assert qmm.dequantize_rows(w, s2, bits) == qmm.X3_GEMM_ROWS
        called = []
        real_run = qmm.run
        monkeypatch.setattr(
            qmm, "run", lambda spec_, *a, **kw: (called.append(spec_.name), real_run(spec_, *a, **kw))[1]
        )
        x = mx.array(rng.standard_normal((qmm.X3_GEMM_ROWS + 72, 512)).astype(np.float32))
        y = qmm.quantized_matmul(x, *panels, group_size=32, bits=bits)
        check_f64(y, x, w, s, b, 32, bits, F32_TOL)
        assert called == ["quantized_matmul"]
        called.clear()
        qmm.quantized_matmul(x, w, s2, b2, group_size=32, bits=bits)
        assert called == ["dequantize"]
    finally:
        spec.set_panel_tiles(tiles)


def check_hard_rows(rng: np.random.Generator, k: int, product, check) -> None:
    """As the row form's exact kernels are tested: a run of x mixing an outlier with values 1e6 times
    smaller, a zero run, a tiny one (``check(y, x)`` holds them to float64); a NaN or infinity makes its
    own row NaN alone."""
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, :32] *= 1e-4
    x[0, 5] = 300.0
    x[0, 64:96] = 0.0
    x[0, 128:160] *= 1e-30
    y = product(mx.array(x))
    check(y, mx.array(x))
    for bad in (np.nan, np.inf):
        xb = x.copy()
        xb[1, 100] = bad
        yb = np.array(product(mx.array(xb)))
        assert np.isnan(yb[1]).all() and np.array_equal(yb[[0, 2]], np.array(y)[[0, 2]]), bad


@needs_vnni
def test_exact_math_on_panels_under_a_large_vocabulary(ext):  # noqa: F811
    """80 rows against a 65,536-row matrix (an LM head under a batch's verification, where the planes'
    products once went in 48 MB chunks; the kernel now joins them and holds none), within float32's
    tolerance."""
    rng = np.random.default_rng(7)
    (w, s2, b2), (s, b) = _layer(rng, 65536, 256)
    x = mx.array(rng.standard_normal((80, 256)).astype(np.float32))
    y = ext.quantized_matmul(x, *ext.panel_layout(w, s2, b2, True), 32, 4, int8=False)
    check_f64(y, x, w, s, b, 32, 4, F32_TOL)


@K32_BITS
def test_experts_in_panels_give_the_row_form_results(ext, bits):  # noqa: F811
    """The gather over a stack of experts in panels (converted as E * N rows): int8 math within float32
    rounding of the row form's (the same int8 x, other sums' order); exact math within float32's
    tolerance of float64, each expert's rows as three int8 planes (bit for bit the row form's where the
    panel kernel does not run)."""
    rng = np.random.default_rng(5)
    experts, n, k = 4, 48, 512
    rows, (sf, bf) = _layer(rng, experts * n, k, bits)
    w, s, b = (
        rows[0].reshape(experts, n, -1),
        rows[1].reshape(experts, n, -1),
        rows[2].reshape(experts, n, -1),
    )
    pw, ps, pb = ext.panel_layout(*rows, True)
    panels = (pw.reshape(experts, n, -1), ps.reshape(experts, n // 16, -1), pb.reshape(experts, n // 16, -1))
    for tokens in (1, 3, 64):
        x = mx.array(rng.standard_normal((tokens, 1, 1, k)).astype(np.float32))
        idx = mx.array(rng.integers(0, experts, (tokens, 1, 2)).astype(np.uint32))
        for int8 in (False, True):
            yr = ext.gather_quantized_matmul(x, w, s, b, idx, 32, bits, int8=int8)
            yp = ext.gather_quantized_matmul(x, *panels, idx, 32, bits, int8=int8)
            assert yp.shape == yr.shape == (tokens, tokens, 2, 1, n)
            if int8 and ext.panel_kernel():
                assert float(mx.abs(yp - yr).max()) <= 1e-5 * float(mx.abs(yr).max()) * k / 32
            elif ext.panel_kernel():
                for t in range(tokens):  # token t's two experts, each against float64
                    for j in range(2):
                        e = int(idx[t, 0, j].item())
                        rows_e = slice(e * n, (e + 1) * n)
                        xt = x[t].reshape(1, k)
                        check_f64(yp[t, t, j], xt, rows[0][rows_e], sf[rows_e], bf[rows_e], 32, bits, F32_TOL)
            else:
                assert mx.array_equal(yp, yr).item(), (tokens, int8)


def _k_quant_model(vocab: int = 300):
    model = _tiny_llama(vocab)  # hidden 256, MLP 512, 4-bit, Q4_K-like scales
    use_cpu_kernels(model)
    two_level_scales(model)
    return model


@needs_vnni
def test_a_model_in_panels_keeps_its_int8_logits_and_goes_back_exactly(ext):  # noqa: F811
    ours, theirs = _k_quant_model(), _k_quant_model()
    before = {
        id(m): (m["weight"], m["scales"], m["biases"]) for _, m in ours.named_modules() if "scales" in m
    }
    changed = use_panels(ours, True)
    assert len(changed) == 2 * 7  # every linear layer; the tied embedding's 300 rows are no whole panels
    assert all(in_panels(m) and m["scales"].shape[0] * 16 == m["weight"].shape[0] for m in changed)
    assert use_panels(ours, True) == []  # nothing left to do
    tokens = mx.array([[5, 9, 200, 31, 7, 64, 3, 12, 290, 17, 18, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]])
    spec.set_cpu_math("int8")
    try:
        for t in (tokens, tokens[:, :1], tokens[:, :3]):
            # the two kernels sum in other orders, so a later layer's input can round to the neighbouring
            # int8 value at a place (one step: max|x| / 127 of its run): measured up to 0.2% of the
            # logits' largest magnitude here, where int8 against exact math differs by ~0.5%
            same_logits(ours, theirs, t, 1e-2)
    finally:
        spec.set_cpu_math("exact")
    # exact math on a model left in panels (x in three int8 planes): the row form's logits within
    # float32's rounding, the same greedy tokens
    for t in (tokens, tokens[:, :1], tokens[:, :3]):
        same_logits(ours, theirs, t, 1e-5)
    assert len(use_panels(ours, False)) == len(changed)
    for _, m in ours.named_modules():
        if "scales" in m:
            assert not in_panels(m)
            assert all(
                mx.array_equal(a, b).item()
                for a, b in zip((m["weight"], m["scales"], m["biases"]), before[id(m)], strict=True)
            )


@needs_vnni
def test_a_tied_embedding_in_panels_looks_up_and_multiplies_as_rows(ext):  # noqa: F811
    """A tied embedding of whole panels (320 rows) goes into panels with the linear layers: the LM head
    is then the panel kernel's product, and a lookup dequantizes each id's panel and takes its row: the
    rows bit for bit the row form's (first and last of a panel, the table's last), the logits within
    float32 rounding of the row form's, the same greedy tokens."""
    ours, theirs = _k_quant_model(320), _k_quant_model(320)
    changed = use_panels(ours, True)
    assert len(changed) == 2 * 7 + 1 and in_panels(ours.model.embed_tokens)
    ids = mx.array([[0, 15, 16, 31, 319, 200, 5, 5]])
    assert mx.array_equal(ours.model.embed_tokens(ids), theirs.model.embed_tokens(ids)).item()
    for t in (ids, ids[:, :1]):
        same_logits(ours, theirs, t, 1e-5)


def same_logits(ours, theirs, tokens: mx.array, tol: float) -> None:
    """The two models' logits for tokens within tol of the largest magnitude, the same greedy choices."""
    a, b = np.array(ours(tokens)).astype(np.float64), np.array(theirs(tokens)).astype(np.float64)
    assert np.abs(a - b).max() <= tol * np.abs(b).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt by the model's own loop (no cache): the reference for an engine's."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
    return ids[len(prompt) :]


def _k_quant_gguf(path: Path, arch: str, quant: str = "Q4_K") -> Path:
    """A tiny model of the family with every matrix the K-quant ``quant`` (Q4_K or Q5_K), or ``mixed``:
    its FFN Q5_K, its attention's V Q6_K, the other matrices Q4_K."""
    from tests.gguf_families import write_family_gguf

    def qtype(name: str, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
        q = gguf.GGMLQuantizationType
        matrix = (
            len(shape) >= 2 and shape[-1] % 256 == 0 and "token_embd" not in name and "gate_inp" not in name
        )
        if not matrix:
            return q.F32
        if quant == "mixed":
            return q.Q5_K if "ffn" in name else q.Q6_K if "attn_v" in name else q.Q4_K
        return q[quant]

    write_family_gguf(
        path,
        arch,
        qtype_of=qtype,
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
    )
    return path


@needs_vnni
@pytest.mark.parametrize(
    "arch, quant",
    [
        ("granite", "Q4_K"),
        ("qwen3moe", "Q4_K"),
        ("granite", "Q5_K"),
        ("qwen3moe", "Q5_K"),
        ("granite", "mixed"),
    ],
)
def test_the_engine_fits_the_layout_to_its_math(ext, tmp_path, arch, quant):  # noqa: F811
    """An int8 engine on a Q4_K (Q5_K, or a mix with Q6_K) model puts its layers in panels and says so
    (numerics profile, weight format); its greedy reply is the one the row form gives with int8 math; an
    exact engine on the same loaded model (put back in rows meanwhile) puts them in panels too and replies
    as the row form does with exact math."""
    from mlx_engine.config import EngineConfig
    from mlx_engine.engine import Engine
    from mlx_engine.loading.loader import load_model
    from mlx_engine.request import GenerationRequest, SamplingParams

    loaded = load_model(str(_k_quant_gguf(tmp_path / "kquant.gguf", arch, quant)))
    types, named = (["Q4_K", "Q5_K", "Q6_K"], "Q4_K, Q5_K and Q6_K") if quant == "mixed" else ([quant], quant)
    layers = [m for _, m in loaded.model.named_modules() if "scales" in m and m["scales"].dtype == mx.uint8]
    assert layers
    req = GenerationRequest(
        prompt=[5, 9, 20, 31, 7, 6], max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0)
    )

    def reply(engine: Engine) -> list[int]:
        async def go() -> list[int]:
            return [t async for ev in engine.generate(req) for t in ev.token_ids]

        return asyncio.run(go())

    try:
        engine = Engine(loaded, EngineConfig(cpu_math="int8", speculative="off"))
        try:
            assert all(in_panels(m) for m in layers if m["weight"].shape[-2] % 16 == 0)
            # the experts' stacks too, where the MoE has them in the K-quant
            assert any(in_panels(m) and m["weight"].ndim == 3 for m in layers) == (arch == "qwen3moe")
            assert engine.numerics_profile()["cpu_math"] == f"int8+panels({','.join(types)})"
            assert engine.stats().weight_format.endswith(f", int8 activations, {named} in 16-row panels")
            with_panels = reply(engine)
        finally:
            engine.shutdown()
        # the same math on the row form: the same greedy tokens (the model's own loop, no cache). Q4_K
        # only: the row kernel for 5-bit codes rounds some outputs to the neighbouring float32 value (the
        # products agree to ~3e-7, tests above), the next layer's int8 x then to the neighbouring int8
        # value, and the logits move by ~0.5%, which a near-tie in 12 random-weight tokens can turn
        use_panels(loaded.model, False)
        if quant == "Q4_K":
            assert with_panels == greedy(loaded.model, req.prompt, 12)
        engine = Engine(loaded, EngineConfig(cpu_math="exact", speculative="off"))
        try:
            # exact math: in panels too (x in three int8 planes)
            assert all(in_panels(m) for m in layers if m["weight"].shape[-2] % 16 == 0)
            # where AMX tiles take the panels' prefill chunks (test_cpu_panel_tiles), it says so
            tiles = f"+tiles(bf16:{','.join(types)})" if spec.panel_tiles() else ""
            assert engine.numerics_profile()["cpu_math"] == f"exact+panels(joined:{','.join(types)})" + tiles
            assert engine.stats().weight_format == loaded.weight_format + f", {named} in 16-row panels"
            exact_panels = reply(engine)
        finally:
            engine.shutdown()
        use_panels(loaded.model, False)
        assert exact_panels == greedy(loaded.model, req.prompt, 12)
    finally:
        spec.set_cpu_math("exact")
