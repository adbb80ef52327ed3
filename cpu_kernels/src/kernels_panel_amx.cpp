// The panel kernel on AMX tiles (Xeons from Sapphire Rapids on): many rows of x (prefill) times Q4_K or
// Q5_K weights in 16-row panels (panels.h), and with exact math Q6_K's too. With int8 math Q6_K stays on
// the VNNI kernel (its groups of 16 measured 0.6-0.94x there).
//
// Int8 math: a panel's codes are expanded once (expand: per group of 32, four consecutive codes of each
// of its 16 rows per 64 bytes), which is an AMX tile of bytes as it is: 8 rows of 16 x 4 codes, the
// layout of tdpbsud's second operand. 16 rows of x over the group are its first (laid out per tile and
// group as one 512-byte block beforehand: tile_x), and one tdpbsud gives the group's 16 x 16 int32 sums,
// exact. The vector units then scale them 16 rows of x at once, as the VNNI kernel's tile does: acc +=
// float(sum) * (scale * d) + bias * xsum, so int8 math's results are the VNNI kernel's bit for bit.
// Groups alternate between two sets of tiles, so the tile unit's product of the next group overlaps the
// scaling of this one. The rows of x past the last whole tile of 16 take the VNNI kernel.
//
// Exact math (AMX-BF16): each float32 value of x is three bfloat16 values whose sum is x exactly
// (split_bf16), the codes are small integers (exact in bfloat16), so every product is exact in float32
// and tdpbf16ps accumulates the three planes' products of a group in one float32 tile, as a float32
// GEMM rounds; the vector units scale each group's sums. Where x in three int8 planes took three integer
// tiles of sums joined before scaling, this loads x's planes once for two panels and has no sums to
// join: one thread, 256 rows of x, an 8192 x 2048 Q4_K matrix 1.2-1.4x faster, 2048 x 8192 1.2x, and
// the 1B model's exact prefill +13% (docs/kernels.md, "AMX tiles"). Q6_K's groups of 16 take half-width
// tiles (16 values of x's planes, 8 rows of code pairs), its codes less 32 (its bias in them: no group
// sums of x), where it was dequantized for OpenBLAS. A panel's codes are prepared (expanded, converted)
// per span of 1024 values of K, once for a whole chunk of 256 rows of x.
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
// values of K per bfloat16 tile product: a group (Q6_K's 16, half a tile's width; Q4_K's and Q5_K's 32)
template <int Bits>
constexpr int kTileK = Bits == 6 ? 16 : kGroup;
constexpr size_t kBlockBytes = size_t(256) << 10; // bytes of x (int8) per block of rows

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Int8 math: tiles 0 and 1 x (16 rows x 32 bytes), 2 and 3 codes (8 rows x 64 bytes), 4 and 5 the sums
// (16 x 16 int32). The configuration is the calling thread's.
void configure() {
  TileConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = kRows;
    c.colsb[t] = kGroup;
    c.rows[2 + t] = kGroup / 4;
    c.colsb[2 + t] = 64;
    c.rows[4 + t] = kRows;
    c.colsb[4 + t] = 64;
  }
  _tile_loadconfig(&c);
}

