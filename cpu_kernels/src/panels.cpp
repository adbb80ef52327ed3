#include "panels.h"

#include <algorithm>
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
// GCC 12 at -O3 (its loop peeling) dropped both calls from the conversion's loop as if they had no
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
  if (bits != 4 || group_size != 32 || scales.dtype() != mx::uint8 || w.ndim() < 2 || scales.ndim() != w.ndim()) {
    return false;
  }
  for (int d = 0; d + 2 < w.ndim(); ++d) { // stacked experts: the same number of matrices
    if (scales.shape(d) != w.shape(d)) {
      return false;
    }
  }
  return int64_t(scales.shape(-2)) * kPanelRows == w.shape(-2);
}

void check_panel_shapes(const mx::array& scales, const mx::array& biases, int K) {
  if (K % 256 != 0 || scales.shape(-1) != K / 16 * kSuperBytes || biases.shape() != scales.shape()) {
    throw std::invalid_argument("a layer in 16-row panels needs K a multiple of 256 and scales and biases (..., N / 16, K / 16 * 10)");
  }
}

namespace {

// Every panel's codes, scales and biases, rows (all the matrices' rows, one after another) -> the
// other form; the outputs are fresh arrays. w, scales and biases must be evaluated.
std::tuple<mx::array, mx::array, mx::array> convert(const mx::array& w, const mx::array& scales, const mx::array& biases, bool to_panels) {
  const int rows = int(w.size() / size_t(w.shape(-1))); // every matrix's rows
  const int K = w.shape(-1) * 8;
  const size_t row_scale_bytes = size_t(K) / 256 * kSuperBytes;
  const size_t panel_codes = size_t(kPanelRows) * K / 2;
  const size_t panel_scales = size_t(kPanelRows) * row_scale_bytes;
  mx::Shape sshape = w.shape();
  sshape.back() = int(to_panels ? panel_scales : row_scale_bytes);
  sshape[sshape.size() - 2] = to_panels ? w.shape(-2) / kPanelRows : w.shape(-2);
  mx::array wo(mx::allocator::malloc(w.nbytes()), w.shape(), mx::uint32);
  mx::array so(mx::allocator::malloc(scales.nbytes()), sshape, mx::uint8);
  mx::array bo(mx::allocator::malloc(biases.nbytes()), sshape, mx::uint8);
  const DenseBytes wd = dense_bytes(w), sd = dense_bytes(scales), bd = dense_bytes(biases);
  const auto* wsrc = static_cast<const uint8_t*>(wd.data);
  const auto* ssrc = static_cast<const uint8_t*>(sd.data);
  const auto* bsrc = static_cast<const uint8_t*>(bd.data);
  uint8_t* wdst = reinterpret_cast<uint8_t*>(wo.data<uint32_t>());
  uint8_t* sdst = so.data<uint8_t>();
  uint8_t* bdst = bo.data<uint8_t>();
  if (!to_panels) {
    std::memset(wdst, 0, w.nbytes()); // the row form is written a nibble at a time
  }
  each_panel(rows / kPanelRows, [&](int p) {
    codes_panel(wsrc + p * panel_codes, wdst + p * panel_codes, K, to_panels);
    scales_panel(ssrc + p * panel_scales, sdst + p * panel_scales, K, to_panels);
    scales_panel(bsrc + p * panel_scales, bdst + p * panel_scales, K, to_panels);
  });
  return {wo, so, bo};
}

} // namespace

std::tuple<mx::array, mx::array, mx::array> panel_layout(const mx::array& w, const mx::array& scales, const mx::array& biases, bool to_panels) {
  if (w.dtype() != mx::uint32 || w.ndim() < 2 || scales.dtype() != mx::uint8 || biases.dtype() != mx::uint8 ||
      scales.ndim() != w.ndim() || biases.shape() != scales.shape()) {
    throw std::invalid_argument("panel_layout takes a 4-bit layer with two-level (uint8) scales and biases");
  }
  const int N = w.shape(-2);
  const int K = w.shape(-1) * 8;
  mx::Shape expected = w.shape(); // the scales' shape in the form given
  expected[expected.size() - 2] = to_panels ? N : N / kPanelRows;
  expected.back() = int(size_t(K) / 256 * kSuperBytes * (to_panels ? 1 : kPanelRows));
  if (N % kPanelRows != 0 || K % 256 != 0 || scales.shape() != expected) {
    throw std::invalid_argument(
        "panel_layout needs N a multiple of 16, K of 256, and scales (..., N, K / 256 * 10) (to panels) or (..., "
        "N / 16, K / 16 * 10) (back)");
  }
  mx::array wc = w, sc = scales, bc = biases;
  mx::eval({wc, sc, bc});
  return convert(wc, sc, bc, to_panels);
}

std::tuple<mx::array, mx::array, mx::array> row_form(const mx::array& w, const mx::array& scales, const mx::array& biases) {
  return convert(w, scales, biases, false);
}

bool panel_kernel_available() {
#if defined(DUET_X86)
  return q8_gemm_fn() != nullptr; // the AVX-512 VNNI variant is the one in force
#else
  return false;
#endif
}

