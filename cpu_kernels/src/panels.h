// K-quant weights in 16-row panels: the layout the int8 panel kernel reads (kernels_panel_avx512.cpp).
//
// The row form (kernels.h: kSuper, kSuper16) keeps each weight row's codes as one bit stream, so a
// product unpacks a row's codes and multiplies them with each row of x. The panel form keeps the same
// bytes regrouped by 16 rows: one 64-byte load holds four consecutive codes of each of 16 rows, so that
// one vpdpbusd multiplies them with four values of one row of x broadcast to every lane, and 16 outputs
// accumulate side by side in one register. No unpacking per row of x, no horizontal sums, and the
// group's scales are applied to 16 rows at once (llama.cpp's repacked Q4_K does the same for the
// same reason). Bytes are unchanged (Q4_K 4.625 bits a weight, Q5_K 5.625, Q6_K 6.5625).
//
// Panel p holds rows 16p..16p+15 where the row form held them (the same byte range of w, scales and
// biases), reordered. Q4_K (4-bit, groups of 32, kSuper):
//   * codes: per group g of 32 values, per step s of 8 values, 64 bytes: row r's 4 bytes at 4r, byte b
//     holding value g*32 + s*8 + b in its low nibble and value g*32 + s*8 + 4 + b in its high nibble;
//   * scales (and biases alike): per super-block of 256 values, 160 bytes: the 16 rows' float16 steps,
//     then per group j of its 8 the 16 rows' uint8 multiples.
// Q5_K (5-bit, groups of 32, kSuper as Q4_K's): per group g, 320 bytes: the low 4 bits of each code
//   laid out as Q4_K's four steps (256 bytes), then 64 bytes of fifth bits: row r's byte b at 4r + b
//   holding at bit 2s + h the fifth bit of value g*32 + s*8 + 4h + b (the code whose low bits are in
//   step s's byte b, low nibble h = 0, high h = 1); scales and biases as Q4_K's.
// Q6_K (6-bit, groups of 16, kSuper16; biases the one-element ratio -32, unchanged; experts' stacks too):
//   * codes: per group g of 16 values, 192 bytes: two 64-byte steps of low nibbles laid out as Q4_K's
//     (step s: row r's byte b at 4r + b, value g*16 + s*8 + b's low 4 bits in its low nibble, value
//     g*16 + s*8 + 4 + b's in its high), then 64 bytes of top bits: row r's byte b at 4r + b holding the
//     top 2 bits of value g*16 + 4k + b at bits 2k and 2k + 1 (k = 0..3);
//   * scales: per super-block of 256 values, 288 bytes: the 16 rows' float16 steps, then per group j of
//     its 16 the 16 rows' int8 multiples.
// A layer in the panel form says so by its scales' shape: (N / 16, K / 16 * 10) (Q6_K: K / 16 * 18)
// where the row form's is (N, K / 256 * 10) (18), so nothing that reads the row form can take it for
// one.
#pragma once

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "mlx/array.h"