// Panel p's group scales and biases over values [k0, k1) of K (all by default) as 16 float lanes a
// group, as group_scales computes them for the VNNI tile
void panel_scales(const PanelArgs& a, int p, float* sc, float* bi, int k0 = 0, int k1 = -1) {
  const int K = a.K;
  k1 = k1 < 0 ? K : k1;
  const size_t sb_bytes = size_t(kPanelRows) * kSuperBytes;
  const uint8_t* sp = a.scales + size_t(p) * sb_bytes * (K / 256);
  const uint8_t* bp = a.biases + size_t(p) * sb_bytes * (K / 256);
  for (int g = k0 / kGroup; g < k1 / kGroup; ++g) { // group j of super-block sb
    const int sb = g / kSuperGroups, j = g % kSuperGroups;
    const uint8_t* sblock = sp + size_t(sb) * sb_bytes;
    const uint8_t* bblock = bp + size_t(sb) * sb_bytes;
    const size_t at = size_t(g - k0 / kGroup) * 16;
    _mm512_storeu_ps(sc + at, group_scales(sblock, block_steps(sblock), j));
    _mm512_storeu_ps(bi + at, group_scales(bblock, block_steps(bblock), j));
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

// Rows [16 * t0, 16 * t1) of x against panel p (its codes expanded in ex, its scales in sc and bi); x
// as tile_x laid it out
void panel_tiles(const PanelArgs& a, int p, int t0, int t1, const uint8_t* ex, const float* sc, const float* bi) {
  const int K = a.K;
  const int G = K / kGroup;
  alignas(64) int32_t sums[2][kRows * 16];
  for (int t = t0; t < t1; ++t) {
    const int m0 = t * kRows;
    const int8_t* x = a.tq + size_t(t) * K * kRows; // the tile's groups, 16 x 32 bytes each
    __m512 acc[kRows];
#pragma GCC unroll 16
    for (int m = 0; m < kRows; ++m) {
      acc[m] = _mm512_setzero_ps();
    }
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
    for (int m = 0; m < kRows; ++m) {
      _mm512_storeu_ps(a.y + size_t(m0 + m) * a.N + size_t(p) * kPanelRows, acc[m]);
    }
  }
}

template <int Bits>
void panels(const PanelArgs& a, int p0, int p1, void (*vnni)(const PanelArgs&, int, int)) {
  const int K = a.K;
  const int tiles = a.M / kRows;
  if (tiles > 0) {
    thread_local std::vector<uint8_t> ex; // 16 bytes a value of a row: 128 KiB at K 8192
    thread_local std::vector<float> sc, bi;
    ex.resize(size_t(K) * kPanelRows);
    sc.resize(size_t(K / kGroup) * 16);
    bi.resize(size_t(K / kGroup) * 16);
    configure();
    // blocks of rows of x that stay in L2 while the task's panels pass (each panel expanded again per
    // block: a small cost beside a block's products)
    const int block = std::max(1, int(kBlockBytes / (size_t(K) * kRows)));
    for (int b0 = 0; b0 < tiles; b0 += block) {
      const int b1 = std::min(tiles, b0 + block);
      for (int p = p0; p < p1; ++p) {
        expand<Bits>(a, p, ex.data());
        panel_scales(a, p, sc.data(), bi.data());
        panel_tiles(a, p, b0, b1, ex.data(), sc.data(), bi.data());
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
    vnni(rest, p0, p1);
  }
}

// Exact math in bfloat16: tiles 0, 1 and 6 x's three planes of a group (16 rows x 32 bfloat16; Q6_K: x
// 16), 2 and 3 the group's codes of two panels as bfloat16 pairs (16 rows x 16 x 2; Q6_K: 8 rows), 4
// and 5 the two panels' sums (16 x 16 float32)
template <int Bits>
void configure_bf16() {
  constexpr int Tk = kTileK<Bits>;
  TileConfig c;
  for (int t = 0; t < 7; ++t) {
    const bool codes = t == 2 || t == 3, sums = t == 4 || t == 5;
    c.rows[t] = codes ? Tk / 2 : kRows;
    c.colsb[t] = codes || sums ? 64 : Tk * 2;
  }
  _tile_loadconfig(&c);
}

// bfloat16 values of one plane of a tile's group: 16 rows x 32
constexpr size_t kPlaneValues = size_t(kRows) * kGroup;

// A panel's expanded codes (expand: four consecutive codes of each of its 16 rows per 64 bytes) as
// tdpbf16ps's second operand: per four values 2 rows of 16 x 2 bfloat16, row 2r + h holding codes 4r + 2h
// and 4r + 2h + 1 of each of the 16 weight rows. Q4_K's and Q5_K's codes (0-31) as they are; Q6_K's less
// 32 (-32..31: its bias, -32 times each scale, taken into the codes), small integers exact in bfloat16.
template <int Bits>
void codes_bf16(const uint8_t* ex, uint16_t* out, int K) {
  // bfloat16 of each code's value (exact), looked up per 16-bit lane: entries 0-31 in lut (0-15 from the
  // second operand of the two-vector conversion, 16-31 from the first), Q6_K's 32-63 in lut_hi
  const __m512 low = _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                                   _mm512_set1_ps(Bits == 6 ? -32.0f : 0.0f));
  const __m512i lut = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(low, _mm512_set1_ps(16.0f)), low);
  const __m512i lut_hi = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(low, _mm512_set1_ps(48.0f)), _mm512_add_ps(low, _mm512_set1_ps(32.0f)));
  const auto look = [&](const uint8_t* src) {
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    return Bits == 6 ? _mm512_permutex2var_epi16(lut, idx, lut_hi) : _mm512_permutexvar_epi16(idx, lut);
  };
  // each row's (c0, c1) pairs (even 32-bit lanes of the two halves), then its (c2, c3) pairs (odd)
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int r = 0; r < K / 4; ++r) { // K / 4 runs of four values, 64 bytes each
    const uint8_t* src = ex + size_t(r) * 64;
    uint16_t* dst = out + size_t(r) * 64;
    const __m512i lo = look(src);
    const __m512i hi = look(src + 32);
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi32(lo, even, hi));
    _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi32(lo, odd, hi));
  }
}

