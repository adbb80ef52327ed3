"""The CPU paged attention kernel (cpu_kernels/paged_attention.py) against float64 NumPy, and the
engine decoding and prefilling through it.

The oracle reads the pool through the block table in float64, independently of the kernel and of
MLX's SDPA. Every slot no row may read (free blocks, the rest of a partly used block, tokens before a
window) holds NaN, so a kernel that reads one shows it.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest

from cpu_kernels import spec
from cpu_kernels.paged_attention import fits, reference
from cpu_kernels.paged_attention import paged_attention as attend
from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.kv_cache import paged_attention
from mlx_engine.loading.loader import load_model
from tests.test_cpu_kernels import variants
from tests.test_engine_tiny import prompts, req, run_all

pytestmark = pytest.mark.skipif(
    mx.metal.is_available(), reason="the CPU kernels are for CPU inference (Metal has its own)"
)

TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def ext():
    module = spec.extension()
    assert module is not None, f"cpu_kernels._ext is not built: {spec.unavailable_reason()}"
    yield module
    spec.set_threads()


def make_case(lens, Hq, Hkv, D, Dv, block_size, seed=0, sinks=False, L=1):
    """Random queries for each row's last L tokens, a NaN-poisoned pool whose rows' tokens sit in shuffled blocks, the block table."""
    rng = np.random.default_rng(seed)
    B = len(lens)
    nblk = max(-(-n // block_size) for n in lens)
    num_blocks = 1 + B * nblk + 3  # the null block, the rows' blocks, spare blocks
    k = np.full((num_blocks * block_size, Hkv, D), np.nan, np.float32)
    v = np.full((num_blocks * block_size, Hkv, Dv), np.nan, np.float32)
    ids = rng.permutation(np.arange(1, num_blocks))
    table = np.zeros((B, nblk), np.int32)
    for b, n in enumerate(lens):
        used = -(-n // block_size)
        table[b, :used] = ids[b * nblk : b * nblk + used]
        for t in range(n):
            slot = table[b, t // block_size] * block_size + t % block_size
            k[slot] = rng.normal(size=(Hkv, D))
            v[slot] = rng.normal(size=(Hkv, Dv))
    q = rng.normal(size=(B, Hq, L, D)).astype(np.float32)
    s = rng.normal(size=(Hq,)).astype(np.float32) * 2 if sinks else None
    return q, k, v, table, np.array(lens, np.int32), s


def oracle(case, scale, block_size, window):
    q, k, v, table, lens, sinks = case
    B, Hq, L, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    out = np.zeros((B, Hq, L, Dv))
    for b in range(B):
        for i in range(L):
            n = int(lens[b]) - L + i + 1  # query i sees the row's tokens [start, n)
            start = max(0, n - window) if window else 0
            ts = np.arange(start, n)
            slots = table[b, ts // block_size].astype(np.int64) * block_size + ts % block_size
            for h in range(Hq):
                hk = h // (Hq // Hkv)
                kk, vv = k[slots, hk].astype(np.float64), v[slots, hk].astype(np.float64)
                s = kk @ q[b, h, i].astype(np.float64) * scale
                extra = [float(sinks[h])] if sinks is not None else []
                m = max([*s, *extra])
                w = np.exp(s - m)
                out[b, h, i] = (w @ vv) / (w.sum() + sum(np.exp(e - m) for e in extra))
    return out


def run_kernel(case, dtype, scale, block_size, window, kv_dtype=None):
    """The kernel on the case with queries in ``dtype`` and the pool in ``kv_dtype`` (``dtype`` when None)."""
    q, k, v, table, lens, s = case
    kv_dtype = kv_dtype or dtype
    out = attend(
        mx.array(q).astype(dtype),
        mx.array(k).astype(kv_dtype),
        mx.array(v).astype(kv_dtype),
        mx.array(table),
        mx.array(lens),
        scale=scale,
        block_size=block_size,
        window=window,
        sinks=None if s is None else mx.array(s),
    )
    return np.array(out.astype(mx.float32))


def rounded(case, dtype, kv_dtype=None):
    """The case's arrays as the kernel sees them (q rounded to ``dtype``, K and V to ``kv_dtype``,
    ``dtype`` when None), for the oracle."""
    q, k, v, table, lens, s = case
    kv_dtype = kv_dtype or dtype
    r = [
        np.array(mx.array(a).astype(t).astype(mx.float32))
        for a, t in ((q, dtype), (k, kv_dtype), (v, kv_dtype))
    ]
    return (*r, table, lens, s)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "lens, Hq, Hkv, D, Dv, block_size",
    [
        ([1], 1, 1, 64, 64, 16),  # one token: the softmax of one score
        ([16, 17, 15], 9, 3, 64, 64, 16),  # block boundaries (SmolLM2's heads)
        ([300, 1, 33, 64], 8, 2, 128, 128, 16),  # ragged: one long row among short ones
        ([40, 7], 16, 1, 80, 80, 8),  # GQA 16, head dim 80, block size 8
        ([70], 4, 4, 256, 256, 16),  # no GQA, head dim 256
        ([50, 3], 6, 2, 64, 32, 16),  # values narrower than keys
        ([200, 40], 12, 2, 64, 64, 16),  # GQA 6: four query heads at once (AVX-512), then a pair
    ],
)
@pytest.mark.parametrize("window, sinks", [(None, False), (8, False), (None, True), (20, True)])
def test_decode_matches_float64(dtype, lens, Hq, Hkv, D, Dv, block_size, window, sinks):
    case = make_case(lens, Hq, Hkv, D, Dv, block_size, seed=len(lens) * Hq + D, sinks=sinks)
    scale = D**-0.5
    got = run_kernel(case, dtype, scale, block_size, window)
    want = oracle(rounded(case, dtype), scale, block_size, window)
    assert np.isfinite(got).all(), "read a poisoned slot"
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    "lens, L, Hq, Hkv, D, block_size",
    [
        ([2], 2, 1, 1, 64, 16),  # a whole two-token prompt
        ([16, 40, 17], 16, 9, 3, 64, 16),  # one full query tile; a row with no history before it
        ([300, 41], 37, 8, 2, 128, 16),  # three tiles, the last partial; long history
        ([33, 50], 5, 16, 1, 80, 8),  # a verification-sized pass, GQA 16
    ],
)
@pytest.mark.parametrize("window, sinks", [(None, False), (7, False), (20, True)])
def test_query_chunks_attend_causally_like_float64(dtype, lens, L, Hq, Hkv, D, block_size, window, sinks):
    """A prefill chunk or a verification pass: each row's last L tokens, query i seeing only tokens up
    to its own position (and the window before it)."""
    case = make_case(lens, Hq, Hkv, D, D, block_size, seed=L * Hq + D, sinks=sinks, L=L)
    scale = D**-0.5
    got = run_kernel(case, dtype, scale, block_size, window)
    want = oracle(rounded(case, dtype), scale, block_size, window)
    assert np.isfinite(got).all(), "read a poisoned slot"
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "lens, L, Hq, Hkv, D, Dv",
    [
        ([1000, 70, 5], 1, 9, 3, 64, 64),  # decode over many chunks (SmolLM2's heads)
        ([333], 1, 16, 1, 128, 128),  # GQA 16: the transposed-key path
        ([1000, 70], 1, 32, 4, 128, 128),  # Qwen3-30B-A3B's heads: GQA 8, two fours of query heads
        ([700, 9], 1, 32, 8, 64, 64),  # Llama-3.2-1B's: GQA 4
        ([130, 64], 3, 6, 2, 80, 48),  # a verification pass; head dims not multiples of 32
        ([300, 41], 37, 8, 2, 64, 64),  # prefill tiles over a long history
    ],
)
@pytest.mark.parametrize("window", [None, 40])
def test_float32_queries_over_a_16_bit_pool_match_float64(kv_dtype, lens, L, Hq, Hkv, D, Dv, window):
    """The CPU engine's pool stores K and V in float16 while the model computes in float32: the kernel
    widens each key and value as it reads it, with float32 arithmetic throughout."""
    case = make_case(lens, Hq, Hkv, D, Dv, 16, seed=L + Hq + D, L=L)
    got = run_kernel(case, mx.float32, D**-0.5, 16, window, kv_dtype=kv_dtype)
    want = oracle(rounded(case, mx.float32, kv_dtype), D**-0.5, 16, window)
    assert np.isfinite(got).all(), "read a poisoned slot"
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("Hq, Hkv, D", [(32, 8, 64), (24, 8, 128), (9, 3, 64), (16, 2, 80)])
@pytest.mark.parametrize("window, sinks", [(None, False), (20, True)])
def test_a_verification_pass_gives_each_token_what_decoding_it_gives(kv_dtype, Hq, Hkv, D, window, sinks):
    """Speculative decoding checks 1 + k proposed tokens in one pass, and its output must be plain
    decoding's token for token: each query token of the pass must get, bit for bit, what a decode step
    at its position computes (GQA groups of 4, 3 and 8; with a window, the tokens' ranges differ at
    both ends)."""
    L = 5
    case = make_case([200, 37, L], Hq, Hkv, D, D, 16, seed=Hq + D, sinks=sinks, L=L)
    q, k, v, table, lens, s = case
    whole = run_kernel(case, mx.float32, D**-0.5, 16, window, kv_dtype=kv_dtype)
    for i in range(L):
        step = (q[:, :, i : i + 1], k, v, table, lens - (L - 1 - i), s)
        one = run_kernel(step, mx.float32, D**-0.5, 16, window, kv_dtype=kv_dtype)
        assert np.array_equal(whole[:, :, i : i + 1], one), i


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_and_a_long_context_give_the_same_result(threads):
    case = make_case([2048, 1000, 5, 1500], 9, 3, 64, 64, 16, seed=3, L=3)
    spec.set_threads(threads)
    got = run_kernel(case, mx.float32, 0.125, 16, None)
    spec.set_threads()
    np.testing.assert_allclose(got, oracle(case, 0.125, 16, None), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window, sinks", [(None, False), (100, True), (None, True), (700, False)])
@pytest.mark.parametrize("L", [1, 3])
def test_one_long_row_split_between_the_threads_matches_float64(window, sinks, L):
    """One sequence's decode (or verification) over a long context: too few rows for the threads, so
    its tokens are split between tasks and the stretches' softmax states merged (flash decoding).
    With a window, most stretches see nothing of it; a sink counts once. Every thread count gives
    float64's result."""
    case = make_case([3001], 8, 2, 64, 64, 16, seed=11 + L, sinks=sinks, L=L)
    want = oracle(case, 0.125, 16, window)
    outs = []
    for threads in (1, 2, 4):
        spec.set_threads(threads)
        got = run_kernel(case, mx.float32, 0.125, 16, window)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=f"{threads} threads")
        outs.append(got)
    spec.set_threads()
    # the merge changes the order of the sums, not more
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window, sinks", [(None, False), (7, False), (20, True)])
def test_the_mlx_reference_matches_float64_too(window, sinks):
    """``reference`` (the same semantics through MLX's ops) against the oracle: causal queries of a
    chunk, the window and the sinks."""
    q, k, v, table, lens, s = make_case([40, 23], 8, 2, 64, 64, 16, seed=13, sinks=sinks, L=5)
    k, v = np.nan_to_num(k), np.nan_to_num(v)  # the gather reads every slot of a row's blocks
    args = (mx.array(k), mx.array(v), mx.array(table), mx.array(lens))
    got = reference(
        mx.array(q),
        *args,
        scale=0.125,
        block_size=16,
        window=window,
        sinks=None if s is None else mx.array(s),
    )
    want = oracle((q, k, v, table, lens, s), 0.125, 16, window)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=2e-5)


