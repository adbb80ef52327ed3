#include "panels.h"

#include <cstring>

#include "mlx/allocator.h"
#include "mlx/transforms.h"
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "pool.h"
#include "qmm_shared.h"

namespace mx = mlx::core;

namespace duet_cpu {

namespace {

constexpr int kPanelSuperBytes = kPanelRows * kSuperBytes; // 160: one super-block's scales for a panel

// One panel's codes, row form <-> panel form (K / 2 bytes a row, 16 rows).
void codes_panel(const uint8_t* src, uint8_t* dst, int K, bool to_panels) {
  const size_t row_bytes = size_t(K) / 2;
  for (int g = 0; g < K / 32; ++g) {
    for (int s = 0; s < 4; ++s) {
      for (int r = 0; r < kPanelRows; ++r) {
        for (int b = 0; b < 4; ++b) {
          const int lo = g * 32 + s * 8 + b; // this byte's low nibble's value; its high nibble's is lo + 4
          const size_t p = ((size_t(g) * 4 + s) * kPanelRows + r) * 4 + b;
          const size_t row = size_t(r) * row_bytes;
          if (to_panels) {
            const uint8_t a = (src[row + lo / 2] >> (4 * (lo % 2))) & 15;
            const uint8_t h = (src[row + (lo + 4) / 2] >> (4 * ((lo + 4) % 2))) & 15;
            dst[p] = uint8_t(a | (h << 4));
          } else {
            const uint8_t v = src[p];
            for (int half = 0; half < 2; ++half) {
              const int e = lo + 4 * half;
              const uint8_t code = half == 0 ? (v & 15) : (v >> 4);
              uint8_t& out = dst[row + e / 2];
              out = uint8_t((out & (e % 2 == 0 ? 0xF0 : 0x0F)) | (code << (4 * (e % 2))));
            }
          }
        }
      }
    }
  }
}

// One panel's two-level scales (or biases), row form <-> panel form (K / 256 * 10 bytes a row). noipa:
// GCC 12 at -O3 (its loop peeling) dropped both calls from panel_layout's loop as if they had no
// effect, which left the new scales unwritten (tests/test_cpu_panels.py checks the round trip).
__attribute__((noipa)) void scales_panel(const uint8_t* src, uint8_t* dst, int K, bool to_panels) {
  const size_t row_bytes = size_t(K) / 256 * kSuperBytes;
  for (int sb = 0; sb < K / 256; ++sb) {
    for (int r = 0; r < kPanelRows; ++r) {
      const size_t row = size_t(r) * row_bytes + size_t(sb) * kSuperBytes;
      const size_t pan = size_t(sb) * kPanelSuperBytes;
      // the float16 step, then the 8 multiples
      const size_t step_p = pan + size_t(r) * 2;
      if (to_panels) {
        std::memcpy(dst + step_p, src + row, 2);
      } else {
        std::memcpy(dst + row, src + step_p, 2);
      }
      for (int j = 0; j < kSuperGroups; ++j) {
        const size_t mp = pan + 2 * kPanelRows + size_t(j) * kPanelRows + r;
        if (to_panels) {
          dst[mp] = src[row + 2 + j];
        } else {
          dst[row + 2 + j] = src[mp];
        }
      }
    }
  }
}

template <typename Fn>
void each_panel(int panels, Fn&& fn) {
  auto pool = shared_pool();
  const int tasks = panels < 64 ? 1 : pool->size();
  pool->run(tasks, [&](int t) {
    const int p1 = int(int64_t(panels) * (t + 1) / tasks);
    for (int p = int(int64_t(panels) * t / tasks); p < p1; ++p) {
      fn(p);
    }
  });
}

} // namespace

bool is_panel_form(const mx::array& w, const mx::array& scales, int group_size, int bits) {
  return bits == 4 && group_size == 32 && scales.dtype() == mx::uint8 && scales.ndim() == 2 && w.ndim() == 2 &&
      int64_t(scales.shape(0)) * kPanelRows == w.shape(0);
}

std::tuple<mx::array, mx::array, mx::array> panel_layout(const mx::array& w, const mx::array& scales, const mx::array& biases, bool to_panels) {
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || scales.dtype() != mx::uint8 || biases.dtype() != mx::uint8 ||
      scales.ndim() != 2 || biases.shape() != scales.shape()) {
    throw std::invalid_argument("panel_layout takes a 4-bit layer with two-level (uint8) scales and biases");
  }
  const int N = w.shape(0);
  const int K = w.shape(1) * 8;
  const int rows = to_panels ? N : N / kPanelRows; // the scales' rows in the form given
  const size_t row_scale_bytes = size_t(K) / 256 * kSuperBytes;
  if (N % kPanelRows != 0 || K % 256 != 0 || scales.shape(0) != rows ||
      size_t(scales.shape(1)) != row_scale_bytes * (to_panels ? 1 : kPanelRows)) {
    throw std::invalid_argument(
        "panel_layout needs N a multiple of 16, K of 256, and scales (N, K / 256 * 10) (to panels) or (N / 16, "
        "K / 16 * 10) (back)");
  }
  mx::array wc = w, sc = scales, bc = biases;
  if (!wc.is_available() || !sc.is_available() || !bc.is_available()) { // not inside a primitive's eval
    mx::eval({wc, sc, bc});
  }
  const DenseBytes wd = dense_bytes(wc), sd = dense_bytes(sc), bd = dense_bytes(bc);
  const size_t panel_codes = size_t(kPanelRows) * K / 2;
  const size_t panel_scales = size_t(kPanelRows) * row_scale_bytes;
  const mx::Shape sshape = to_panels ? mx::Shape{N / kPanelRows, int(panel_scales)} : mx::Shape{N, int(row_scale_bytes)};
  mx::array wo(mx::allocator::malloc(w.nbytes()), w.shape(), mx::uint32);
  mx::array so(mx::allocator::malloc(scales.nbytes()), sshape, mx::uint8);
  mx::array bo(mx::allocator::malloc(biases.nbytes()), sshape, mx::uint8);
  uint8_t* wdst = reinterpret_cast<uint8_t*>(wo.data<uint32_t>());
  uint8_t* sdst = so.data<uint8_t>();
  uint8_t* bdst = bo.data<uint8_t>();
  if (!to_panels) {
    std::memset(wdst, 0, w.nbytes()); // the row form is written a nibble at a time
  }
  const auto* wsrc = static_cast<const uint8_t*>(wd.data);
  const auto* ssrc = static_cast<const uint8_t*>(sd.data);
  const auto* bsrc = static_cast<const uint8_t*>(bd.data);
  each_panel(N / kPanelRows, [&](int p) {
    codes_panel(wsrc + p * panel_codes, wdst + p * panel_codes, K, to_panels);
    scales_panel(ssrc + p * panel_scales, sdst + p * panel_scales, K, to_panels);
    scales_panel(bsrc + p * panel_scales, bdst + p * panel_scales, K, to_panels);
  });
  return {wo, so, bo};
}

