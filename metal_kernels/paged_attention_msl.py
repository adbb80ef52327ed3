"""The Metal Shading Language source of the paged decode attention kernels
(``metal_kernels/paged_attention.py`` assembles a variant from these pieces and launches it): row
loads (quantized and plain), the per-partition body with its online softmax, the SIMD-groups'
merge, the epilogues (final output, or a partition's max, sum and output), the sink logits, and the
kernel that reduces the partitions."""

# Quantized rows, lane-contiguous: lane l holds dims [l * NE, l * NE + NE). Whole words per lane when
# NE is a multiple of the elements per word, one shifted word when the run lies inside one word.
LOAD_QUANT_WORDS = """
      {{
        const device uint* wp = {pool}_q + {row} * (D / PER_WORD);
        if (NE % PER_WORD == 0) {{
          for (int w = 0; w < NE / PER_WORD; ++w) {{
            const uint word = wp[d0 / PER_WORD + w];
            for (int e = 0; e < PER_WORD; ++e) {{
              {dst}[w * PER_WORD + e] = float((word >> (e * BITS)) & MASK);
            }}
          }}
        }} else if (PER_WORD % NE == 0) {{
          const uint word = wp[d0 / PER_WORD] >> ((d0 % PER_WORD) * BITS);
          for (int j = 0; j < NE; ++j) {{
            {dst}[j] = float((word >> (j * BITS)) & MASK);
          }}
        }} else {{
          for (int j = 0; j < NE; ++j) {{
            const int d = d0 + j;
            {dst}[j] = float((wp[d / PER_WORD] >> ((d % PER_WORD) * BITS)) & MASK);
          }}
        }}
        if (!FOLD) {{  // the run crosses a group edge: dequantize per element
          for (int j = 0; j < NE; ++j) {{
            const size_t g = {row} * (D / GS) + (d0 + j) / GS;
            {dst}[j] = float({pool}_scales[g]) * {dst}[j] + float({pool}_biases[g]);
          }}
        }}
      }}
      const size_t {pre}g = {row} * (D / GS) + d0 / GS;
      const float {pre}sc = FOLD ? float({pool}_scales[{pre}g]) : 1.0f;
      const float {pre}bi = FOLD ? float({pool}_biases[{pre}g]) : 0.0f;"""

LOAD_PLAIN = """
      {{
        const device T* src = {pool} + {row} * D + d0;
        for (int j = 0; j < NE; ++j) {{
          {dst}[j] = (D % 32 == 0 || d0 + j < D) ? float(src[j]) : 0.0f;
        }}
      }}"""

BODY = """
  constexpr int NS = {simdgroups};
  constexpr int NE = (D + 31) / 32;
  constexpr int HGROUPS = GQA / HG;
  constexpr float EMPTY = -1.0e30f;  // "no score yet": finite, as fast math may assume no infinities
{quant_consts}
  const int n_kv = params[0];
  const int max_blocks = params[1];
  const int window = params[2];
  const int part_tokens = params[3];
  const int n_parts = params[4];
  const int kvh = int(threadgroup_position_in_grid.x) / HGROUPS;
  const int h0 = kvh * GQA + (int(threadgroup_position_in_grid.x) % HGROUPS) * HG;
  const int b = int(threadgroup_position_in_grid.y);
  const int part = int(threadgroup_position_in_grid.z);
  const uint sg = simdgroup_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint tid = thread_index_in_threadgroup;
  const int n_q = n_kv * GQA;
  const int len = context_lens[b];
  const int first = window > 0 ? max(len - window, 0) : 0;
  const int lo = first + part * part_tokens;
  const int hi = min(len, lo + part_tokens);
{early_exit}
  const int d0 = int(lane) * NE;
  const float qscale = scale * M_LOG2E_F;

  float qr[HG][NE];
  float m[HG];
  float l[HG];
  float acc[HG][NE];
  float qsum[HG];
  for (int r = 0; r < HG; ++r) {{
    m[r] = EMPTY;
    l[r] = 0.0f;
    qsum[r] = 0.0f;
    for (int j = 0; j < NE; ++j) {{
      const int d = d0 + j;
      qr[r][j] = (D % 32 == 0 || d < D) ? float(q[(size_t(b) * n_q + h0 + r) * D + d]) * qscale : 0.0f;
      qsum[r] += qr[r][j];
      acc[r][j] = 0.0f;
    }}
  }}

  // Blocks in chunks of 32: lane i holds the chunk's i-th block id, each token takes it by a shuffle.
  const int blo = lo / BS;
  const int bhi = hi > lo ? (hi - 1) / BS + 1 : blo;
  for (int cb = blo; cb < bhi; cb += 32) {{
    const int nb = min(32, bhi - cb);
    const int my_blk = int(lane) < nb ? block_tables[size_t(b) * max_blocks + cb + int(lane)] : 0;
    const int t_end = min(hi, (cb + nb) * BS);
    // Two tokens per iteration (t and t + NS): both rows' loads are in flight together, and the
    // running max and sum are rescaled once per pair. Without a second token the first row is
    // loaded again (a cache hit) and its weight is 0.
    for (int t = max(lo, cb * BS) + int(sg); t < t_end; t += 2 * NS) {{
      const bool two = t + NS < t_end;
      const int t2 = two ? t + NS : t;
      const int blk1 = simd_shuffle(my_blk, ushort(t / BS - cb));
      const int blk2 = simd_shuffle(my_blk, ushort(t2 / BS - cb));
      const size_t row1 = (size_t(blk1) * BS + t % BS) * n_kv + kvh;
      const size_t row2 = (size_t(blk2) * BS + t2 % BS) * n_kv + kvh;
      float kv1[NE];
      float kv2[NE];
      float vv1[NE];
      float vv2[NE];
{load_k}
      float s1[HG];
      float s2[HG];
      for (int r = 0; r < HG; ++r) {{
        float partial1 = 0.0f;
        float partial2 = 0.0f;
        for (int j = 0; j < NE; ++j) {{
          partial1 += qr[r][j] * kv1[j];
          partial2 += qr[r][j] * kv2[j];
        }}
{fold_k}
        s1[r] = simd_sum(partial1);
        s2[r] = simd_sum(partial2);
      }}
{load_v}
      for (int r = 0; r < HG; ++r) {{
        const float m_new = max(m[r], two ? max(s1[r], s2[r]) : s1[r]);
        const float f = fast::exp2(m[r] - m_new);
        const float p1 = fast::exp2(s1[r] - m_new);
        const float p2 = two ? fast::exp2(s2[r] - m_new) : 0.0f;
        l[r] = l[r] * f + p1 + p2;
{accumulate}
        m[r] = m_new;
      }}
    }}
  }}

  // Merge the SIMD-groups, one query head at a time.
  threadgroup float tg_m[NS];
  threadgroup float tg_l[NS];
  threadgroup float tg_o[NS * D];
  for (int r = 0; r < HG; ++r) {{
    if (lane == 0) {{
      tg_m[sg] = m[r];
      tg_l[sg] = l[r];
    }}
    for (int j = 0; j < NE; ++j) {{
      if (D % 32 == 0 || d0 + j < D) {{
        tg_o[sg * D + d0 + j] = acc[r][j];
      }}
    }}
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int h = h0 + r;
{merge}
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }}
"""

