// Quantized matrix product kernels over MLX's affine layout, compiled once per instruction set.
//
// This header is included by the per-ISA translation units (kernels_<isa>.cpp), which must not
// include MLX or other headers with inline code: a function compiled with AVX-512 flags must never
// be picked by the linker for a CPU without AVX-512.
#pragma once

#include <cstddef>
#include <cstdint>

namespace duet_cpu {

// How a quantized matrix's scales and biases are stored (for a KV pool's rows, the first three are its
// dtype). kSuper: a K-quant's two levels as they are (Q4_K, Q5_K; groups of 32, K a multiple of 256):
// per row, per super-block of 8 groups, 10 bytes: a float16 step, then 8 uint8 multiples of it, each
// group's scale (or bias) being step * multiple. That is 4.625 bits a 4-bit weight to read, where a
// float16 scale and bias per group are 5.
// kSuper16: Q6_K's scales as its file holds them (6-bit codes in groups of 16, K a multiple of 256):
// per row, per super-block of 16 groups, 18 bytes: a float16 step, then 16 int8 multiples of it, each
// group's scale being step * multiple; no biases (each is -32 times its scale: a one-element ratio).
// 6.5625 bits a weight to read, the file's, where the 8-bit re-code in groups of 32 is 8.5.
enum ScaleType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kSuper = 3, kSuper16 = 4 };
constexpr int kSuperGroups = 8; // groups per super-block
constexpr int kSuperBytes = 10; // bytes per super-block: the float16 step, 8 multiples
// rows of weights per panel in the panel form of 4-bit two-level layers (panels.h)
constexpr int kPanelRows = 16;
constexpr int kSuper16Groups = 16; // groups of 16 per kSuper16 super-block
constexpr int kSuper16Bytes = 18; // bytes per kSuper16 super-block: the float16 step, 16 int8 multiples

struct QmmArgs {
  const float* x; // (M, K) float32; for bits == 4 each run of 32 is stored evens first, then odds
  const float* xsum; // (M, K / group_size): sum of x over each group
  const uint8_t* w; // (N, K * bits / 8) bytes, a little-endian bitstream per row
  const void* scales; // (N, K / group_size) of scale_type (kSuper: (N, K / 256 * kSuperBytes) bytes)
  const void* biases; // (N, K / group_size) of scale_type, likewise; null: bias_ratio * each scale
  float* y; // (M, N)
  int M;
  int N;
  int K;
  int group_size;
  int bits;
  int scale_type;
  // The rows of x (at most two: qmm.cpp's kIntegerRows) as three signed bytes per value and a unit
  // per 32 (quantize_x, row after row), or null for the float kernel.
  const int8_t* xq = nullptr;
  const float* xunit = nullptr;
  // With xq and one row of x (decode): the same bytes with each two steps' vectors side by side, as
  // the 512-bit loop (row_int8_wide) reads them: for steps s, s + 1 (s even; a step is 64 values of
  // 4-bit weights, 32 of others, NX = 6 or 3 vectors of 32 bytes), vector j of s then vector j of
  // s + 1, for each j (pair_steps_x, qmm.cpp), or null.
  const int8_t* xq_pairs = nullptr;
  // With xq and Q6_K's scales (kSuper16): per row of x, K / 4 int32, bias_ratio times the sum of each
  // four values of x as integers (x1 * 2^14 + x2 * 2^7 + x3), added to the dot products so that they
  // are those of the codes less 32 (no bias term left), or null.
  const int32_t* xq_offset = nullptr;
  // The rows of x as int8 for the int8 kernel (q8_rows, int8_impl.inc: one byte per value, K per row,
  // and K / 8 floats of scales per row, as q8_quantize writes them), or null.
  const int8_t* x8 = nullptr;
  const float* x8_scale = nullptr;
  // With x8, one row of x and 4-bit weights: the row with the middle 32 bytes of each 128 swapped, so
  // that the two pairs of runs a 512-bit step of the one-row loop takes have their evens, then their
  // odds, side by side (pair_runs_x8, qmm.cpp), or null.
  const int8_t* x8_pairs = nullptr;
  // With x8 and Q6_K's scales (kSuper16): per row of x, K / 16 int32, bias_ratio times the sum of each
  // group's 16 values of x8, so that a group's dot products started from them (in its first lane)
  // are those of the codes less 32 (the bias term in integers, where the 512-bit loop reads it), or
  // null.
  const int32_t* x8_offset = nullptr;
  // With biases null, each group's bias is this times its scale (a symmetric type's -zero point:
  // Q8_0's -128, Q4_0's -8; a power of two, so the product is the stored bias exactly).
  float bias_ratio = 0.0f;
};

