#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "pool.h"
#include "strided.h"

namespace duet_cpu {

namespace {

constexpr int kChunk = 32; // tokens scored before the running max and sums are rescaled once

bool supported_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// A row-contiguous view of an input: the array itself when it is, else a row-major copy.
template <typename T>
struct Dense {
  std::vector<T> copy;
  const T* ptr;
  explicit Dense(const mx::array& a) {
    if (a.flags().row_contiguous) {
      ptr = a.data<T>();
    } else {
      copy = row_major_copy<T>(a);
      ptr = copy.data();
    }
  }
};

struct Shape {
  int B, Hq, Hkv, D, Dv, max_blocks, block_size, window;
  float scale;
};

// Rows [b, b+1), KV head hk: its G = Hq / Hkv query heads over the row's tokens, online softmax in
// float32 over chunks of kChunk tokens.
template <typename T>
void attend(
    const T* q,
    const T* k,
    const T* v,
    const int32_t* table,
    const int32_t* lens,
    const float* sinks,
    T* out,
    const Shape& s,
    int b,
    int hk) {
  const int G = s.Hq / s.Hkv;
  const int D = s.D, Dv = s.Dv;
  const int len = lens[b];
  const int start = s.window > 0 ? std::max(0, len - s.window) : 0;
  std::vector<float> qf(size_t(G) * D), acc(size_t(G) * Dv, 0.0f), m(G), l(G), sc(size_t(G) * kChunk);
  for (int g = 0; g < G; ++g) {
    const T* qr = q + (size_t(b) * s.Hq + size_t(hk) * G + g) * D;
    for (int d = 0; d < D; ++d) {
      qf[size_t(g) * D + d] = static_cast<float>(qr[d]) * s.scale;
    }
    // a sink is a logit with no value: it starts the running max and sum
    m[g] = sinks ? sinks[hk * G + g] : -std::numeric_limits<float>::infinity();
    l[g] = sinks ? 1.0f : 0.0f;
  }
  const int32_t* row_table = table + size_t(b) * s.max_blocks;
  const T* kv_rows[kChunk];
  const T* vv_rows[kChunk];
  for (int t0 = start; t0 < len; t0 += kChunk) {
    const int n = std::min(kChunk, len - t0);
    for (int j = 0; j < n; ++j) {
      const int t = t0 + j;
      const size_t slot = size_t(row_table[t / s.block_size]) * s.block_size + t % s.block_size;
      kv_rows[j] = k + (slot * s.Hkv + hk) * D;
      vv_rows[j] = v + (slot * s.Hkv + hk) * Dv;
    }
    for (int g = 0; g < G; ++g) {
      const float* qg = qf.data() + size_t(g) * D;
      float* sg = sc.data() + size_t(g) * kChunk;
      float mx_new = m[g];
      for (int j = 0; j < n; ++j) {
        const T* kr = kv_rows[j];
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) {
          dot += qg[d] * static_cast<float>(kr[d]);
        }
        sg[j] = dot;
        mx_new = std::max(mx_new, dot);
      }
      float* ag = acc.data() + size_t(g) * Dv;
      if (mx_new > m[g]) { // rescale what was summed under the old max (nothing, the first time)
        const float corr = std::isinf(m[g]) ? 0.0f : std::exp(m[g] - mx_new);
        l[g] *= corr;
#pragma omp simd
        for (int d = 0; d < Dv; ++d) {
          ag[d] *= corr;
        }
        m[g] = mx_new;
      }
      for (int j = 0; j < n; ++j) {
        const float p = std::exp(sg[j] - m[g]);
        l[g] += p;
        const T* vr = vv_rows[j];
#pragma omp simd
        for (int d = 0; d < Dv; ++d) {
          ag[d] += p * static_cast<float>(vr[d]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    T* o = out + (size_t(b) * s.Hq + size_t(hk) * G + g) * Dv;
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    const float* ag = acc.data() + size_t(g) * Dv;
    for (int d = 0; d < Dv; ++d) {
      o[d] = static_cast<T>(ag[d] * inv);
    }
  }
}

template <typename T>
void run_typed(const std::vector<mx::array>& in, mx::array& out, const Shape& s) {
  const Dense<T> q(in[0]), k(in[1]), v(in[2]);
  const Dense<int32_t> table(in[3]), lens(in[4]);
  std::vector<float> sink_copy;
  const float* sinks = nullptr;
  if (in.size() > 5) {
    sink_copy = row_major_copy<float>(in[5]);
    sinks = sink_copy.data();
  }
  T* o = out.data<T>();
  const int tasks_total = s.B * s.Hkv;
  // the work of the whole call, in multiply-adds: one thread below ~256K (waking the pool costs more)
  size_t work = 0;
  for (int b = 0; b < s.B; ++b) {
    work += size_t(std::max(lens.ptr[b], 0)) * s.Hq * (s.D + s.Dv);
  }
  auto pool = shared_pool();
  const int tasks = pool->size() <= 1 || work < (size_t(1) << 18) ? 1 : std::min(tasks_total, pool->size() * 4);
  auto run_range = [&](int i0, int i1) {
    for (int i = i0; i < i1; ++i) {
      attend<T>(q.ptr, k.ptr, v.ptr, table.ptr, lens.ptr, sinks, o, s, i / s.Hkv, i % s.Hkv);
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

mx::array paged_decode_attention(
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
  if (q.ndim() != 3 || k.ndim() != 3 || v.ndim() != 3) {
    throw std::invalid_argument("q must be (B, Hq, D), k (slots, Hkv, D) and v (slots, Hkv, Dv)");
  }
  if (!supported_float(q.dtype()) || k.dtype() != q.dtype() || v.dtype() != q.dtype()) {
    throw std::invalid_argument("q, k and v must share one float dtype (float32, float16 or bfloat16)");
  }
  const int B = q.shape(0), Hq = q.shape(1), Hkv = k.shape(1);
  if (k.shape(2) != q.shape(2) || v.shape(1) != Hkv || v.shape(0) != k.shape(0) || Hkv == 0 || Hq % Hkv) {
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
      {B, Hq, v.shape(2)},
      q.dtype(),
      std::make_shared<PagedDecodeCPU>(mx::to_stream(s, mx::Device::cpu), scale, block_size, window, bool(sinks)),
      std::move(inputs));
}

void PagedDecodeCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  const auto& q = inputs[0];
  const Shape shape{
      q.shape(0),
      q.shape(1),
      inputs[1].shape(1),
      q.shape(2),
      inputs[2].shape(2),
      inputs[3].shape(1),
      block_size_,
      window_,
      scale_};
  encoder.dispatch([inputs, out, shape]() mutable {
    if (out.dtype() == mx::float32) {
      run_typed<float>(inputs, out, shape);
    } else if (out.dtype() == mx::float16) {
      run_typed<mx::float16_t>(inputs, out, shape);
    } else {
      run_typed<mx::bfloat16_t>(inputs, out, shape);
    }
  });
}

void PagedDecodeCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DuetPagedDecodeCPU runs on the CPU stream only");
}

bool PagedDecodeCPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedDecodeCPU&>(other);
  return scale_ == o.scale_ && block_size_ == o.block_size_ && window_ == o.window_ && sinks_ == o.sinks_;
}

std::vector<mx::Shape> PagedDecodeCPU::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), inputs[2].shape(2)}};
}

} // namespace duet_cpu
