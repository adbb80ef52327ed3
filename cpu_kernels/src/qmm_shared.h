// What the quantized matmul (qmm.cpp) shares with the gather over experts (gather_qmm.cpp): the chosen
// variant's row kernel, the preparation of x's rows for it, reading inputs of any strides and the
// split into pool tasks. Defined in qmm.cpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "mlx/array.h"
#include "pool.h"

namespace mx = mlx::core;

namespace duet_cpu {

// Up to this many rows of x take the integer kernel (qmm_rows with QmmArgs::xq): its three byte
// dot products per value cost about a float multiply-add's once more rows share the unpacking (one
// 49152 x 576 matrix, one thread: 4-bit 1 row 2.5 -> 1.6 ms, 2 rows 2.9 -> 2.6 ms, 3 rows even).
constexpr int kIntegerRows = 2;

// The best (or forced) variant's row kernel, and its quantize_x (null where there is no integer
// kernel: the x rows then stay float).
using RowsFn = void (*)(const QmmArgs&, int, int);
using QuantizeXFn = void (*)(const float*, int, int, int8_t*, float*);
using Q8QuantizeFn = void (*)(const float*, int, int, int8_t*, float*, float*);
using Q8GemmFn = void (*)(const Q8GemmArgs&, int, int);
// Rows of x from which int8 math takes the GEMM (where the variant has one) instead of the row kernel:
// its panels cost their unpacking once however many rows pass, the row kernel's tiles once per 8 rows.
// Measured with 8-row tiles, 2 threads, GMAC/s GEMM vs rows: a 1B model's 8192 x 2048 Q4_K (two-level)
// matrices from DRAM at 16 rows 127-146 vs 137-139, 20 rows 137-149 vs 134-135, 24 rows 145-163 vs
// 129-130; 8192 x 2048 in L3 at 8 rows, 5-bit 100-133 vs 82-99, 6-bit (Q6_K) 104-111 vs 94-97, 8-bit
// 106-118 vs 97-100.
inline int gemm_rows(int bits) {
  return bits == 4 ? 20 : 8;
}
RowsFn qmm_rows_fn();
QuantizeXFn quantize_x_fn();
// The int8 kernel and its quantization of a row of x (kernels.h: q8_rows, q8_quantize), and the int8
// GEMM (null where the variant has none).
RowsFn q8_rows_fn();
Q8QuantizeFn q8_quantize_fn();
Q8GemmFn q8_gemm_fn();
// Whether int8 math multiplies M rows of x by B-bit weights with the GEMM (where there is one: it takes
// every width check_bits_and_groups lets through).
inline bool takes_q8_gemm(Q8GemmFn gemm, int M, int bits) {
  return gemm != nullptr && M >= gemm_rows(bits);
}
// Rows of x from which exact math multiplies by the int8 GEMM on three planes of x (qmm.cpp:
// run_planes_gemm; fewer take the integer or float row kernels), where the variant has both.
constexpr int kExactGemmRows = 3;
inline bool takes_x3_gemm(Q8GemmFn gemm, QuantizeXFn qx, int M) {
  return gemm != nullptr && qx != nullptr && M >= kExactGemmRows;
}
// a's product by the GEMM, its panels of 32 weight rows split into tasks on the shared pool
void q8_gemm_on_pool(Q8GemmFn gemm, const Q8GemmArgs& a);

bool supported_float(mx::Dtype t);
// Throws unless bits is 4, 5, 6 or 8 and group_size 32, 64 or 128 (or 16, Q6_K's: check_scale_format
// holds it to that form).
void check_bits_and_groups(int bits, int group_size);
// Throws unless planes (how many int8 planes x takes: quantized_matmul's) is 1, 2 or 3.
void check_planes(int planes);
// Throws unless scales and biases are one float dtype, or the two-level uint8 form (kernels.h: kSuper)
// of 4- or 5-bit weights in groups of 32.
void check_scale_format(const mx::array& scales, const mx::array& biases, int group_size, int bits);
// Whether biases is the one-element form (a ratio to the scales) rather than one per group.
inline bool implicit_biases(const mx::array& biases) {
  return biases.ndim() <= 1 && biases.size() == 1;
}
// Throws unless scales (and biases, or a one-element ratio) are lead + (K / group_size) floats, or
// lead + (K / 256 * 10) bytes in the two-level form.
void check_scale_shapes(const mx::array& scales, const mx::array& biases, mx::Shape lead, int K, int group_size);
float load_float(const void* p, size_t i, mx::Dtype t);

// One row of x as the int8 kernel reads it (q8 the variant's q8_quantize): from the float row as
// prepare_x_row leaves it, K bytes into q, K / 8 floats into scale, and the group sums of the
// quantized values (what the bias term multiplies) into xsum, overwriting the float ones.
void quantize_row_q8(Q8QuantizeFn q8, const float* row, int K, int group_size, int bits, int8_t* q, float* scale, float* xsum);
// Rows of x as the int8 GEMM and the panel kernel read them: quantized per run of 32 in element order,
// K bytes a row in q, K / 8 floats in unit (q8_quantize's layout), each group's sum of the quantized
// values in sum. Row i is K values of dtype t at elements first[i], first[i] + step, ...
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> unit;
  std::vector<float> sum;
};
// The first elements of M contiguous rows of K values from row m0: m0 K, (m0 + 1) K, ...
inline std::vector<int64_t> row_starts(int M, int K, int m0 = 0) {
  std::vector<int64_t> first(static_cast<size_t>(M));
  for (int m = 0; m < M; ++m) {
    first[size_t(m)] = int64_t(m0 + m) * K;
  }
  return first;
}
Q8Rows quantize_rows_q8(Q8QuantizeFn q8, const void* x, mx::Dtype t, const std::vector<int64_t>& first, int64_t step, int K, int group_size);
// Rows of x for the int8 GEMM and the panel kernel in planes of int8: each row split by qx (quantize_x:
// per run of 32, x ~= unit * (x1 * 2^14 + x2 * 2^7 + x3), three int8 pieces, each rounded to nearest)
// into its first `planes` pieces (3: exact math, x to within 2^-22 of a run's largest value; 2: int16
// math, x1 and x2 alone, to within 2^-15), plane j of row i as row j * M + i with its runs' scales
// unit * 2^14, unit * 2^7 and unit; the bias term rides on the first plane alone, through x's own float
// group sums (the others' sums are zero; int16 math: x held first, prepare_x_row, its sums the held x's).
Q8Rows split_rows_planes(QuantizeXFn qx, const void* x, mx::Dtype t, const std::vector<int64_t>& first, int64_t step, int K, int group_size, int planes);
// One row of x as quantize_x writes it (3 * K bytes, its layout for weights of `bits`) with its third
// piece zeroed, so the integer row kernel multiplies x as int16 math holds it (x1 and x2 alone).
void drop_third_piece(int8_t* xq, int K, int bits);
// One row of x as quantize_x writes it (3 * K bytes: per step of NX 32-byte vectors, NX = 6 for 4-bit
// weights, 3 for others) into out with each two steps' vectors side by side (QmmArgs::xq_pairs);
// false (nothing written) unless the row is a whole number of pairs of steps.
bool pair_steps_x(const int8_t* xq, int K, int bits, int8_t* out);
// One 4-bit-ordered int8 row of x (K bytes, quantize_row_q8's) into out with the middle 32 bytes of
// each whole 128 swapped (QmmArgs::x8_pairs).
void pair_runs_x8(const int8_t* x8, int K, int8_t* out);
// y = the sum of the planes' products yp (planes * M, N), the small pieces first: yp[i] + (yp[M + i] +
// yp[2M + i]) for three planes, yp[i] + yp[M + i] for two.
void sum_planes(const float* yp, int planes, int M, int N, float* y);
// The planes' products (2 or 3 floats per output) are held for at most this many bytes: rows of x go
// in chunks where N is large (a 152K-token vocabulary's LM head under a batch's verification: 80 rows
// would hold 146 MB in three planes).
constexpr size_t kX3ProductBytes = size_t(48) << 20;
// Exact (3) or int16 (2) math's products on planes of x: M contiguous rows of x (dtype t) in chunks of
// at least min_rows (kX3ProductBytes apart), each chunk split (split_rows_planes, groups of
// group_size), multiplied by product(split, planes * rows, yp) into yp (planes * rows, N), and its planes
// added into y's rows.
template <typename Product>
void planes_in_chunks(QuantizeXFn qx, int planes, const void* x, mx::Dtype t, int M, int N, int K, int group_size, int min_rows, float* y, Product&& product) {
  const int chunk = int(std::clamp<size_t>(kX3ProductBytes / (size_t(4) * planes * N), size_t(std::min(min_rows, M)), size_t(M)));
  std::vector<float> yp;
  for (int m0 = 0; m0 < M; m0 += chunk) {
    const int mc = std::min(chunk, M - m0);
    yp.resize(size_t(planes) * mc * N);
    product(split_rows_planes(qx, x, t, row_starts(mc, K, m0), 1, K, group_size, planes), planes * mc, yp.data());
    sum_planes(yp.data(), planes, mc, N, y + size_t(m0) * N);
  }
}