// The int8 GEMM (kernels_gemm_avx512.cpp): y (M, N) = the product of many rows of x, quantized per run
// of 32 in element order (q8_quantize with bits != 4), with the 4-, 5-, 6- or 8-bit weights.
struct Q8GemmArgs {
  const int8_t* xq; // (M, K) int8, element order
  const float* xd; // (M, K / 8): each run's scale d four times over (q8_quantize's layout)
  const float* xsum; // (M, K / group_size): each group's sum of d * q
  const uint8_t* w; // (N, K * bits / 8) bytes, a little-endian bitstream per row; bits 4, 5, 6 or 8
  const void* scales; // (N, K / group_size) of scale_type (kSuper: (N, K / 256 * kSuperBytes) bytes)
  const void* biases; // (N, K / group_size) of scale_type, likewise; null: bias_ratio * each scale
  float* y; // (M, N), written
  int M;
  int N;
  int K; // a multiple of 32
  int group_size; // 32, 64 or 128 (16: Q6_K's kSuper16)
  int bits;
  int scale_type;
  float bias_ratio = 0.0f; // as QmmArgs::bias_ratio
};

// One chunk of n <= 32 keys for the paged attention kernel (paged_attention.cpp): R query rows (scaled
// by the softmax scale), each seeing keys [j0[r], j1[r]) of the chunk, update their running max m,
// sum l and (R, Dv) accumulator acc (online softmax, float32).
struct AttendChunk {
  const float* q; // (R, D)
  const void* const* k; // 32 key rows of D values of kv_type: the chunk's n, then rows of zeros
  const void* const* v; // 32 value rows of Dv values, likewise
  const int* j0;
  const int* j1;
  float* m;
  float* l;
  float* acc;
  int n;
  int R;
  int D;
  int Dv;
  int kv_type; // ScaleType of the pool's rows
  // the next chunk's n_next key and value rows (the same head's), prefetched into L2 as this chunk's
  // are read: a steady trickle the loads then find in cache (a burst of prefetches per chunk, or
  // none, left decode at a 1K context waiting on memory at ~6 GB/s)
  const void* const* k_next = nullptr;
  const void* const* v_next = nullptr;
  int n_next = 0;
};

// A few query tokens of a row (decode: one; a verification pass: 1 + the proposed tokens) over its
// paged KV, for H KV heads side by side (heads h0 .. h0 + H - 1 of the pool's Hkv), each with its R
// query rows (a token's GQA heads, token after token), row r seeing tokens [lo[r], hi[r]) within [t0,
// t1): scores for the stretch, one softmax per query row over its own tokens, then the values, where
// AttendChunk's online softmax rescales per chunk of 32. A row's result does not depend on the other
// rows (the same floats in the same order as the row alone), so a verification pass gives each token
// what decoding it would. Both passes read the pool a block at a time, every head of a token before
// the next token (front to back), and prefetch the next block's rows as they go. m and l come in as
// the row's start (a sink: its logit and 1; else -inf and 0) and leave as the max and sum of the
// stretch's softmax; acc (zeros in) leaves unnormalised, so a stretch of a row split between tasks
// merges as AttendChunk's results do. D and Dv multiples of 16.
struct AttendDecode {
  const float* q; // (H, R, D): scaled by the softmax scale
  const void* k; // the pool's keys (slots, Hkv, D) of kv_type, from head h0 of slot 0
  const void* v; // its values (slots, Hkv, Dv), likewise
  const int32_t* table; // the row's block table
  int block_size;
  int Hkv;
  int H;
  int R;
  int D;
  int Dv;
  int kv_type;
  int t0;
  int t1;
  const int* lo; // (R,): row r's first token (>= t0)
  const int* hi; // (R,): one past its last (<= t1)
  float* m; // (H, R)
  float* l; // (H, R)
  float* acc; // (H, R, Dv)
};

