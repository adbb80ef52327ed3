#include "rope.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "strided.h"

namespace duet_cpu {

namespace {

bool supported_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// The elements of a in row-major order, as T (any strides).
template <typename T, typename S>
void gather(const mx::array& a, std::vector<T>& out) {
  out = row_major_copy<T, S>(a);
}

template <typename T>
void gather_float(const mx::array& a, std::vector<T>& out) {
  with_float_type(a.dtype(), [&](auto s) { gather<T, decltype(s)>(a, out); });
}

void gather_offsets(const mx::array& a, std::vector<int64_t>& out) {
  switch (a.dtype()) {
    case mx::int32:
      gather<int64_t, int32_t>(a, out);
      break;
    case mx::int64:
      gather<int64_t, int64_t>(a, out);
      break;
    case mx::uint32:
      gather<int64_t, uint32_t>(a, out);
      break;
    default:
      throw std::invalid_argument("rope's offset must be int32, int64 or uint32");
  }
}

template <typename T>
void store(mx::array& out, const std::vector<float>& y) {
  T* o = out.data<T>();
  for (size_t i = 0; i < y.size(); ++i) {
    o[i] = static_cast<T>(y[i]);
  }
}

struct RopeParams {
  int dims;
  bool traditional;
  float base;
  float scale;
  bool has_freqs;
};

void run_rope(const std::vector<mx::array>& inputs, mx::array& out, const RopeParams& p) {
  const mx::array& x = inputs[0];
  if (x.size() == 0) {
    return;
  }
  const int D = x.shape(-1);
  const int T = x.shape(-2);
  const int B = x.shape(0);
  const size_t per_batch = x.size() / size_t(B); // (*, T, D)
  std::vector<int64_t> offsets;
  gather_offsets(inputs[1], offsets);
  const int half = p.dims / 2;
  std::vector<double> theta(half);
  if (p.has_freqs) {
    std::vector<double> f;
    gather_float<double>(inputs[2], f);
    for (int i = 0; i < half; ++i) {
      theta[i] = 1.0 / f[i];
    }
  } else {
    for (int i = 0; i < half; ++i) {
      theta[i] = std::pow(double(p.base), -2.0 * i / p.dims);
    }
  }
  std::vector<float> xf;
  gather_float<float>(x, xf);
  std::vector<float> y(xf.size());
  std::vector<float> cs(size_t(T) * half), sn(size_t(T) * half);
  for (int b = 0; b < B; ++b) {
    const int64_t start = offsets.size() == 1 ? offsets[0] : offsets[b];
    for (int t = 0; t < T; ++t) {
      const double pos = double(start + t) * p.scale;
      for (int i = 0; i < half; ++i) {
        const double a = pos * theta[i];
        cs[size_t(t) * half + i] = float(std::cos(a));
        sn[size_t(t) * half + i] = float(std::sin(a));
      }
    }
    const size_t rows = per_batch / D; // (*, T) rows of D
    for (size_t r = 0; r < rows; ++r) {
      const int t = int(r % T);
      const float* xr = xf.data() + size_t(b) * per_batch + r * D;
      float* yr = y.data() + size_t(b) * per_batch + r * D;
      const float* c = cs.data() + size_t(t) * half;
      const float* s = sn.data() + size_t(t) * half;
      if (p.traditional) {
        for (int i = 0; i < half; ++i) {
          const float x1 = xr[2 * i], x2 = xr[2 * i + 1];
          yr[2 * i] = x1 * c[i] - x2 * s[i];
          yr[2 * i + 1] = x1 * s[i] + x2 * c[i];
        }
      } else {
        for (int i = 0; i < half; ++i) {
          const float x1 = xr[i], x2 = xr[i + half];
          yr[i] = x1 * c[i] - x2 * s[i];
          yr[i + half] = x1 * s[i] + x2 * c[i];
        }
      }
      for (int d = 2 * half; d < D; ++d) {
        yr[d] = xr[d];
      }
    }
  }
  if (out.dtype() == mx::float32) {
    std::memcpy(out.data<float>(), y.data(), y.size() * sizeof(float));
  } else if (out.dtype() == mx::float16) {
    store<mx::float16_t>(out, y);
  } else {
    store<mx::bfloat16_t>(out, y);
  }
}

} // namespace

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& freqs,
    mx::StreamOrDevice s) {
  if (x.ndim() < 3 || !supported_float(x.dtype())) {
    throw std::invalid_argument("x must be float32, float16 or bfloat16 with shape (B, *, T, D)");
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) {
    throw std::invalid_argument(
        "dims must be even and in 2.." + std::to_string(x.shape(-1)) + ", got " + std::to_string(dims));
  }
  if (offset.ndim() > 1 || (offset.ndim() == 1 && offset.shape(0) != x.shape(0) && offset.shape(0) != 1)) {
    throw std::invalid_argument("offset must be a scalar or one position per batch row (B,)");
  }
  if (offset.dtype() != mx::int32 && offset.dtype() != mx::int64 && offset.dtype() != mx::uint32) {
    throw std::invalid_argument("rope's offset must be int32, int64 or uint32");
  }
  std::vector<mx::array> inputs = {x, offset};
  if (freqs) {
    if (freqs->ndim() != 1 || freqs->shape(0) != dims / 2 || !supported_float(freqs->dtype())) {
      throw std::invalid_argument("freqs must be a float array of dims / 2 values");
    }
    inputs.push_back(*freqs);
  }
  return mx::array(
      x.shape(),
      x.dtype(),
      std::make_shared<RoPECPU>(mx::to_stream(s, mx::Device::cpu), dims, traditional, base, scale),
      std::move(inputs));
}

void RoPECPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  RopeParams p{dims_, traditional_, base_, scale_, inputs.size() > 2};
  dispatch_cpu(stream(), inputs, out, [inputs, out, p]() mutable { run_rope(inputs, out, p); });
}

void RoPECPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DuetRoPECPU runs on the CPU stream only");
}

bool RoPECPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RoPECPU&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
}

std::vector<mx::Shape> RoPECPU::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

} // namespace duet_cpu
