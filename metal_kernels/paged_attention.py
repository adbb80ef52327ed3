"""Paged decode attention: one query token per sequence against its KV blocks.

Layout (see ``docs/kernels.md``): per layer a K pool and a V pool of shape
``(num_blocks, block_size, n_kv_heads, head_dim)``; token t of sequence b lives in block
``block_tables[b, t // block_size]`` at slot ``t % block_size``; block 0 is the null block. With
``bits`` set, the pools hold MLX affine-quantized rows (``mx.quantize`` along head_dim): uint32 words
``(..., head_dim * bits // 32)`` plus scales and biases ``(..., head_dim // group_size)``.

Kernel design: one threadgroup of 8 SIMD-groups per (KV head, sequence, context partition). All
query heads sharing the KV head are processed together, so every K/V row is read once. SIMD-groups
take tokens in turn; lane l holds dimensions l, l + 32, ... of the query, key and value. Scores are
a ``simd_sum`` per key and head, softmax is online (base-2, scale folded into the query). The
SIMD-groups are merged through threadgroup memory. A single partition writes the output directly;
several partitions write (max, sum, unnormalised output) per partition and a second kernel merges
them and the optional sink logits.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache

import mlx.core as mx

from metal_kernels.paged_attention_msl import (
    BODY,
    EPILOGUE_FINAL,
    EPILOGUE_PARTIAL,
    LOAD_PLAIN,
    LOAD_QUANT_WORDS,
    MERGE,
    REDUCE,
    SINK_DENOM,
    SINK_TOP,
)
from metal_kernels.spec import KernelSpec, Launch, resolve_backend, run

SIMDGROUPS = 8
THREADS = 32 * SIMDGROUPS
MAX_HEAD_DIM = 256  # larger head dims decline to the reference path
LANE_FLOATS = 32  # heads per threadgroup x dims per lane: caps the query and accumulator registers
TARGET_THREADGROUPS = 256  # partition until a decode step launches about this many threadgroups
MIN_PARTITION_TOKENS = 256  # ... but never into partitions shorter than this
KERNEL_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _pair(template: str, dst: str, pool: str, pre: str) -> str:
    """A row load for both tokens of an iteration: ``{dst}1`` from ``row1``, ``{dst}2`` from ``row2``."""
    return "".join(
        template.format(dst=f"{dst}{u}", pool=pool, pre=f"{pre}{u}", row=f"row{u}") for u in (1, 2)
    )


@cache
def _attention_spec(quantized: bool, final: bool, sinks: bool) -> KernelSpec:
    """The kernel's source for one variant, built once (the key is cheap to hash)."""
    pools = (
        ["k_q", "k_scales", "k_biases", "v_q", "v_scales", "v_biases"] if quantized else ["k_pool", "v_pool"]
    )
    inputs = ["q", *pools, "block_tables", "context_lens", "params", "scale"]
    if sinks and final:
        inputs.append("sinks")
    if quantized:
        quant_consts = (
            "  constexpr int PER_WORD = 32 / BITS;\n  constexpr uint MASK = (1u << BITS) - 1u;\n"
            "  constexpr bool FOLD = GS % NE == 0;  // a lane's run of dims lies in one group"
        )
        load_k = _pair(LOAD_QUANT_WORDS, "kv", "k", "k")
        load_v = _pair(LOAD_QUANT_WORDS, "vv", "v", "v")
        # q.k = sc * sum(q w) + bi * sum(q): the affine form folded, sum(q) once per query
        fold_k = (
            "        partial1 = k1sc * partial1 + k1bi * qsum[r];\n"
            "        partial2 = k2sc * partial2 + k2bi * qsum[r];"
        )
        # acc += p (sc w + bi) = (p sc) w + p bi
        accumulate = """        const float ps1 = p1 * v1sc;
        const float ps2 = p2 * v2sc;
        const float pb = p1 * v1bi + p2 * v2bi;
        for (int j = 0; j < NE; ++j) {
          acc[r][j] = acc[r][j] * f + (ps1 * vv1[j] + ps2 * vv2[j] + pb);
        }"""
    else:
        quant_consts = ""
        load_k = _pair(LOAD_PLAIN, "kv", "k_pool", "k")
        load_v = _pair(LOAD_PLAIN, "vv", "v_pool", "v")
        fold_k = ""
        accumulate = """        for (int j = 0; j < NE; ++j) {
          acc[r][j] = acc[r][j] * f + (p1 * vv1[j] + p2 * vv2[j]);
        }"""
    if final:
        epilogue = EPILOGUE_FINAL.format(
            sink_top=SINK_TOP if sinks else "", sink_denom=SINK_DENOM if sinks else ""
        )
        outputs: tuple[str, ...] = ("out",)
        early_exit = ""
    else:
        epilogue = EPILOGUE_PARTIAL
        outputs = ("o_part", "m_part", "l_part")
        # a partition past this sequence's tokens writes nothing: the reduce never reads it
        early_exit = "  if (lo >= hi) {\n    return;\n  }"
    source = BODY.format(
        simdgroups=SIMDGROUPS,
        quant_consts=quant_consts,
        early_exit=early_exit,
        load_k=load_k,
        load_v=load_v,
        fold_k=fold_k,
        accumulate=accumulate,
        merge=MERGE.format(epilogue=epilogue),
    )
    name = (
        "paged_attn"
        + ("_q" if quantized else "")
        + ("_final" if final else "_partial")
        + ("_sinks" if sinks and final else "")
    )
    return KernelSpec(name, tuple(inputs), outputs, source)


