#include "panels.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "mlx/allocator.h"
#include "mlx/transforms.h"
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "pool.h"
#include "qmm_shared.h"
#include "reused_rows.h"

namespace mx = mlx::core;

namespace duet_cpu {

namespace {

// Eight 4-bit codes (a 32-bit word, code i at bit 4i) <-> a byte each (code i in byte i), halving the
// fields twice: 16-bit halves to 32-bit lanes, bytes to 16-bit lanes, nibbles to bytes.
uint64_t spread4(uint32_t w) {
  uint64_t x = (w & 0xFFFFull) | uint64_t(w >> 16) << 32;
  x = (x & 0x000000FF000000FFull) | (x & 0x0000FF000000FF00ull) << 8;
  return (x & 0x000F000F000F000Full) | (x & 0x00F000F000F000F0ull) << 4;
}

uint32_t gather4(uint64_t x) {
  x = (x & 0x000F000F000F000Full) | (x & 0x0F000F000F000F00ull) >> 4;
  x = (x & 0x000000FF000000FFull) | (x & 0x00FF000000FF0000ull) >> 8;
  return uint32_t((x & 0xFFFF) | (x >> 32 & 0xFFFF) << 16);
}

constexpr uint32_t kByteLow4 = 0x0F0F0F0Fu, kByteBit0 = 0x01010101u;

// One row's 32 Q4_K codes of a group (16 bytes of its bit stream) <-> the panel form's four step words
// of that row (panels.h): step s is the group's codes 8s .. 8s + 7 (4 bytes of the stream), its byte b
// holding code 8s + b in the low nibble and 8s + 4 + b in the high.
void pack_group4(const uint8_t* row, uint8_t* block) {
  for (int s = 0; s < 4; ++s) {
    uint32_t w;
    std::memcpy(&w, row + 4 * s, 4);
    const uint64_t x = spread4(w);
    const uint32_t step = (uint32_t(x) & kByteLow4) | (uint32_t(x >> 32) & kByteLow4) << 4;
    std::memcpy(block + 64 * s, &step, 4);
  }
}

void unpack_group4(const uint8_t* block, uint8_t* row) {
  for (int s = 0; s < 4; ++s) {
    uint32_t step;
    std::memcpy(&step, block + 64 * s, 4);
    const uint32_t w = gather4(uint64_t(step & kByteLow4) | uint64_t((step >> 4) & kByteLow4) << 32);
    std::memcpy(row + 4 * s, &w, 4);
  }
}

// Eight 5-bit codes (40 bits, code i at bit 5i) <-> a byte each (code i in byte i), in three steps of
// halving fields: 20-bit halves to 32-bit lanes, 10-bit quarters to 16-bit lanes, 5-bit codes to bytes.
uint64_t spread5(uint64_t v) {
  uint64_t x = (v & 0xFFFFF) | ((v >> 20) & 0xFFFFF) << 32;
  x = (x & 0x000003FF000003FFull) | (x & 0x000FFC00000FFC00ull) << 6;
  return (x & 0x001F001F001F001Full) | (x & 0x03E003E003E003E0ull) << 3;
}

uint64_t gather5(uint64_t x) {
  x = (x & 0x001F001F001F001Full) | (x & 0x1F001F001F001F00ull) >> 3;
  x = (x & 0x000003FF000003FFull) | (x & 0x03FF000003FF0000ull) >> 6;
  return (x & 0xFFFFF) | ((x >> 32) & 0xFFFFF) << 20;
}

// A group's 20 bytes as its four steps' 40 bits (whole-word loads: a 5-byte copy into a zeroed word
// stalled on store forwarding, 40% of the conversion's time)
constexpr uint64_t kLow40 = (uint64_t(1) << 40) - 1;

void load_steps5(const uint8_t* row, uint64_t* v) {
  uint64_t a, b;
  uint32_t c;
  std::memcpy(&a, row, 8);
  std::memcpy(&b, row + 8, 8);
  std::memcpy(&c, row + 16, 4);
  v[0] = a & kLow40;
  v[1] = (a >> 40 | b << 24) & kLow40;
  v[2] = (b >> 16) & kLow40;
  v[3] = b >> 56 | uint64_t(c) << 8;
}

void store_steps5(const uint64_t* v, uint8_t* row) {
  const uint64_t a = v[0] | v[1] << 40, b = v[1] >> 24 | v[2] << 16 | v[3] << 56;
  const uint32_t c = uint32_t(v[3] >> 8);
  std::memcpy(row, &a, 8);
  std::memcpy(row + 8, &b, 8);
  std::memcpy(row + 16, &c, 4);
}

// One row's 32 Q5_K codes of a group (20 bytes of its bit stream, eight codes to each 5 bytes) <-> the
// panel form's four step words and fifth-bit word of that row (panels.h): step s's byte b holds values
// s * 8 + b (low nibble) and s * 8 + 4 + b (high) of the group, the fifth-bit word's byte b at bit
// 2s + h the fifth bit of value s * 8 + 4h + b.
// Step s is the group's codes 8s .. 8s + 7 (5 bytes of the stream): bytes 0-3 of their spread word
// give the step's low nibbles, bytes 4-7 its high ones, bit 4 of each byte the fifth bits.
void pack_group5(const uint8_t* row, uint8_t* block) {
  uint64_t v[4];
  load_steps5(row, v);
  uint32_t top = 0;
  for (int s = 0; s < 4; ++s) {
    const uint64_t x = spread5(v[s]);
    const uint32_t lo = uint32_t(x), hi = uint32_t(x >> 32);
    const uint32_t step = (lo & kByteLow4) | (hi & kByteLow4) << 4;
    top |= ((lo >> 4) & kByteBit0) << (2 * s) | ((hi >> 4) & kByteBit0) << (2 * s + 1);
    std::memcpy(block + 64 * s, &step, 4);
  }
  std::memcpy(block + 256, &top, 4);
}

void unpack_group5(const uint8_t* block, uint8_t* row) {
  uint32_t top;
  std::memcpy(&top, block + 256, 4);
  uint64_t v[4];
  for (int s = 0; s < 4; ++s) {
    uint32_t step;
    std::memcpy(&step, block + 64 * s, 4);
    const uint32_t lo = (step & kByteLow4) | ((top >> (2 * s)) & kByteBit0) << 4;
    const uint32_t hi = ((step >> 4) & kByteLow4) | ((top >> (2 * s + 1)) & kByteBit0) << 4;
    v[s] = gather5(uint64_t(lo) | uint64_t(hi) << 32);
  }
  store_steps5(v, row);
}

// One panel's codes, row form <-> panel form, a group of Values values of a row (RowBytes of its bit
// stream) at a time through Pack / Unpack, row r's words at 4r of the group's PanelBytes (16 rows).
template <int Values, int RowBytes, int PanelBytes, void (*Pack)(const uint8_t*, uint8_t*), void (*Unpack)(const uint8_t*, uint8_t*)>
void codes_panel_by_groups(const uint8_t* src, uint8_t* dst, int K, bool to_panels) {
  const size_t row_bytes = size_t(K) / Values * RowBytes;
  for (int g = 0; g < K / Values; ++g) {
    for (int r = 0; r < kPanelRows; ++r) {
      const size_t row = size_t(r) * row_bytes + size_t(g) * RowBytes, block = size_t(g) * PanelBytes + 4 * r;
      if (to_panels) {
        Pack(src + row, dst + block);
      } else {
        Unpack(src + block, dst + row);
      }
    }
  }
}

// Q4_K: K / 2 bytes a row, 256 bytes a group of 32 of a panel
constexpr auto codes_panel = codes_panel_by_groups<32, 16, 256, pack_group4, unpack_group4>;
// Q5_K: K * 5 / 8 bytes a row, 320 bytes a group of 32 of a panel
constexpr auto codes_panel5 = codes_panel_by_groups<32, 20, 320, pack_group5, unpack_group5>;

// One row's 16 Q6_K codes of a group (12 bytes of its bit stream, four codes to each 3 bytes) <-> the
// panel form's three 32-bit words of that row (panels.h): vector k's codes (values 4k .. 4k + 3) a byte
// each, low nibbles in word k / 2 (half k % 2), top bits at bit 2k of the third word.
constexpr uint32_t kTopBits = 0x03030303u;

void pack_group6(const uint8_t* row, uint8_t* block) {
  uint32_t vec[4];
  for (int k = 0; k < 4; ++k) {
    const uint8_t* t = row + 3 * k;
    const uint32_t v = uint32_t(t[0]) | uint32_t(t[1]) << 8 | uint32_t(t[2]) << 16;
    vec[k] = (v & 63) | ((v >> 6) & 63) << 8 | ((v >> 12) & 63) << 16 | ((v >> 18) & 63) << 24;
  }
  const uint32_t n0 = (vec[0] & kByteLow4) | (vec[1] & kByteLow4) << 4;
  const uint32_t n1 = (vec[2] & kByteLow4) | (vec[3] & kByteLow4) << 4;
  uint32_t top = 0;
  for (int k = 0; k < 4; ++k) {
    top |= ((vec[k] >> 4) & kTopBits) << (2 * k);
  }
  std::memcpy(block, &n0, 4);
  std::memcpy(block + 64, &n1, 4);
  std::memcpy(block + 128, &top, 4);
}

void unpack_group6(const uint8_t* block, uint8_t* row) {
  uint32_t n0, n1, top;
  std::memcpy(&n0, block, 4);
  std::memcpy(&n1, block + 64, 4);
  std::memcpy(&top, block + 128, 4);
  const uint32_t nib[4] = {n0 & kByteLow4, (n0 >> 4) & kByteLow4, n1 & kByteLow4, (n1 >> 4) & kByteLow4};
  for (int k = 0; k < 4; ++k) {
    const uint32_t c = nib[k] | ((top >> (2 * k)) & kTopBits) << 4;
    const uint32_t v = (c & 63) | ((c >> 8) & 63) << 6 | ((c >> 16) & 63) << 12 | ((c >> 24) & 63) << 18;
    row[3 * k] = uint8_t(v);
    row[3 * k + 1] = uint8_t(v >> 8);
    row[3 * k + 2] = uint8_t(v >> 16);
  }
}

// Q6_K: K * 3 / 4 bytes a row, 192 bytes a group of 16 of a panel
constexpr auto codes_panel6 = codes_panel_by_groups<16, 12, 192, pack_group6, unpack_group6>;

// One panel's two-level scales (or biases), row form <-> panel form (K / 256 * (2 + Groups) bytes a
// row: Q4_K's kSuper, Groups 8; Q6_K's kSuper16, 16). noipa: GCC 12 at -O3 (its loop peeling) dropped
// both calls from the conversion's loop as if they had no effect, which left the new scales unwritten
// (tests/test_cpu_panels.py checks the round trip).
template <int Groups>
__attribute__((noipa)) void scales_panel(const uint8_t* src, uint8_t* dst, int K, bool to_panels) {
  constexpr int sb_bytes = 2 + Groups;
  const size_t row_bytes = size_t(K) / 256 * sb_bytes;
  for (int sb = 0; sb < K / 256; ++sb) {
    for (int r = 0; r < kPanelRows; ++r) {
      const size_t row = size_t(r) * row_bytes + size_t(sb) * sb_bytes;
      const size_t pan = size_t(sb) * kPanelRows * sb_bytes;
      // the float16 step, then the Groups multiples
      const size_t step_p = pan + size_t(r) * 2;
      if (to_panels) {
        std::memcpy(dst + step_p, src + row, 2);
      } else {
        std::memcpy(dst + row, src + step_p, 2);
      }
      for (int j = 0; j < Groups; ++j) {
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

namespace {

// Scales' bytes a row of the row form per super-block of 256 values: Q4_K and Q5_K 10, Q6_K 18.
int block_bytes(int bits) {
  return bits == 6 ? kSuper16Bytes : kSuperBytes;
}

} // namespace

bool is_panel_form(const mx::array& w, const mx::array& scales, int group_size, int bits) {
  const bool k32 = (bits == 4 || bits == 5) && group_size == 32, q6k = bits == 6 && group_size == 16;
  if (!(k32 || q6k) || scales.dtype() != mx::uint8 || w.ndim() < 2 || scales.ndim() != w.ndim()) {
    return false;
  }
  for (int d = 0; d + 2 < w.ndim(); ++d) { // stacked experts: the same number of matrices
    if (scales.shape(d) != w.shape(d)) {
      return false;
    }
  }
  return int64_t(scales.shape(-2)) * kPanelRows == w.shape(-2);
}

void check_panel_shapes(const mx::array& scales, const mx::array& biases, int K, int bits) {
  const bool fits = bits == 6 ? implicit_biases(biases) : biases.shape() == scales.shape();
  if (K % 256 != 0 || scales.shape(-1) != K / 16 * block_bytes(bits) || !fits) {
    throw std::invalid_argument(
        "a layer in 16-row panels needs K a multiple of 256 and scales (..., N / 16, K / 16 * 10) with biases "
        "alike (Q4_K, Q5_K), or scales (N / 16, K / 16 * 18) with a one-element bias ratio (Q6_K)");
  }
}

void check_panel_biases(const mx::array& biases, int bits) {
  if (bits == 6 && biases_of(biases).ratio != kQ6Ratio) {
    throw std::invalid_argument("a Q6_K layer in panels takes Q6_K's own bias ratio (-32) only");
  }
}

namespace {

// Every panel's codes, scales and biases, rows (all the matrices' rows, one after another) -> the
// other form; the outputs are fresh arrays (Q6_K's biases, the ratio, pass as they are). w, scales
// and biases must be evaluated.
std::tuple<mx::array, mx::array, mx::array> convert(const mx::array& w, const mx::array& scales, const mx::array& biases, int bits, bool to_panels) {
  const int rows = int(w.size() / size_t(w.shape(-1))); // every matrix's rows
  const int K = w.shape(-1) * 32 / bits;
  const size_t row_scale_bytes = size_t(K) / 256 * block_bytes(bits);
  const size_t panel_codes = size_t(kPanelRows) * K * bits / 8;
  const size_t panel_scales = size_t(kPanelRows) * row_scale_bytes;
  mx::Shape sshape = w.shape();
  sshape.back() = int(to_panels ? panel_scales : row_scale_bytes);
  sshape[sshape.size() - 2] = to_panels ? w.shape(-2) / kPanelRows : w.shape(-2);
  mx::array wo(mx::allocator::malloc(w.nbytes()), w.shape(), mx::uint32);
  mx::array so(mx::allocator::malloc(scales.nbytes()), sshape, mx::uint8);
  mx::array bo = bits == 6 ? biases : mx::array(mx::allocator::malloc(biases.nbytes()), sshape, mx::uint8);
  const DenseBytes wd = dense_bytes(w), sd = dense_bytes(scales), bd = dense_bytes(biases);
  const auto* wsrc = static_cast<const uint8_t*>(wd.data);
  const auto* ssrc = static_cast<const uint8_t*>(sd.data);
  const auto* bsrc = static_cast<const uint8_t*>(bd.data);
  uint8_t* wdst = reinterpret_cast<uint8_t*>(wo.data<uint32_t>());
  uint8_t* sdst = so.data<uint8_t>();
  each_panel(rows / kPanelRows, [&](int p) {
    if (bits == 6) {
      codes_panel6(wsrc + p * panel_codes, wdst + p * panel_codes, K, to_panels);
      scales_panel<kSuper16Groups>(ssrc + p * panel_scales, sdst + p * panel_scales, K, to_panels);
      return;
    }
    (bits == 5 ? codes_panel5 : codes_panel)(wsrc + p * panel_codes, wdst + p * panel_codes, K, to_panels);
    scales_panel<kSuperGroups>(ssrc + p * panel_scales, sdst + p * panel_scales, K, to_panels);
    scales_panel<kSuperGroups>(bsrc + p * panel_scales, bo.data<uint8_t>() + p * panel_scales, K, to_panels);
  });
  return {wo, so, bo};
}

} // namespace

namespace {

// A two-level layer's bits from its arrays in either form: Q6_K by its one-element bias ratio, else 5
// where the codes are 5 bits to each value the scales cover (Q5_K), else 4 (Q4_K; the shapes checked
// by the caller). The scales hold 10 bytes per 256 values of a row (the row form) or 10 per 16 values of
// 16 rows (a panel).
int panel_bits(const mx::array& w, const mx::array& scales, const mx::array& biases, bool in_panels) {
  if (implicit_biases(biases)) {
    return 6;
  }
  const int64_t K = int64_t(scales.shape(-1)) / kSuperBytes * (in_panels ? 16 : 256);
  return int64_t(w.shape(-1)) * 32 == K * 5 ? 5 : 4;
}

} // namespace

std::tuple<mx::array, mx::array, mx::array> panel_layout(const mx::array& w, const mx::array& scales, const mx::array& biases, bool to_panels) {
  if (w.dtype() != mx::uint32 || w.ndim() < 2 || scales.dtype() != mx::uint8 || scales.ndim() != w.ndim()) {
    throw std::invalid_argument("panel_layout takes a Q4_K, Q5_K or Q6_K layer: uint32 codes and two-level (uint8) scales");
  }
  const int bits = panel_bits(w, scales, biases, !to_panels);
  const bool q6k = bits == 6;
  const int N = w.shape(-2);
  const int K = int(int64_t(w.shape(-1)) * 32 / bits);
  mx::Shape expected = w.shape(); // the scales' shape in the form given
  expected[expected.size() - 2] = to_panels ? N : N / kPanelRows;
  expected.back() = int(size_t(K) / 256 * block_bytes(bits) * (to_panels ? 1 : kPanelRows));
  const bool biases_fit = q6k || (biases.dtype() == mx::uint8 && biases.shape() == scales.shape());
  if (N % kPanelRows != 0 || K % 256 != 0 || scales.shape() != expected || !biases_fit) {
    throw std::invalid_argument(
        "panel_layout needs N a multiple of 16, K of 256, and scales (..., N, K / 256 * 10) (to panels) or (..., "
        "N / 16, K / 16 * 10) (back) with biases alike (Q4_K, Q5_K), or scales (..., N, K / 256 * 18) or (..., N / "
        "16, K / 16 * 18) and a one-element bias ratio (Q6_K)");
  }
  mx::array wc = w, sc = scales, bc = biases;
  mx::eval({wc, sc, bc});
  check_panel_biases(bc, bits);
  return convert(wc, sc, bc, bits, to_panels);
}

std::tuple<mx::array, mx::array, mx::array> row_form(const mx::array& w, const mx::array& scales, const mx::array& biases) {
  return convert(w, scales, biases, panel_bits(w, scales, biases, true), false);
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

// Rows of x from which the AMX tiles take a panel-form product (see amx::q4_panels): from one whole tile
constexpr int kTileRows = 16;

#if defined(DUET_X86)
// Whether the CPU and OS give this process AMX tiles: asked of Linux once, at the first product that
// could use them (or panel_tiles()), so a process that never prefills on panels never asks
bool tiles_usable() {
  static const bool usable = panel_kernel_available() && amx::usable();
  return usable;
}

// Whether the tiles are on unless set_panel_tiles says otherwise: where usable and not DUET_CPU_AMX=0
bool tiles_by_default() {
  static const bool on = [] {
    const char* env = std::getenv("DUET_CPU_AMX");
    return !(env != nullptr && std::string(env) == "0") && tiles_usable();
  }();
  return on;
}

// set_panel_tiles's choice: -1 none (the default holds), else 0 or 1
std::atomic<int> g_tiles{-1};

bool tiles_on() {
  const int set = g_tiles.load(std::memory_order_relaxed);
  return set < 0 ? tiles_by_default() : set == 1;
}

// Whether M rows of x against a layer of the format (bits 4: Q4_K, 5: Q5_K, 6: Q6_K) go on AMX tiles
// with int8 math: Q4_K and Q5_K (Q6_K's groups of 16 measured slower there than on the VNNI kernel:
// 0.6-0.94x)
bool on_tiles(int bits, int M) {
  return M >= kTileRows && bits != 6 && tiles_on();
}

// The same with exact math (x in bfloat16 planes): every format, Q6_K's groups of 16 on half-width
// tiles (where the alternative is dequantize + a float32 GEMM, not the VNNI kernel)
bool on_tiles_bf16(int M) {
  return M >= kTileRows && tiles_on();
}

// The panel kernel for a format and M rows of x
auto panel_kernel(int bits, int M) {
  if (on_tiles(bits, M)) {
    return bits == 5 ? amx::q5_panels : amx::q4_panels;
  }
  return bits == 6 ? avx512::q6_panels : bits == 5 ? avx512::q5_panels : avx512::q8_panels;
}

// a's rows of x laid out for the tiles (into tx) where they go on the tiles: once, before the tasks
void tile_rows(PanelArgs& a, int bits, amx::TiledX& tx) {
  if (on_tiles(bits, a.M)) {
    amx::tile_x(a, tx);
    a.tq = tx.q.data();
    a.td = tx.d.data();
    a.ts = tx.sum.data();
  }
}

// kernel(a, p0, p1) over a's panels, split into tasks on the shared pool
void panel_tasks(const PanelArgs& a, int bits, void (*kernel)(const PanelArgs&, int, int)) {
  auto pool = shared_pool();
  const int panels = a.N / kPanelRows;
  const int tasks = std::min(panels, task_count(size_t(a.N) * a.K * bits / 8, a.M, pool->size()));
  if (tasks <= 1) {
    kernel(a, 0, panels);
    return;
  }
  pool->run(tasks, [&](int task) {
    const int p0 = int(int64_t(panels) * task / tasks), p1 = int(int64_t(panels) * (task + 1) / tasks);
    if (p0 < p1) {
      kernel(a, p0, p1);
    }
  });
}

// Rows of x a time whose bfloat16 planes go on the tiles at once (6 bytes a value: 12 MiB at K 8192)
constexpr int kTilesBf16Rows = 256;

// y (M, N) = M rows of x (M a multiple of 16) times a panel layer (Q4_K, Q5_K, Q6_K) with exact math on
// the tiles: each chunk of rows split into three bfloat16 planes laid out per tile and group
// (amx::tile_bf16_row, rows shared among the pool's threads: rows_on_pool), then the panels' tasks
void tiles_bf16(int planes, const void* x, mx::Dtype t, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int M, int N, int K, int bits) {
  const int G = K / 32;
  amx::TiledBf16 tiled; // one buffer for every chunk of rows
  for (int m0 = 0; m0 < M; m0 += kTilesBf16Rows) {
    const int mc = std::min(kTilesBf16Rows, M - m0);
    tiled.q.resize(size_t(mc) * K * 3);
    tiled.sum.resize(size_t(mc) * G);
    rows_on_pool(mc, [&](int r0, int r1) {
      std::vector<float> row(static_cast<size_t>(K)), sums(static_cast<size_t>(G));
      for (int m = r0; m < r1; ++m) {
        prepare_x_row(x, t, size_t(m0 + m) * K, 1, K, 32, 8, row.data(), sums.data(), planes); // int16: held x
        amx::tile_bf16_row(row.data(), sums.data(), m, K, tiled);
      }
    });
    PanelArgs a{nullptr, nullptr, nullptr, w, scales, biases, y + size_t(m0) * N, mc, N, K};
    a.tb = tiled.q.data();
    a.ts = tiled.sum.data();
    panel_tasks(a, bits, bits == 6 ? amx::q6_panels_bf16 : bits == 5 ? amx::q5_panels_bf16 : amx::q4_panels_bf16);
  }
}
#endif

// y (M, N) = M rows of x8 (quantize_rows_q8's layout) times the panel-form layer
// (bits 4: Q4_K, 5: Q5_K, 6: Q6_K), the panels split into tasks on the shared pool.
void panels_on_pool(const Q8Rows& x8, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int M, int N, int K, int bits) {
#if defined(DUET_X86)
  std::vector<int32_t> offsets;
  PanelArgs a{x8.q.data(), x8.unit.data(), x8.sum.data(), w, scales, biases, y, M, N, K};
  if (bits == 6) { // Q6_K's bias term (-32 times each scale) in integers, on every plane of x alike
    a.xoff = offsets_int8(x8.q, M, K, int32_t(kQ6Ratio), offsets);
  }
  amx::TiledX tiled;
  tile_rows(a, bits, tiled);
  panel_tasks(a, bits, panel_kernel(bits, M));
#else
  (void)x8, (void)w, (void)scales, (void)biases, (void)y, (void)M, (void)N, (void)K, (void)bits;
  throw std::logic_error("the int8 panel kernel needs x86-64");
#endif
}

} // namespace

bool panel_tiles() {
#if defined(DUET_X86)
  return tiles_on();
#else
  return false;
#endif
}

bool set_panel_tiles(bool on) {
#if defined(DUET_X86)
  g_tiles.store(on && tiles_usable() ? 1 : 0);
#else
  (void)on;
#endif
  return panel_tiles();
}

namespace {
// What reused_rows keys a panel product's rows of x by: the function that quantizes them (a variant's
// own) and the planes (1: int8 math's quantize_rows_q8, else split_rows_planes'), groups of 32.
uint64_t preparation(uintptr_t quantizer, int planes) {
  return uint64_t(quantizer) ^ (uint64_t(planes) << 60);
}
} // namespace

void run_panels(int planes, const void* x, mx::Dtype t, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int M, int N, int K, int bits) {
  if (planes == 1) {
    const Q8QuantizeFn q8 = q8_quantize_fn();
    const auto x8 = reused_rows(preparation(reinterpret_cast<uintptr_t>(q8), 1), x, t, M, K, [&] {
      return quantize_rows_q8(q8, x, t, row_starts(M, K), 1, K, 32);
    });
    panels_on_pool(*x8, w, scales, biases, y, M, N, K, bits);
    return;
  }
  int whole = 0; // rows on the tiles (x in three bfloat16 planes): whole tiles of 16
#if defined(DUET_X86)
  if (on_tiles_bf16(M)) {
    whole = M / kTileRows * kTileRows;
    tiles_bf16(planes, x, t, w, scales, biases, y, whole, N, K, bits);
  }
#endif
  if (whole == M) {
    return;
  }
  const void* rest = static_cast<const uint8_t*>(x) + size_t(whole) * K * mx::size_of(t);
#if defined(DUET_X86)
  const int rows = M - whole;
  const QuantizeXFn qx = quantize_x_fn();
  const auto split = reused_rows(preparation(reinterpret_cast<uintptr_t>(qx), planes), rest, t, rows, K, [&] {
    return split_rows_planes(qx, rest, t, row_starts(rows, K), 1, K, 32, planes);
  });
  const Q8Rows& xp = *split;
  PanelArgs a{xp.q.data(), xp.unit.data(), xp.sum.data(), w, scales, biases, y + size_t(whole) * N, rows, N, K};
  std::vector<int32_t> offsets;
  if (bits == 6) { // each plane's offsets, joined in the kernel as its sums are
    a.xoff = offsets_int8(xp.q, planes * rows, K, int32_t(kQ6Ratio), offsets);
  }
  panel_tasks(a, bits, avx512::joined_panels(bits, planes));
#else
  (void)rest, (void)w, (void)scales, (void)biases;
  throw std::logic_error("the panel kernel needs x86-64");
#endif
}

void gather_panels(const GatherRows& g, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int E, int N, int K, int bits, int planes) {
#if defined(DUET_X86)
  const int G = K / 32;
  const int sorted = g.start[E];
  const int U = int(g.unique.size());
  // each distinct row quantized once (element order; exact or int16 math: split into planes, plane j
  // of distinct row u at row j * U + u), then each expert's rows side by side, plane after plane:
  // expert e's rows start at planes * start[e], plane j's count[e] rows at planes * start[e] + j * count[e]
  const bool int8 = planes == 1;
  const Q8Rows u8 = int8 ? quantize_rows_q8(q8_quantize_fn(), g.x, g.t, g.unique, g.kstep, K, 32)
                         : split_rows_planes(quantize_x_fn(), g.x, g.t, g.unique, g.kstep, K, 32, planes);
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
  std::vector<int32_t> offsets; // Q6_K: each sorted row's bias term in integers (panels_on_pool)
  if (bits == 6) {
    offsets_int8(xq, planes * sorted, K, int32_t(kQ6Ratio), offsets);
  }
  // exact or int16 math: the VNNI kernel joins each row's planes itself (avx512::joined_panels);
  // where AMX tiles are on, the plane rows go through the int8 kernel (on the tiles from 16) and their
  // products are added
  const bool joined = !int8 && !tiles_on();
  std::vector<float> yplanes(int8 || joined ? 0 : size_t(planes) * sorted * N);
  float* yp = int8 || joined ? y : yplanes.data();
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
  const size_t expert_codes = size_t(N) * K * bits / 8;
  const size_t expert_scales = size_t(N) / kPanelRows * (size_t(K) / 16 * block_bytes(bits));
  // each expert's rows (laid out for the tiles where they go there), before the units run
  std::vector<PanelArgs> args(size_t(E), PanelArgs{});
  std::vector<amx::TiledX> tiled(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) {
    const size_t q0 = size_t(planes) * g.start[e];
    PanelArgs& a = args[size_t(e)];
    a = {xq.data() + q0 * K,
         xd.data() + q0 * (K / 8),
         xs.data() + q0 * G,
         w + e * expert_codes,
         scales + e * expert_scales,
         bits == 6 ? biases : biases + e * expert_scales, // Q6_K's: the ratio, not read
         (joined ? y + size_t(g.start[e]) * N : yp + q0 * N),
         joined ? g.count[e] : planes * g.count[e], // joined: plane j of row i at row j * count + i
         N,
         K};
    if (bits == 6) {
      a.xoff = offsets.data() + q0 * (K / 16);
    }
    if (!joined) {
      tile_rows(a, bits, tiled[size_t(e)]);
    }
  }
  pool->run(int(units.size()), [&](int i) {
    const Unit& u = units[size_t(i)];
    const PanelArgs& a = args[size_t(u.e)];
    (joined ? avx512::joined_panels(bits, planes) : panel_kernel(bits, a.M))(a, u.p0, u.p1);
  });
  if (!int8 && !joined) {
    for (int e = 0; e < E; ++e) {
      const size_t q0 = size_t(g.start[e]);
      sum_planes(yplanes.data() + planes * q0 * N, planes, g.count[e], N, y + q0 * N);
    }
  }
#else
  (void)g, (void)w, (void)scales, (void)biases, (void)y, (void)E, (void)N, (void)K, (void)bits, (void)planes;
  throw std::logic_error("the int8 panel kernel needs x86-64");
#endif
}

} // namespace duet_cpu
