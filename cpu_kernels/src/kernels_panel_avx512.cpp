// The int8 panel kernel (panels.h): int8 rows of x times Q4_K (q8_panels), Q5_K (q5_panels) or Q6_K
// (q6_panels) weights in 16-row panels, AVX-512 VNNI.
//
// Per group of 32 values and panel, four 64-byte loads give 16 rows x 8 values each (two nibbles a
// byte); each row of x then takes 8 vpdpbusd with 4 of its int8 values broadcast to every lane, and
// 16 int32 sums (one per weight row) are exact for the group. They become float once per group:
// y += sum * (scale * d) + bias * xsum, 16 rows at once, where a row at a time needs a horizontal sum
// per row. The codes are unpacked once per tile of up to 8 rows of x (exact math: 2 rows, 6 planes). One thread, a 1B model's
// matrices from L3 (cpu_kernels/panels.py): one row of x 71-77 GMAC/s (the row kernel 35), 8-16 rows
// 130-147 (62-67), 64 rows 128-133 (the int8 GEMM 107-110). Exact math sends each row of x as three
// int8 planes (panels.cpp: run_panels), and the tile joins a row's three planes' int32 sums per group
// (Planes 3: exact in int32) before the float work, which is then done once a row, not once a plane
// (one row through a 1B model's layers 1.02x, 128 rows 1.07x, against scaling each plane's sums and
// adding the three products). Q5_K's codes are Q4_K's nibbles with a fifth bit joined from a fifth load
// per group (step_codes). Q6_K's
// groups of 16 join their codes from two nibble steps and a step of top bits (codes6), and start their
// int32 sums from -32 times the group's sum of x (the bias term, in integers).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "panels.h"