bool panel_kernel_runs(bool int8) {
  return panel_kernel_available() && (int8 || quantize_x_fn() != nullptr);
}

namespace {

// y (M, N) = M rows of x8 (quantize_rows_q8's or split_rows_x3's layout) times the panel-form layer,
// the panels split into tasks on the shared pool.
void panels_on_pool(const Q8Rows& x8, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int M, int N, int K) {
#if defined(DUET_X86)
  const PanelArgs a{x8.q.data(), x8.unit.data(), x8.sum.data(), w, scales, biases, y, M, N, K};
  auto pool = shared_pool();
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
  (void)x8, (void)w, (void)scales, (void)biases, (void)y, (void)M, (void)N, (void)K;
  throw std::logic_error("the int8 panel kernel needs x86-64");
#endif
}

} // namespace

void run_panels(const void* x, mx::Dtype t, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int M, int N, int K) {
  panels_on_pool(quantize_rows_q8(q8_quantize_fn(), x, t, row_starts(M, K), 1, K, 32), w, scales, biases, y, M, N, K);
}

void run_panels_x3(const void* x, mx::Dtype t, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int M, int N, int K) {
  x3_in_chunks(quantize_x_fn(), x, t, M, N, K, 32, 1, y, [&](const Q8Rows& x3, int rows, float* y3) {
    panels_on_pool(x3, w, scales, biases, y3, rows, N, K);
  });
}

void gather_panels(const GatherRows& g, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int E, int N, int K, bool int8) {
#if defined(DUET_X86)
  const int G = K / 32;
  const int sorted = g.start[E];
  const int U = int(g.unique.size());
  // each distinct row quantized once (element order; exact math: split into three planes, plane j of
  // distinct row u at row j * U + u), then each expert's rows side by side, plane after plane: expert
  // e's rows start at planes * start[e], plane j's count[e] rows at planes * start[e] + j * count[e]
  const int planes = int8 ? 1 : 3;
  const Q8Rows u8 = int8 ? quantize_rows_q8(q8_quantize_fn(), g.x, g.t, g.unique, g.kstep, K, 32)
                         : split_rows_x3(quantize_x_fn(), g.x, g.t, g.unique, g.kstep, K, 32);
  std::vector<int8_t> xq(size_t(planes) * sorted * K);
  std::vector<float> xd(size_t(planes) * sorted * (K / 8)), xs(size_t(planes) * sorted * G);
  for (int e = 0; e < E; ++e) {
    for (int j = 0; j < planes; ++j) {
      for (int i = 0; i < g.count[e]; ++i) {
        const size_t dst = size_t(planes) * g.start[e] + size_t(j) * g.count[e] + i;
        const size_t src = size_t(j) * U + g.source[g.order[g.start[e] + i]];
        std::memcpy(xq.data() + dst * K, u8.q.data() + src * K, size_t(K));
        std::memcpy(xd.data() + dst * (K / 8), u8.unit.data() + src * (K / 8), sizeof(float) * (K / 8));
        std::memcpy(xs.data() + dst * G, u8.sum.data() + src * G, sizeof(float) * G);
      }
    }
  }
  std::vector<float> y3(int8 ? 0 : size_t(3) * sorted * N); // exact math: the planes' products
  float* yp = int8 ? y : y3.data();
  // units of (expert, run of panels), claimed by the pool's threads as they come free
  struct Unit {
    int e, p0, p1;
  };
  auto pool = shared_pool();
  const int panels = N / kPanelRows;
  int active = 0;
  for (int e = 0; e < E; ++e) {
    active += g.count[e] > 0 ? 1 : 0;
  }
  const int per = std::max(1, std::min(8, active * panels / std::max(1, pool->size() * 4)));
  std::vector<Unit> units;
  for (int e = 0; e < E; ++e) {
    for (int p = 0; g.count[e] > 0 && p < panels; p += per) {
      units.push_back({e, p, std::min(panels, p + per)});
    }
  }
  const size_t expert_codes = size_t(N) * K / 2;
  const size_t expert_scales = size_t(N) / kPanelRows * (size_t(K) / 16 * kSuperBytes);
  pool->run(int(units.size()), [&](int i) {
    const Unit& u = units[size_t(i)];
    const size_t q0 = size_t(planes) * g.start[u.e];
    const PanelArgs a{
        xq.data() + q0 * K,
        xd.data() + q0 * (K / 8),
        xs.data() + q0 * G,
        w + u.e * expert_codes,
        scales + u.e * expert_scales,
        biases + u.e * expert_scales,
        yp + q0 * N,
        planes * g.count[u.e],
        N,
        K};
    avx512::q8_panels(a, u.p0, u.p1);
  });
  if (!int8) {
    for (int e = 0; e < E; ++e) {
      const size_t q0 = size_t(g.start[e]);
      sum_planes_x3(y3.data() + 3 * q0 * N, g.count[e], N, y + q0 * N);
    }
  }
#else
  (void)g, (void)w, (void)scales, (void)biases, (void)y, (void)E, (void)N, (void)K, (void)int8;
  throw std::logic_error("the int8 panel kernel needs x86-64");
#endif
}

} // namespace duet_cpu
