#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "kernels.h"
#include "pool.h"
#include "strided.h"

namespace duet_cpu {

namespace {

constexpr int kChunk = 32; // tokens scored before the running max and sums are rescaled once
static_assert(kChunk == 32, "attend_chunk scores 32 keys at a time (attention_impl.inc)");

bool supported_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

struct Shape {
  int B, Hq, Hkv, L, D, Dv, max_blocks, block_size, window;
  float scale;
  int kv_type; // the pool's dtype as a ScaleType (kernels.h)
};

constexpr int kQueryTile = 16; // query tokens of one row that share each key and value they read

// Row b, KV heads [h0, h1), query tokens [i0, i1) of the row's L: each query token with its G = Hq /
// Hkv query heads is a query row r of its own, over the row's tokens it may see (causal: the query
// at position p = len - L + i sees [max(0, p + 1 - window), p]); online softmax in float32 over
// chunks of kChunk tokens, each key and value read once for all query rows of the tile. The heads of
// a slot sit side by side in the pool, so taking every head of a chunk before the next chunk reads
// the pool's blocks front to back (one head at a time read every Hkv-th row of scattered blocks:
// decode at a 1K context ran at ~4 GB/s), and attend_chunk prefetches the next chunk's rows as it goes.
// A pass of one tile (decode, verification) goes to attend_decode where the variant has it (AVX-512):
// it scores the whole stretch, takes one softmax per query row over its own tokens and then adds up
// the values (synthetic 3B model, decode at a 1K context: 68.8 -> 64.0 ms a token).
// The call's operands, as attend and run_split read them.
template <typename T, typename KV>
struct Operands {
  const T* q;
  const KV* k;
  const KV* v;
  const int32_t* table;
  const int32_t* lens;
  const float* sinks; // (Hq,) or null
  T* out;
};

// One task's unnormalised result when a row's tokens are split between tasks (flash decoding): per
// query row of the task (head h0.. first, as attend numbers them) its running max m, sum l and Dv
// accumulator, which run_split merges (merge_stretches).
struct Partial {
  float* m;
  float* l;
  float* acc;
};

// A task's query rows: per KV head h (0..H), its R rows (row h * R + r; query token (r / G)'s head g = r
// % G), scaled, and their state (running max m, sum l, unnormalised accumulator acc); row r sees the
// row's tokens [lo[r], hi[r]), all within the task's stretch [t_begin, t_end).
struct TaskRows {
  int H, R;
  std::vector<float> q, acc, m, l;
  std::vector<int> lo, hi;
  int t_begin, t_end;
};

// The rows' keys and values a chunk of kChunk tokens at a time (AttendChunk: online softmax).
template <typename T, typename KV>
void attend_in_chunks(const Operands<T, KV>& op, const Shape& s, const int32_t* row_table, int h0, TaskRows& rows) {
  const int D = s.D, Dv = s.Dv, R = rows.R, t_end = rows.t_end;
  // every chunk hands over kChunk row pointers into the pool; rows past its n point at zeros
  // (attend_chunk scores whole blocks of 8 keys and masks the lanes outside each query's range)
  const std::vector<float> zeros(size_t(std::max(D, Dv)), 0.0f);
  const void* kv_rows[kChunk];
  const void* vv_rows[kChunk];
  const void* k_next[kChunk]; // the next chunk's rows, which attend_chunk prefetches
  const void* v_next[kChunk];
  std::vector<int> j0(R), j1(R);
  const AttendFn attend_chunk = attend_chunk_fn();
  // the pool slots of a chunk's tokens, this chunk's and the next's
  size_t slots[2][kChunk];
  auto locate = [&](int t0, size_t* out_slots) {
    const int n = std::min(kChunk, t_end - t0);
    int blk = t0 / s.block_size, off = t0 % s.block_size; // walked, not divided, per token
    for (int j = 0; j < n; ++j, ++off) {
      if (off == s.block_size) {
        ++blk;
        off = 0;
      }
      out_slots[j] = size_t(row_table[blk]) * s.block_size + off;
    }
  };
  locate(rows.t_begin, slots[0]);
  for (int t0 = rows.t_begin, c = 0; t0 < t_end; t0 += kChunk, c ^= 1) {
    const int n = std::min(kChunk, t_end - t0);
    const int n_next = std::max(0, std::min(kChunk, t_end - t0 - kChunk));
    if (n_next > 0) {
      locate(t0 + kChunk, slots[c ^ 1]);
    }
    for (int r = 0; r < R; ++r) {
      j0[r] = std::max(rows.lo[r] - t0, 0);
      j1[r] = std::min(rows.hi[r] - t0, n);
    }
    for (int j = n; j < kChunk; ++j) {
      kv_rows[j] = vv_rows[j] = zeros.data();
    }
    for (int hk = h0; hk < h0 + rows.H; ++hk) {
      for (int j = 0; j < n; ++j) {
        kv_rows[j] = op.k + (slots[c][j] * s.Hkv + hk) * D;
        vv_rows[j] = op.v + (slots[c][j] * s.Hkv + hk) * Dv;
      }
      for (int j = 0; j < n_next; ++j) {
        k_next[j] = op.k + (slots[c ^ 1][j] * s.Hkv + hk) * D;
        v_next[j] = op.v + (slots[c ^ 1][j] * s.Hkv + hk) * Dv;
      }
      const size_t row0 = size_t(hk - h0) * R;
      attend_chunk(AttendChunk{
          rows.q.data() + row0 * D,
          kv_rows,
          vv_rows,
          j0.data(),
          j1.data(),
          rows.m.data() + row0,
          rows.l.data() + row0,
          rows.acc.data() + row0 * Dv,
          n,
          R,
          D,
          Dv,
          s.kv_type,
          k_next,
          v_next,
          n_next});
    }
  }
}

// Only tokens [ta, tb) of the row are attended (all of them: 0, INT_MAX); with `part` the result is
// left unnormalised there instead of written to out, and a sink counts only where `with_sinks`.
template <typename T, typename KV>
void attend(
    const Operands<T, KV>& op,
    const Shape& s,
    int b,
    int h0,
    int h1,
    int i0,
    int i1,
    int ta = 0,
    int tb = std::numeric_limits<int>::max(),
    const Partial* part = nullptr,
    bool with_sinks = true) {
  const auto [q, k, v, table, lens, sinks, out] = op;
  const int G = s.Hq / s.Hkv;
  const int D = s.D, Dv = s.Dv;
  const int R = G * (i1 - i0); // query rows per KV head
  const int H = h1 - h0;
  const int len = std::min(lens[b], s.max_blocks * s.block_size); // never past the table
  const int first = len - s.L; // position of query token 0
  TaskRows rows{H, R, std::vector<float>(size_t(H) * R * D), std::vector<float>(size_t(H) * R * Dv, 0.0f),
      std::vector<float>(size_t(H) * R), std::vector<float>(size_t(H) * R), std::vector<int>(R), std::vector<int>(R), len, 0};
  for (int i = i0; i < i1; ++i) {
    const int p = first + i;
    const int hi_i = std::max(0, std::min(len, p + 1));
    const int lo_i = s.window > 0 ? std::max(0, p + 1 - s.window) : 0;
    rows.t_begin = std::min(rows.t_begin, lo_i);
    rows.t_end = std::max(rows.t_end, hi_i);
    for (int g = 0; g < G; ++g) {
      const int r = (i - i0) * G + g;
      rows.lo[r] = lo_i;
      rows.hi[r] = hi_i;
      for (int hk = h0; hk < h1; ++hk) {
        const int h = hk * G + g;
        const size_t row = size_t(hk - h0) * R + r;
        const T* qr = q + ((size_t(b) * s.Hq + h) * s.L + i) * D;
        for (int d = 0; d < D; ++d) {
          rows.q[row * D + d] = static_cast<float>(qr[d]) * s.scale;
        }
        // a sink is a logit with no value: it starts the running max and sum
        const bool sink = sinks != nullptr && with_sinks;
        rows.m[row] = sink ? sinks[h] : -std::numeric_limits<float>::infinity();
        rows.l[row] = sink ? 1.0f : 0.0f;
      }
    }
  }
  rows.t_begin = std::max(rows.t_begin, ta);
  rows.t_end = std::min(rows.t_end, tb);
  for (int r = 0; r < R; ++r) { // within this task's stretch (empty where the row sees none of it)
    rows.lo[r] = std::clamp(rows.lo[r], rows.t_begin, std::max(rows.t_begin, rows.t_end));
    rows.hi[r] = std::clamp(rows.hi[r], rows.t_begin, std::max(rows.t_begin, rows.t_end));
  }
  const int32_t* row_table = table + size_t(b) * s.max_blocks;
  const AttendDecodeFn decode = attend_decode_fn();
  if (rows.t_begin >= rows.t_end) {
    // nothing of the row in this stretch: the rows keep their start
  } else if (s.L <= kQueryTile && decode != nullptr && D % 16 == 0 && Dv % 16 == 0) {
    // decode and verification (a pass of one tile): in two passes (AttendDecode), each query token's
    // rows as decoding that token alone would take them, so a verified token's logits are decode's
    decode(AttendDecode{
        rows.q.data(),
        k + size_t(h0) * D,
        v + size_t(h0) * Dv,
        row_table,
        s.block_size,
        s.Hkv,
        H,
        R,
        D,
        Dv,
        s.kv_type,
        rows.t_begin,
        rows.t_end,
        rows.lo.data(),
        rows.hi.data(),
        rows.m.data(),
        rows.l.data(),
        rows.acc.data()});
  } else {
    attend_in_chunks(op, s, row_table, h0, rows);
  }
  if (part != nullptr) {
    std::copy(rows.m.begin(), rows.m.end(), part->m);
    std::copy(rows.l.begin(), rows.l.end(), part->l);
    std::copy(rows.acc.begin(), rows.acc.end(), part->acc);
    return;
  }
  for (int hk = h0; hk < h1; ++hk) {
    for (int i = i0; i < i1; ++i) {
      for (int g = 0; g < G; ++g) {
        const size_t row = size_t(hk - h0) * R + (i - i0) * G + g;
        T* o = out + ((size_t(b) * s.Hq + hk * G + g) * s.L + i) * Dv;
        const float inv = rows.l[row] > 0.0f ? 1.0f / rows.l[row] : 0.0f;
        const float* ag = rows.acc.data() + row * Dv;
        for (int d = 0; d < Dv; ++d) {
          o[d] = static_cast<T>(ag[d] * inv);
        }
      }
    }
  }
}

// Tokens a task takes at least when a row's context is split between tasks (run_split): a stretch
// shorter than this costs more to set up and merge than it saves.
constexpr int kSplitTokens = 256;

// Query row `row`'s result from the P stretches' partial states (each `stride` floats from `parts`:
// m at [0, rows), l at [rows, 2 rows), the accumulators after): m = max m_p, l = sum l_p e^(m_p - m),
// the accumulator likewise, then out = acc / l. A stretch the row saw nothing of (l 0) weighs nothing.
template <typename T>
void merge_stretches(const float* parts, int P, size_t stride, int rows, size_t row, int Dv, float* acc, T* out) {
  float m = -std::numeric_limits<float>::infinity();
  for (int p = 0; p < P; ++p) {
    m = std::max(m, parts[size_t(p) * stride + row]);
  }
  float l = 0.0f;
  std::fill(acc, acc + Dv, 0.0f);
  for (int p = 0; p < P; ++p) {
    const float* base = parts + size_t(p) * stride;
    if (base[rows + row] <= 0.0f) {
      continue;
    }
    const float w = std::exp(base[row] - m);
    l += base[rows + row] * w;
    const float* a = base + 2 * size_t(rows) + row * Dv;
    for (int d = 0; d < Dv; ++d) {
      acc[d] += a[d] * w;
    }
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int d = 0; d < Dv; ++d) {
    out[d] = static_cast<T>(acc[d] * inv);
  }
}

// Flash decoding: each of the (row, query tile) units is split into P stretches of the row's tokens,
// whole chunks each; a task attends one stretch with all KV heads (the pool read front to back, and
// every thread busy however few rows there are), leaving m, l and the accumulator per query row;
// then each query row's stretches are merged: m = max m_p, l = sum l_p e^(m_p - m), acc likewise.
template <typename T, typename KV>
void run_split(
    const Operands<T, KV>& op,
    const Shape& s,
    int tiles,
    int longest,
    ThreadPool& pool) {
  const int32_t* lens = op.lens;
  T* out = op.out;
  const int G = s.Hq / s.Hkv;
  const int P = std::max(2, std::min(pool.size() * 2, longest / kSplitTokens));
  const int rows = s.Hkv * G * kQueryTile; // query rows of one unit, at most
  const size_t stride = size_t(rows) * (2 + s.Dv); // one task's m, l and acc
  const int units = s.B * tiles;
  std::vector<float> scratch(size_t(units) * P * stride);
  auto stretch = [&](int b, int p, int* ta, int* tb) {
    const int len = std::min(lens[b], s.max_blocks * s.block_size);
    const int chunks = (len + kChunk - 1) / kChunk;
    *ta = int(int64_t(chunks) * p / P) * kChunk;
    *tb = p == P - 1 ? std::numeric_limits<int>::max() : int(int64_t(chunks) * (p + 1) / P) * kChunk;
  };
  pool.run(units * P, [&](int t) {
    const int unit = t / P, p = t % P;
    const int b = unit / tiles, tile = unit % tiles;
    const int i0 = tile * kQueryTile, i1 = std::min(s.L, i0 + kQueryTile);
    int ta, tb;
    stretch(b, p, &ta, &tb);
    float* base = scratch.data() + size_t(t) * stride;
    const Partial part{base, base + rows, base + 2 * size_t(rows)};
    attend<T, KV>(op, s, b, 0, s.Hkv, i0, i1, ta, tb, &part, p == 0);
  });
  std::vector<float> acc(size_t(s.Dv));
  for (int unit = 0; unit < units; ++unit) {
    const int b = unit / tiles, tile = unit % tiles;
    const int i0 = tile * kQueryTile, i1 = std::min(s.L, i0 + kQueryTile);
    const int R = G * (i1 - i0);
    for (int hk = 0; hk < s.Hkv; ++hk) {
      for (int i = i0; i < i1; ++i) {
        for (int g = 0; g < G; ++g) {
          const size_t row = size_t(hk) * R + (i - i0) * G + g;
          T* o = out + ((size_t(b) * s.Hq + hk * G + g) * s.L + i) * s.Dv;
          merge_stretches(scratch.data() + size_t(unit) * P * stride, P, stride, rows, row, s.Dv, acc.data(), o);
        }
      }
    }
  }
}

template <typename T, typename KV>
void run_typed(const std::vector<mx::array>& in, mx::array& out, const Shape& s) {
  const Dense<T> q(in[0]);
  const Dense<KV> k(in[1]), v(in[2]);
  const Dense<int32_t> table(in[3]), lens(in[4]);
  std::vector<float> sink_copy;
  const float* sinks = nullptr;
  if (in.size() > 5) {
    sink_copy = row_major_copy<float>(in[5]);
    sinks = sink_copy.data();
  }
  const Operands<T, KV> op{q.ptr, k.ptr, v.ptr, table.ptr, lens.ptr, sinks, out.data<T>()};
  const int tiles = (s.L + kQueryTile - 1) / kQueryTile;
  // the work of the whole call, in multiply-adds: one thread below ~256K (waking the pool costs more)
  size_t work = 0;
  for (int b = 0; b < s.B; ++b) {
    work += size_t(std::max(lens.ptr[b], 0)) * s.L * s.Hq * (s.D + s.Dv);
  }
  auto pool = shared_pool();
  const bool one_thread = pool->size() <= 1 || work < (size_t(1) << 18);
  int longest = 0;
  for (int b = 0; b < s.B; ++b) {
    longest = std::max(longest, std::min(lens.ptr[b], s.max_blocks * s.block_size));
  }
  // Too few rows and tiles for the threads (one sequence's decode) over a long enough context: split
  // each row's tokens between tasks instead, every task taking all KV heads of its stretch
  if (!one_thread && s.B * tiles < 2 * pool->size() && longest >= 2 * kSplitTokens) {
    run_split<T, KV>(op, s, tiles, longest, *pool);
    return;
  }
  // A task takes every KV head of its rows' tiles (the pool read front to back), unless that leaves
  // too few tasks for the threads (one sequence's decode): then one head per task.
  const int heads = one_thread || s.B * tiles >= 2 * pool->size() ? s.Hkv : 1;
  const int groups = s.Hkv / heads;
  const int tasks_total = s.B * groups * tiles;
  const int tasks = one_thread ? 1 : std::min(tasks_total, pool->size() * 4);
  auto run_range = [&](int t0, int t1) {
    for (int t = t0; t < t1; ++t) {
      const int tile = t % tiles, bg = t / tiles;
      const int i0 = tile * kQueryTile, i1 = std::min(s.L, i0 + kQueryTile);
      const int h0 = (bg % groups) * heads;
      attend<T, KV>(op, s, bg / groups, h0, h0 + heads, i0, i1);
    }
  };
  if (tasks <= 1) {
    run_range(0, tasks_total);
    return;
  }
  pool->run(tasks, [&](int t) {
    run_range(int(int64_t(tasks_total) * t / tasks), int(int64_t(tasks_total) * (t + 1) / tasks));
  });
}

} // namespace

mx::array paged_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& table,
    const mx::array& lens,
    float scale,
    int block_size,
    int window,
    const std::optional<mx::array>& sinks,
    mx::StreamOrDevice s) {
  if (q.ndim() != 4 || k.ndim() != 3 || v.ndim() != 3) {
    throw std::invalid_argument("q must be (B, Hq, L, D), k (slots, Hkv, D) and v (slots, Hkv, Dv)");
  }
  if (!supported_float(q.dtype()) || !supported_float(k.dtype()) || v.dtype() != k.dtype()) {
    throw std::invalid_argument("q, k and v must be float32, float16 or bfloat16, k and v of one dtype");
  }
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), Hkv = k.shape(1);
  if (k.shape(2) != q.shape(3) || v.shape(1) != Hkv || v.shape(0) != k.shape(0) || Hkv == 0 || Hq % Hkv) {
    throw std::invalid_argument("k must be (slots, Hkv, D) like q's D, v (slots, Hkv, Dv), and Hkv divide Hq");
  }
  if (table.ndim() != 2 || table.shape(0) != B || table.dtype() != mx::int32) {
    throw std::invalid_argument("table must be int32 (B, max_blocks)");
  }
  if (lens.ndim() != 1 || lens.shape(0) != B || lens.dtype() != mx::int32) {
    throw std::invalid_argument("lens must be int32 (B,)");
  }
  if (block_size <= 0 || window < 0) {
    throw std::invalid_argument("block_size must be positive and window >= 0");
  }
  std::vector<mx::array> inputs = {q, k, v, table, lens};
  if (sinks) {
    if (sinks->ndim() != 1 || sinks->shape(0) != Hq) {
      throw std::invalid_argument("sinks must be (Hq,)");
    }
    inputs.push_back(mx::astype(*sinks, mx::float32, s));
  }
  return mx::array(
      {B, Hq, L, v.shape(2)},
      q.dtype(),
      std::make_shared<PagedAttentionCPU>(mx::to_stream(s, mx::Device::cpu), scale, block_size, window, bool(sinks)),
      std::move(inputs));
}

void PagedAttentionCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  const auto& q = inputs[0];
  const Shape shape{
      q.shape(0),
      q.shape(1),
      inputs[1].shape(1),
      q.shape(2),
      q.shape(3),
      inputs[2].shape(2),
      inputs[3].shape(1),
      block_size_,
      window_,
      scale_,
      scale_type(inputs[1].dtype())};
  dispatch_cpu(stream(), inputs, out, [inputs, out, shape]() mutable {
    with_float_type(out.dtype(), [&](auto t) {
      with_float_type(inputs[1].dtype(), [&](auto kv) { run_typed<decltype(t), decltype(kv)>(inputs, out, shape); });
    });
  });
}

void PagedAttentionCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DuetPagedAttentionCPU runs on the CPU stream only");
}

bool PagedAttentionCPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedAttentionCPU&>(other);
  return scale_ == o.scale_ && block_size_ == o.block_size_ && window_ == o.window_ && sinks_ == o.sinks_;
}

std::vector<mx::Shape> PagedAttentionCPU::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), inputs[0].shape(2), inputs[2].shape(2)}};
}

} // namespace duet_cpu
