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

import mlx.core as mx

from metal_kernels.spec import KernelSpec, Launch, resolve_backend, run

SIMDGROUPS = 8
THREADS = 32 * SIMDGROUPS
DEFAULT_PARTITION_TOKENS = 256

_LOAD_PLAIN = """
      for (int j = 0; j < NE; ++j) {{
        int d = int(lane) + 32 * j;
        {dst}[j] = d < D ? float({pool}[row * D + d]) : 0.0f;
      }}"""

_LOAD_QUANT = """
      for (int j = 0; j < NE; ++j) {{
        int d = int(lane) + 32 * j;
        if (d < D) {{
          uint word = {pool}_q[row * (D / PER_WORD) + d / PER_WORD];
          float qv = float((word >> ((d % PER_WORD) * BITS)) & MASK);
          const size_t g = row * (D / GS) + d / GS;
          {dst}[j] = float({pool}_scales[g]) * qv + float({pool}_biases[g]);
        }} else {{
          {dst}[j] = 0.0f;
        }}
      }}"""

_BODY = """
  constexpr int NS = {simdgroups};
  constexpr int NE = (D + 31) / 32;
{quant_consts}
  const int n_kv = params[0];
  const int max_blocks = params[1];
  const int window = params[2];
  const int part_tokens = params[3];
  const int n_parts = params[4];
  const int kvh = int(threadgroup_position_in_grid.x);
  const int b = int(threadgroup_position_in_grid.y);
  const int part = int(threadgroup_position_in_grid.z);
  const uint sg = simdgroup_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint tid = thread_index_in_threadgroup;
  const int n_q = n_kv * GQA;
  const int len = context_lens[b];
  const int first = window > 0 ? max(len - window, 0) : 0;
  const int lo = max(first, part * part_tokens);
  const int hi = min(len, (part + 1) * part_tokens);
  const float qscale = scale * M_LOG2E_F;

  float qr[GQA][NE];
  float m[GQA];
  float l[GQA];
  float acc[GQA][NE];
  for (int r = 0; r < GQA; ++r) {{
    m[r] = -INFINITY;
    l[r] = 0.0f;
    for (int j = 0; j < NE; ++j) {{
      int d = int(lane) + 32 * j;
      qr[r][j] = d < D ? float(q[(size_t(b) * n_q + kvh * GQA + r) * D + d]) * qscale : 0.0f;
      acc[r][j] = 0.0f;
    }}
  }}

  for (int t = lo + int(sg); t < hi; t += NS) {{
    const int blk = block_tables[size_t(b) * max_blocks + t / BS];
    const size_t row = (size_t(blk) * BS + t % BS) * n_kv + kvh;
    float kv[NE];
    float vv[NE];
{load_k}
    float s[GQA];
    for (int r = 0; r < GQA; ++r) {{
      float partial = 0.0f;
      for (int j = 0; j < NE; ++j) {{
        partial += qr[r][j] * kv[j];
      }}
      s[r] = simd_sum(partial);
    }}
{load_v}
    for (int r = 0; r < GQA; ++r) {{
      float m_new = max(m[r], s[r]);
      float f = exp2(m[r] - m_new);
      float p = exp2(s[r] - m_new);
      l[r] = l[r] * f + p;
      for (int j = 0; j < NE; ++j) {{
        acc[r][j] = acc[r][j] * f + p * vv[j];
      }}
      m[r] = m_new;
    }}
  }}

  // Merge the SIMD-groups, one query head at a time.
  threadgroup float tg_m[NS];
  threadgroup float tg_l[NS];
  threadgroup float tg_o[NS * D];
  for (int r = 0; r < GQA; ++r) {{
    if (lane == 0) {{
      tg_m[sg] = m[r];
      tg_l[sg] = l[r];
    }}
    for (int j = 0; j < NE; ++j) {{
      int d = int(lane) + 32 * j;
      if (d < D) {{
        tg_o[sg * D + d] = acc[r][j];
      }}
    }}
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int h = kvh * GQA + r;
    float big = -INFINITY;
    for (int i = 0; i < NS; ++i) {{
      big = max(big, tg_m[i]);
    }}
    for (uint d = tid; d < uint(D); d += NS * 32) {{
      float o = 0.0f;
      float sum = 0.0f;
      if (big > -INFINITY) {{
        for (int i = 0; i < NS; ++i) {{
          if (tg_m[i] > -INFINITY) {{
            float w = exp2(tg_m[i] - big);
            o += tg_o[i * D + d] * w;
            sum += tg_l[i] * w;
          }}
        }}
      }}
{epilogue}
    }}
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }}
"""