def test_strided_query_and_lazy_composition_match_mlx_reference():
    q, k, v, table, lens, _ = make_case([33, 64], 8, 2, 64, 64, 16, seed=5, L=4)
    k, v = np.nan_to_num(k), np.nan_to_num(v)  # the gather reads every slot of a row's blocks
    # q as mlx-lm's attention makes it, a transposed view of (B, L, Hq, D)
    qt = mx.array(np.ascontiguousarray(q.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    args = (mx.array(k), mx.array(v), mx.array(table), mx.array(lens))
    want = reference(mx.array(q), *args, scale=0.1, block_size=16)
    for view in (mx.array(q), qt):
        got = attend(view * 1.0, *args, scale=0.1, block_size=16)  # lazy input
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5)
    compiled = mx.compile(lambda x: attend(x, *args, scale=0.1, block_size=16))
    np.testing.assert_allclose(np.array(compiled(mx.array(q))), np.array(want), atol=2e-5)


def test_bad_input_is_a_clear_error_and_unfit_operands_are_declined():
    case = make_case([5], 4, 2, 64, 64, 16)
    args = [mx.array(a) for a in case[:5]]
    with pytest.raises(ValueError, match="int32"):
        attend(*args[:3], args[3].astype(mx.int64), args[4], scale=1.0, block_size=16)
    with pytest.raises(ValueError, match="divide"):
        attend(args[0][:, :3], *args[1:], scale=1.0, block_size=16)
    with pytest.raises(ValueError, match="dtype"):
        attend(args[0], args[1], args[2].astype(mx.float16), *args[3:], scale=1.0, block_size=16)
    with pytest.raises(ValueError, match="L, D"):
        attend(args[0][:, :, 0], *args[1:], scale=1.0, block_size=16)
    assert fits(*args[:3]) and not fits(args[0][:, :3], *args[1:3])
    assert not fits(args[0], args[1].astype(mx.float16), args[2])  # K and V of different dtypes
    assert fits(args[0], args[1].astype(mx.float16), args[2].astype(mx.float16))  # a 16-bit pool
    # the op still works after the errors
    np.testing.assert_allclose(
        np.array(attend(*args, scale=1.0, block_size=16)),
        oracle(case, 1.0, 16, None),
        atol=2e-5,
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_engine_runs_through_the_kernel_with_the_reference_paths_tokens(arch, tiny_dirs, monkeypatch):
    """Greedy tokens of a ragged batch (one row shorter than Gemma 3's window), prefilled in 16-token
    chunks over the chunks before them, with the kernel and with the reference path (gather + SDPA);
    every layer of every decode step and prefill chunk reached the kernel."""
    loaded = load_model(str(tiny_dirs(arch)))
    ps = prompts(loaded.tokenizer.vocab_size, [3, 21, 45], seed=17)

    def generate(kernel: bool) -> tuple[list, list]:
        calls = []
        engine = Engine(loaded, EngineConfig(cache_gb=0.01, prefill_chunk=16, max_batch_tokens=64))
        try:
            assert engine.runner.attention.kernel is paged_attention.cpu_attention  # the CPU default

            def counting(queries, cache, scale, sinks, window):
                out = paged_attention.cpu_attention(queries, cache, scale, sinks, window)
                assert out is not None
                calls.append((cache.layer, queries.shape[2], min(cache.layout.starts)))
                return out

            engine.runner.attention = paged_attention.AttentionRoute(kernel=counting if kernel else None)
            return asyncio.run(run_all(engine, [req(p, 12) for p in ps])), calls
        finally:
            engine.shutdown()

    with_kernel, calls = generate(True)
    without, _ = generate(False)
    assert with_kernel == without, arch
    layers = loaded.model.args.num_hidden_layers
    assert calls and len(calls) % layers == 0 and {c[0] for c in calls} == set(range(layers))
    assert any(n == 1 for _, n, _ in calls), "no decode step"
    assert any(n > 1 and start > 0 for _, n, start in calls), "no prefill chunk over earlier tokens"


def test_every_instruction_set_this_cpu_has_gives_the_float64_result(ext):
    """The arithmetic is compiled per instruction set (attention_impl.inc): each variant the CPU can
    run, on a case with head dims that are not a multiple of 8 and a partial query tile, and on decode
    over many chunks (paired query heads, the next chunk prefetched), with float32, float16 and
    bfloat16 pools under float32 queries."""
    cases = [
        (make_case([70, 19], 6, 2, 36, 20, 16, seed=9, sinks=True, L=19), 24),
        (make_case([300, 45], 9, 3, 64, 64, 16, seed=10), None),
    ]
    try:
        for isa in variants(ext):
            ext.set_isa(isa)
            for case, window in cases:
                for kv in (mx.float32, mx.float16, mx.bfloat16):
                    got = run_kernel(case, mx.float32, 0.2, 16, window, kv_dtype=kv)
                    want = oracle(rounded(case, mx.float32, kv), 0.2, 16, window)
                    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=f"{isa} {kv}")
    finally:
        ext.set_isa("")