// A row-major copy of a's bytes when a is not row contiguous (rare: parameters and activations are).
struct DenseBytes {
  const void* data;
  std::vector<uint8_t> copy;
};
DenseBytes dense_bytes(const mx::array& a);

// The biases as the kernels take them (QmmArgs::biases, bias_ratio): their bytes, or, for a
// one-element biases array (a symmetric type's, which scales.implicit_biases leaves), null and that
// element, each group's bias being it times the group's scale.
struct Biases {
  DenseBytes bytes;
  const void* data;
  float ratio;
};
Biases biases_of(const mx::array& biases);

// Whether Q6_K's bias term goes into the integer dot products (QmmArgs::x8_offset, xq_offset): a
// whole-number ratio (-32) in [-128, 0], which keeps the offset sums within int32.
bool integer_offsets(int group_size, const Biases& bd);
// QmmArgs::x8_offset for M int8 rows of x (q8_quantize's element order), built in out: ratio times
// each group of 16 values' sum.
const int32_t* offsets_int8(const std::vector<int8_t>& xq, int M, int K, int32_t ratio, std::vector<int32_t>& out);
// QmmArgs::xq_offset for M rows of x as three bytes a value (quantize_x), built in out: ratio times
// each four values' sum.
const int32_t* offsets_three_byte(const std::vector<int8_t>& xq, int M, int K, int32_t ratio, std::vector<int32_t>& out);

