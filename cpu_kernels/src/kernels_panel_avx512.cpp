// The int8 panel kernel (panels.h): int8 rows of x times Q4_K (q8_panels) or Q6_K (q6_panels) weights
// in 16-row panels, AVX-512 VNNI.
//
// Per group of 32 values and panel, four 64-byte loads give 16 rows x 8 values each (two nibbles a
// byte); each row of x then takes 8 vpdpbusd with 4 of its int8 values broadcast to every lane, and
// 16 int32 sums (one per weight row) are exact for the group. They become float once per group:
// y += sum * (scale * d) + bias * xsum, 16 rows at once, where a row at a time needs a horizontal sum
// per row. The codes are unpacked once per tile of up to 8 rows of x. One thread, a 1B model's
// matrices from L3 (cpu_kernels/panels.py): one row of x 71-77 GMAC/s (the row kernel 35), 8-16 rows
// 130-147 (62-67), 64 rows 128-133 (the int8 GEMM 107-110). Exact math sends each row of x as three
// int8 planes (panels.cpp: run_panels_x3), so one row of x in decode is a tile of three. Q6_K's
// groups of 16 join their codes from two nibble steps and a step of top bits (codes6), and start their
// int32 sums from -32 times the group's sum of x (the bias term, in integers).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels.h"
#include "panels.h"

namespace duet_cpu {
namespace avx512 {
namespace {

constexpr int kTileRows = 8; // rows of x per pass over a panel: 8 int32 and 8 float accumulators
constexpr int kAhead = 3072; // bytes of codes prefetched ahead for up to three rows of x (decode)

// 16 rows' scales of group j of a super-block: step * multiple in float32 (exact, as the row form's);
// the multiples uint8 (Q4_K) or int8 (Q6_K)
template <bool Signed = false>
inline __m512 group_scales(const uint8_t* block, __m512 steps, int j) {
  const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 * kPanelRows + j * kPanelRows));
  return _mm512_mul_ps(steps, _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(m) : _mm512_cvtepu8_epi32(m)));
}

// A tile's outputs: row m0 + m of y, the panel's 16 columns, from acc[m]
template <int MT>
inline void store_tile(const PanelArgs& a, int p, int m0, const __m512* acc) {
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(a.y + size_t(m0 + m) * a.N + size_t(p) * kPanelRows, acc[m]);
  }
}

inline __m512 block_steps(const uint8_t* block) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
}

template <int MT>
void panel_tile(const PanelArgs& a, int p, int m0) {
  const int K = a.K;
  const int G = K / 32;
  const size_t sb_bytes = size_t(kPanelRows) * kSuperBytes;
  const uint8_t* wp = a.w + size_t(p) * kPanelRows * (K / 2);
  const uint8_t* sp = a.scales + size_t(p) * sb_bytes * (K / 256);
  const uint8_t* bp = a.biases + size_t(p) * sb_bytes * (K / 256);
  const __m512i low4 = _mm512_set1_epi8(15);
  const int8_t* xq[MT];
  const float* xd[MT];
  const float* xs[MT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    xq[m] = a.xq + size_t(m0 + m) * K;
    xd[m] = a.xd + size_t(m0 + m) * (K / 8);
    xs[m] = a.xsum + size_t(m0 + m) * G;
  }
  __m512 acc[MT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm512_setzero_ps();
  }
  for (int sb = 0; sb < K / 256; ++sb) {
    const uint8_t* sblock = sp + size_t(sb) * sb_bytes;
    const uint8_t* bblock = bp + size_t(sb) * sb_bytes;
    const __m512 ssteps = block_steps(sblock);
    const __m512 bsteps = block_steps(bblock);
    for (int j = 0; j < kSuperGroups; ++j) {
      const int g = sb * kSuperGroups + j;
      const uint8_t* wg = wp + size_t(g) * 256;
      if constexpr (MT <= 3) { // decode: one or two rows of x, or one row's three planes (exact math)
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead + 64 * l), _MM_HINT_T0);
        }
      }
      // few rows of x: two chains of vpdpbusd per row (low and high nibbles), else the chains' latency
      // (8 in a row per group) bounds the tile
      constexpr int C = MT <= 4 ? 2 : 1;
      __m512i ia[MT], ib[MT];
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        ia[m] = _mm512_setzero_si512();
        ib[m] = _mm512_setzero_si512();
      }
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m512i raw = _mm512_loadu_si512(wg + s * 64);
        const __m512i lo = _mm512_and_si512(raw, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const int8_t* x = xq[m] + size_t(g) * 32 + s * 8;
          int32_t x0, x1;
          __builtin_memcpy(&x0, x, 4);
          __builtin_memcpy(&x1, x + 4, 4);
          ia[m] = _mm512_dpbusd_epi32(ia[m], lo, _mm512_set1_epi32(x0));
          if constexpr (C == 2) {
            ib[m] = _mm512_dpbusd_epi32(ib[m], hi, _mm512_set1_epi32(x1));
          } else {
            ia[m] = _mm512_dpbusd_epi32(ia[m], hi, _mm512_set1_epi32(x1));
          }
        }
      }
      if constexpr (C == 2) {
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          ia[m] = _mm512_add_epi32(ia[m], ib[m]);
        }
      }
      const __m512 sc = group_scales(sblock, ssteps, j);
      const __m512 bi = group_scales(bblock, bsteps, j);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m512 u = _mm512_mul_ps(sc, _mm512_set1_ps(xd[m][size_t(g) * 4]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m]), u, acc[m]);
        acc[m] = _mm512_fmadd_ps(bi, _mm512_set1_ps(xs[m][g]), acc[m]);
      }
    }
  }
  store_tile<MT>(a, p, m0, acc);
}

