#include "qmm.h"

#include "panels.h"
#include "qmm_shared.h"

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "dispatch.h"
#include "kernels.h"
#include "pool.h"
#include "strided.h"

namespace duet_cpu {

namespace {

using DequantFn = void (*)(const QmmArgs&, int, int, float*);

struct Variant {
  const char* name;
  RowsFn fn;
  DequantFn dequant;
  DequantFn dequant_panels; // the panel form's (panels.h): panels p0..p1
  AttendFn attend;
  SwigluFn swiglu;
  QuantizeXFn quantize_x = nullptr; // one row of x as bytes for the integer dot-product kernel
  RowsFn q8_rows = nullptr; // the int8 kernel (cpu_math "int8") and its quantization of x
  Q8QuantizeFn q8_quantize = nullptr;
  Q8GemmFn q8_gemm = nullptr; // the int8 GEMM for many rows of x (4-, 5-, 6- and 8-bit weights)
  AttendDecodeFn attend_decode = nullptr; // one query token's attention in two passes
};

// The best variant's name (its functions: variant_named).
Variant best_variant() {
#if defined(DUET_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
      __builtin_cpu_supports("avx512vnni")) {
    return {"avx512"};
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return {"avx2"};
  }
#endif
  return {"base"};
}

std::atomic<const Variant*> g_variant{nullptr};

const Variant& variant_named(const std::string& name) {
  static const Variant base_v{
      "base", base::qmm_rows, base::dequant_rows, base::dequant_panels, base::attend_chunk, base::swiglu, nullptr, base::q8_rows, base::q8_quantize};
#if defined(DUET_X86)
  static const Variant avx2_v{
      "avx2", avx2::qmm_rows, avx2::dequant_rows, avx2::dequant_panels, avx2::attend_chunk, avx2::swiglu, nullptr, avx2::q8_rows, avx2::q8_quantize};
  static const Variant avx512_v{
      "avx512",
      avx512::qmm_rows,
      avx512::dequant_rows,
      avx512::dequant_panels,
      avx512::attend_chunk,
      avx512::swiglu,
      avx512::quantize_x,
      avx512::q8_rows,
      avx512::q8_quantize,
      avx512::q8_gemm,
      avx512::attend_decode};
  if (name == "avx512") {
    return avx512_v;
  }
  if (name == "avx2") {
    return avx2_v;
  }
#endif
  return base_v;
}

const Variant& variant() {
  const Variant* v = g_variant.load();
  if (v == nullptr) {
    v = &variant_named(best_variant().name);
    g_variant.store(v);
  }
  return *v;
}

} // namespace

AttendFn attend_chunk_fn() {
  return variant().attend;
}

AttendDecodeFn attend_decode_fn() {
  return variant().attend_decode;
}

SwigluFn swiglu_fn() {
  return variant().swiglu;
}

RowsFn qmm_rows_fn() {
  return variant().fn;
}

QuantizeXFn quantize_x_fn() {
  return variant().quantize_x;
}

RowsFn q8_rows_fn() {
  return variant().q8_rows;
}

Q8QuantizeFn q8_quantize_fn() {
  return variant().q8_quantize;
}

Q8GemmFn q8_gemm_fn() {
  return variant().q8_gemm;
}

void q8_gemm_on_pool(Q8GemmFn gemm, const Q8GemmArgs& a) {
  auto pool = shared_pool();
  const int panels = (a.N + 31) / 32;
  const int tasks = std::min(panels, pool->size() * 4);
  if (tasks <= 1) {
    gemm(a, 0, a.N);
    return;
  }
  pool->run(tasks, [&](int t) {
    const int n0 = std::min(a.N, int(int64_t(panels) * t / tasks) * 32);
    const int n1 = std::min(a.N, int(int64_t(panels) * (t + 1) / tasks) * 32);
    if (n0 < n1) {
      gemm(a, n0, n1);
    }
  });
}

bool supported_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

void check_bits_and_groups(int bits, int group_size) {
  if (bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    throw std::invalid_argument("bits must be 4, 5, 6 or 8, got " + std::to_string(bits));
  }
  if (group_size != 16 && group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("group_size must be 32, 64 or 128 (16: Q6_K's form), got " + std::to_string(group_size));
  }
}

void check_planes(int planes) {
  if (planes < 1 || planes > 3) {
    throw std::invalid_argument("x_planes must be 1 (int8), 2 (int16) or 3 (exact), got " + std::to_string(planes));
  }
}

