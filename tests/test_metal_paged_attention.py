"""Paged decode attention: the Metal kernel (emulated here, real on Apple Silicon) and the MLX
reference path against a float64 NumPy oracle, with adversarial lengths and poisoned pools."""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels import numpy_reference as ref
from metal_kernels import paged_attention as pa
from metal_kernels.emulator import EmulatorError, metal_kernel, options
from metal_kernels.spec import Launch, metal_available

EPS = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-23}

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


class Case:
    """Random pools with every slot no sequence owns (and the null block 0) set to ``poison``."""

    def __init__(self, lens, n_kv, gqa, dim, dtype, block_size=16, bits=None, group_size=32, seed=0,
                 poison=float("nan"), window=None, spare_blocks=3, pad_blocks=1):  # fmt: skip
        rng = np.random.default_rng(seed)
        self.lens = list(lens)
        self.dtype = dtype
        self.bits = bits
        self.group_size = group_size
        self.window = window
        batch = len(lens)
        need = [max(1, -(-n // block_size)) for n in lens]
        max_blocks = max(need) + pad_blocks
        num_blocks = 1 + sum(need) + spare_blocks
        ids = rng.permutation(np.arange(1, num_blocks))
        tables = np.zeros((batch, max_blocks), dtype=np.int32)
        owned = np.zeros((num_blocks, block_size), dtype=bool)
        pos = 0
        for b, n in enumerate(lens):
            tables[b, : need[b]] = ids[pos : pos + need[b]]
            pos += need[b]
            first = 0 if window is None else max(0, n - window)
            for t in range(first, n):
                owned[tables[b, t // block_size], t % block_size] = True
        shape = (num_blocks, block_size, n_kv, dim)
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        self.q = mx.array(rng.standard_normal((batch, n_kv * gqa, dim)).astype(np.float32)).astype(dtype)
        self.tables = mx.array(tables)
        self.context_lens = mx.array(np.array(lens, dtype=np.int32))
        self.scale = 1.0 / math.sqrt(dim)
        mask = owned[:, :, None, None]
        if bits is None:
            self.k = mx.array(np.where(mask, k, poison)).astype(dtype)
            self.v = mx.array(np.where(mask, v, poison)).astype(dtype)
            self.quant = {}
            self.k64 = ref.to_f64(self.k)
            self.v64 = ref.to_f64(self.v)
        else:
            kq, ks, kb = mx.quantize(mx.array(k).astype(dtype), group_size=group_size, bits=bits)
            vq, vs, vb = mx.quantize(mx.array(v).astype(dtype), group_size=group_size, bits=bits)
            gmask = mx.array(np.broadcast_to(mask, (*shape[:3], dim // group_size)).copy())
            ks, vs = (mx.where(gmask, s, mx.array(poison, dtype=dtype)) for s in (ks, vs))
            self.k, self.v = kq, vq
            self.quant = dict(
                k_scales=ks, k_biases=kb, v_scales=vs, v_biases=vb, bits=bits, group_size=group_size
            )
            self.k64 = ref.dequantize_affine(np.array(kq), ref.to_f64(ks), ref.to_f64(kb), group_size, bits)
            self.v64 = ref.dequantize_affine(np.array(vq), ref.to_f64(vs), ref.to_f64(vb), group_size, bits)

    def expected(self, sinks=None):
        s = None if sinks is None else ref.to_f64(sinks)
        return ref.paged_decode_attention(
            self.q, self.k64, self.v64, np.array(self.tables), np.array(self.context_lens), self.scale,
            window=self.window, sinks=s,
        )  # fmt: skip

    def run(self, backend, sinks=None, **kw):
        return pa.paged_decode_attention(
            self.q, self.k, self.v, self.tables, self.context_lens, scale=self.scale, window=self.window,
            sinks=sinks, backend=backend, **self.quant, **kw,
        )  # fmt: skip

    def assert_matches(self, out, sinks=None):
        expected = self.expected(sinks)
        got = ref.to_f64(out)
        assert out.dtype == self.dtype and out.shape == self.q.shape
        vmax = np.nanmax(np.abs(self.v64[np.isfinite(self.v64)]))
        tol = (4 * EPS[self.dtype] + 2e-6) * vmax
        assert np.isfinite(got).all(), "NaN/inf in output: a poisoned slot was read"
        err = np.abs(got - expected)
        assert (err <= tol).all(), f"max err {err.max()} > {tol}"


BLOCK_EDGE_LENS = [1, 15, 16, 17, 40]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize(
    "dtype,dim,gqa,block_size,order",
    [
        (mx.float16, 64, 4, 16, "forward"),
        (mx.bfloat16, 128, 1, 16, "reverse"),
        (mx.float32, 80, 8, 16, "random"),
        (mx.float16, 96, 1, 8, "random"),
    ],
)
def test_single_partition_block_edges(backend, dtype, dim, gqa, block_size, order):
    lens = [1, block_size - 1, block_size, block_size + 1, 40]
    case = Case(lens, n_kv=2, gqa=gqa, dim=dim, dtype=dtype, block_size=block_size)
    with options(order=order, strict=True):
        out = case.run(backend)
    case.assert_matches(out)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_multi_partition_with_reduce(backend, order):
    """Partitions of 32 tokens: several per sequence, some entirely past a sequence's end."""
    case = Case([1, 31, 32, 33, 100, 64], n_kv=2, gqa=4, dim=64, dtype=mx.float16, seed=1)
    with options(order=order, strict=True):
        out = case.run(backend, partition_tokens=32)
    case.assert_matches(out)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("partition_tokens", [256, 32])
def test_sliding_window_and_sinks(backend, partition_tokens):
    """Tokens before the window are poisoned, so reading them would show up as NaN."""
    case = Case([1, 5, 16, 17, 90], n_kv=2, gqa=2, dim=64, dtype=mx.bfloat16, window=20, seed=2)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0], dtype=mx.bfloat16)
    with options(order="random", strict=True):
        out = case.run(backend, sinks=sinks, partition_tokens=partition_tokens)
    case.assert_matches(out, sinks)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize(
    "dtype,dim,gqa,bits,group_size,partition_tokens",
    [
        (mx.float16, 128, 4, 8, 32, 256),
        (mx.bfloat16, 64, 1, 4, 64, 256),
        (mx.float32, 96, 8, 4, 32, 32),
    ],
)
def test_quantized_kv(backend, dtype, dim, gqa, bits, group_size, partition_tokens):
    case = Case(
        BLOCK_EDGE_LENS, n_kv=2, gqa=gqa, dim=dim, dtype=dtype, bits=bits, group_size=group_size, seed=3
    )
    with options(order="reverse", strict=True):
        out = case.run(backend, partition_tokens=partition_tokens)
    case.assert_matches(out)


ORDERS = ["forward", "reverse", "random"]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_ragged_batch_partitions_per_sequence(backend, order, bits):
    """One long row among short ones (and an empty one): partitions come from the rows' own lengths,
    threadgroups past a short row's tokens write nothing, and the reduce never reads them (the
    emulator fills unwritten outputs with NaN, so reading one would show)."""
    lens = [600, 3, 17, 0, 1]
    case = Case(lens, n_kv=2, gqa=2, dim=64, dtype=mx.float16, bits=bits, seed=11)
    part, n_parts = pa.plan_partitions(600, len(lens) * 2, 16)
    assert n_parts == 3, "a 600-token row among 5 rows splits into 256-token partitions"
    with options(order=order, strict=True):
        out = case.run(backend, max_context=max(lens))
    case.assert_matches(out)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "dim,gqa,dtype,bits,group_size",
    [
        (128, 16, mx.float16, None, 32),  # GQA 16: two threadgroups of 8 heads per KV head
        (256, 4, mx.bfloat16, None, 32),  # D 256: 8 dims per lane
        (256, 8, mx.float32, 8, 64),  # D 256 and 8 heads: split in two, whole words per lane
        (128, 16, mx.float16, 4, 64),  # 4-bit, half a word per lane
        (64, 4, mx.float16, 8, 32),  # 8-bit, half a word per lane
    ],
)
def test_large_gqa_and_head_dims(backend, order, dim, gqa, dtype, bits, group_size):
    case = Case([1, 16, 45, 130], n_kv=2, gqa=gqa, dim=dim, dtype=dtype, bits=bits, group_size=group_size,
                seed=12)  # fmt: skip
    with options(order=order, strict=True):
        out = case.run(backend, partition_tokens=64)
    case.assert_matches(out)


def test_heads_per_threadgroup_caps_registers():
    assert pa.heads_per_threadgroup(8, 128) == 8
    assert pa.heads_per_threadgroup(16, 128) == 8
    assert pa.heads_per_threadgroup(16, 256) == 4
    assert pa.heads_per_threadgroup(16, 64) == 16
    assert pa.heads_per_threadgroup(6, 128) == 6
    assert pa.heads_per_threadgroup(12, 256) == 4
    assert pa.heads_per_threadgroup(7, 256) == 1


def test_partitions_follow_occupancy():
    # batch 1, 8 KV heads at 32K: 32 partitions of 1024 fill ~256 threadgroups
    assert pa.plan_partitions(32768, 8, 16) == (1024, 32)
    # batch 16 x 8 KV heads: two partitions per row
    assert pa.plan_partitions(32768, 128, 16) == (16384, 2)
    # a full GPU or a short context: one partition, no reduce
    assert pa.plan_partitions(32768, 512, 16) == (32768, 1)
    assert pa.plan_partitions(200, 1, 16) == (256, 1)
    # an explicit size wins, rounded up to whole blocks
    assert pa.plan_partitions(100, 1, 16, partition_tokens=20) == (32, 4)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
def test_windowed_and_global_layers_over_one_pool(backend, order):
    """A Gemma-3 / gpt-oss step: the same pools read by a sliding-window layer and a global one."""
    case = Case([1, 9, 40, 300], n_kv=2, gqa=4, dim=64, dtype=mx.float16, seed=13)
    sinks = mx.array(np.linspace(-2, 2, 8).astype(np.float32)).astype(mx.float16)
    with options(order=order, strict=True):
        glob = case.run(backend, sinks=sinks, max_context=300)
        case.window = 24
        win = case.run(backend, sinks=sinks, max_context=300, partition_tokens=16)
    case.assert_matches(win, sinks)
    case.window = None
    case.assert_matches(glob, sinks)


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("bits,group_size", [(8, 32), (4, 64)])
def test_quantized_kv_at_32k(backend, bits, group_size):
    """32K context with 8- and 4-bit KV, auto partitions (128 of 256 tokens, reduced in parallel)."""
    case = Case([32768, 100], n_kv=1, gqa=4, dim=128, dtype=mx.float16, bits=bits, group_size=group_size,
                seed=14, spare_blocks=0)  # fmt: skip
    with options(order="random", strict=True):
        out = case.run(backend, max_context=32768)
    case.assert_matches(out)


@pytest.mark.parametrize("kw", [dict(bits=2, group_size=32), dict(dim=512)])
def test_unsupported_shapes_decline_to_the_reference(kw):
    """Shapes the kernel does not take run the reference path (same answer), never an error."""
    kw = {"dim": 64, **kw}  # a copy: the parameter's dict is shared by every run of the test
    case = Case([5, 40], n_kv=1, gqa=2, dtype=mx.float32, poison=0.0, seed=15, **kw)
    assert pa.declines(case.q, case.k, case.v, case.bits, case.group_size) is not None
    case.assert_matches(case.run("emulator"))


@pytest.mark.parametrize("q_dtype, kv_dtype", [(mx.float32, mx.float16), (mx.bfloat16, mx.float16)])
def test_a_pool_of_another_dtype_than_the_queries_declines_to_the_reference(q_dtype, kv_dtype):
    """``kv_dtype`` set apart from the model's (a float16 pool under float32 activations): the kernels
    read the pool as the queries' dtype, so such a pool takes the reference path (same answer)."""
    case = Case([5, 40], n_kv=1, gqa=2, dim=64, dtype=q_dtype, poison=0.0, seed=15)
    case.k, case.v = case.k.astype(kv_dtype), case.v.astype(kv_dtype)
    case.k64, case.v64 = ref.to_f64(case.k), ref.to_f64(case.v)
    assert pa.declines(case.q, case.k, case.v, None, 32) is not None
    case.assert_matches(case.run("emulator"))


def test_kernel_sources_are_built_once():
    assert pa._attention_spec(True, False, False) is pa._attention_spec(True, False, False)
    assert pa._reduce_spec(True) is pa._reduce_spec(True)


def test_zero_length_sequence_gives_zeros():
    case = Case([0, 5], n_kv=1, gqa=1, dim=64, dtype=mx.float32, seed=4)
    out = np.array(case.run("emulator"))
    assert (out[0] == 0).all()
    case.assert_matches(case.run("emulator"))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(window=7),
        dict(bits=4, group_size=32),
        dict(bits=8, group_size=64),
    ],
)
def test_mlx_reference_path_matches_float64(kw):
    """The path Linux uses: finite garbage in unused slots (masked SDPA multiplies them by 0)."""
    bits = kw.get("bits")
    case = Case([1, 15, 16, 17, 50], n_kv=2, gqa=4, dim=64, dtype=mx.float32, bits=bits,
                group_size=kw.get("group_size", 32), window=kw.get("window"), poison=1e4, seed=5)  # fmt: skip
    sinks = mx.array(np.linspace(-1, 1, 8).astype(np.float32))
    case.assert_matches(case.run("reference"))
    case.assert_matches(case.run("reference", sinks=sinks), sinks)


@pytest.mark.parametrize("bits", [None, 8])
def test_flat_pool_view(bits):
    """The engine keeps pools flat, (num_blocks * block_size, n_kv_heads, X)."""
    case = Case([3, 20], n_kv=2, gqa=2, dim=64, dtype=mx.float32, bits=bits, block_size=8, poison=0.0, seed=9)
    flat = {k: (v.reshape(-1, *v.shape[2:]) if isinstance(v, mx.array) else v) for k, v in case.quant.items()}
    out = pa.paged_decode_attention(
        case.q, case.k.reshape(-1, *case.k.shape[2:]), case.v.reshape(-1, *case.v.shape[2:]), case.tables,
        case.context_lens, block_size=8, backend="emulator", **flat,
    )  # fmt: skip
    case.assert_matches(out)


def test_default_backend_and_validation():
    case = Case([3], n_kv=1, gqa=1, dim=64, dtype=mx.float32, poison=0.0)
    out = pa.paged_decode_attention(case.q, case.k, case.v, case.tables, case.context_lens)
    case.assert_matches(out)
    with pytest.raises(ValueError):
        pa.paged_decode_attention(case.q[:, :, :32], case.k, case.v, case.tables, case.context_lens)
    with pytest.raises(ValueError):
        pa.paged_decode_attention(case.q, case.k, case.v, case.tables, case.context_lens, bits=4)


# ---- injected bugs in the production kernel must be caught ------------------------------------------


def run_modified(case: Case, old: str, new: str, name: str):
    spec = pa._attention_spec(quantized=False, final=True, sinks=False)
    assert spec.source.count(old) == 1, old
    kernel = metal_kernel(
        name, list(spec.input_names), list(spec.output_names), spec.source.replace(old, new)
    )
    batch, n_q, dim = case.q.shape
    n_kv = case.k.shape[2]
    params = mx.array([n_kv, case.tables.shape[1], 0, 256, 1], dtype=mx.int32)
    launch = Launch(
        [
            case.q,
            case.k,
            case.v,
            case.tables,
            case.context_lens,
            params,
            mx.array(case.scale, dtype=mx.float32),
        ],
        [case.q.shape],
        [case.q.dtype],
        (pa.THREADS * n_kv, batch, 1),
        (pa.THREADS, 1, 1),
        [("T", case.q.dtype), ("D", dim), ("GQA", n_q // n_kv), ("HG", n_q // n_kv), ("BS", case.k.shape[1])],
    )
    return kernel(inputs=launch.inputs, output_shapes=launch.output_shapes, output_dtypes=launch.output_dtypes,
                  grid=launch.grid, threadgroup=launch.threadgroup, template=launch.template)[0]  # fmt: skip


def is_correct(case: Case, out) -> bool:
    try:
        case.assert_matches(out)
    except AssertionError:
        return False
    return True


def test_injected_missing_barrier_is_caught():
    case = Case(BLOCK_EDGE_LENS, n_kv=1, gqa=2, dim=64, dtype=mx.float32, seed=6)
    old = "    threadgroup_barrier(mem_flags::mem_threadgroup);\n    const int h = h0 + r;"
    results = []
    for order in ("forward", "reverse", "random"):
        with options(order=order):
            results.append(
                is_correct(case, run_modified(case, old, "    const int h = h0 + r;", "pa_nobarrier"))
            )
    assert not all(results)


def test_injected_off_by_one_block_index_is_caught():
    case = Case(BLOCK_EDGE_LENS, n_kv=1, gqa=2, dim=64, dtype=mx.float32, seed=7)
    out = run_modified(case, "ushort(t2 / BS - cb)", "ushort((t2 + 1) / BS - cb)", "pa_off_by_one")
    assert not is_correct(case, out)


def test_injected_divergent_simd_sum_is_caught():
    case = Case(BLOCK_EDGE_LENS, n_kv=1, gqa=2, dim=64, dtype=mx.float32, seed=8)
    old = "        s1[r] = simd_sum(partial1);"
    new = "        s1[r] = lane < 31 ? simd_sum(partial1) : partial1;"
    with options(strict=True), pytest.raises(EmulatorError, match="divergent"):
        run_modified(case, old, new, "pa_divergent")
    assert not is_correct(case, run_modified(case, old, new, "pa_divergent"))


def test_injected_missing_barrier_in_the_reduce_is_caught(monkeypatch):
    case = Case([200, 90, 7], n_kv=1, gqa=2, dim=64, dtype=mx.float32, seed=16)
    spec = pa._reduce_spec(False)
    old = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
    assert spec.source.count(old) == 1
    broken = dataclasses.replace(spec, name="pa_reduce_nobarrier", source=spec.source.replace(old, ""))
    monkeypatch.setattr(pa, "_reduce_spec", lambda sinks: broken)
    results = []
    for order in ORDERS:
        with options(order=order):
            results.append(is_correct(case, case.run("emulator", partition_tokens=32)))
    assert not all(results)


def test_injected_wrong_partition_count_in_the_reduce_is_caught(monkeypatch):
    """The reduce reading one partition too many reads an unwritten (NaN) partial: row 250 has 8
    partitions of 32 tokens, so SIMD-group 0 would take a ninth after its first."""
    case = Case([400, 250, 7], n_kv=1, gqa=2, dim=64, dtype=mx.float32, seed=17)
    spec = pa._reduce_spec(False)
    old = "(len - first + part_tokens - 1) / part_tokens)"
    new = "(len - first + part_tokens - 1) / part_tokens + 1)"
    broken = dataclasses.replace(spec, name="pa_reduce_extra", source=spec.source.replace(old, new))
    assert broken.source != spec.source
    monkeypatch.setattr(pa, "_reduce_spec", lambda sinks: broken)
    assert not is_correct(case, case.run("emulator", partition_tokens=32))


def test_old_mlx_keeps_the_reference_path():
    from metal_kernels.spec import mlx_version_ok

    assert mlx_version_ok()  # the pinned MLX
    assert mlx_version_ok("0.32.0") and mlx_version_ok("0.33.1.dev20260101") and mlx_version_ok("1.0")
    assert not mlx_version_ok("0.31.2") and not mlx_version_ok("0.29.0")


def test_injected_unpaired_tail_token_is_caught():
    """Two tokens per iteration: a SIMD-group whose second token is past the end must not read it."""
    case = Case(BLOCK_EDGE_LENS, n_kv=1, gqa=2, dim=64, dtype=mx.float32, seed=18)
    out = run_modified(case, "const bool two = t + NS < t_end;", "const bool two = true;", "pa_unpaired")
    assert not is_correct(case, out)