// Q6_K: the codes of group g (16 values) of a panel, as four vectors of 16 rows x 4 values (vector k
// holding values g*16 + 4k + b at row r's byte 4r + b): two nibble steps, one of top bits (panels.h).
struct Codes6 {
  __m512i c[4];
};

inline Codes6 codes6(const uint8_t* wg) {
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i top2 = _mm512_set1_epi8(0x30);
  const __m512i n0 = _mm512_loadu_si512(wg);
  const __m512i n1 = _mm512_loadu_si512(wg + 64);
  const __m512i h = _mm512_loadu_si512(wg + 128);
  // a | (b & 0x30) in one ternary-logic op: 0xF8 = A | (B & C)
  const auto join = [&](__m512i nibble, __m512i top) {
    return _mm512_ternarylogic_epi32(_mm512_and_si512(nibble, low4), top, top2, 0xF8);
  };
  // 16-bit shifts move bits across the two bytes of a lane; the masks keep each byte's own
  return {{join(n0, _mm512_slli_epi16(h, 4)),
           join(_mm512_srli_epi16(n0, 4), _mm512_slli_epi16(h, 2)),
           join(n1, h),
           join(_mm512_srli_epi16(n1, 4), _mm512_srli_epi16(h, 2))}};
}

// Q6_K (kSuper16, groups of 16): per group, the 16 rows' int32 dot products start from the group's
// offset (-32 times its sum of x, PanelArgs::xoff), so they are those of the codes less 32, exact; then
// y += sum * (step * multiple * d) for 16 rows at once. A group is 192 bytes of codes (three loads).
template <int MT>
void panel6_tile(const PanelArgs& a, int p, int m0) {
  const int K = a.K;
  const int G = K / 16;
  const size_t sb_bytes = size_t(kPanelRows) * kSuper16Bytes; // 288
  const uint8_t* wp = a.w + size_t(p) * kPanelRows * (size_t(K) * 3 / 4);
  const uint8_t* sp = a.scales + size_t(p) * sb_bytes * (K / 256);
  const int8_t* xq[MT];
  const float* xd[MT];
  const int32_t* xo[MT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    xq[m] = a.xq + size_t(m0 + m) * K;
    xd[m] = a.xd + size_t(m0 + m) * (K / 8);
    xo[m] = a.xoff + size_t(m0 + m) * G;
  }
  __m512 acc[MT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm512_setzero_ps();
  }
  for (int sb = 0; sb < K / 256; ++sb) {
    const uint8_t* sblock = sp + size_t(sb) * sb_bytes;
    const __m512 steps = block_steps(sblock);
    for (int j = 0; j < kSuper16Groups; ++j) {
      const int g = sb * kSuper16Groups + j;
      const uint8_t* wg = wp + size_t(g) * 192;
      if constexpr (MT <= 3) { // decode (exact math: one row's three planes)
#pragma GCC unroll 3
        for (int l = 0; l < 3; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead + 64 * l), _MM_HINT_T0);
        }
      }
      const Codes6 c = codes6(wg);
      __m512i ia[MT];
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        ia[m] = _mm512_set1_epi32(xo[m][g]);
      }
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          int32_t x4;
          __builtin_memcpy(&x4, xq[m] + size_t(g) * 16 + 4 * k, 4);
          ia[m] = _mm512_dpbusd_epi32(ia[m], c.c[k], _mm512_set1_epi32(x4));
        }
      }
      const __m512 sc = group_scales<true>(sblock, steps, j);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) { // x's run of 32 holds groups 2i and 2i + 1
        const __m512 u = _mm512_mul_ps(sc, _mm512_set1_ps(xd[m][size_t(g / 2) * 4]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m]), u, acc[m]);
      }
    }
  }
  store_tile<MT>(a, p, m0, acc);
}

// A tile of MT rows of x against panel p in the format's kernel (Bits 4: Q4_K, 6: Q6_K)
template <int Bits, int MT>
inline void tile(const PanelArgs& a, int p, int m0) {
  if constexpr (Bits == 6) {
    panel6_tile<MT>(a, p, m0);
  } else {
    panel_tile<MT>(a, p, m0);
  }
}

// The last rows of x (fewer than a tile), with the tile that holds exactly them.
template <int Bits, int MT>
void rest(const PanelArgs& a, int p, int m0, int rows) {
  if (rows == MT) {
    tile<Bits, MT>(a, p, m0);
  } else if constexpr (MT > 1) {
    rest<Bits, MT - 1>(a, p, m0, rows);
  }
}

template <int Bits>
void panels(const PanelArgs& a, int p0, int p1) {
  for (int p = p0; p < p1; ++p) {
    int m0 = 0;
    for (; m0 + kTileRows <= a.M; m0 += kTileRows) {
      tile<Bits, kTileRows>(a, p, m0);
    }
    if (m0 < a.M) {
      rest<Bits, kTileRows - 1>(a, p, m0, a.M - m0);
    }
  }
}

} // namespace

void q8_panels(const PanelArgs& a, int p0, int p1) {
  panels<4>(a, p0, p1);
}

void q6_panels(const PanelArgs& a, int p0, int p1) {
  panels<6>(a, p0, p1);
}

} // namespace avx512
} // namespace duet_cpu
