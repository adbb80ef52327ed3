#include "swiglu.h"

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "dispatch.h"
#include "kernels.h"
#include "pool.h"
#include "strided.h"

namespace duet_cpu {

namespace {

bool supported_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// Elements per pass through the ISA kernel for half-precision inputs (converted to float32 first).
constexpr size_t kPiece = 4096;

template <typename T>
void run_typed(const mx::array& gate, const mx::array& up, mx::array& out) {
  const size_t n = out.size();
  if (n == 0) {
    return;
  }
  const Dense<T> gd(gate), ud(up);
  const T* g = gd.ptr;
  const T* u = ud.ptr;
  T* y = out.data<T>();
  const SwigluFn fn = swiglu_fn();
  auto span = [&](size_t i0, size_t i1) {
    if constexpr (std::is_same_v<T, float>) {
      fn(g + i0, u + i0, y + i0, i1 - i0);
    } else {
      float gf[kPiece], uf[kPiece], yf[kPiece];
      for (size_t p = i0; p < i1; p += kPiece) {
        const size_t m = std::min(kPiece, i1 - p);
        for (size_t i = 0; i < m; ++i) {
          gf[i] = static_cast<float>(g[p + i]);
          uf[i] = static_cast<float>(u[p + i]);
        }
        fn(gf, uf, yf, m);
        for (size_t i = 0; i < m; ++i) {
          y[p + i] = static_cast<T>(yf[i]);
        }
      }
    }
  };
  auto pool = shared_pool();
  // One thread up to ~64K elements (a decode step's rows): waking the pool costs more than the work.
  const int tasks = pool->size() <= 1 ? 1 : int(std::min<size_t>(n / 65536 + 1, size_t(pool->size())));
  if (tasks <= 1) {
    span(0, n);
    return;
  }
  pool->run(tasks, [&](int t) {
    const size_t i0 = n * size_t(t) / size_t(tasks);
    const size_t i1 = n * size_t(t + 1) / size_t(tasks);
    if (i0 < i1) {
      span(i0, i1);
    }
  });
}

} // namespace

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  if (!supported_float(gate.dtype()) || gate.dtype() != up.dtype()) {
    throw std::invalid_argument("gate and up must share one dtype: float32, float16 or bfloat16");
  }
  if (gate.shape() != up.shape()) {
    throw std::invalid_argument("gate and up must have the same shape");
  }
  return mx::array(gate.shape(), gate.dtype(), std::make_shared<SwiGLUCPU>(mx::to_stream(s, mx::Device::cpu)), {gate, up});
}

void SwiGLUCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  dispatch_cpu(stream(), inputs, out, [gate = inputs[0], up = inputs[1], out]() mutable {
    with_float_type(out.dtype(), [&](auto t) { run_typed<decltype(t)>(gate, up, out); });
  });
}

void SwiGLUCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DuetSwiGLUCPU runs on the CPU stream only");
}

} // namespace duet_cpu