void check_scale_format(const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  if (group_size == 16) {
    // Q6_K's form (kSuper16): nothing else comes in groups of 16, and it has no biases to store
    if (bits != 6 || scales.dtype() != mx::uint8 || !implicit_biases(biases) || !supported_float(biases.dtype())) {
      throw std::invalid_argument(
          "group_size 16 is Q6_K's form only: 6-bit codes, uint8 scales (a float16 step and 16 int8 multiples per "
          "256 weights) and a one-element float biases (the ratio -32)");
    }
    return;
  }
  if (implicit_biases(biases)) {
    if (!supported_float(scales.dtype()) || !supported_float(biases.dtype())) {
      throw std::invalid_argument("a one-element biases (a ratio to the scales) needs float scales and a float ratio");
    }
    return;
  }
  if (biases.dtype() != scales.dtype()) {
    throw std::invalid_argument("scales and biases must share one dtype");
  }
  if (scales.dtype() == mx::uint8) {
    if (group_size != 32 || (bits != 4 && bits != 5)) {
      throw std::invalid_argument("two-level (uint8) scales are for 4- and 5-bit weights in groups of 32");
    }
    return;
  }
  if (!supported_float(scales.dtype())) {
    throw std::invalid_argument("scales and biases must be float32, float16, bfloat16 or two-level uint8");
  }
}

void check_scale_shapes(const mx::array& scales, const mx::array& biases, mx::Shape lead, int K, int group_size) {
  const bool two_level = scales.dtype() == mx::uint8;
  if (two_level && K % 256 != 0) {
    throw std::invalid_argument("two-level (uint8) scales need K a multiple of 256");
  }
  lead.push_back(two_level ? int(scale_row_bytes(scale_type(scales.dtype(), group_size), K / group_size)) : K / group_size);
  if (scales.shape() != lead || (biases.shape() != lead && !implicit_biases(biases))) {
    throw std::invalid_argument(
        "scales and biases must be (..., N, K / group_size), or (..., N, K / 256 * 10) uint8 for two-level "
        "scales (K / 256 * 18 in groups of 16); biases may be one element (a ratio to the scales)");
  }
}

float load_float(const void* p, size_t i, mx::Dtype t) {
  if (t == mx::float32) {
    return static_cast<const float*>(p)[i];
  }
  if (t == mx::float16) {
    return static_cast<float>(static_cast<const mx::float16_t*>(p)[i]);
  }
  return static_cast<float>(static_cast<const mx::bfloat16_t*>(p)[i]);
}

Biases biases_of(const mx::array& biases) {
  if (implicit_biases(biases)) {
    return {{nullptr, {}}, nullptr, load_float(biases.data<void>(), 0, biases.dtype())};
  }
  DenseBytes bytes = dense_bytes(biases);
  const void* data = bytes.data;
  return {std::move(bytes), data, 0.0f};
}

DenseBytes dense_bytes(const mx::array& a) {
  if (a.flags().row_contiguous) {
    return {a.data<void>(), {}};
  }
  DenseBytes d{nullptr, std::vector<uint8_t>(a.nbytes())};
  const size_t item = a.itemsize();
  const auto offsets = element_offsets(a);
  const auto* src = static_cast<const uint8_t*>(a.data<void>());
  for (size_t e = 0; e < offsets.size(); ++e) {
    std::memcpy(d.copy.data() + e * item, src + offsets[e] * int64_t(item), item);
  }
  d.data = d.copy.data();
  return d;
}

int task_count(size_t weight_bytes, int M, int threads) {
  if (threads <= 1) {
    return 1;
  }
  const size_t per_task = M > 1 ? 8192 : 16384;
  const size_t wanted = std::max<size_t>(1, weight_bytes / per_task);
  return int(std::min<size_t>(wanted, size_t(threads) * 4));
}

Q8Rows quantize_rows_q8(Q8QuantizeFn q8, const void* x, mx::Dtype t, const std::vector<int64_t>& first, int64_t step, int K, int group_size) {
  const int M = int(first.size());
  const int G = K / group_size;
  Q8Rows r{std::vector<int8_t>(size_t(M) * K), std::vector<float>(size_t(M) * (K / 8)), std::vector<float>(size_t(M) * G)};
  rows_on_pool(M, [&](int m0, int m1) {
    std::vector<float> row(static_cast<size_t>(K));
    for (int m = m0; m < m1; ++m) {
      float* sum = r.sum.data() + size_t(m) * G;
      prepare_x_row(x, t, size_t(first[m]), step, K, group_size, 8, row.data(), sum); // its float sums, replaced below
      quantize_row_q8(q8, row.data(), K, group_size, 8, r.q.data() + size_t(m) * K, r.unit.data() + size_t(m) * (K / 8), sum);
    }
  });
  return r;
}

