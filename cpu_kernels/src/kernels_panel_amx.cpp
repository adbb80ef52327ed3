// The panel kernel on AMX tiles (Xeons from Sapphire Rapids on): many rows of x (prefill) times Q4_K or
// Q5_K weights in 16-row panels (panels.h). Q6_K stays on the VNNI kernel (its groups of 16 measured
// 0.6-0.94x there).
//
// A panel's codes are expanded once (expand: per group of 32, four consecutive codes of each of its 16
// rows per 64 bytes), which is an AMX tile of bytes as it is: 8 rows of 16 x 4 codes, the layout of
// tdpbsud's second operand. 16 rows of x over the group are its first (laid out per tile and group as
// one 512-byte block beforehand: tile_x), and one tdpbsud gives the group's 16 x 16 int32 sums, exact.
// The vector units then scale them 16 rows of x at once, as the VNNI kernel's tile does: acc +=
// float(sum) * (scale * d) + bias * xsum, so int8 math's results are the VNNI kernel's bit for bit.
// Groups alternate between two sets of tiles, so the tile unit's product of the next group overlaps the
// scaling of this one. The rows of x past the last whole tile of 16 take the VNNI kernel.
//
// Exact math (x split into three int8 planes, as the exact integer kernels split it): the three planes
// of 16 rows go through the tiles together, and their sums are joined in integers and one float32
// rounding before they are scaled (scale_planes), where the VNNI kernel scales each plane's products
// and adds them: a third of the vector work, within float32's rounding of it. Two threads, an 8192 x
// 2048 Q4_K matrix, 256 rows of x: int8 19.3 -> 14.4 ms (VNNI -> tiles), exact 67.8 -> 42 ms, where
// dequantize + OpenBLAS's float32 GEMM takes 42-49 (and 86 against 118 ms at 512 rows).
#include <cpuid.h>
#include <immintrin.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "panels.h"

namespace duet_cpu {
namespace amx {
namespace {

#include "panel_codes.inc"

constexpr int kRows = 16; // rows of x per tile
constexpr int kGroup = 32; // values of K per group (Q4_K's, Q5_K's), per tile product
constexpr size_t kBlockBytes = size_t(256) << 10; // bytes of x (int8) per block of rows

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One plane of x: tiles 0 and 1 x (16 rows x 32 bytes), 2 and 3 codes (8 rows x 64 bytes), 4 and 5 the
// sums (16 x 16 int32). Three planes (exact math): tiles 0-2 the planes, 3 the codes, 4-6 the sums.
// The configuration is the calling thread's.
template <int Planes>
void configure() {
  TileConfig c;
  constexpr int x_tiles = Planes == 3 ? 3 : 2;
  constexpr int code_tiles = Planes == 3 ? 1 : 2;
  for (int t = 0; t < x_tiles; ++t) {
    c.rows[t] = kRows;
    c.colsb[t] = kGroup;
  }
  for (int t = x_tiles; t < x_tiles + code_tiles; ++t) {
    c.rows[t] = kGroup / 4;
    c.colsb[t] = 64;
  }
  for (int t = 4; t < 4 + x_tiles; ++t) {
    c.rows[t] = kRows;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// Panel p's group scales and biases as 16 float lanes a group, as group_scales computes them for the
// VNNI tile
void panel_scales(const PanelArgs& a, int p, float* sc, float* bi) {
  const int K = a.K;
  const size_t sb_bytes = size_t(kPanelRows) * kSuperBytes;
  const uint8_t* sp = a.scales + size_t(p) * sb_bytes * (K / 256);
  const uint8_t* bp = a.biases + size_t(p) * sb_bytes * (K / 256);
  for (int g = 0; g < K / kGroup; ++g) { // group j of super-block sb
    const int sb = g / kSuperGroups, j = g % kSuperGroups;
    const uint8_t* sblock = sp + size_t(sb) * sb_bytes;
    const uint8_t* bblock = bp + size_t(sb) * sb_bytes;
    _mm512_storeu_ps(sc + size_t(g) * 16, group_scales(sblock, block_steps(sblock), j));
    _mm512_storeu_ps(bi + size_t(g) * 16, group_scales(bblock, block_steps(bblock), j));
  }
}

// acc[m] += group g's sums of row 16t + m of x, scaled: the VNNI tile's arithmetic in its order
inline void scale_group(const PanelArgs& a, int t, int g, const int32_t* sums, const float* sc, const float* bi, __m512* acc) {
  const __m512 s = _mm512_loadu_ps(sc + size_t(g) * 16);
  const __m512 b = _mm512_loadu_ps(bi + size_t(g) * 16);
  const size_t at = (size_t(t) * (a.K / kGroup) + g) * kRows; // the tile's group in td and ts
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m) {
    const __m512 u = _mm512_mul_ps(s, _mm512_set1_ps(a.td[at + m]));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * m)), u, acc[m]);
    acc[m] = _mm512_fmadd_ps(b, _mm512_set1_ps(a.ts[at + m]), acc[m]);
  }
}

// Exact math: acc[m] += group g's sums of row 16t + m's three planes joined, scaled. The planes' integer
// sums S1, S2, S3 stand for unit * (S1 * 2^14 + S2 * 2^7 + S3) (quantize_x's split): S2 * 2^7 + S3 is
// exact in int32 and in float32 (below 2^24: |S| <= 32 * 31 * 127), S1 * 2^14 is exact, and their sum is
// rounded once (the VNNI kernel rounds each plane's product and adds them: within float32's rounding)
inline void scale_planes(const PanelArgs& a, int t, int g, const int32_t (*sums)[kRows * 16], const float* sc, const float* bi, __m512* acc) {
  const __m512 s = _mm512_loadu_ps(sc + size_t(g) * 16);
  const __m512 b = _mm512_loadu_ps(bi + size_t(g) * 16);
  const __m512 high = _mm512_set1_ps(16384.0f);
  const size_t at = (size_t(t) * (a.K / kGroup) + g) * kRows;
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m) {
    const __m512i low = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[1] + 16 * m), 7), _mm512_load_si512(sums[2] + 16 * m));
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[0] + 16 * m)), high, _mm512_cvtepi32_ps(low));
    const __m512 u = _mm512_mul_ps(s, _mm512_set1_ps(a.td[at + m]));
    acc[m] = _mm512_fmadd_ps(v, u, acc[m]);
    acc[m] = _mm512_fmadd_ps(b, _mm512_set1_ps(a.ts[at + m]), acc[m]);
  }
}