namespace duet_cpu {
namespace avx512 {
namespace {

constexpr int kTileRows = 8; // rows of x per pass over a panel: 8 int32 and 8 float accumulators
// rows of x per pass with exact math: each row's three planes (split_rows_planes) take 3 int32 accumulators.
// In-process A/B on a 1B model's 112 matrices, two threads, 16 and 128 rows of x: 2 rows a tile against
// 4 1.15x and 1.21x, against 3 1.03x and 1.04x; 5 rows 0.5x of 4 (the registers run out)
constexpr int kTileRowsX3 = 2;
// rows of x per pass with int16 math (each row's two planes)
#ifndef DUET_TILE_ROWS_X2
#define DUET_TILE_ROWS_X2 4
#endif
constexpr int kTileRowsX2 = DUET_TILE_ROWS_X2;

// Rows of x per pass over a panel for x in Planes int8 planes
template <int Planes>
constexpr int kRowsPerTile = Planes == 3 ? kTileRowsX3 : Planes == 2 ? kTileRowsX2 : kTileRows;

// A row's int32 sums of a group from its planes' (r: its first plane's accumulator): int8 math's own;
// exact math's three joined as split_rows_planes weighs them, s1 * 2^14 + s2 * 2^7 + s3, exact in int32:
// |s| <= 32 * 31 * 127 * (2^14 + 2^7 + 1) < 2^31 for codes up to 31 (Q6_K's groups of 16, codes less
// 32: 16 * 32 * 127 * (...)), and a partial sum that wraps does no harm (int32 addition is exact
// modulo 2^32); int16 math's two, s1 * 2^7 + s2
template <int Planes>
inline __m512i joined(const __m512i* ia, int r) {
  if constexpr (Planes == 3) {
    return _mm512_add_epi32(_mm512_slli_epi32(ia[r], 14), _mm512_add_epi32(_mm512_slli_epi32(ia[r + 1], 7), ia[r + 2]));
  } else if constexpr (Planes == 2) {
    return _mm512_add_epi32(_mm512_slli_epi32(ia[r], 7), ia[r + 1]);
  } else {
    return ia[r];
  }
}
constexpr int kAhead = 3072; // bytes of codes prefetched ahead for up to three rows of x (decode)

#include "panel_codes.inc"

// A tile's outputs: row m0 + m of y, the panel's 16 columns, from acc[m]
template <int MT>
inline void store_tile(const PanelArgs& a, int p, int m0, const __m512* acc) {
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(a.y + size_t(m0 + m) * a.N + size_t(p) * kPanelRows, acc[m]);
  }
}

// Many rows of x against Q5_K or Q6_K: each panel's codes are joined once (expand) into a buffer of
// bytes the tiles then load as they are, where each tile of 8 rows would join them again: per group of
// a panel, Q5_K 512 bytes (per step, its low codes' 64 bytes, then its high codes'), Q6_K 256 (codes6's
// four vectors). Two threads, int8 math, an 8192 x 2048 Q5_K matrix and a 2048 x 8192 Q6_K one from L3
// (in-process A/B, medians of 7): 512 rows of x 46 -> 42 ms and 59 -> 54; 64 rows 1.06x; 16 rows 0.85-0.9x
// (the buffer's writes not paid back). Q4_K's nibbles cost the tile nothing measurable to unpack (40.3
// against 40.3 ms at 512 rows: the tile is bound by vpdpbusd's port), so Q4_K never expands.
constexpr int kExpandRows = 48; // from this many rows of x

// Q4_K and Q5_K (kSuper, groups of 32): a group is 256 bytes of codes (four loads), Q5_K's 64 more of
// fifth bits; Expanded: the panel's codes as expand wrote them to ex. Planes 3 (exact math): x as
// split_rows_planes lays it out, plane j of row m at row j * a.M + m (units unit * 2^14, 2^7 and 1; x's
// group sums on plane 0), MT rows of x taking 3 * MT int32 accumulators.
template <int Bits, int MT, bool Expanded = false, int Planes = 1>
void panel_tile(const PanelArgs& a, int p, int m0, const uint8_t* ex = nullptr) {
  constexpr int R = MT * Planes; // int8 rows: plane j of row m at m * Planes + j
  constexpr int kGroupBytes = Expanded ? kExpandedGroup : Bits * 64;
  const int K = a.K;
  const int G = K / 32;
  const size_t sb_bytes = size_t(kPanelRows) * kSuperBytes;
  const uint8_t* wp = Expanded ? ex : a.w + size_t(p) * kPanelRows * (size_t(K) * Bits / 8);
  const uint8_t* sp = a.scales + size_t(p) * sb_bytes * (K / 256);
  const uint8_t* bp = a.biases + size_t(p) * sb_bytes * (K / 256);
  const int8_t* xq[R];
  const float* xd[MT];
  const float* xs[MT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
#pragma GCC unroll 3
    for (int j = 0; j < Planes; ++j) {
      xq[m * Planes + j] = a.xq + (size_t(j) * a.M + m0 + m) * K;
    }
    xd[m] = a.xd + (size_t(Planes - 1) * a.M + m0 + m) * (K / 8); // the last plane's: the unit
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
      const uint8_t* wg = wp + size_t(g) * kGroupBytes;
      if constexpr (R <= 3 && !Expanded) { // decode: one or two rows of x, or one row's three planes (exact math)
#pragma GCC unroll 5
        for (int l = 0; l < Bits; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead + 64 * l), _MM_HINT_T0);
        }
      }
      const __m512i top = Bits == 5 && !Expanded ? _mm512_loadu_si512(wg + 256) : _mm512_setzero_si512();
      // few rows of x: two chains of vpdpbusd per row (low and high nibbles), else the chains' latency
      // (8 in a row per group) bounds the tile
      constexpr int C = R <= 4 ? 2 : 1;
      __m512i ia[R], ib[R];
#pragma GCC unroll 12
      for (int m = 0; m < R; ++m) {
        ia[m] = _mm512_setzero_si512();
        ib[m] = _mm512_setzero_si512();
      }
      each_step([&]<int S>() {
        __m512i lo, hi;
        if constexpr (Expanded) {
          lo = _mm512_loadu_si512(wg + S * 128);
          hi = _mm512_loadu_si512(wg + S * 128 + 64);
        } else {
          step_codes<Bits, S>(wg, top, lo, hi);
        }
#pragma GCC unroll 12
        for (int m = 0; m < R; ++m) {
          const int8_t* x = xq[m] + size_t(g) * 32 + S * 8;
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
      });
      if constexpr (C == 2) {
#pragma GCC unroll 12
        for (int m = 0; m < R; ++m) {
          ia[m] = _mm512_add_epi32(ia[m], ib[m]);
        }
      }
      const __m512 sc = group_scales(sblock, ssteps, j);
      const __m512 bi = group_scales(bblock, bsteps, j);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m512 u = _mm512_mul_ps(sc, _mm512_set1_ps(xd[m][size_t(g) * 4]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined<Planes>(ia, m * Planes)), u, acc[m]);
        acc[m] = _mm512_fmadd_ps(bi, _mm512_set1_ps(xs[m][g]), acc[m]);
      }
    }
  }
  store_tile<MT>(a, p, m0, acc);
}