Q8Rows split_rows_planes(QuantizeXFn qx, const void* x, mx::Dtype t, const std::vector<int64_t>& first, int64_t step, int K, int group_size, int planes) {
  const int M = int(first.size());
  const int G = K / group_size;
  const int runs = K / 32;
  const size_t P = size_t(planes);
  Q8Rows r{std::vector<int8_t>(P * M * K), std::vector<float>(P * M * (K / 8)), std::vector<float>(P * M * G, 0.0f)};
  rows_on_pool(M, [&](int m0, int m1) {
    std::vector<float> row(static_cast<size_t>(K));
    std::vector<int8_t> pieces(size_t(3) * K);
    std::vector<float> unit(static_cast<size_t>(runs));
    for (int m = m0; m < m1; ++m) {
      // element order (bits 8); its float group sums stay as the first plane's (the bias term)
      float* sums = r.sum.data() + size_t(m) * G;
      prepare_x_row(x, t, size_t(first[m]), step, K, group_size, 8, row.data(), sums);
      qx(row.data(), K, 8, pieces.data(), unit.data()); // per run: [x1 (32), x2 (32), x3 (32)], unit
      if (planes == 2) { // int16 math: the held x's sums (hold_two_pieces' values, from these pieces)
        held_group_sums(pieces.data(), unit.data(), K, group_size, sums);
      }
      for (int j = 0; j < planes; ++j) { // x2 is rounded to nearest: two planes are x to within 2^-15
        const size_t pr = size_t(j) * M + m; // plane j's row
        const float times = j == 0 ? 16384.0f : (j == 1 ? 128.0f : 1.0f); // exact powers of two
        for (int rr = 0; rr < runs; ++rr) {
          std::memcpy(r.q.data() + pr * K + size_t(rr) * 32, pieces.data() + size_t(rr) * 96 + 32 * j, 32);
          const float d = unit[size_t(rr)] * times;
          for (int i = 0; i < 4; ++i) {
            r.unit[pr * (K / 8) + size_t(rr) * 4 + i] = d;
          }
        }
      }
    }
  });
  return r;
}

void drop_third_piece(int8_t* xq, int K, int bits) {
  if (bits == 4) { // per step of 64 values, 6 vectors of 32 bytes: piece j's at 64j
    for (int s = 0; s < K / 64; ++s) {
      std::memset(xq + size_t(s) * 192 + 128, 0, 64);
    }
    return;
  }
  for (int r = 0; r < K / 32; ++r) { // per run of 32: x1, x2, x3
    std::memset(xq + size_t(r) * 96 + 64, 0, 32);
  }
}

bool pair_steps_x(const int8_t* xq, int K, int bits, int8_t* out) {
  const int nx = bits == 4 ? 6 : 3;
  const int steps = K / (bits == 4 ? 64 : 32);
  if (K % (bits == 4 ? 64 : 32) != 0 || steps % 2 != 0) {
    return false;
  }
  for (int s = 0; s < steps; s += 2) {
    for (int j = 0; j < nx; ++j) {
      for (int h = 0; h < 2; ++h) {
        std::memcpy(out + (size_t(s / 2) * nx + j) * 64 + h * 32, xq + (size_t(s + h) * nx + j) * 32, 32);
      }
    }
  }
  return true;
}

void pair_runs_x8(const int8_t* x8, int K, int8_t* out) {
  std::memcpy(out, x8, size_t(K));
  for (int b = 0; b + 128 <= K; b += 128) {
    std::memcpy(out + b + 32, x8 + b + 64, 32);
    std::memcpy(out + b + 64, x8 + b + 32, 32);
  }
}

void sum_planes(const float* yp, int planes, int M, int N, float* y) {
  const size_t plane = size_t(M) * N;
  if (planes == 2) {
    for (size_t i = 0; i < plane; ++i) {
      y[i] = yp[i] + yp[plane + i];
    }
    return;
  }
  for (size_t i = 0; i < plane; ++i) {
    y[i] = yp[i] + (yp[plane + i] + yp[2 * plane + i]); // the small pieces first
  }
}

