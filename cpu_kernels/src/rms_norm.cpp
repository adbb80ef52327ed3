#include "rms_norm.h"

#include <cmath>
#include <stdexcept>
#include <type_traits>
#include <algorithm>
#include <vector>

#include "dispatch.h"
#include "pool.h"
#include "strided.h"

namespace duet_cpu {

namespace {

bool supported_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// Rows [r0, r1) of a row-contiguous (M, D) x. OutT is the output dtype: the normalized value is rounded
// to it before the multiply by w, as mx.fast.rms_norm does.
template <typename XT, typename WT, typename OutT>
void norm_rows(const XT* x, const WT* w, OutT* y, int D, float eps, int r0, int r1) {
  std::vector<float> wf(D);
  for (int d = 0; d < D; ++d) {
    wf[d] = static_cast<float>(w[d]);
  }
  std::vector<float> row(D);
  for (int r = r0; r < r1; ++r) {
    const XT* xr = x + size_t(r) * D;
    OutT* yr = y + size_t(r) * D;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int d = 0; d < D; ++d) {
      const float v = static_cast<float>(xr[d]);
      row[d] = v;
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / float(D) + eps);
    if constexpr (std::is_same_v<OutT, float>) {
#pragma omp simd
      for (int d = 0; d < D; ++d) {
        yr[d] = (row[d] * inv) * wf[d];
      }
    } else {
      for (int d = 0; d < D; ++d) {
        const float n = static_cast<float>(static_cast<OutT>(row[d] * inv));
        yr[d] = static_cast<OutT>(n * wf[d]);
      }
    }
  }
}

template <typename XT, typename WT, typename OutT>
void run_typed(const mx::array& x, const mx::array& w, mx::array& out, float eps) {
  const int D = x.shape(-1);
  const int M = D == 0 ? 0 : int(x.size() / D);
  if (M == 0) {
    return;
  }
  const Dense<XT> xd(x);
  const Dense<WT> wd(w);
  const XT* xp = xd.ptr;
  const WT* wp = wd.ptr;
  OutT* yp = out.data<OutT>();
  auto pool = shared_pool();
  // One thread up to ~64K elements (a decode step's rows): waking the pool costs more than the work.
  const size_t work = size_t(M) * D;
  const int tasks = pool->size() <= 1 ? 1 : int(std::min<size_t>(std::min<size_t>(M, work / 65536 + 1), pool->size()));
  if (tasks <= 1) {
    norm_rows(xp, wp, yp, D, eps, 0, M);
    return;
  }
  pool->run(tasks, [&](int t) {
    const int r0 = int(int64_t(M) * t / tasks);
    const int r1 = int(int64_t(M) * (t + 1) / tasks);
    if (r0 < r1) {
      norm_rows(xp, wp, yp, D, eps, r0, r1);
    }
  });
}

void run_rms_norm(const mx::array& x, const mx::array& w, mx::array& out, float eps) {
  with_float_type(x.dtype(), [&](auto xt) {
    with_float_type(w.dtype(), [&](auto wt) {
      with_float_type(out.dtype(), [&](auto ot) {
        run_typed<decltype(xt), decltype(wt), decltype(ot)>(x, w, out, eps);
      });
    });
  });
}

} // namespace

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || !supported_float(x.dtype())) {
    throw std::invalid_argument("x must be float32, float16 or bfloat16 with at least 1 dim");
  }
  if (w.ndim() != 1 || !supported_float(w.dtype())) {
    throw std::invalid_argument("w must be a 1-D float32, float16 or bfloat16 array");
  }
  if (w.shape(0) != x.shape(-1)) {
    throw std::invalid_argument(
        "w has " + std::to_string(w.shape(0)) + " values but x's last axis has " + std::to_string(x.shape(-1)));
  }
  return mx::array(
      x.shape(),
      mx::promote_types(x.dtype(), w.dtype()),
      std::make_shared<RMSNormCPU>(mx::to_stream(s, mx::Device::cpu), eps),
      {x, w});
}

void RMSNormCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  dispatch_cpu(stream(), inputs, out, [x = inputs[0], w = inputs[1], out, eps = eps_]() mutable {
    run_rms_norm(x, w, out, eps);
  });
}

void RMSNormCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DuetRMSNormCPU runs on the CPU stream only");
}

bool RMSNormCPU::is_equivalent(const mx::Primitive& other) const {
  return eps_ == static_cast<const RMSNormCPU&>(other).eps_;
}

std::vector<mx::Shape> RMSNormCPU::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

} // namespace duet_cpu