bool panel_kernel_available() {
#if defined(DUET_X86)
  return q8_gemm_fn() != nullptr; // the AVX-512 VNNI variant is the one in force
#else
  return false;
#endif
}

void run_panels(const void* x, mx::Dtype t, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int M, int N, int K) {
#if defined(DUET_X86)
  const int G = K / 32;
  std::vector<int8_t> xq(size_t(M) * K);
  std::vector<float> xunit(size_t(M) * (K / 8));
  std::vector<float> xsum(size_t(M) * G);
  auto pool = shared_pool();
  const Q8QuantizeFn q8 = q8_quantize_fn();
  // x's rows quantized in element order (on the pool when there are several)
  const int qtasks = std::min(M, pool->size());
  auto quantize = [&](int task) {
    std::vector<float> row(static_cast<size_t>(K));
    const int m1 = int(int64_t(M) * (task + 1) / qtasks);
    for (int m = int(int64_t(M) * task / qtasks); m < m1; ++m) {
      q8_gemm_row(q8, x, t, size_t(m) * K, 1, K, 32, row.data(), xq.data() + size_t(m) * K, xunit.data() + size_t(m) * (K / 8), xsum.data() + size_t(m) * G);
    }
  };
  if (qtasks <= 1) {
    quantize(0);
  } else {
    pool->run(qtasks, quantize);
  }
  const PanelArgs a{xq.data(), xunit.data(), xsum.data(), w, scales, biases, y, M, N, K};
  const int panels = N / kPanelRows;
  const int tasks = std::min(panels, task_count(size_t(N) * K / 2, M, pool->size()));
  if (tasks <= 1) {
    avx512::q8_panels(a, 0, panels);
    return;
  }
  pool->run(tasks, [&](int task) {
    const int p0 = int(int64_t(panels) * task / tasks), p1 = int(int64_t(panels) * (task + 1) / tasks);
    if (p0 < p1) {
      avx512::q8_panels(a, p0, p1);
    }
  });
#else
  (void)x, (void)t, (void)w, (void)scales, (void)biases, (void)y, (void)M, (void)N, (void)K;
  throw std::logic_error("the int8 panel kernel needs x86-64");
#endif
}

} // namespace duet_cpu