// Q6_K (kSuper16, groups of 16): per group, the 16 rows' int32 dot products start from the group's
// offset (-32 times its sum of x, PanelArgs::xoff), so they are those of the codes less 32, exact; then
// y += sum * (step * multiple * d) for 16 rows at once. A group is 192 bytes of codes (three loads).
// Planes 3: as panel_tile's (each plane's sums start from its own offsets, joined as its sums are).
template <int MT, bool Expanded = false, int Planes = 1>
void panel6_tile(const PanelArgs& a, int p, int m0, const uint8_t* ex = nullptr) {
  constexpr int R = MT * Planes;
  const int K = a.K;
  const int G = K / 16;
  const size_t sb_bytes = size_t(kPanelRows) * kSuper16Bytes; // 288
  const uint8_t* wp = Expanded ? ex : a.w + size_t(p) * kPanelRows * (size_t(K) * 3 / 4);
  const uint8_t* sp = a.scales + size_t(p) * sb_bytes * (K / 256);
  const int8_t* xq[R];
  const float* xd[MT];
  const int32_t* xo[R];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
#pragma GCC unroll 3
    for (int j = 0; j < Planes; ++j) {
      xq[m * Planes + j] = a.xq + (size_t(j) * a.M + m0 + m) * K;
      xo[m * Planes + j] = a.xoff + (size_t(j) * a.M + m0 + m) * G;
    }
    xd[m] = a.xd + (size_t(Planes - 1) * a.M + m0 + m) * (K / 8);
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
      const uint8_t* wg = wp + size_t(g) * (Expanded ? kExpandedGroup / 2 : 192);
      if constexpr (R <= 3 && !Expanded) { // decode (exact math: one row's three planes)
#pragma GCC unroll 3
        for (int l = 0; l < 3; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(wg + kAhead + 64 * l), _MM_HINT_T0);
        }
      }
      Codes6 c;
      if constexpr (Expanded) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          c.c[k] = _mm512_loadu_si512(wg + 64 * k);
        }
      } else {
        c = codes6(wg);
      }
      __m512i ia[R];
#pragma GCC unroll 12
      for (int m = 0; m < R; ++m) {
        ia[m] = _mm512_set1_epi32(xo[m][g]);
      }
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
#pragma GCC unroll 12
        for (int m = 0; m < R; ++m) {
          int32_t x4;
          __builtin_memcpy(&x4, xq[m] + size_t(g) * 16 + 4 * k, 4);
          ia[m] = _mm512_dpbusd_epi32(ia[m], c.c[k], _mm512_set1_epi32(x4));
        }
      }
      const __m512 sc = group_scales<true>(sblock, steps, j);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) { // x's run of 32 holds groups 2i and 2i + 1
        const __m512 u = _mm512_mul_ps(sc, _mm512_set1_ps(xd[m][size_t(g / 2) * 4]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined<Planes>(ia, m * Planes)), u, acc[m]);
      }
    }
  }
  store_tile<MT>(a, p, m0, acc);
}

// A tile of MT rows of x against panel p in the format's kernel (Bits 4: Q4_K, 5: Q5_K, 6: Q6_K), on
// the panel's codes as they are or expanded to ex, x in Planes int8 planes
template <int Bits, int MT, bool Expanded, int Planes>
inline void tile(const PanelArgs& a, int p, int m0, const uint8_t* ex) {
  if constexpr (Bits == 6) {
    panel6_tile<MT, Expanded, Planes>(a, p, m0, ex);
  } else {
    panel_tile<Bits, MT, Expanded, Planes>(a, p, m0, ex);
  }
}

// The last rows of x (fewer than a tile), with the tile that holds exactly them.
template <int Bits, int MT, bool Expanded, int Planes>
void rest(const PanelArgs& a, int p, int m0, int rows, const uint8_t* ex) {
  if (rows == MT) {
    tile<Bits, MT, Expanded, Planes>(a, p, m0, ex);
  } else if constexpr (MT > 1) {
    rest<Bits, MT - 1, Expanded, Planes>(a, p, m0, rows, ex);
  }
}

template <int Bits, bool Expanded, int Planes>
void panel_rows(const PanelArgs& a, int p, const uint8_t* ex) {
  constexpr int T = kRowsPerTile<Planes>;
  int m0 = 0;
  for (; m0 + T <= a.M; m0 += T) {
    tile<Bits, T, Expanded, Planes>(a, p, m0, ex);
  }
  if (m0 < a.M) {
    rest<Bits, T - 1, Expanded, Planes>(a, p, m0, a.M - m0, ex);
  }
}

template <int Bits, int Planes = 1>
void panels(const PanelArgs& a, int p0, int p1) {
  if constexpr (Bits != 4) {
    if (a.M * Planes >= kExpandRows) {
      thread_local std::vector<uint8_t> ex; // 16 bytes a value of a row: 128 KiB at K 8192
      ex.resize(size_t(a.K) * kPanelRows);
      for (int p = p0; p < p1; ++p) {
        expand<Bits>(a, p, ex.data());
        panel_rows<Bits, true, Planes>(a, p, ex.data());
      }
      return;
    }
  }
  for (int p = p0; p < p1; ++p) {
    panel_rows<Bits, false, Planes>(a, p, nullptr);
  }
}

} // namespace

void q8_panels(const PanelArgs& a, int p0, int p1) {
  panels<4>(a, p0, p1);
}

void q5_panels(const PanelArgs& a, int p0, int p1) {
  panels<5>(a, p0, p1);
}

void q6_panels(const PanelArgs& a, int p0, int p1) {
  panels<6>(a, p0, p1);
}

PanelFn joined_panels(int bits, int planes) {
  if (planes == 2) {
    return bits == 6 ? panels<6, 2> : bits == 5 ? panels<5, 2> : panels<4, 2>;
  }
  return bits == 6 ? panels<6, 3> : bits == 5 ? panels<5, 3> : panels<4, 3>;
}

} // namespace avx512
} // namespace duet_cpu