void quantize_row_q8(Q8QuantizeFn q8, const float* row, int K, int group_size, int bits, int8_t* q, float* scale, float* xsum) {
  std::vector<float> run_sum(size_t(K) / 32);
  q8(row, K, bits, q, scale, run_sum.data());
  if (group_size == 16) { // each half run's sum of d * q, as q8 sums a run (q in element order)
    for (int g = 0; g < K / 16; ++g) {
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) {
        s += q[size_t(g) * 16 + i];
      }
      xsum[g] = scale[size_t(g / 2) * 4] * float(s);
    }
    return;
  }
  const int per = group_size / 32;
  for (int g = 0; g < K / group_size; ++g) {
    float s = 0.0f;
    for (int r = g * per; r < (g + 1) * per; ++r) {
      s += run_sum[r];
    }
    xsum[g] = s;
  }
}

namespace {

// x's K values (dtype t, elements first, first + step, ...) as float32 into out: one typed loop per
// dtype, not a dtype test per element.
template <typename T>
void widen_row(const void* x, size_t first, int64_t step, int K, float* out) {
  const T* p = static_cast<const T*>(x) + first;
  if (step == 1) {
    for (int k = 0; k < K; ++k) {
      out[k] = static_cast<float>(p[k]);
    }
  } else {
    for (int k = 0; k < K; ++k) {
      out[k] = static_cast<float>(p[int64_t(k) * step]);
    }
  }
}

// Each group of a row summed in element order, as always (the float kernels' results depend on it),
// but eight groups side by side: one group's chain of dependent adds alone is latency-bound.
void group_sums(const float* row, int K, int group_size, float* xsum) {
  const int G = K / group_size;
  int g0 = 0;
  for (; g0 + 8 <= G; g0 += 8) {
    float s[8] = {};
    for (int k = 0; k < group_size; ++k) {
      for (int j = 0; j < 8; ++j) {
        s[j] += row[(g0 + j) * group_size + k];
      }
    }
    for (int j = 0; j < 8; ++j) {
      xsum[g0 + j] = s[j];
    }
  }
  for (int g = g0; g < G; ++g) {
    float s = 0.0f;
    for (int k = g * group_size; k < (g + 1) * group_size; ++k) {
      s += row[k];
    }
    xsum[g] = s;
  }
}

// The values x's first two pieces hold (quantize_x's bits-8 layout: per run of 32, x1, x2, x3 and its
// unit d / 2^14) into out: d * (x1 + x2 / 2^7) = (x1 * 2^7 + x2) * (unit * 2^7), exactly as int16 math
// takes x everywhere.
void held_values(const int8_t* pieces, const float* unit, int K, float* out) {
  for (int r = 0; r < K / 32; ++r) {
    const int8_t* p = pieces + size_t(r) * 96;
    const float step = unit[size_t(r)] * 128.0f; // d / 2^7, exactly
    for (int i = 0; i < 32; ++i) {
      out[size_t(r) * 32 + i] = float(int32_t(p[i]) * 128 + int32_t(p[32 + i])) * step;
    }
  }
}

} // namespace

void held_group_sums(const int8_t* pieces, const float* unit, int K, int group_size, float* sums) {
  thread_local std::vector<float> held; // the held values, then summed as prepare_x_row sums a row
  held.resize(size_t(K));
  held_values(pieces, unit, K, held.data());
  group_sums(held.data(), K, group_size, sums);
}

void held_sums_of_pieces(const int8_t* xq, const float* unit, int K, int bits, int group_size, float* sums) {
  if (bits != 4) { // per run: x1, x2, x3 (32 bytes each) and its unit
    held_group_sums(xq, unit, K, group_size, sums);
    return;
  }
  // per step of 64 values (two runs), 6 vectors of 32 bytes, piece j's low vector at 64j and high at
  // 64j + 32; run r's 32 values (permuted) at 16 * (r % 2) of both, its unit at (r / 2) * 8 + (r % 2) * 4
  const int per = group_size / 32;
  for (int g = 0; g < K / group_size; ++g) {
    float s = 0.0f;
    for (int r = g * per; r < (g + 1) * per; ++r) {
      const int8_t* step = xq + size_t(r / 2) * 192 + (r % 2) * 16;
      int32_t run = 0;
      for (int h = 0; h < 2; ++h) { // the low vectors, then the high
        for (int i = 0; i < 16; ++i) {
          run += int32_t(step[32 * h + i]) * 128 + int32_t(step[64 + 32 * h + i]);
        }
      }
      s += float(run) * (unit[size_t(r / 2) * 8 + (r % 2) * 4] * 128.0f);
    }
    sums[g] = s;
  }
}