// Splits work over weight_bytes into tasks that each read at least ~16 KB of weights (8 KB when
// M > 1 rows of x share them), up to 4 per thread: the pool's threads claim them in turn, so a late
// or slow thread costs little.
int task_count(size_t weight_bytes, int M, int threads);

// fn(m0, m1) over rows [0, M) of x, split on the pool from 8 rows (at 512 rows of K = 8192 preparing x
// was ~10% of a prefill's product); fewer are not worth a round trip.
template <typename F>
void rows_on_pool(int M, F&& fn) {
  auto pool = shared_pool();
  const int tasks = M >= 8 ? std::min(M, pool->size()) : 1;
  if (tasks <= 1) {
    fn(0, M);
    return;
  }
  pool->run(tasks, [&](int task) { fn(int(int64_t(M) * task / tasks), int(int64_t(M) * (task + 1) / tasks)); });
}

// One row of x (K values of dtype t at elements first, first + step, ...) as the kernel reads it:
// float32, each 4-bit run of 32 permuted to (evens, odds) to match the nibble unpacking, and its
// K / group_size group sums. With planes 2 (int16 math) x is first held as its first two pieces hold
// it (hold_two_pieces), so every path, integer or float, multiplies the same x and sums it alike.
void prepare_x_row(
    const void* x, mx::Dtype t, size_t first, int64_t step, int K, int group_size, int bits, float* row, float* xsum, int planes = 3);
// int16 math's x: each run of 32 of a float row (K a multiple of 32) replaced by quantize_x's first two
// pieces' value, d * (x1 + x2 / 2^7) (within d / 2^8 of it; a NaN or infinity makes its run NaN);
// nothing where the variant has no quantize_x (no integer kernels: int16 math is exact math there).
void hold_two_pieces(float* row, int K);
// The group sums of that held x from quantize_x's pieces and units of a row (bits 8 layout) into sums:
// what the bias term multiplies under int16 math, without holding the row first.
void held_group_sums(const int8_t* pieces, const float* unit, int K, int group_size, float* sums);
// The same from one row as quantize_x lays it out for weights of `bits` (4: per step of 64 values; else
// per run, held_group_sums), its units as quantize_x wrote them.
void held_sums_of_pieces(const int8_t* xq, const float* unit, int K, int bits, int group_size, float* sums);

} // namespace duet_cpu