// Rows [16 * t0, 16 * t1) of x against panel p (its codes expanded in ex, its scales in sc and bi); x
// as tile_x (Planes 1) or tile_x3 (Planes 3: each row's three planes, exact math) laid it out
template <int Planes>
void panel_tiles(const PanelArgs& a, int p, int t0, int t1, const uint8_t* ex, const float* sc, const float* bi) {
  const int K = a.K;
  const int G = K / kGroup;
  alignas(64) int32_t sums[3][kRows * 16];
  for (int t = t0; t < t1; ++t) {
    const int m0 = t * kRows;
    const int8_t* x = a.tq + size_t(t) * K * kRows * Planes; // the tile's groups, 16 x 32 bytes a plane
    __m512 acc[kRows];
#pragma GCC unroll 16
    for (int m = 0; m < kRows; ++m) {
      acc[m] = _mm512_setzero_ps();
    }
    if constexpr (Planes == 3) {
      for (int g = 0; g < G; ++g) {
        const int8_t* xg = x + size_t(g) * 3 * kGroup * kRows;
        _tile_loadd(0, xg, kGroup);
        _tile_loadd(1, xg + kGroup * kRows, kGroup);
        _tile_loadd(2, xg + 2 * kGroup * kRows, kGroup);
        _tile_loadd(3, ex + size_t(g) * kExpandedGroup, 64);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_dpbsud(4, 0, 3);
        _tile_dpbsud(5, 1, 3);
        _tile_dpbsud(6, 2, 3);
        _tile_stored(4, sums[0], 64);
        _tile_stored(5, sums[1], 64);
        _tile_stored(6, sums[2], 64);
        scale_planes(a, t, g, sums, sc, bi, acc);
      }
    } else {
      // group g's product into tile C (its x into tile A, its codes into tile B); a macro, as GCC's tile
      // intrinsics take the tiles' numbers as literals
#define DUET_ISSUE(A, B, C, g)                              \
  do {                                                      \
    _tile_loadd(A, x + size_t(g) * kGroup * kRows, kGroup); \
    _tile_loadd(B, ex + size_t(g) * kExpandedGroup, 64);    \
    _tile_zero(C);                                          \
    _tile_dpbsud(C, A, B);                                  \
  } while (0)
      // a software pipeline: the tile unit multiplies group g + 1 while the vector units scale group g
      DUET_ISSUE(0, 2, 4, 0);
      for (int g = 0; g < G; g += 2) { // G is even: K a multiple of 256
        DUET_ISSUE(1, 3, 5, g + 1);
        _tile_stored(4, sums[0], 64);
        scale_group(a, t, g, sums[0], sc, bi, acc);
        if (g + 2 < G) {
          DUET_ISSUE(0, 2, 4, g + 2);
        }
        _tile_stored(5, sums[1], 64);
        scale_group(a, t, g + 1, sums[1], sc, bi, acc);
      }
#undef DUET_ISSUE
    }
    for (int m = 0; m < kRows; ++m) {
      _mm512_storeu_ps(a.y + size_t(m0 + m) * a.N + size_t(p) * kPanelRows, acc[m]);
    }
  }
}