void hold_two_pieces(float* row, int K) {
  const QuantizeXFn qx = quantize_x_fn();
  if (qx == nullptr || K % 32 != 0) {
    return; // no integer kernels here: int16 math is exact math
  }
  std::vector<int8_t> pieces(size_t(3) * K);
  std::vector<float> unit(size_t(K) / 32);
  qx(row, K, 8, pieces.data(), unit.data()); // per run: [x1 (32), x2 (32), x3 (32)], unit d / 2^14
  held_values(pieces.data(), unit.data(), K, row);
}

void prepare_x_row(const void* x, mx::Dtype t, size_t first, int64_t step, int K, int group_size, int bits, float* row, float* xsum, int planes) {
  // into row directly, or (4-bit) into a copy that is then permuted into row
  std::vector<float> plain(bits == 4 ? size_t(K) : 0);
  float* dst = bits == 4 ? plain.data() : row;
  if (t == mx::float32) {
    widen_row<float>(x, first, step, K, dst);
  } else if (t == mx::float16) {
    widen_row<mx::float16_t>(x, first, step, K, dst);
  } else {
    widen_row<mx::bfloat16_t>(x, first, step, K, dst);
  }
  if (planes == 2) {
    hold_two_pieces(dst, K); // per run of 32, so before the 4-bit permutation within runs
  }
  if (bits == 4) {
    for (int base = 0; base < K; base += 32) {
      for (int i = 0; i < 16; ++i) {
        row[base + i] = dst[base + 2 * i];
        row[base + 16 + i] = dst[base + 2 * i + 1];
      }
    }
  }
  group_sums(row, K, group_size, xsum);
}

// qmm_shared.h says what these three compute
bool integer_offsets(int group_size, const Biases& bd) {
  return group_size == 16 && bd.data == nullptr && bd.ratio == std::nearbyint(bd.ratio) && bd.ratio >= -128.0f &&
         bd.ratio <= 0.0f;
}

// one int32 a group of 16 values of x, which the kernel adds to the group's first lane
const int32_t* offsets_int8(const std::vector<int8_t>& xq, int M, int K, int32_t ratio, std::vector<int32_t>& out) {
  out.resize(size_t(M) * (K / 16));
  for (size_t j = 0; j < out.size(); ++j) {
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) {
      sum += xq[16 * j + i];
    }
    out[j] = ratio * sum;
  }
  return out.data();
}

// per run of 32, x1, x2 and x3 32 bytes each; each value the integer x1 * 2^14 + x2 * 2^7 + x3
const int32_t* offsets_three_byte(const std::vector<int8_t>& xq, int M, int K, int32_t ratio, std::vector<int32_t>& out) {
  out.resize(size_t(M) * (K / 4));
  for (int m = 0; m < M; ++m) {
    const int8_t* q = xq.data() + size_t(3) * K * m;
    for (int j = 0; j < K / 4; ++j) {
      const int8_t* p = q + size_t(j / 8) * 96 + (j % 8) * 4;
      int32_t sum = 0;
      for (int i = 0; i < 4; ++i) {
        sum += int32_t(p[i]) * 16384 + int32_t(p[32 + i]) * 128 + int32_t(p[64 + i]);
      }
      out[size_t(m) * (K / 4) + j] = ratio * sum;
    }
  }
  return out.data();
}

