#include "moe_route.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <vector>

#include "dispatch.h"
#include "qmm_shared.h"
#include "strided.h"

namespace duet_cpu {

namespace {

// An input's elements as float32 in row-major order: the array itself when it is float32 and row
// contiguous (the router's weights and a decode step's x), else a converted copy.
struct Floats {
  std::vector<float> copy;
  const float* ptr;
  explicit Floats(const mx::array& a) {
    if (a.dtype() == mx::float32 && a.flags().row_contiguous) {
      ptr = a.data<float>();
      return;
    }
    with_float_type(a.dtype(), [&](auto t) { copy = row_major_copy<float, decltype(t)>(a); });
    ptr = copy.data();
  }
};

// The router's weights (E, D) as float32, read where they are in either of the layouts a loaded model
// has: row-major, or input-major (the transpose of a row-major (D, E), which is how the loader keeps a
// dense float32 Linear's weight for OpenBLAS: loader.py _input_major_weights). Anything else is copied
// to row-major: once per call, so a layout only a caller makes (a routing weight of 16 x 2048 copied
// element by element through its strides cost 55 us a layer, a third of a MoE decode step's routing).
struct RouterWeights {
  std::optional<Floats> rows; // row-major (E, D), when not input-major
  const float* input_major = nullptr; // (D, E) row-major, or null
  explicit RouterWeights(const mx::array& w) {
    if (w.dtype() == mx::float32 && w.ndim() == 2 && !w.flags().row_contiguous && w.flags().col_contiguous) {
      input_major = w.data<float>();
    } else {
      rows.emplace(w);
    }
  }
};

// dot(a, b) over n floats, in 8 partial sums (a vectorisable order; float32 as MLX's matmul sums).
float dot(const float* a, const float* b, int n) {
  float part[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      part[j] += a[i + j] * b[i + j];
    }
  }
  float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; i < n; ++i) {
    s += a[i] * b[i];
  }
  return s;
}

// dot(a, w[:, e]) for every e of a row-major (n, E) w, each in dot's order of additions: the same
// float32 results as dot on the row-major transpose, with w read once, row by row. part: 8 * E floats
// of scratch (part[j * E + e]: a row of w against 8 lanes).
void dot_input_major(const float* a, const float* w, int n, int E, std::vector<float>& part, float* out) {
  part.assign(size_t(E) * 8, 0.0f);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const float ai = a[i + j];
      const float* wr = w + size_t(i + j) * E;
      float* pj = part.data() + size_t(j) * E;
      for (int e = 0; e < E; ++e) {
        pj[e] += ai * wr[e];
      }
    }
  }
  for (int e = 0; e < E; ++e) {
    const auto q = [&](int j) { return part[size_t(j) * E + e]; };
    out[e] = ((q(0) + q(1)) + (q(2) + q(3))) + ((q(4) + q(5)) + (q(6) + q(7)));
  }
  for (; i < n; ++i) {
    for (int e = 0; e < E; ++e) {
      out[e] += a[i] * w[size_t(i) * E + e];
    }
  }
}

template <typename T>
void route(const mx::array& x, const mx::array& w, mx::array& inds, mx::array& scores, int k, bool normalize) {
  const int D = x.shape(-1);
  const int E = w.shape(0);
  const size_t rows = D == 0 ? 0 : x.size() / size_t(D);
  const Floats xf(x);
  const RouterWeights wf(w);
  auto* out_i = inds.data<uint32_t>();
  T* out_s = scores.data<T>();
  std::vector<float> p(static_cast<size_t>(E));
  std::vector<int> order(static_cast<size_t>(E));
  std::vector<float> part; // dot_input_major's scratch
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = xf.ptr + r * size_t(D);
    float top = -INFINITY;
    if (wf.input_major != nullptr) {
      dot_input_major(xr, wf.input_major, D, E, part, p.data());
    } else {
      for (int e = 0; e < E; ++e) {
        p[e] = dot(xr, wf.rows->ptr + size_t(e) * D, D);
      }
    }
    for (int e = 0; e < E; ++e) {
      top = std::max(top, p[e]);
    }
    double sum = 0.0; // the softmax in float32 against the largest logit, summed in double
    for (int e = 0; e < E; ++e) {
      p[e] = std::exp(p[e] - top);
      sum += p[e];
    }
    for (int e = 0; e < E; ++e) {
      p[e] = float(p[e] / sum);
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
      return p[a] > p[b] || (p[a] == p[b] && a < b); // a NaN row keeps the experts' order
    });
    double chosen = 0.0;
    for (int j = 0; j < k; ++j) {
      chosen += p[order[j]];
    }
    for (int j = 0; j < k; ++j) {
      out_i[r * k + j] = uint32_t(order[j]);
      const float v = p[order[j]];
      out_s[r * k + j] = static_cast<T>(normalize ? float(v / chosen) : v);
    }
  }
}

} // namespace

std::vector<mx::array> moe_route(const mx::array& x, const mx::array& w, int k, bool normalize, mx::StreamOrDevice s) {
  if (!supported_float(x.dtype()) || !supported_float(w.dtype())) {
    throw std::invalid_argument("x and w must be float32, float16 or bfloat16");
  }
  if (x.ndim() < 1 || w.ndim() != 2 || w.shape(1) != x.shape(-1)) {
    throw std::invalid_argument("x must be (..., D) and w (experts, D)");
  }
  if (k < 1 || k > w.shape(0)) {
    throw std::invalid_argument("k must be between 1 and the number of experts");
  }
  mx::Shape shape = x.shape();
  shape.back() = k;
  return mx::array::make_arrays(
      {shape, shape},
      {mx::uint32, mx::promote_types(x.dtype(), w.dtype())},
      std::make_shared<MoeRouteCPU>(mx::to_stream(s, mx::Device::cpu), k, normalize),
      {x, w});
}

void MoeRouteCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  dispatch_cpu(stream(), inputs, outputs, [x = inputs[0], w = inputs[1], inds = outputs[0], scores = outputs[1], k = k_, normalize = normalize_]() mutable {
    with_float_type(scores.dtype(), [&](auto t) { route<decltype(t)>(x, w, inds, scores, k, normalize); });
  });
}

void MoeRouteCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DuetMoeRouteCPU runs on the CPU stream only");
}

} // namespace duet_cpu