template <int Bits, int Planes = 1>
void panels(const PanelArgs& a, int p0, int p1, void (*vnni)(const PanelArgs&, int, int)) {
  const int K = a.K;
  const int tiles = a.M / kRows;
  if (tiles > 0) {
    thread_local std::vector<uint8_t> ex; // 16 bytes a value of a row: 128 KiB at K 8192
    thread_local std::vector<float> sc, bi;
    ex.resize(size_t(K) * kPanelRows);
    sc.resize(size_t(K / kGroup) * 16);
    bi.resize(size_t(K / kGroup) * 16);
    configure<Planes>();
    // blocks of rows of x that stay in L2 while the task's panels pass (each panel expanded again per
    // block: a small cost beside a block's products)
    const int block = std::max(1, int(kBlockBytes / (size_t(K) * kRows * Planes)));
    for (int b0 = 0; b0 < tiles; b0 += block) {
      const int b1 = std::min(tiles, b0 + block);
      for (int p = p0; p < p1; ++p) {
        expand<Bits>(a, p, ex.data());
        panel_scales(a, p, sc.data(), bi.data());
        panel_tiles<Planes>(a, p, b0, b1, ex.data(), sc.data(), bi.data());
      }
    }
    _tile_release();
  }
  const int done = tiles * kRows;
  if (Planes == 1 && done < a.M) { // the last rows, fewer than a tile (three planes: whole tiles only)
    PanelArgs rest = a;
    rest.xq = a.xq + size_t(done) * K;
    rest.xd = a.xd + size_t(done) * (K / 8);
    rest.xsum = a.xsum + size_t(done) * (K / 32);
    rest.y = a.y + size_t(done) * a.N;
    rest.M = a.M - done;
    vnni(rest, p0, p1);
  }
}

} // namespace

void tile_x(const PanelArgs& a, TiledX& out) {
  const int K = a.K;
  const int G = K / 32;
  const int tiles = a.M / kRows;
  out.q.resize(size_t(tiles) * kRows * K);
  out.d.resize(size_t(tiles) * G * kRows);
  out.sum.resize(size_t(tiles) * G * kRows);
  for (int t = 0; t < tiles; ++t) {
    for (int r = 0; r < kRows; ++r) {
      const size_t row = size_t(t) * kRows + r;
      const int8_t* x = a.xq + row * K;
      for (int g = 0; g < G; ++g) {
        const size_t at = (size_t(t) * G + g) * kRows + r;
        std::memcpy(out.q.data() + at * 32, x + size_t(g) * 32, 32);
        out.d[at] = a.xd[row * (K / 8) + size_t(g) * 4];
        out.sum[at] = a.xsum[row * G + g];
      }
    }
  }
}

void tile_x3(const PanelArgs& a3, TiledX& out) {
  const int K = a3.K;
  const int G = K / 32;
  const int M = a3.M / 3;
  const int tiles = M / kRows;
  out.q.resize(size_t(tiles) * kRows * K * 3);
  out.d.resize(size_t(tiles) * G * kRows);
  out.sum.resize(size_t(tiles) * G * kRows);
  for (int t = 0; t < tiles; ++t) {
    for (int r = 0; r < kRows; ++r) {
      const size_t row = size_t(t) * kRows + r;
      for (int g = 0; g < G; ++g) {
        const size_t at = (size_t(t) * G + g) * kRows + r;
        for (int j = 0; j < 3; ++j) {
          const int8_t* x = a3.xq + (size_t(j) * M + row) * K + size_t(g) * 32;
          std::memcpy(out.q.data() + ((size_t(t) * G + g) * 3 + j) * kRows * 32 + size_t(r) * 32, x, 32);
        }
        out.d[at] = a3.xd[(size_t(2) * M + row) * (K / 8) + size_t(g) * 4]; // the third plane's: the unit
        out.sum[at] = a3.xsum[row * G + g]; // the first plane's: x's own group sums
      }
    }
  }
}

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

void q4_panels_x3(const PanelArgs& a, int p0, int p1) {
  panels<4, 3>(a, p0, p1, nullptr);
}

void q5_panels_x3(const PanelArgs& a, int p0, int p1) {
  panels<5, 3>(a, p0, p1, nullptr);
}

} // namespace amx
} // namespace duet_cpu
