// Quantized matrix product kernels over MLX's affine layout, compiled once per instruction set.
//
// This header is included by the per-ISA translation units (kernels_<isa>.cpp), which must not
// include MLX or other headers with inline code: a function compiled with AVX-512 flags must never
// be picked by the linker for a CPU without AVX-512.
#pragma once

#include <cstddef>
#include <cstdint>

namespace duet_cpu {

enum ScaleType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

struct QmmArgs {
  const float* x; // (M, K) float32; for bits == 4 each run of 32 is stored evens first, then odds
  const float* xsum; // (M, K / group_size): sum of x over each group
  const uint8_t* w; // (N, K * bits / 8) bytes, a little-endian bitstream per row
  const void* scales; // (N, K / group_size) of scale_type
  const void* biases; // (N, K / group_size) of scale_type
  float* y; // (M, N)
  int M;
  int N;
  int K;
  int group_size;
  int bits;
  int scale_type;
};

// qmm_rows: y[:, n0:n1] for every row of x. dequant_rows: rows n0..n1 of the dequantized weights
// into out (N, K) float32 (x, xsum, y and M unused). Each ISA namespace defines both.
namespace base {
void qmm_rows(const QmmArgs& a, int n0, int n1);
void dequant_rows(const QmmArgs& a, int n0, int n1, float* out);
}
namespace avx2 {
void qmm_rows(const QmmArgs& a, int n0, int n1);
void dequant_rows(const QmmArgs& a, int n0, int n1, float* out);
}
namespace avx512 {
void qmm_rows(const QmmArgs& a, int n0, int n1);
void dequant_rows(const QmmArgs& a, int n0, int n1, float* out);
}

} // namespace duet_cpu