namespace {

// y, computed in float32 (yf) for a float16 or bfloat16 out, into out.
void write_out(mx::array& out, const std::vector<float>& yf) {
  if (out.dtype() == mx::float16) {
    auto* o = out.data<mx::float16_t>();
    for (size_t i = 0; i < yf.size(); ++i) {
      o[i] = static_cast<mx::float16_t>(yf[i]);
    }
  } else if (out.dtype() == mx::bfloat16) {
    auto* o = out.data<mx::bfloat16_t>();
    for (size_t i = 0; i < yf.size(); ++i) {
      o[i] = static_cast<mx::bfloat16_t>(yf[i]);
    }
  }
}

// Many rows of x with int8 math (prefill): the GEMM on packed panels (kernels_gemm_avx512.cpp). x is
// quantized in element order per run of 32, as the row kernel's other widths are.
void run_q8_gemm(const Variant& v, const DenseBytes& xd, mx::Dtype xt, const uint8_t* w, const void* scales, const Biases& biases, int scale_type, float* y, int M, int N, int K, int group_size, int bits) {
  const Q8Rows x8 = quantize_rows_q8(v.q8_quantize, xd.data, xt, row_starts(M, K), 1, K, group_size);
  q8_gemm_on_pool(v.q8_gemm, {x8.q.data(), x8.unit.data(), x8.sum.data(), w, scales, biases.data, y, M, N, K, group_size, bits, scale_type, biases.ratio});
}

// Many rows of x with exact math: the int8 GEMM on three planes of x (split_rows_planes), 3M rows, whose
// products are added per row. Each plane's dot products are exact in int32 and scaled once per run in
// float32, as the float kernel's products are rounded; x is held to within 2^-15 of a run's step
// (quantize_x's split, as in the exact integer row kernel), so the result keeps float32's accuracy.
// int16 math (planes 2): the held x's first two planes, 2M rows (x within 2^-15 of a run's largest value).
void run_planes_gemm(const Variant& v, int planes, const DenseBytes& xd, mx::Dtype xt, const uint8_t* w, const void* scales, const Biases& biases, int scale_type, float* y, int M, int N, int K, int group_size, int bits) {
  planes_in_chunks(v.quantize_x, planes, xd.data, xt, M, N, K, group_size, kExactGemmRows, y, [&](const Q8Rows& xp, int rows, float* yp) {
    q8_gemm_on_pool(v.q8_gemm, {xp.q.data(), xp.unit.data(), xp.sum.data(), w, scales, biases.data, yp, rows, N, K, group_size, bits, scale_type, biases.ratio});
  });
}

void run_qmm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    mx::array& out,
    int group_size,
    int bits,
    int planes) {
  const int K = x.shape(-1);
  const int M = int(x.size() / std::max(K, 1));
  const int N = w.shape(0);
  const int G = K / group_size;
  if (M == 0 || N == 0) {
    return;
  }
  const bool int8 = planes == 1;

  const bool panels = is_panel_form(w, scales, group_size, bits);
  if (panels && !panel_kernel_runs(int8)) {
    // the row form's paths (no AVX-512 VNNI) on a row-form copy
    const auto [rw, rs, rb] = row_form(w, scales, biases);
    return run_qmm(x, rw, rs, rb, out, group_size, bits, planes);
  }
  const DenseBytes xd = dense_bytes(x);
  std::vector<float> yf;
  float* y = nullptr;
  if (out.dtype() == mx::float32) {
    y = out.data<float>();
  } else {
    yf.resize(size_t(M) * N);
    y = yf.data();
  }
  const DenseBytes wd = dense_bytes(w);
  if (panels) {
    check_panel_biases(biases, bits);
    const DenseBytes sd = dense_bytes(scales);
    const DenseBytes bd = dense_bytes(biases);
    run_panels(
        planes,
        xd.data,
        x.dtype(),
        static_cast<const uint8_t*>(wd.data),
        static_cast<const uint8_t*>(sd.data),
        static_cast<const uint8_t*>(bd.data),
        y,
        M,
        N,
        K,
        bits);
    write_out(out, yf);
    return;
  }
  const DenseBytes sd = dense_bytes(scales);
  const Biases bd = biases_of(biases);
  const Variant& v = variant();
  if (int8 && takes_q8_gemm(v.q8_gemm, M, bits)) {
    // the GEMM prepares x its own way (element order, on the pool)
    const auto* wb = static_cast<const uint8_t*>(wd.data);
    run_q8_gemm(v, xd, x.dtype(), wb, sd.data, bd, scale_type(scales.dtype(), group_size), y, M, N, K, group_size, bits);
    write_out(out, yf);
    return;
  }

  if (!int8 && takes_x3_gemm(v.q8_gemm, v.quantize_x, M)) {
    const auto* wb = static_cast<const uint8_t*>(wd.data);
    run_planes_gemm(v, planes, xd, x.dtype(), wb, sd.data, bd, scale_type(scales.dtype(), group_size), y, M, N, K, group_size, bits);
    write_out(out, yf);
    return;
  }

  // x in float32, 4-bit runs of 32 permuted to (evens, odds) to match the nibble unpacking. The integer
  // row kernel reads x's pieces alone: with int16 math it takes the held x's sums from them below, so
  // its rows are not held here (one split a row instead of two)
  const bool integer_rows = !int8 && v.quantize_x != nullptr && M <= kIntegerRows && K % (bits == 4 ? 64 : 32) == 0;
  std::vector<float> xf(size_t(M) * K);
  std::vector<float> xsum(size_t(M) * G);
  for (int m = 0; m < M; ++m) {
    prepare_x_row(xd.data, x.dtype(), size_t(m) * K, 1, K, group_size, bits, xf.data() + size_t(m) * K, xsum.data() + size_t(m) * G, integer_rows ? 3 : planes);
  }

  QmmArgs a{
      xf.data(),
      xsum.data(),
      static_cast<const uint8_t*>(wd.data),
      sd.data,
      bd.data,
      y,
      M,
      N,
      K,
      group_size,
      bits,
      scale_type(scales.dtype(), group_size)};
  a.bias_ratio = bd.ratio;
  // A few rows of x (decode, verification of proposed tokens, small batches): as bytes for the
  // integer dot-product kernel where there is one. With int8 math, every row as int8 (once, before
  // the threads start) for the int8 kernel.
  std::vector<int8_t> xq;
  std::vector<float> xunit;
  std::vector<int32_t> offsets; // Q6_K's bias term in integers (QmmArgs::x8_offset, xq_offset)
  std::vector<int8_t> xpairs; // one row's xq with each two steps side by side (QmmArgs::xq_pairs)
  if (int8) {
    xq.resize(size_t(M) * K);
    xunit.resize(size_t(M) * (K / 8));
    for (int m = 0; m < M; ++m) {
      quantize_row_q8(
          v.q8_quantize,
          xf.data() + size_t(m) * K,
          K,
          group_size,
          bits,
          xq.data() + size_t(m) * K,
          xunit.data() + size_t(m) * (K / 8),
          xsum.data() + size_t(m) * G);
    }
    a.x8 = xq.data();
    a.x8_scale = xunit.data();
    if (M == 1 && bits == 4) {
      xpairs.resize(size_t(K));
      pair_runs_x8(xq.data(), K, xpairs.data());
      a.x8_pairs = xpairs.data();
    }
    if (integer_offsets(group_size, bd)) {
      a.x8_offset = offsets_int8(xq, M, K, int32_t(bd.ratio), offsets);
    }
  } else if (integer_rows) {
    xq.resize(size_t(3) * K * M);
    xunit.resize(size_t(K) / 8 * M);
    for (int m = 0; m < M; ++m) {
      int8_t* q = xq.data() + size_t(3) * K * m;
      float* u = xunit.data() + size_t(K) / 8 * m;
      v.quantize_x(xf.data() + size_t(m) * K, K, bits, q, u);
      if (planes == 2) { // int16 math: x as its two pieces hold it, as every other path takes it
        drop_third_piece(q, K, bits);
        held_sums_of_pieces(q, u, K, bits, group_size, xsum.data() + size_t(m) * G);
      }
    }
    a.xq = xq.data();
    a.xunit = xunit.data();
    if (M == 1) {
      xpairs.resize(size_t(3) * K);
      a.xq_pairs = pair_steps_x(xq.data(), K, bits, xpairs.data()) ? xpairs.data() : nullptr;
    }
    if (integer_offsets(group_size, bd)) {
      a.xq_offset = offsets_three_byte(xq, M, K, int32_t(bd.ratio), offsets);
    }
  }
  const RowsFn fn = int8 ? v.q8_rows : v.fn;
  auto pool = shared_pool();
  const int tasks = task_count(w.nbytes(), M, pool->size());
  if (tasks <= 1) {
    fn(a, 0, N);
  } else {
    // Chunks of whole 8-row blocks, spread evenly.
    const int blocks = (N + 7) / 8;
    pool->run(tasks, [&](int t) {
      const int b0 = int(int64_t(blocks) * t / tasks);
      const int b1 = int(int64_t(blocks) * (t + 1) / tasks);
      const int n0 = std::min(N, b0 * 8);
      const int n1 = std::min(N, b1 * 8);
      if (n0 < n1) {
        fn(a, n0, n1);
      }
    });
  }

  write_out(out, yf);
}