_EPILOGUE_FINAL = """
      float top = big;
{sink_top}
      float denom = 0.0f;
      if (top > -INFINITY) {{
        float w = big > -INFINITY ? exp2(big - top) : 0.0f;
        o *= w;
        denom = sum * w;
{sink_denom}
      }}
      out[(size_t(b) * n_q + h) * D + d] = static_cast<T>(denom == 0.0f ? 0.0f : o / denom);"""

_EPILOGUE_PARTIAL = """
      const size_t slot = (size_t(b) * n_q + h) * n_parts + part;
      o_part[slot * D + d] = o;
      if (d == 0) {
        m_part[slot] = big;
        l_part[slot] = sum;
      }"""

_SINK_TOP = """      const float sink = float(sinks[h]) * M_LOG2E_F;
      top = max(top, sink);"""
_SINK_DENOM = """        denom += exp2(sink - top);"""

_REDUCE = """
  constexpr int NE = (D + 31) / 32;
  const int n_parts = params[0];
  const int h = int(threadgroup_position_in_grid.x);
  const int b = int(threadgroup_position_in_grid.y);
  const int n_q = int(threadgroups_per_grid.x);
  const uint lane = thread_index_in_simdgroup;
  const size_t base = (size_t(b) * n_q + h) * n_parts;
  float top = -INFINITY;
  for (int p = 0; p < n_parts; ++p) {{
    top = max(top, m_part[base + p]);
  }}
{sink_top}
  float o[NE];
  for (int j = 0; j < NE; ++j) {{
    o[j] = 0.0f;
  }}
  float denom = 0.0f;
  if (top > -INFINITY) {{
    for (int p = 0; p < n_parts; ++p) {{
      const float mp = m_part[base + p];
      if (mp > -INFINITY) {{
        const float w = exp2(mp - top);
        denom += l_part[base + p] * w;
        for (int j = 0; j < NE; ++j) {{
          int d = int(lane) + 32 * j;
          if (d < D) {{
            o[j] += o_part[(base + p) * D + d] * w;
          }}
        }}
      }}
    }}
{sink_denom}
  }}
  for (int j = 0; j < NE; ++j) {{
    int d = int(lane) + 32 * j;
    if (d < D) {{
      out[(size_t(b) * n_q + h) * D + d] = static_cast<T>(denom == 0.0f ? 0.0f : o[j] / denom);
    }}
  }}
"""


def _attention_spec(quantized: bool, final: bool, sinks: bool) -> KernelSpec:
    pools = (
        ["k_q", "k_scales", "k_biases", "v_q", "v_scales", "v_biases"] if quantized else ["k_pool", "v_pool"]
    )
    inputs = ["q", *pools, "block_tables", "context_lens", "params", "scale"]
    if sinks and final:
        inputs.append("sinks")
    load = _LOAD_QUANT if quantized else _LOAD_PLAIN
    k_name, v_name = ("k", "v") if quantized else ("k_pool", "v_pool")
    quant_consts = (
        "  constexpr int PER_WORD = 32 / BITS;\n  constexpr uint MASK = (1u << BITS) - 1u;"
        if quantized
        else ""
    )
    if final:
        epilogue = _EPILOGUE_FINAL.format(
            sink_top=_SINK_TOP if sinks else "", sink_denom=_SINK_DENOM if sinks else ""
        )
        outputs = ("out",)
    else:
        epilogue = _EPILOGUE_PARTIAL
        outputs = ("o_part", "m_part", "l_part")
    source = _BODY.format(
        simdgroups=SIMDGROUPS,
        quant_consts=quant_consts,
        load_k=load.format(dst="kv", pool=k_name),
        load_v=load.format(dst="vv", pool=v_name),
        epilogue=epilogue,
    )
    name = (
        "paged_attn"
        + ("_q" if quantized else "")
        + ("_final" if final else "_partial")
        + ("_sinks" if sinks and final else "")
    )
    return KernelSpec(name, tuple(inputs), outputs, source)