// Q6_K panel p's group scales (groups of 16) over values [k0, k1) of K as 16 float lanes a group: step *
// multiple, as the VNNI kernel's panel6_tile computes them
void panel_scales6(const PanelArgs& a, int p, float* sc, int k0, int k1) {
  const size_t sb_bytes = size_t(kPanelRows) * kSuper16Bytes;
  const uint8_t* sp = a.scales + size_t(p) * sb_bytes * (a.K / 256);
  for (int g = k0 / 16; g < k1 / 16; ++g) {
    const uint8_t* sblock = sp + size_t(g / kSuper16Groups) * sb_bytes;
    _mm512_storeu_ps(sc + size_t(g - k0 / 16) * 16, group_scales<true>(sblock, block_steps(sblock), g % kSuper16Groups));
  }
}

// Panels as the bfloat16 tiles read them over a span of K: per panel its codes as bfloat16 pairs (32
// bytes a value of a row: 32 KiB over a span of 1024), its group scales and biases
struct PanelsBf16 {
  std::vector<uint16_t> codes[2];
  std::vector<float> sc[2], bi[2];
};

// Panel p's codes, scales and biases over values [k0, k1) of K as the bfloat16 tiles read them, into q's
// slot i
template <int Bits>
void prepare_bf16(const PanelArgs& a, int p, int k0, int k1, std::vector<uint8_t>& ex, PanelsBf16& out, int i) {
  const size_t span = size_t(k1 - k0), groups = span / kTileK<Bits>;
  ex.resize(span * kPanelRows);
  out.codes[i].resize(span * kPanelRows);
  out.sc[i].resize(groups * 16);
  expand<Bits>(a, p, ex.data(), k0, k1);
  codes_bf16<Bits>(ex.data(), out.codes[i].data(), k1 - k0);
  if constexpr (Bits == 6) {
    panel_scales6(a, p, out.sc[i].data(), k0, k1);
  } else {
    out.bi[i].resize(groups * 16);
    panel_scales(a, p, out.sc[i].data(), out.bi[i].data(), k0, k1);
  }
}

// acc (16 rows x 16 outputs, in memory) += a group's float32 sums of the tile's rows (its three planes
// accumulated by the tiles), scaled: sum * scale + bias * x's group sum (ts: the 16 rows'; Q6_K, whose
// codes hold its bias, has none: bi null)
inline void scale_bf16(const float* ts, const float* sums, const float* sc, const float* bi, float* acc) {
  const __m512 s = _mm512_loadu_ps(sc);
  if (bi == nullptr) {
#pragma GCC unroll 16
    for (int m = 0; m < kRows; ++m) {
      _mm512_store_ps(acc + 16 * m, _mm512_fmadd_ps(_mm512_load_ps(sums + 16 * m), s, _mm512_load_ps(acc + 16 * m)));
    }
    return;
  }
  const __m512 b = _mm512_loadu_ps(bi);
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m) {
    const __m512 v = _mm512_fmadd_ps(_mm512_load_ps(sums + 16 * m), s, _mm512_load_ps(acc + 16 * m));
    _mm512_store_ps(acc + 16 * m, _mm512_fmadd_ps(b, _mm512_set1_ps(ts[m]), v));
  }
}

