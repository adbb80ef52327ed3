// The int8 ("cpu_math int8") quantized matrix product for many rows of x (prefill, big batches), for
// AVX-512 VNNI: a register-blocked GEMM on packed panels, where the row kernel (int8_impl.inc) would
// unpack every weight once per few rows of x and the float path dequantizes the whole matrix for a
// float32 GEMM.
//
// The same numbers as the row kernel: x quantized per run of 32 to int8 with one scale d (q8_quantize,
// element order), and
//
//   y[m, n] = sum_r s[n, g(r)] * d[m, r] * dot(codes[n, r], q[m, r]) + sum_g b[n, g] * xsum[m, g].
//
// Blocking: a thread takes panels of kNB = 32 weight rows; for each stretch of kKC values of K the
// panel's codes are unpacked once into an L1-resident buffer laid out for vpdpbusd (for each run of
// four values of K, 32 lanes of four bytes: two registers, the codes of 32 rows side by side), with
// the panel's scales and biases as float lanes, and then every row of x streams past it, four rows at a
// time: per run of 32, 8 x 2 register loads of codes, 4 x 8 broadcasts of four bytes of x and 64
// vpdpbusd into 8 int32 accumulators, which are converted and scaled once per run into 8 float
// accumulators. The unpacking costs once per panel what the row kernel pays once per row of x.
//
// kernels_impl.inc contributes its helpers only (scale_at), as in kernels_int8_avx512.cpp.
#define DUET_ISA avx512
#define DUET_MAX_MB 8
#define DUET_HELPERS_ONLY
#include "kernels_impl.inc"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

// Rows of x per micro-kernel call: 4 (8 int32 + 8 float accumulators). 5 measured the same and 6
// slower (register spills): 512 x 8192 x 2048 4-bit, 2 threads, 38.7 / 38.8 / 42.6 ms.
#ifndef DUET_GEMM_MB
#define DUET_GEMM_MB 4
#endif

namespace duet_cpu {
namespace avx512 {
namespace {

constexpr int kNB = 32; // weight rows per panel: two registers of 16 int32 lanes
constexpr int kKC = 512; // values of K per panel stretch (16 runs; a multiple of every group size)
constexpr int kMB = DUET_GEMM_MB; // rows of x per micro-kernel call

// The codes of one weight row for K values [k0, k0 + kc) into out (one byte each, element order).
inline void row_codes(const uint8_t* row, int bits, int k0, int kc, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, row + k0, size_t(kc));
    return;
  }
  if (bits == 5 || bits == 6) { // 4 * bits bytes per run of 32 (kc and k0 are whole runs)
    for (int j = 0; j < kc; j += 32) {
      const uint8_t* p = row + size_t(k0 + j) * bits / 8;
      const __m256i v = bits == 5 ? unpack32_u8<5>(p, std::make_index_sequence<32>{}) : unpack32_u8<6>(p, std::make_index_sequence<32>{});
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), v);
    }
    return;
  }
  // 4-bit: byte j holds values 2j (low nibble) and 2j + 1 (high); kc is a multiple of 32. 32 bytes
  // widened to 16-bit words, each word's high nibble moved up to its high byte: 64 codes in order
  const uint8_t* p = row + k0 / 2;
  int j = 0;
  for (; j + 32 <= kc / 2; j += 32) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j)));
    // (w | w << 4) & 0x0F0F: the low nibble stays in byte 0, the high one lands in byte 1
    _mm512_storeu_si512(out + 2 * j, _mm512_ternarylogic_epi32(w, _mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x0F0F), 0xA8));
  }
  const __m128i low4 = _mm_set1_epi8(15);
  for (; j < kc / 2; j += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j));
    const __m128i lo = _mm_and_si128(b, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * j), _mm_unpacklo_epi8(lo, hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * j + 16), _mm_unpackhi_epi8(lo, hi));
  }
}

