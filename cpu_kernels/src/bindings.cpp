// Python bindings: cpu_kernels._ext (import mlx.core first; NB_DOMAIN mlx shares its array type).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "gather_qmm.h"
#include "moe_route.h"
#include "paged_attention.h"
#include "panels.h"
#include "pool.h"
#include "qmm.h"
#include "rms_norm.h"
#include "rope.h"
#include "swiglu.h"
#include "two_level.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "Duet's CPU kernels: quantized matrix products over MLX's affine layout";
  m.def(
      "quantized_matmul",
      [](const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
         int bits, bool int8, int x_planes, mx::StreamOrDevice s) {
        return duet_cpu::quantized_matmul(x, w, scales, biases, group_size, bits, int8 ? 1 : x_planes, s);
      },
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "int8"_a = false,
      "x_planes"_a = 3,
      "stream"_a = nb::none(),
      "x @ dequantize(w, scales, biases).T for MLX's affine layout (w packed as mx.quantize packs it); "
      "x_planes: how x meets the weights, 3 exact (float32's accuracy), 2 int16 (x to within 2^-15 of "
      "each run of 32's largest value), 1 int8 (x quantized to int8 per 32 values); int8=True: 1.");
  m.def(
      "gather_quantized_matmul",
      [](const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
         const mx::array& indices, int group_size, int bits, bool int8, int x_planes, mx::StreamOrDevice s) {
        return duet_cpu::gather_quantized_matmul(x, w, scales, biases, indices, group_size, bits, int8 ? 1 : x_planes, s);
      },
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "indices"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "int8"_a = false,
      "x_planes"_a = 3,
      "stream"_a = nb::none(),
      "x[b, m] @ dequantize(w[indices[b]]).T for stacked affine experts (mx.gather_qmm with rhs_indices, "
      "transpose=True); x (..., M, K), indices broadcasting with x's batch dims, out (batch, M, N).");
  m.def(
      "dequantize",
      &duet_cpu::dequantize,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "dequantize(w, scales, biases) as float32 (N, K), multi-threaded.");
  m.def(
      "moe_route",
      &duet_cpu::moe_route,
      "x"_a,
      "w"_a,
      "k"_a,
      "normalize"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "A mixture of experts' routing in one op: softmax(x @ w.T)'s k largest probabilities (renormalised "
      "to sum to 1 with normalize) and their experts; returns [indices (..., k) uint32, scores (..., k)].");
  m.def(
      "two_level_scales",
      &duet_cpu::two_level_scales,
      "values"_a,
      "float32 per-group scales or biases (..., G) as the kernels' two-level uint8 form (..., G / 8 * 10): "
      "per 8 groups a float16 step (their largest magnitude / 63) and 8 uint8 multiples; None unless "
      "exact.");
  m.def(
      "panel_layout",
      &duet_cpu::panel_layout,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "to_panels"_a,
      "A Q4_K layer (4-bit, two-level scales and biases, groups of 32) or a stack of them, or one Q6_K matrix "
      "(6-bit, kSuper16 scales, the one-element bias ratio -32), N a multiple of 16 and K of 256, in 16-row "
      "panels, the int8 panel kernel's layout (scales then (N / 16, K / 16 * 10), Q6_K's (N / 16, K / 16 * 18)), "
      "or back; returns (w, scales, biases).");
  m.def("panel_kernel", &duet_cpu::panel_kernel_available, "Whether the int8 panel kernel runs here (AVX-512 VNNI).");
  m.def("panel_tiles", &duet_cpu::panel_tiles, "Whether the panel kernel's products of 16 or more rows of x run on AMX tiles.");
  m.def(
      "set_panel_tiles",
      &duet_cpu::set_panel_tiles,
      "on"_a,
      "Turn the AMX tiles' path on (where the CPU and OS allow it) or off; returns whether it is on.");
  m.def(
      "rms_norm",
      &duet_cpu::rms_norm,
      "x"_a,
      "w"_a,
      "eps"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "x * rsqrt(mean(x^2, -1) + eps) * w in one op, float32 accumulation (mx.fast.rms_norm's semantics).");
  m.def(
      "rope",
      &duet_cpu::rope,
      "x"_a,
      "dims"_a,
      "traditional"_a,
      "base"_a,
      "scale"_a,
      "offset"_a,
      "freqs"_a = nb::none(),
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Rotary position embedding in one op (mx.fast.rope's semantics; offset an int array, scalar or (B,)).");
  m.def(
      "paged_attention",
      &duet_cpu::paged_attention,
      "q"_a,
      "k"_a,
      "v"_a,
      "table"_a,
      "lens"_a,
      "scale"_a,
      "block_size"_a,
      "window"_a = 0,
      "sinks"_a = nb::none(),
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Each row's last L query tokens, causally over its KV in the paged pool, read through the block table (one op).");
  m.def(
      "swiglu",
      &duet_cpu::swiglu,
      "gate"_a,
      "up"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "silu(gate) * up in one op with a vectorised exp (mlx-lm's swiglu).");
  m.def("set_num_threads", &duet_cpu::set_num_threads, "threads"_a, "Threads the kernels use (1..1024).");
  m.def("num_threads", &duet_cpu::num_threads);
  m.def("isa", &duet_cpu::isa, "The instruction set the kernels run with: avx512, avx2 or base.");
  m.def("set_isa", &duet_cpu::set_isa, "name"_a, "Force a kernel variant ('' = best); for tests.");
}