// q8_quantize: one float32 row of x (K values, in the 4-bit order when bits == 4) as int8 per run of
// 32 with one scale each (K bytes into q, K / 8 floats into scale; layout in int8_impl.inc) and each
// run's d * sum(q) (K / 32 floats into run_sum), the same in every variant. q8_rows: y[:, n0:n1] from them (QmmArgs::x8, x8_scale, xsum).
// qmm_rows: y[:, n0:n1] for every row of x. dequant_rows: rows n0..n1 of the dequantized weights
// into out (N, K) float32 (x, xsum, y and M unused); dequant_panels: the same for a Q4_K or Q6_K
// layer in the panel form (panels.h; a.bits says which), rows 16 p0 .. 16 p1, bit for bit dequant_rows' values of its
// row form. Each ISA namespace defines them all.
namespace base {
void q8_quantize(const float* x, int K, int bits, int8_t* q, float* scale, float* run_sum);
void q8_rows(const QmmArgs& a, int n0, int n1);
void attend_chunk(const AttendChunk& c);
void swiglu(const float* g, const float* u, float* y, size_t n);
void qmm_rows(const QmmArgs& a, int n0, int n1);
void dequant_rows(const QmmArgs& a, int n0, int n1, float* out);
void dequant_panels(const QmmArgs& a, int p0, int p1, float* out);
}
namespace avx2 {
void q8_quantize(const float* x, int K, int bits, int8_t* q, float* scale, float* run_sum);
void q8_rows(const QmmArgs& a, int n0, int n1);
void attend_chunk(const AttendChunk& c);
void swiglu(const float* g, const float* u, float* y, size_t n);
void qmm_rows(const QmmArgs& a, int n0, int n1);
void dequant_rows(const QmmArgs& a, int n0, int n1, float* out);
void dequant_panels(const QmmArgs& a, int p0, int p1, float* out);
}
namespace avx512 {
// y[:, n0:n1] of the int8 GEMM (AVX-512 VNNI; n0 a multiple of 32)
void q8_gemm(const Q8GemmArgs& a, int n0, int n1);
void q8_quantize(const float* x, int K, int bits, int8_t* q, float* scale, float* run_sum);
void q8_rows(const QmmArgs& a, int n0, int n1);
// x (K values, K a multiple of 32; in the 4-bit order when bits == 4, K then a multiple of 64) as
// the integer form qmm_rows takes in QmmArgs::xq: q holds 3 * K bytes, unit K / 8 floats.
void quantize_x(const float* x, int K, int bits, int8_t* q, float* unit);
void attend_chunk(const AttendChunk& c);
void attend_decode(const AttendDecode& a);
void swiglu(const float* g, const float* u, float* y, size_t n);
void qmm_rows(const QmmArgs& a, int n0, int n1);
void dequant_rows(const QmmArgs& a, int n0, int n1, float* out);
void dequant_panels(const QmmArgs& a, int p0, int p1, float* out);
}

// The best variant's attend_chunk and swiglu (y = silu(g) * u over n floats) for this CPU (or the
// one set_isa forced); defined in qmm.cpp.
using AttendFn = void (*)(const AttendChunk&);
AttendFn attend_chunk_fn();
// Its attend_decode (AVX-512 only; nullptr elsewhere, where attend_chunk does decode too)
using AttendDecodeFn = void (*)(const AttendDecode&);
AttendDecodeFn attend_decode_fn();
using SwigluFn = void (*)(const float*, const float*, float*, size_t);
SwigluFn swiglu_fn();

} // namespace duet_cpu
