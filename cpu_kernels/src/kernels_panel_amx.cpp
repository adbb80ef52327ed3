// The panel kernel on AMX tiles (Xeons from Sapphire Rapids on): many rows of x (prefill) times Q4_K,
// Q5_K or Q6_K weights in 16-row panels (panels.h), the same numbers as the AVX-512 VNNI kernel
// (kernels_panel_avx512.cpp), bit for bit.
//
// A panel's codes are expanded once (expand: per group, four consecutive codes of each of its 16 rows
// per 64 bytes), which is an AMX tile of bytes as it is: GS / 4 rows of 16 x 4 codes, the layout of
// tdpbsud's second operand. 16 rows of x over the group (16 rows x GS bytes, a row K bytes from the
// next) are its first operand, and one tdpbsud gives the group's 16 x 16 int32 sums, exact. The vector
// units then scale them as the VNNI kernel's tile does, 16 rows of x at once: acc += float(sum) *
// (scale * d) + bias * xsum (Q6_K: the sum started from its integer offset, no bias term). Groups
// alternate between two sets of tiles, so the tile unit's product of the next group overlaps the
// scaling of this one. The rows of x past the last whole tile of 16 take the VNNI kernel.
#include <cpuid.h>
#include <immintrin.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "panels.h"

namespace duet_cpu {
namespace amx {
namespace {

#include "panel_codes.inc"

constexpr int kRows = 16; // rows of x per tile
constexpr size_t kBlockBytes = size_t(256) << 10; // bytes of x (int8) per block of rows

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 and 1: x (16 rows x GS bytes); 2 and 3: codes (GS / 4 rows x 64 bytes); 4 and 5: the sums
// (16 x 16 int32). The configuration is the calling thread's.
template <int GS>
void configure() {
  TileConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = kRows;
    c.colsb[t] = GS;
    c.rows[2 + t] = GS / 4;
    c.colsb[2 + t] = 64;
    c.rows[4 + t] = kRows;
    c.colsb[4 + t] = 64;
  }
  _tile_loadconfig(&c);
}

// Panel p's group scales (and Q4_K's and Q5_K's biases) as 16 float lanes a group, as group_scales
// computes them for the VNNI tile
template <int Bits>
void panel_scales(const PanelArgs& a, int p, float* sc, float* bi) {
  const int K = a.K;
  if constexpr (Bits == 6) {
    const size_t sb_bytes = size_t(kPanelRows) * kSuper16Bytes;
    const uint8_t* sp = a.scales + size_t(p) * sb_bytes * (K / 256);
    for (int sb = 0; sb < K / 256; ++sb) {
      const uint8_t* block = sp + size_t(sb) * sb_bytes;
      const __m512 steps = block_steps(block);
      for (int j = 0; j < kSuper16Groups; ++j) {
        _mm512_storeu_ps(sc + size_t(sb * kSuper16Groups + j) * 16, group_scales<true>(block, steps, j));
      }
    }
  } else {
    const size_t sb_bytes = size_t(kPanelRows) * kSuperBytes;
    const uint8_t* sp = a.scales + size_t(p) * sb_bytes * (K / 256);
    const uint8_t* bp = a.biases + size_t(p) * sb_bytes * (K / 256);
    for (int sb = 0; sb < K / 256; ++sb) {
      const uint8_t* sblock = sp + size_t(sb) * sb_bytes;
      const uint8_t* bblock = bp + size_t(sb) * sb_bytes;
      const __m512 ssteps = block_steps(sblock);
      const __m512 bsteps = block_steps(bblock);
      for (int j = 0; j < kSuperGroups; ++j) {
        const size_t g = size_t(sb * kSuperGroups + j);
        _mm512_storeu_ps(sc + g * 16, group_scales(sblock, ssteps, j));
        _mm512_storeu_ps(bi + g * 16, group_scales(bblock, bsteps, j));
      }
    }
  }
}

// acc[m] += group g's sums of row m0 + m of x, scaled: the VNNI tile's arithmetic in its order
template <int Bits>
inline void scale_group(const PanelArgs& a, int m0, int g, const int32_t* sums, const float* sc, const float* bi, __m512* acc) {
  const int K = a.K;
  const __m512 s = _mm512_loadu_ps(sc + size_t(g) * 16);
  if constexpr (Bits == 6) {
    const int G = K / 16;
#pragma GCC unroll 16
    for (int m = 0; m < kRows; ++m) {
      const size_t row = size_t(m0 + m);
      const __m512i sum = _mm512_add_epi32(_mm512_load_si512(sums + 16 * m), _mm512_set1_epi32(a.xoff[row * G + g]));
      const __m512 u = _mm512_mul_ps(s, _mm512_set1_ps(a.xd[row * (K / 8) + size_t(g / 2) * 4]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), u, acc[m]);
    }
  } else {
    const int G = K / 32;
    const __m512 b = _mm512_loadu_ps(bi + size_t(g) * 16);
#pragma GCC unroll 16
    for (int m = 0; m < kRows; ++m) {
      const size_t row = size_t(m0 + m);
      const __m512 u = _mm512_mul_ps(s, _mm512_set1_ps(a.xd[row * (K / 8) + size_t(g) * 4]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * m)), u, acc[m]);
      acc[m] = _mm512_fmadd_ps(b, _mm512_set1_ps(a.xsum[row * G + g]), acc[m]);
    }
  }
}

// Rows [16 * t0, 16 * t1) of x against panel p (its codes expanded in ex, its scales in sc and bi)
template <int Bits>
void panel_tiles(const PanelArgs& a, int p, int t0, int t1, const uint8_t* ex, const float* sc, const float* bi) {
  constexpr int GS = Bits == 6 ? 16 : 32;
  constexpr int GB = Bits == 6 ? kExpandedGroup / 2 : kExpandedGroup;
  const int K = a.K;
  const int G = K / GS;
  alignas(64) int32_t sums[2][kRows * 16];
  for (int t = t0; t < t1; ++t) {
    const int m0 = t * kRows;
    const int8_t* x = a.xq + size_t(m0) * K;
    __m512 acc[kRows];
#pragma GCC unroll 16
    for (int m = 0; m < kRows; ++m) {
      acc[m] = _mm512_setzero_ps();
    }
    // group g's product into tile C (its x into tile A, its codes into tile B); a macro, as GCC's tile
    // intrinsics take the tiles' numbers as literals
#define DUET_ISSUE(A, B, C, g)                     \
  do {                                             \
    _tile_loadd(A, x + size_t(g) * GS, K);         \
    _tile_loadd(B, ex + size_t(g) * GB, 64);       \
    _tile_zero(C);                                 \
    _tile_dpbsud(C, A, B);                         \
  } while (0)
    // a software pipeline: the tile unit multiplies group g + 1 while the vector units scale group g
    DUET_ISSUE(0, 2, 4, 0);
    for (int g = 0; g < G; g += 2) { // G is even: K a multiple of 256
      DUET_ISSUE(1, 3, 5, g + 1);
      _tile_stored(4, sums[0], 64);
      scale_group<Bits>(a, m0, g, sums[0], sc, bi, acc);
      if (g + 2 < G) {
        DUET_ISSUE(0, 2, 4, g + 2);
      }
      _tile_stored(5, sums[1], 64);
      scale_group<Bits>(a, m0, g + 1, sums[1], sc, bi, acc);
    }
#undef DUET_ISSUE
    for (int m = 0; m < kRows; ++m) {
      _mm512_storeu_ps(a.y + size_t(m0 + m) * a.N + size_t(p) * kPanelRows, acc[m]);
    }
  }
}

template <int Bits>
void panels(const PanelArgs& a, int p0, int p1, void (*vnni)(const PanelArgs&, int, int)) {
  constexpr int GS = Bits == 6 ? 16 : 32;
  const int K = a.K;
  const int tiles = a.M / kRows;
  if (tiles > 0) {
    thread_local std::vector<uint8_t> ex; // 16 bytes a value of a row: 128 KiB at K 8192
    thread_local std::vector<float> sc, bi;
    ex.resize(size_t(K) * kPanelRows);
    sc.resize(size_t(K / GS) * 16);
    bi.resize(size_t(K / GS) * 16);
    configure<GS>();
    // blocks of rows of x that stay in L2 while the task's panels pass (each panel expanded again per
    // block: a small cost beside a block's products)
    const int block = std::max(1, int(kBlockBytes / (size_t(K) * kRows)));
    for (int b0 = 0; b0 < tiles; b0 += block) {
      const int b1 = std::min(tiles, b0 + block);
      for (int p = p0; p < p1; ++p) {
        expand<Bits>(a, p, ex.data());
        panel_scales<Bits>(a, p, sc.data(), bi.data());
        panel_tiles<Bits>(a, p, b0, b1, ex.data(), sc.data(), bi.data());
      }
    }
    _tile_release();
  }
  const int done = tiles * kRows;
  if (done < a.M) { // the last rows, fewer than a tile
    PanelArgs rest = a;
    rest.xq = a.xq + size_t(done) * K;
    rest.xd = a.xd + size_t(done) * (K / 8);
    rest.xsum = a.xsum + size_t(done) * (K / 32);
    rest.y = a.y + size_t(done) * a.N;
    rest.M = a.M - done;
    if (a.xoff != nullptr) {
      rest.xoff = a.xoff + size_t(done) * (K / 16);
    }
    vnni(rest, p0, p1);
  }
}

} // namespace

bool usable() {
#if defined(__linux__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) {
    return false;
  }
  if ((edx & (1u << 24)) == 0 || (edx & (1u << 25)) == 0) { // AMX-TILE, AMX-INT8
    return false;
  }
  // Linux hands out the tiles' state only to a process that asks (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); a tile instruction faults otherwise
  constexpr long kReqXcompPerm = 0x1023;
  constexpr long kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) {
    return false;
  }
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & (3u << 17)) == (3u << 17); // XTILECFG and XTILEDATA enabled by the OS
#else
  return false;
#endif
}

void q4_panels(const PanelArgs& a, int p0, int p1) {
  panels<4>(a, p0, p1, avx512::q8_panels);
}

void q5_panels(const PanelArgs& a, int p0, int p1) {
  panels<5>(a, p0, p1, avx512::q5_panels);
}

void q6_panels(const PanelArgs& a, int p0, int p1) {
  panels<6>(a, p0, p1, avx512::q6_panels);
}

} // namespace amx
} // namespace duet_cpu