# Threads combine the SIMD-groups' (max, sum, output) for dims tid, tid + 256, ...
MERGE = """
    float big = EMPTY;
    for (int i = 0; i < NS; ++i) {{
      big = max(big, tg_m[i]);
    }}
    for (uint d = tid; d < uint(D); d += NS * 32) {{
      float o = 0.0f;
      float sum = 0.0f;
      if (big > EMPTY) {{
        for (int i = 0; i < NS; ++i) {{
          if (tg_m[i] > EMPTY) {{
            const float w = fast::exp2(tg_m[i] - big);
            o += tg_o[i * D + d] * w;
            sum += tg_l[i] * w;
          }}
        }}
      }}
{epilogue}
    }}"""

EPILOGUE_FINAL = """
      float top = big;
{sink_top}
      float denom = 0.0f;
      if (top > EMPTY) {{
        const float w = big > EMPTY ? fast::exp2(big - top) : 0.0f;
        o *= w;
        denom = sum * w;
{sink_denom}
      }}
      out[(size_t(b) * n_q + h) * D + d] = static_cast<T>(denom == 0.0f ? 0.0f : o / denom);"""

EPILOGUE_PARTIAL = """
      const size_t slot = (size_t(b) * n_q + h) * n_parts + part;
      o_part[slot * D + d] = o;
      if (d == 0) {
        m_part[slot] = big;
        l_part[slot] = sum;
      }"""

SINK_TOP = """      const float sink = float(sinks[h]) * M_LOG2E_F;
      top = max(top, sink);"""
SINK_DENOM = """        denom += fast::exp2(sink - top);"""

# One threadgroup per (query head, sequence); its SIMD-groups take this sequence's partitions in turn
# (only those that hold its tokens, so short rows in a ragged batch read nothing more), then merge.
REDUCE = """
  constexpr int NS = {simdgroups};
  constexpr int NE = (D + 31) / 32;
  constexpr float EMPTY = -1.0e30f;
  const int n_parts = params[0];
  const int window = params[1];
  const int part_tokens = params[2];
  const int h = int(threadgroup_position_in_grid.x);
  const int b = int(threadgroup_position_in_grid.y);
  const int n_q = int(threadgroups_per_grid.x);
  const uint sg = simdgroup_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint tid = thread_index_in_threadgroup;
  const int len = context_lens[b];
  const int first = window > 0 ? max(len - window, 0) : 0;
  const int mine = min(n_parts, (len - first + part_tokens - 1) / part_tokens);
  const size_t base = (size_t(b) * n_q + h) * n_parts;
  const int d0 = int(lane) * NE;
  float m = EMPTY;
  float l = 0.0f;
  float acc[NE];
  for (int j = 0; j < NE; ++j) {{
    acc[j] = 0.0f;
  }}
  for (int p = int(sg); p < mine; p += NS) {{  // each of these holds a token: its max is finite
    const float mp = m_part[base + p];
    const float m_new = max(m, mp);
    const float f = fast::exp2(m - m_new);
    const float w = fast::exp2(mp - m_new);
    l = l * f + l_part[base + p] * w;
    for (int j = 0; j < NE; ++j) {{
      if (D % 32 == 0 || d0 + j < D) {{
        acc[j] = acc[j] * f + o_part[(base + p) * D + d0 + j] * w;
      }}
    }}
    m = m_new;
  }}
  threadgroup float tg_m[NS];
  threadgroup float tg_l[NS];
  threadgroup float tg_o[NS * D];
  if (lane == 0) {{
    tg_m[sg] = m;
    tg_l[sg] = l;
  }}
  for (int j = 0; j < NE; ++j) {{
    if (D % 32 == 0 || d0 + j < D) {{
      tg_o[sg * D + d0 + j] = acc[j];
    }}
  }}
  threadgroup_barrier(mem_flags::mem_threadgroup);
{merge}
"""