// Rows [16 * t0, 16 * t1) of x (tile_bf16_row's planes in a.tb, group sums in a.ts) against panels p and
// p + 1 (Two false: panel p alone), as q holds them. Tile loads bound this kernel (x's planes take 3 KiB
// a group, where the products take ~16 cycles each), so each plane of x is loaded once for both panels,
// into its own tile (a tile reloaded while a product still reads it stalls the next load), and the three
// planes' products accumulate in one float32 tile a panel, scaled per group. Q6_K's groups of 16 take
// half of each group of 32 of x's planes (its tiles configured 32 bytes wide: configure_bf16<6>).
template <int Bits, bool Two>
void panel_tiles_bf16(const PanelArgs& a, int p, int t0, int t1, int k0, int k1, const PanelsBf16& q) {
  constexpr int Tk = kTileK<Bits>;
  constexpr int Halves = kGroup / Tk; // tile products per group of 32 of x's planes
  constexpr size_t kCodes = size_t(Tk) * kPanelRows; // bfloat16 codes of a panel's group
  const int G = a.K / kGroup;
  const int G0 = k0 / kGroup, Gs = (k1 - k0) / kGroup; // the span's first group of 32 and its count
  const uint16_t* c0 = q.codes[0].data();
  const uint16_t* c1 = Two ? q.codes[1].data() : nullptr;
  const float* sc[2] = {q.sc[0].data(), Two ? q.sc[1].data() : nullptr};
  const float* bi[2] = {Bits == 6 ? nullptr : q.bi[0].data(), Bits == 6 || !Two ? nullptr : q.bi[1].data()};
  alignas(64) float sums[kRows * 16];
  alignas(64) float acc[2][kRows * 16];
  for (int t = t0; t < t1; ++t) {
    const uint16_t* x = a.tb + (size_t(t) * G + G0) * 3 * kPlaneValues;
    const float* ts = a.ts + (size_t(t) * G + G0) * kRows;
    // the sums of the spans before this one, as this loop left them in y (the same additions in the
    // same order as one span over all of K)
    for (int i = 0; i < (Two ? 2 : 1); ++i) {
      for (int m = 0; m < kRows; ++m) {
        float* row = acc[i] + 16 * m;
        if (k0 == 0) {
          std::memset(row, 0, 16 * sizeof(float));
        } else {
          std::memcpy(row, a.y + size_t(t * kRows + m) * a.N + size_t(p + i) * kPanelRows, 16 * sizeof(float));
        }
      }
    }
    for (int g = 0; g < Gs * Halves; ++g) {
      const uint16_t* xg = x + size_t(g / Halves) * 3 * kPlaneValues + size_t(g % Halves) * Tk;
      const float* tg = Bits == 6 ? nullptr : ts + size_t(g) * kRows;
      _tile_loadd(2, c0 + size_t(g) * kCodes, 64);
      _tile_zero(4);
      if constexpr (Two) {
        _tile_loadd(3, c1 + size_t(g) * kCodes, 64);
        _tile_zero(5);
      }
      _tile_loadd(0, xg, 64);
      _tile_loadd(1, xg + kPlaneValues, 64);
      _tile_loadd(6, xg + 2 * kPlaneValues, 64);
      _tile_dpbf16ps(4, 0, 2);
      if constexpr (Two) {
        _tile_dpbf16ps(5, 0, 3);
      }
      _tile_dpbf16ps(4, 1, 2);
      if constexpr (Two) {
        _tile_dpbf16ps(5, 1, 3);
      }
      _tile_dpbf16ps(4, 6, 2);
      _tile_stored(4, sums, 64);
      scale_bf16(tg, sums, sc[0] + size_t(g) * 16, bi[0] == nullptr ? nullptr : bi[0] + size_t(g) * 16, acc[0]);
      if constexpr (Two) {
        _tile_dpbf16ps(5, 6, 3);
        _tile_stored(5, sums, 64);
        scale_bf16(tg, sums, sc[1] + size_t(g) * 16, bi[1] == nullptr ? nullptr : bi[1] + size_t(g) * 16, acc[1]);
      }
    }
    for (int i = 0; i < (Two ? 2 : 1); ++i) {
      for (int m = 0; m < kRows; ++m) {
        std::memcpy(a.y + size_t(t * kRows + m) * a.N + size_t(p + i) * kPanelRows, acc[i] + 16 * m, 16 * sizeof(float));
      }
    }
  }
}