void check_format(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  check_bits_and_groups(bits, group_size);
  if (w.dtype() != mx::uint32 || w.ndim() != 2) {
    throw std::invalid_argument("w must be a 2-D uint32 array (N, K * bits / 32)");
  }
  check_scale_format(scales, biases, group_size, bits);
}

void check_groups(const mx::array& w, const mx::array& scales, const mx::array& biases, int K, int group_size, int bits) {
  if (K % group_size != 0) {
    throw std::invalid_argument("K must be a multiple of group_size");
  }
  if (is_panel_form(w, scales, group_size, bits)) {
    return check_panel_shapes(scales, biases, K, bits);
  }
  check_scale_shapes(scales, biases, {w.shape(0)}, K, group_size);
}

void run_dequant(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    mx::array& out,
    int group_size,
    int bits) {
  const int N = out.shape(0);
  const int K = out.shape(1);
  if (N == 0 || K == 0) {
    return;
  }
  const bool panels = is_panel_form(w, scales, group_size, bits);
  const DenseBytes wd = dense_bytes(w);
  const DenseBytes sd = dense_bytes(scales);
  const Biases bd = biases_of(biases);
  QmmArgs a{
      nullptr,
      nullptr,
      static_cast<const uint8_t*>(wd.data),
      sd.data,
      bd.data,
      nullptr,
      0,
      N,
      K,
      group_size,
      bits,
      scale_type(scales.dtype(), group_size)};
  a.bias_ratio = bd.ratio;
  const DequantFn fn = panels ? variant().dequant_panels : variant().dequant;
  const int units = panels ? N / kPanelRows : N; // panels or rows
  float* o = out.data<float>();
  auto pool = shared_pool();
  const int tasks = std::min(units, task_count(out.nbytes(), 1, pool->size()));
  if (tasks <= 1) {
    fn(a, 0, units, o);
    return;
  }
  pool->run(tasks, [&](int t) {
    const int u0 = int(int64_t(units) * t / tasks);
    const int u1 = int(int64_t(units) * (t + 1) / tasks);
    if (u0 < u1) {
      fn(a, u0, u1, o);
    }
  });
}

} // namespace