@cache
def _reduce_spec(sinks: bool) -> KernelSpec:
    inputs = ["o_part", "m_part", "l_part", "context_lens", "params"] + (["sinks"] if sinks else [])
    epilogue = EPILOGUE_FINAL.format(
        sink_top=SINK_TOP if sinks else "", sink_denom=SINK_DENOM if sinks else ""
    )
    source = REDUCE.format(simdgroups=SIMDGROUPS, merge=MERGE.format(epilogue=epilogue))
    return KernelSpec("paged_attn_reduce" + ("_sinks" if sinks else ""), tuple(inputs), ("out",), source)


def _check(
    q, k_pool, v_pool, block_tables, context_lens, bits, group_size, k_scales, k_biases, v_scales, v_biases
):
    """Raise ``ValueError`` for inputs that do not fit together (a caller's bug, on any backend)."""
    if q.ndim != 3:
        raise ValueError("q must be (batch, n_q_heads, head_dim)")
    if k_pool.ndim != 4 or v_pool.ndim != 4 or v_pool.shape[:3] != k_pool.shape[:3]:
        raise ValueError("k_pool and v_pool must be (num_blocks, block_size, n_kv_heads, head_dim*)")
    batch, n_q, dim = q.shape
    n_kv = k_pool.shape[2]
    if n_q % n_kv:
        raise ValueError(f"n_q_heads {n_q} is not a multiple of n_kv_heads {n_kv}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("block_tables must be (batch, max_blocks) and context_lens (batch,)")
    if bits is None:
        if k_pool.shape[3] != dim:
            raise ValueError("pool head_dim differs from q")
        if any(a is not None for a in (k_scales, k_biases, v_scales, v_biases)):
            raise ValueError("scales/biases given without bits")
    else:
        if dim % group_size or k_pool.shape[3] * 32 != dim * bits:
            raise ValueError("quantized pools do not match head_dim, bits and group_size")
        for a in (k_scales, k_biases, v_scales, v_biases):
            if a is None or a.shape[:3] != k_pool.shape[:3]:
                raise ValueError(
                    "quantized KV needs scales and biases of shape (blocks, block_size, kv_heads, D/group)"
                )
        if k_scales.shape != (*k_pool.shape[:3], dim // group_size):
            raise ValueError("k_scales must be (blocks, block_size, kv_heads, D/group)")


def declines(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, bits: int | None, group_size: int
) -> str | None:
    """Why the kernel does not take these shapes (the reference path does), or None when it does.

    ``k_pool``/``v_pool`` are the blocked or flat pools (only the last axis is looked at)."""
    dim = q.shape[-1]
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}"
    if bits is None and k_pool.dtype != q.dtype:
        return f"a {k_pool.dtype} pool under {q.dtype} queries"
    if dim > MAX_HEAD_DIM:
        return f"head_dim {dim} > {MAX_HEAD_DIM}"
    if v_pool.shape[-1] != k_pool.shape[-1]:
        return "V head_dim differs from K head_dim"
    if bits is not None and (bits not in (4, 8) or group_size not in (32, 64, 128)):
        return f"{bits}-bit KV with group size {group_size}"
    return None


def heads_per_threadgroup(gqa: int, dim: int) -> int:
    """The most query heads of one KV head a threadgroup takes: a divisor of ``gqa`` with
    heads x dims-per-lane <= ``LANE_FLOATS`` (MLX caps GQA x query length the same way), so the
    query and accumulator registers stay bounded at GQA 16; more heads split across threadgroups."""
    per_lane = -(-dim // 32)
    cap = max(1, LANE_FLOATS // per_lane)
    return max(h for h in range(1, gqa + 1) if gqa % h == 0 and h <= cap)


def plan_partitions(
    span: int, threadgroups: int, block_size: int, partition_tokens: int | None = None
) -> tuple[int, int]:
    """(tokens per partition, partitions) for the longest row's ``span`` attended tokens.

    Without ``partition_tokens`` a row is split only when ``threadgroups`` (KV-head groups x rows)
    would underfill the GPU: into about ``TARGET_THREADGROUPS / threadgroups`` parts of at least
    ``MIN_PARTITION_TOKENS`` tokens. Each row's kernel threadgroups past its own tokens write nothing
    and the reduce reads only that row's partitions."""
    if partition_tokens is None:
        want = max(1, -(-TARGET_THREADGROUPS // max(1, threadgroups)))
        part = max(MIN_PARTITION_TOKENS, -(-span // want))
    else:
        part = max(1, int(partition_tokens))
    part = max(block_size, -(-part // block_size) * block_size)
    return part, max(1, -(-span // part))


@lru_cache(maxsize=256)
def _params(*values: int) -> mx.array:
    return mx.array(values, dtype=mx.int32)


@lru_cache(maxsize=64)
def _scale(scale: float) -> mx.array:
    return mx.array(scale, dtype=mx.float32)


def paged_decode_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float | None = None,
    k_scales: mx.array | None = None,
    k_biases: mx.array | None = None,
    v_scales: mx.array | None = None,
    v_biases: mx.array | None = None,
    bits: int | None = None,
    group_size: int = 32,
    window: int | None = None,
    sinks: mx.array | None = None,
    partition_tokens: int | None = None,
    max_context: int | None = None,
    block_size: int = 16,
    backend: str | None = None,
) -> mx.array:
    """Attention of each sequence's single query token over its paged KV; returns (batch, n_q, D).

    Pools are ``(num_blocks, block_size, n_kv_heads, X)`` or the flat ``(num_blocks * block_size,
    n_kv_heads, X)`` view of it (then ``block_size`` says how to split it; reshaping is free).
    With ``bits``, ``k_pool``/``v_pool`` are the uint32 words and ``k_scales`` ... ``v_biases`` the
    group scales and biases. ``window`` keeps the last ``window`` tokens; ``sinks`` (n_q_heads,) are
    per-head logits added to the softmax denominator. Sequences with ``context_lens == 0`` give 0.
    ``max_context`` (the longest ``context_lens``, when the caller knows it without a device sync)
    sizes the partitions; otherwise the padded block table does. ``partition_tokens`` overrides the
    occupancy-based partition size. Shapes the kernel does not take (``declines``) run the reference.
    """
    if k_pool.ndim == 3:
        k_pool, v_pool, k_scales, k_biases, v_scales, v_biases = (
            None if a is None else a.reshape(-1, block_size, *a.shape[1:])
            for a in (k_pool, v_pool, k_scales, k_biases, v_scales, v_biases)
        )
    _check(
        q,
        k_pool,
        v_pool,
        block_tables,
        context_lens,
        bits,
        group_size,
        k_scales,
        k_biases,
        v_scales,
        v_biases,
    )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if window is not None and window <= 0:
        raise ValueError("window must be positive")
    backend = resolve_backend(backend)
    if backend == "reference" or declines(q, k_pool, v_pool, bits, group_size) is not None:
        return reference(
            q, k_pool, v_pool, block_tables, context_lens, scale=scale, k_scales=k_scales, k_biases=k_biases,
            v_scales=v_scales, v_biases=v_biases, bits=bits, group_size=group_size, window=window, sinks=sinks,
        )  # fmt: skip
    return _run_kernels(
        q, k_pool, v_pool, block_tables, context_lens, scale, (k_scales, k_biases, v_scales, v_biases),
        bits, group_size, window, sinks, partition_tokens, max_context, backend,
    )  # fmt: skip


def _run_kernels(q, k_pool, v_pool, block_tables, context_lens, scale, quant, bits, group_size, window, sinks,
                 partition_tokens, max_context, backend):  # fmt: skip
    batch, n_q, dim = q.shape
    _, block_size, n_kv, _ = k_pool.shape
    max_blocks = block_tables.shape[1]
    gqa = n_q // n_kv
    hg = heads_per_threadgroup(gqa, dim)
    span = max_blocks * block_size if max_context is None else max(1, int(max_context))
    if window is not None:
        span = min(span, window)
    part_tokens, n_parts = plan_partitions(span, batch * n_kv * (gqa // hg), block_size, partition_tokens)
    final = n_parts == 1
    quantized = bits is not None
    sinks32 = None if sinks is None else sinks.astype(mx.float32)
    lens = context_lens.astype(mx.int32)
    params = _params(n_kv, max_blocks, window or 0, part_tokens, n_parts)
    pools = [k_pool, quant[0], quant[1], v_pool, quant[2], quant[3]] if quantized else [k_pool, v_pool]
    inputs = [q, *pools, block_tables.astype(mx.int32), lens, params, _scale(float(scale))]
    if final and sinks32 is not None:
        inputs.append(sinks32)
    template: list[tuple[str, object]] = [
        ("T", q.dtype),
        ("D", dim),
        ("GQA", gqa),
        ("HG", hg),
        ("BS", block_size),
    ]
    if quantized:
        template += [("BITS", bits), ("GS", group_size)]
    spec = _attention_spec(quantized, final, sinks is not None)
    grid = (THREADS * n_kv * (gqa // hg), batch, n_parts)
    if final:
        launch = Launch(inputs, [(batch, n_q, dim)], [q.dtype], grid, (THREADS, 1, 1), template)
        return run(spec, launch, backend)[0]
    launch = Launch(
        inputs,
        [(batch, n_q, n_parts, dim), (batch, n_q, n_parts), (batch, n_q, n_parts)],
        [mx.float32] * 3,
        grid,
        (THREADS, 1, 1),
        template,
    )
    o_part, m_part, l_part = run(spec, launch, backend)
    red_inputs = [o_part, m_part, l_part, lens, _params(n_parts, window or 0, part_tokens)]
    if sinks32 is not None:
        red_inputs.append(sinks32)
    red = Launch(
        red_inputs,
        [(batch, n_q, dim)],
        [q.dtype],
        (THREADS * n_q, batch, 1),
        (THREADS, 1, 1),
        [("T", q.dtype), ("D", dim)],
    )
    return run(_reduce_spec(sinks is not None), red, backend)[0]


def reference(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
    k_scales: mx.array | None = None,
    k_biases: mx.array | None = None,
    v_scales: mx.array | None = None,
    v_biases: mx.array | None = None,
    bits: int | None = None,
    group_size: int = 32,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """MLX-ops implementation with the kernel's semantics: gather blocks, mask, fused SDPA."""
    batch, n_q, dim = q.shape
    _, block_size, n_kv, _ = k_pool.shape
    span = block_tables.shape[1] * block_size

    def gather(pool, scales, biases):
        g = pool[block_tables].reshape(batch, span, n_kv, -1)
        if bits is not None:
            s = scales[block_tables].reshape(batch, span, n_kv, -1)
            b = biases[block_tables].reshape(batch, span, n_kv, -1)
            g = mx.dequantize(g, s, b, group_size=group_size, bits=bits)
        return g.astype(q.dtype).transpose(0, 2, 1, 3)

    k = gather(k_pool, k_scales, k_biases)
    v = gather(v_pool, v_scales, v_biases)
    pos = mx.arange(span)[None, :]
    lens = context_lens.astype(mx.int32)[:, None]
    visible = pos < lens
    if window is not None:
        visible = visible & (pos >= lens - window)
    mask = visible[:, None, None, :]
    out = mx.fast.scaled_dot_product_attention(
        q[:, :, None, :], k, v, scale=scale, mask=mask, sinks=None if sinks is None else sinks.astype(q.dtype)
    )[:, :, 0, :]
    return mx.where((context_lens > 0)[:, None, None], out, mx.zeros_like(out))