// bytes of x's planes per block of rows that stays in L2 while the task's panels pass
constexpr size_t kBf16BlockBytes = size_t(3) << 19;
// values of K whose codes are prepared at once: x's planes over them for 256 rows (a chunk of
// tiles_bf16's, panels.cpp) fill one block, so each panel's codes are prepared once per chunk of rows
// (over all of K at once, a block held 2 tiles of 16 rows at K 8192 and each panel was prepared again
// for every 32 rows)
constexpr int kBf16Span = 1024;

template <int Bits>
void panels_bf16(const PanelArgs& a, int p0, int p1) {
  const int tiles = a.M / kRows;
  thread_local std::vector<uint8_t> ex;
  thread_local PanelsBf16 q;
  configure_bf16<Bits>();
  const int span = std::min(a.K, kBf16Span);
  const int block = std::max(1, int(kBf16BlockBytes / (size_t(span) * kRows * 3 * 2)));
  for (int k0 = 0; k0 < a.K; k0 += span) {
    const int k1 = std::min(a.K, k0 + span);
    for (int b0 = 0; b0 < tiles; b0 += block) {
      const int b1 = std::min(tiles, b0 + block);
      for (int p = p0; p < p1; p += 2) {
        prepare_bf16<Bits>(a, p, k0, k1, ex, q, 0);
        if (p + 1 < p1) {
          prepare_bf16<Bits>(a, p + 1, k0, k1, ex, q, 1);
          panel_tiles_bf16<Bits, true>(a, p, b0, b1, k0, k1, q);
        } else {
          panel_tiles_bf16<Bits, false>(a, p, b0, b1, k0, k1, q);
        }
      }
    }
  }
  _tile_release();
}

// x = hi + mid + lo exactly: each bfloat16 (8 significant bits) rounded from what the planes before
// it left (each remainder exact in float32)
inline void split_bf16(__m512 x, __m256i& hi, __m256i& mid, __m256i& lo) {
  const auto widen = [](__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); };
  hi = (__m256i)_mm512_cvtneps_pbh(x);
  const __m512 r1 = _mm512_sub_ps(x, widen(hi));
  mid = (__m256i)_mm512_cvtneps_pbh(r1);
  lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(r1, widen(mid)));
}

} // namespace

void tile_bf16_row(const float* row, const float* sums, int m, int K, TiledBf16& out) {
  const int G = K / kGroup;
  const int t = m / kRows, r = m % kRows;
  for (int g = 0; g < G; ++g) {
    uint16_t* dst = out.q.data() + (size_t(t) * G + g) * 3 * kPlaneValues + size_t(r) * kGroup;
    for (int h = 0; h < 2; ++h) {
      __m256i hi, mid, lo;
      split_bf16(_mm512_loadu_ps(row + size_t(g) * kGroup + 16 * h), hi, mid, lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * h), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + kPlaneValues + 16 * h), mid);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * kPlaneValues + 16 * h), lo);
    }
    out.sum[(size_t(t) * G + g) * kRows + r] = sums[g];
  }
}

void q4_panels_bf16(const PanelArgs& a, int p0, int p1) {
  panels_bf16<4>(a, p0, p1);
}

void q5_panels_bf16(const PanelArgs& a, int p0, int p1) {
  panels_bf16<5>(a, p0, p1);
}

void q6_panels_bf16(const PanelArgs& a, int p0, int p1) {
  panels_bf16<6>(a, p0, p1);
}

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

bool usable() {
#if defined(__linux__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) {
    return false;
  }
  if ((edx & (1u << 24)) == 0 || (edx & (1u << 25)) == 0 || (edx & (1u << 22)) == 0) { // AMX-TILE, -INT8, -BF16
    return false;
  }
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) == 0 || (eax & (1u << 5)) == 0) { // AVX512-BF16
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

} // namespace amx
} // namespace duet_cpu