std::string isa() {
  return variant().name;
}

void set_isa(const std::string& name) {
  const Variant best = best_variant();
  if (name.empty()) {
    g_variant.store(&variant_named(best.name));
    return;
  }
  const std::vector<std::string> order = {"avx512", "avx2", "base"};
  auto rank = [&](const std::string& n) { return std::find(order.begin(), order.end(), n) - order.begin(); };
  if (rank(name) == long(order.size())) {
    throw std::invalid_argument("unknown kernel variant '" + name + "'");
  }
  if (rank(name) < rank(best.name)) {
    throw std::invalid_argument("this CPU cannot run the '" + name + "' kernels (best: " + best.name + ")");
  }
  g_variant.store(&variant_named(name));
}

mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    int planes,
    mx::StreamOrDevice s) {
  check_format(w, scales, biases, group_size, bits);
  check_planes(planes);
  if (x.ndim() < 1 || !supported_float(x.dtype())) {
    throw std::invalid_argument("x must be float32, float16 or bfloat16 with at least 1 dim");
  }
  const int K = x.shape(-1);
  const int N = w.shape(0);
  if (int64_t(w.shape(1)) * 32 != int64_t(K) * bits) {
    throw std::invalid_argument(
        "x has K=" + std::to_string(K) + " but w packs " + std::to_string(int64_t(w.shape(1)) * 32 / bits) +
        " values per row");
  }
  check_groups(w, scales, biases, K, group_size, bits);
  auto out_shape = x.shape();
  out_shape.back() = N;
  const auto dtype = mx::promote_types(x.dtype(), scales.dtype());
  return mx::array(
      out_shape,
      dtype,
      std::make_shared<QuantizedMatmulCPU>(mx::to_stream(s, mx::Device::cpu), group_size, bits, planes),
      {x, w, scales, biases});
}

void QuantizedMatmulCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  dispatch_cpu(stream(), inputs, out, [x = inputs[0], w = inputs[1], scales = inputs[2], biases = inputs[3], out,
                                       group_size = group_size_, bits = bits_, planes = planes_]() mutable {
    run_qmm(x, w, scales, biases, out, group_size, bits, planes);
  });
}

mx::array dequantize(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  check_format(w, scales, biases, group_size, bits);
  if ((int64_t(w.shape(1)) * 32) % bits != 0) {
    throw std::invalid_argument("w's row length is not a whole number of values");
  }
  const int K = int(int64_t(w.shape(1)) * 32 / bits);
  check_groups(w, scales, biases, K, group_size, bits);
  return mx::array(
      {w.shape(0), K},
      mx::float32,
      std::make_shared<DequantizeCPU>(mx::to_stream(s, mx::Device::cpu), group_size, bits),
      {w, scales, biases});
}

void DequantizeCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  dispatch_cpu(stream(), inputs, out, [w = inputs[0], scales = inputs[1], biases = inputs[2], out,
                                       group_size = group_size_, bits = bits_]() mutable {
    run_dequant(w, scales, biases, out, group_size, bits);
  });
}

void DequantizeCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DuetDequantizeCPU runs on the CPU stream only");
}

bool DequantizeCPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DequantizeCPU&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

std::vector<mx::Shape> DequantizeCPU::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), int(int64_t(inputs[0].shape(1)) * 32 / bits_)}};
}

void QuantizedMatmulCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DuetQuantizedMatmulCPU runs on the CPU stream only");
}

bool QuantizedMatmulCPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmulCPU&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && planes_ == o.planes_;
}

std::vector<mx::Shape> QuantizedMatmulCPU::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

} // namespace duet_cpu