namespace duet_cpu {

struct PanelArgs {
  const int8_t* xq; // (M, K) int8, element order
  const float* xd; // (M, K / 8): each run's scale d four times over (q8_quantize's layout)
  const float* xsum; // (M, K / 32): each group's sum of d * q
  const uint8_t* w; // (N, K * bits / 8) bytes in panels
  const uint8_t* scales; // (N / 16, K / 16 * 10) bytes in panels
  const uint8_t* biases; // likewise
  float* y; // (M, N), written
  int M;
  int N; // a multiple of 16
  int K; // a multiple of 256
  // Q6_K (biases unused): (M, K / 16) int32, -32 times each group of 16 values' sum of xq, where each
  // group's integer dot products start (offsets_int8), so they are those of the codes less 32
  const int32_t* xoff = nullptr;
  // x's whole tiles of 16 rows as the AMX kernel loads them (amx::tile_x: the caller lays them out
  // once, before the tasks); unused by the VNNI kernel
  const int8_t* tq = nullptr;
  const float* td = nullptr;
  const float* ts = nullptr;
  // exact math on the tiles: x's three bfloat16 planes as amx::tile_bf16_row laid them out (ts its group
  // sums)
  const uint16_t* tb = nullptr;
};

// Q6_K's biases: each -32 times its scale (the ratio a layer in panels holds; panel_layout checks it)
constexpr float kQ6Ratio = -32.0f;

#if defined(DUET_X86)
namespace avx512 {
// y[:, 16 * p0 : 16 * p1] (AVX-512 VNNI): Q4_K panels, Q5_K panels, Q6_K panels (with a.xoff)
void q8_panels(const PanelArgs& a, int p0, int p1);
void q5_panels(const PanelArgs& a, int p0, int p1);
void q6_panels(const PanelArgs& a, int p0, int p1);
// The same for a format (bits 4: Q4_K, 5: Q5_K, 6: Q6_K) with exact math (planes 3) or int16 math (2):
// M rows of x as split_rows_planes lays out their planes (plane j of row i at row j * M + i of a.xq,
// a.xd, a.xoff; x's group sums a.xsum on plane 0), each row's planes' int32 sums joined per group
// (s1 * 2^14 + s2 * 2^7 + s3, or s1 * 2^7 + s2: exact) and made float once
using PanelFn = void (*)(const PanelArgs& a, int p0, int p1);
PanelFn joined_panels(int bits, int planes);
} // namespace avx512
namespace amx {
// Whether this CPU has AMX tiles with int8 and bfloat16 products (AMX-TILE, AMX-INT8, AMX-BF16; and
// AVX512-BF16, which splits x for them) and the OS lets this process use them (asks Linux for the
// permission: ARCH_REQ_XCOMP_PERM)
bool usable();
// The same products as avx512's on AMX tiles (kernels_panel_amx.cpp), bit for bit: whole tiles of 16
// rows of x (as tile_x laid them out in a.tq, td, ts), the rows past them on the VNNI kernel
void q4_panels(const PanelArgs& a, int p0, int p1);
void q5_panels(const PanelArgs& a, int p0, int p1);
// x's whole tiles of 16 rows (groups of 32) laid out for the tiles: per tile and group, the 16 rows' 32
// bytes of x as one 512-byte block (a tile load of consecutive lines, where x's own rows lie K bytes
// apart), and their run scales and group sums side by side (PanelArgs::tq, td, ts)
struct TiledX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> sum;
};
void tile_x(const PanelArgs& a, TiledX& out);
// Exact math on the tiles in bfloat16 (AMX-BF16): each float32 row of x as three bfloat16 planes whose
// sum is x exactly, per tile and group the three planes' 16 x 32 values (TiledBf16::q) and x's float
// group sums (sum); tile_bf16_row lays out row m (out sized for whole tiles of 16 rows beforehand)
struct TiledBf16 {
  // n values left unset: every one is written before it is read, and zeroing megabytes a product (a
  // vector's resize) measured ~1% of an exact prefill
  template <typename T>
  struct Buffer {
    std::unique_ptr<T[]> p;
    size_t n = 0;
    void resize(size_t count) {
      if (count > n) {
        p.reset(new T[count]); // default-initialized: not zeroed
        n = count;
      }
    }
    T* data() const { return p.get(); }
    T& operator[](size_t i) const { return p[i]; }
  };
  Buffer<uint16_t> q;
  Buffer<float> sum;
};
void tile_bf16_row(const float* row, const float* sums, int m, int K, TiledBf16& out);
// y = M rows of x (M a multiple of 16, a.tb and a.ts as tile_bf16_row laid them out) times Q4_K, Q5_K or
// Q6_K panels p0..p1: each code exact in bfloat16 (Q6_K's less 32, its bias), every product exact in
// float32, the three planes' products accumulated by the tiles in float32 (a float32 GEMM's rounding),
// scaled per group (Q6_K's of 16: half-width tiles)
void q4_panels_bf16(const PanelArgs& a, int p0, int p1);
void q5_panels_bf16(const PanelArgs& a, int p0, int p1);
void q6_panels_bf16(const PanelArgs& a, int p0, int p1);
} // namespace amx
#endif

// Whether the panel kernel's many-row products run on AMX tiles: where amx::usable() and not turned
// off (set_panel_tiles(false), or DUET_CPU_AMX=0 in the environment)
bool panel_tiles();
// Turns the AMX path on (where usable; returns whether it is now on) or off: for A/B runs and tests.
bool set_panel_tiles(bool on);