// A panel: rows [n, n + rows) of the weights over K values [k0, k0 + kc), as codes (for quad q and
// lane l, the four codes of row n + l at values 4q..4q + 3) and, per run (per half run in groups of
// 16: Q6_K's) and per group, the rows' scales and biases as float lanes. Lanes past `rows` are zero.
struct Panel {
  alignas(64) uint32_t codes[kKC / 4 * kNB];
  alignas(64) float scales[kKC / 16 * kNB];
  alignas(64) float biases[kKC / 16 * kNB];
  // each row's codes (one byte each), run scales and group biases, before the transposes
  alignas(64) uint8_t rows[kNB][kKC];
  alignas(64) float row_scales[kNB][kKC / 16];
  alignas(64) float row_biases[kNB][kKC / 16];
};

// Transposes a 16 x 16 block of int32 (r[i] row i) in registers: afterwards r[k] holds column
// swap01(k), k with its two low bits swapped (the shuffles' order).
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    for (int k = 0; k < 2; ++k) {
      u[4 * i + k] = _mm512_unpacklo_epi64(t[4 * i + k], t[4 * i + 2 + k]);
      u[4 * i + 2 + k] = _mm512_unpackhi_epi64(t[4 * i + k], t[4 * i + 2 + k]);
    }
  }
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) {
      v[8 * i + k] = _mm512_shuffle_i32x4(u[8 * i + k], u[8 * i + 4 + k], 0x88);
      v[8 * i + 4 + k] = _mm512_shuffle_i32x4(u[8 * i + k], u[8 * i + 4 + k], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(v[k], v[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(v[k], v[8 + k], 0xdd);
  }
}

constexpr int swap01(int k) {
  return (k & ~3) | ((k & 1) << 1) | ((k & 2) >> 1);
}

// src's rows [0, kNB) of cols 4-byte values each (row stride `stride` values) into dst column-major:
// dst[c * kNB + l] = src[l][c], by 16 x 16 blocks transposed in registers. A last partial block
// reads up to 16 values of each row (within its buffer) and stores only its cols.
inline void transpose_panel(const uint32_t* src, int stride, int cols, uint32_t* dst) {
  for (int l0 = 0; l0 < kNB; l0 += 16) {
    for (int c0 = 0; c0 < cols; c0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = _mm512_load_si512(src + size_t(l0 + i) * stride + c0);
      }
      transpose16(r);
      const int n_c = std::min(16, cols - c0);
      for (int j = 0; j < n_c; ++j) {
        _mm512_store_si512(dst + size_t(c0 + j) * kNB + l0, r[swap01(j)]);
      }
    }
  }
}

template <int ST>
void pack(const Q8GemmArgs& a, int n, int rows, int k0, int kc, Panel& p) {
  const size_t row_bytes = size_t(a.K) * a.bits / 8;
  const int G = a.K / a.group_size;
  const int runs = kc / 32, quads = kc / 4, groups = kc / a.group_size, g0 = k0 / a.group_size;
  const int parts = a.group_size == 16 ? 2 : 1; // scales per run
  const int per_group = a.group_size * parts / 32; // runs (half runs) a group spans
  for (int l = 0; l < kNB; ++l) {
    float* scale = p.row_scales[l];
    float* bias = p.row_biases[l];
    if (l >= rows) {
      std::memset(p.rows[l], 0, size_t(kc));
      std::memset(scale, 0, sizeof(p.row_scales[l]));
      std::memset(bias, 0, sizeof(p.row_biases[l]));
      continue;
    }
    row_codes(a.w + size_t(n + l) * row_bytes, a.bits, k0, kc, p.rows[l]);
    // the row's group scales and biases, 16 groups at a time where there are (whole super-blocks:
    // at is a multiple of 16), then (groups of 64 or more) each run's from its group's
    const size_t at = size_t(n + l) * G + g0;
    int g = 0;
    for (; g + 16 <= groups; g += 16) {
      const __m512 s = (__m512)load_scales16<ST>(a.scales, at + g);
      _mm512_store_ps(scale + g, s);
      _mm512_store_ps(
          bias + g,
          a.biases != nullptr ? (__m512)load_scales16<ST>(a.biases, at + g) : _mm512_mul_ps(s, _mm512_set1_ps(a.bias_ratio)));
    }
    for (; g < groups; ++g) {
      scale[g] = scale_at<ST>(a.scales, at + g);
      bias[g] = bias_at<ST>(a.biases, a.scales, a.bias_ratio, at + g);
    }
    if (per_group > 1) {
      for (int r = runs * parts - 1; r >= 0; --r) { // in place, from the end
        scale[r] = scale[r / per_group];
      }
    }
  }
  // codes[q * kNB + l] = the four codes of row l at values 4q..4q + 3, scales[r * kNB + l] and
  // biases[g * kNB + l] likewise: transposed in registers (a scalar store per four codes, and an
  // integer division per scale, cost as much as the rows' products at 16 rows of x)
  transpose_panel(reinterpret_cast<const uint32_t*>(p.rows), kKC / 4, quads, p.codes);
  transpose_panel(reinterpret_cast<const uint32_t*>(p.row_scales), kKC / 16, runs * parts, reinterpret_cast<uint32_t*>(p.scales));
  transpose_panel(reinterpret_cast<const uint32_t*>(p.row_biases), kKC / 16, groups, reinterpret_cast<uint32_t*>(p.biases));
}

// Fetches into L2 the codes of rows [n, n + rows) over K values [k0, k0 + kc), the panel packed next,
// while the rows of x stream past the current one: each row's stretch is a short run of lines the
// hardware prefetchers do not see coming (rows are K * bits / 8 bytes apart). Spreading the lines over
// the micro-kernel calls instead measured slower at 8 and 16 rows of x.
void prefetch_stretch(const Q8GemmArgs& a, int n, int rows, int k0, int kc) {
  const size_t row_bytes = size_t(a.K) * a.bits / 8;
  const size_t first = size_t(k0) * a.bits / 8;
  const size_t bytes = size_t(kc) * a.bits / 8;
  for (int l = 0; l < rows; ++l) {
    const char* row = reinterpret_cast<const char*>(a.w + size_t(n + l) * row_bytes + first);
    for (size_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(row + b, _MM_HINT_T1);
    }
  }
}

// y[m..m+R, n..n+rows) += the panel's part of the product, for R rows of x. HALF: groups of 16 (Q6_K),
// each half run's dot products scaled on their own.
template <int R, bool HALF>
void micro(const Q8GemmArgs& a, const Panel& p, int m, int k0, int kc, int n, __mmask16 mask0, __mmask16 mask1) {
  const int runs = kc / 32, groups = kc / a.group_size;
  const int G = a.K / a.group_size;
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) {
    acc[i][0] = _mm512_setzero_ps();
    acc[i][1] = _mm512_setzero_ps();
  }
  const int8_t* xrow[R];
  const float* drow[R];
  for (int i = 0; i < R; ++i) {
    xrow[i] = a.xq + size_t(m + i) * a.K + k0;
    drow[i] = a.xd + size_t(m + i) * (a.K / 8) + k0 / 8;
  }
  for (int r = 0; r < runs; ++r) {
    __m512i dot[R][2];
    for (int i = 0; i < R; ++i) {
      dot[i][0] = _mm512_setzero_si512();
      dot[i][1] = _mm512_setzero_si512();
    }
    const uint32_t* codes = p.codes + size_t(r) * 8 * kNB;
    // the dot products so far times scale set `at` (a run's, or with HALF a half run's)
    const auto scale_in = [&](int at) __attribute__((always_inline)) {
      const __m512 s0 = _mm512_load_ps(p.scales + at * kNB);
      const __m512 s1 = _mm512_load_ps(p.scales + at * kNB + 16);
      for (int i = 0; i < R; ++i) {
        const __m512 d = _mm512_set1_ps(drow[i][r * 4]);
        acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][0]), _mm512_mul_ps(s0, d), acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][1]), _mm512_mul_ps(s1, d), acc[i][1]);
        dot[i][0] = _mm512_setzero_si512();
        dot[i][1] = _mm512_setzero_si512();
      }
    };
    for (int q = 0; q < 8; ++q) {
      const __m512i w0 = _mm512_load_si512(codes + q * kNB);
      const __m512i w1 = _mm512_load_si512(codes + q * kNB + 16);
      for (int i = 0; i < R; ++i) {
        int32_t four;
        std::memcpy(&four, xrow[i] + r * 32 + q * 4, sizeof(four));
        const __m512i xb = _mm512_set1_epi32(four);
        dot[i][0] = _mm512_dpbusd_epi32(dot[i][0], w0, xb);
        dot[i][1] = _mm512_dpbusd_epi32(dot[i][1], w1, xb);
      }
      if (HALF && q == 3) {
        scale_in(2 * r);
      }
    }
    scale_in(HALF ? 2 * r + 1 : r);
  }
  const int g0 = k0 / a.group_size;
  for (int g = 0; g < groups; ++g) {
    const __m512 b0 = _mm512_load_ps(p.biases + g * kNB);
    const __m512 b1 = _mm512_load_ps(p.biases + g * kNB + 16);
    for (int i = 0; i < R; ++i) {
      const __m512 xs = _mm512_set1_ps(a.xsum[size_t(m + i) * G + g0 + g]);
      acc[i][0] = _mm512_fmadd_ps(b0, xs, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(b1, xs, acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    float* y = a.y + size_t(m + i) * a.N + n;
    if (k0 == 0) {
      _mm512_mask_storeu_ps(y, mask0, acc[i][0]);
      _mm512_mask_storeu_ps(y + 16, mask1, acc[i][1]);
    } else {
      _mm512_mask_storeu_ps(y, mask0, _mm512_add_ps(_mm512_maskz_loadu_ps(mask0, y), acc[i][0]));
      _mm512_mask_storeu_ps(y + 16, mask1, _mm512_add_ps(_mm512_maskz_loadu_ps(mask1, y + 16), acc[i][1]));
    }
  }
}

template <int ST, bool HALF>
void gemm(const Q8GemmArgs& a, int n0, int n1) {
  static thread_local Panel panel;
  for (int n = n0; n < n1; n += kNB) {
    const int rows = std::min(kNB, n1 - n);
    const __mmask16 mask0 = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
    const __mmask16 mask1 = rows >= 32 ? __mmask16(0xFFFF) : rows <= 16 ? __mmask16(0) : __mmask16((1u << (rows - 16)) - 1);
    for (int k0 = 0; k0 < a.K; k0 += kKC) {
      const int kc = std::min(kKC, a.K - k0);
      pack<ST>(a, n, rows, k0, kc, panel);
      if (k0 + kKC < a.K) {
        prefetch_stretch(a, n, rows, k0 + kKC, std::min(kKC, a.K - k0 - kKC));
      } else if (n + kNB < n1) {
        prefetch_stretch(a, n + kNB, std::min(kNB, n1 - n - kNB), 0, std::min(kKC, a.K));
      }
      int m = 0;
      for (; m + kMB <= a.M; m += kMB) {
        micro<kMB, HALF>(a, panel, m, k0, kc, n, mask0, mask1);
      }
      switch (a.M - m) {
        case 5:
          micro<5, HALF>(a, panel, m, k0, kc, n, mask0, mask1);
          break;
        case 4:
          micro<4, HALF>(a, panel, m, k0, kc, n, mask0, mask1);
          break;
        case 3:
          micro<3, HALF>(a, panel, m, k0, kc, n, mask0, mask1);
          break;
        case 2:
          micro<2, HALF>(a, panel, m, k0, kc, n, mask0, mask1);
          break;
        case 1:
          micro<1, HALF>(a, panel, m, k0, kc, n, mask0, mask1);
          break;
        default:
          break;
      }
    }
  }
}

} // namespace

void q8_gemm(const Q8GemmArgs& a, int n0, int n1) {
  switch (a.scale_type) {
    case kSuper16: // Q6_K's (groups of 16)
      gemm<kSuper16, true>(a, n0, n1);
      break;
    case kSuper:
      gemm<kSuper, false>(a, n0, n1);
      break;
    case kF16:
      gemm<kF16, false>(a, n0, n1);
      break;
    case kBF16:
      gemm<kBF16, false>(a, n0, n1);
      break;
    default:
      gemm<kF32, false>(a, n0, n1);
      break;
  }
}

} // namespace avx512
} // namespace duet_cpu