def _reduce_spec(sinks: bool) -> KernelSpec:
    inputs = ["o_part", "m_part", "l_part", "params"] + (["sinks"] if sinks else [])
    sink_top = "  const float sink = float(sinks[h]) * M_LOG2E_F;\n  top = max(top, sink);" if sinks else ""
    sink_denom = "    denom += exp2(sink - top);" if sinks else ""
    source = _REDUCE.format(sink_top=sink_top, sink_denom=sink_denom)
    return KernelSpec("paged_attn_reduce" + ("_sinks" if sinks else ""), tuple(inputs), ("out",), source)


def _check(
    q, k_pool, v_pool, block_tables, context_lens, bits, group_size, k_scales, k_biases, v_scales, v_biases
):
    if q.ndim != 3:
        raise ValueError("q must be (batch, n_q_heads, head_dim)")
    if k_pool.ndim != 4 or v_pool.shape != k_pool.shape:
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
        if bits not in (4, 8):
            raise ValueError("bits must be 4 or 8")
        if dim % group_size or k_pool.shape[3] != dim * bits // 32:
            raise ValueError("quantized pools do not match head_dim, bits and group_size")
        for a in (k_scales, k_biases, v_scales, v_biases):
            if a is None or a.shape != (*k_pool.shape[:3], dim // group_size):
                raise ValueError(
                    "quantized KV needs scales and biases of shape (blocks, block_size, kv_heads, D/group)"
                )


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
    partition_tokens: int = DEFAULT_PARTITION_TOKENS,
    block_size: int = 16,
    backend: str | None = None,
) -> mx.array:
    """Attention of each sequence's single query token over its paged KV; returns (batch, n_q, D).

    Pools are ``(num_blocks, block_size, n_kv_heads, X)`` or the flat ``(num_blocks * block_size,
    n_kv_heads, X)`` view of it (then ``block_size`` says how to split it; reshaping is free).
    With ``bits``, ``k_pool``/``v_pool`` are the uint32 words and ``k_scales`` ... ``v_biases`` the
    group scales and biases. ``window`` keeps the last ``window`` tokens; ``sinks`` (n_q_heads,) are
    per-head logits added to the softmax denominator. Sequences with ``context_lens == 0`` give 0.
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
    if backend == "reference":
        return reference(
            q, k_pool, v_pool, block_tables, context_lens, scale=scale, k_scales=k_scales, k_biases=k_biases,
            v_scales=v_scales, v_biases=v_biases, bits=bits, group_size=group_size, window=window, sinks=sinks,
        )  # fmt: skip
    return _run_kernels(
        q, k_pool, v_pool, block_tables, context_lens, scale, (k_scales, k_biases, v_scales, v_biases),
        bits, group_size, window, sinks, partition_tokens, backend,
    )  # fmt: skip


def _run_kernels(q, k_pool, v_pool, block_tables, context_lens, scale, quant, bits, group_size, window, sinks,
                 partition_tokens, backend):  # fmt: skip
    batch, n_q, dim = q.shape
    _, block_size, n_kv, _ = k_pool.shape
    max_blocks = block_tables.shape[1]
    part_tokens = max(block_size, int(partition_tokens))
    n_parts = max(1, -(-max_blocks * block_size // part_tokens))
    final = n_parts == 1
    quantized = bits is not None
    sinks32 = None if sinks is None else sinks.astype(mx.float32)
    params = mx.array([n_kv, max_blocks, window or 0, part_tokens, n_parts], dtype=mx.int32)
    pools = [k_pool, quant[0], quant[1], v_pool, quant[2], quant[3]] if quantized else [k_pool, v_pool]
    inputs = [q, *pools, block_tables.astype(mx.int32), context_lens.astype(mx.int32), params,
              mx.array(scale, dtype=mx.float32)]  # fmt: skip
    if final and sinks32 is not None:
        inputs.append(sinks32)
    template: list[tuple[str, object]] = [
        ("T", q.dtype),
        ("D", dim),
        ("GQA", n_q // n_kv),
        ("BS", block_size),
    ]
    if quantized:
        template += [("BITS", bits), ("GS", group_size)]
    spec = _attention_spec(quantized, final, sinks is not None)
    grid = (THREADS * n_kv, batch, n_parts)
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
    red_inputs = [o_part, m_part, l_part, mx.array([n_parts], dtype=mx.int32)]
    if sinks32 is not None:
        red_inputs.append(sinks32)
    red = Launch(
        red_inputs,
        [(batch, n_q, dim)],
        [q.dtype],
        (32 * n_q, batch, 1),
        (32, 1, 1),
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