// Whether (w, scales) are a layer (or a stack of experts, w (E, N, ...)) in the panel form: Q4_K's or
// Q5_K's (4- or 5-bit, groups of 32, two-level scales) or Q6_K's (6-bit, groups of 16, kSuper16);
// check_panel_shapes throws unless its scales and biases fit K.
bool is_panel_form(const mlx::core::array& w, const mlx::core::array& scales, int group_size, int bits);
void check_panel_shapes(const mlx::core::array& scales, const mlx::core::array& biases, int K, int bits);
// Throws unless a Q6_K layer's biases (evaluated) are its own ratio, -32, which the panel kernel builds
// in as integer offsets (nothing to check for Q4_K and Q5_K).
void check_panel_biases(const mlx::core::array& biases, int bits);

// A Q4_K or Q5_K layer (4- or 5-bit, two-level scales, groups of 32) or a Q6_K layer (6-bit, kSuper16 scales, biases
// the one-element ratio -32), or a stack of either (..., N, ...), N a multiple of 16 and K of 256, into the panel form (to_panels) or back into the row form; the values are unchanged (the form
// is read from the shapes). Evaluates its inputs (Python's call).
std::tuple<mlx::core::array, mlx::core::array, mlx::core::array>
panel_layout(const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases, bool to_panels);

// A panel-form layer's (or stack's) row-form copy, from evaluated arrays (inside a primitive's eval):
// for the paths that read rows (exact math, dequantize, an instruction set without the panel kernel).
std::tuple<mlx::core::array, mlx::core::array, mlx::core::array>
row_form(const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases);

// Whether the int8 panel kernel runs here (AVX-512 VNNI chosen); else a panel-form layer's products
// take the row form's paths on a row-form copy.
bool panel_kernel_available();
// Whether a panel-form layer's products run on the panel kernel with this math (int8, or exact/int16
// where the variant splits x into int8 planes); else they take the row form's paths on a row-form copy.
bool panel_kernel_runs(bool int8);

// y (M, N) float32 = x (M rows, dtype t) times the panel-form layer (bits 4: Q4_K, 5: Q5_K, 6: Q6_K,
// whose biases are not read), x in `planes` int8 planes (quantized_matmul's): 1, int8 math; 3, exact
// math, each row of x split into three int8 planes (split_rows_planes, as the exact integer kernels
// split it), whose int32 sums the panel kernel joins per group exactly before scaling them
// (avx512::joined_panels): float32's accuracy, as the row form's exact paths; 2, int16 math, the first
// two of those planes. With 2 or 3 planes, whole tiles of 16 rows go on AMX tiles
// instead where they are on (x, held to its two pieces with 2: prepare_x_row, in three bfloat16 planes
// that sum to it exactly).
void run_panels(int planes, const void* x, mlx::core::Dtype t, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int M, int N, int K, int bits);

// The rows of a gather over experts (gather_qmm.cpp), sorted by expert: the distinct rows of x (their
// element offsets in x, every kstep-th value a row), each sorted pair's distinct row, the pairs' order
// and each expert's first sorted pair and count.
struct GatherRows {
  const void* x;
  mlx::core::Dtype t;
  int64_t kstep;
  const std::vector<int64_t>& unique;
  const std::vector<int>& source;
  const std::vector<int>& order;
  const std::vector<int>& start;
  const std::vector<int>& count;
};

// y (sorted pairs, N) float32: each pair's row of x times its expert's matrix, the E experts' w
// (E, N, K * bits / 8 bytes), scales and biases in panels (bits 4: Q4_K; 5: Q5_K; 6: Q6_K, biases the ratio),
// x in `planes` int8 planes as run_panels takes them (2 or 3 joined by the kernel; where AMX tiles are
// on, the plane rows through the int8 kernel and their products added); the panel kernel must be available.
void gather_panels(const GatherRows& g, const uint8_t* w, const uint8_t* scales, const uint8_t* biases, float* y, int E, int N, int K, int bits, int planes);

} // namespace duet_cpu
