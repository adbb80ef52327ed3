// The part every CPU primitive's eval_cpu shares: allocate its one output, declare its inputs and
// output to MLX's CPU command encoder (which keeps them alive and orders the work), enqueue the work.
#pragma once

#include <utility>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/stream.h"

namespace duet_cpu {

template <typename F>
void dispatch_cpu(const mlx::core::Stream& stream, const std::vector<mlx::core::array>& inputs, mlx::core::array& out, F&& work) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  encoder.dispatch(std::forward<F>(work));
}

// The same for a primitive with several outputs.
template <typename F>
void dispatch_cpu(const mlx::core::Stream& stream, const std::vector<mlx::core::array>& inputs, std::vector<mlx::core::array>& outputs, F&& work) {
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& out : outputs) {
    out.set_data(mlx::core::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
  }
  encoder.dispatch(std::forward<F>(work));
}

// f(T{}) with T the C++ type of a float dtype: float, float16_t or bfloat16_t (the kernels' three).
template <typename F>
void with_float_type(mlx::core::Dtype t, F&& f) {
  if (t == mlx::core::float32) {
    f(float{});
  } else if (t == mlx::core::float16) {
    f(mlx::core::float16_t{});
  } else {
    f(mlx::core::bfloat16_t{});
  }
}

// A dtype as the kernels' ScaleType (kernels.h): the type of a quantized matrix's scales (uint8: the
// two-level kSuper form, or in groups of 16 Q6_K's kSuper16), or of a KV pool's rows.
inline int scale_type(mlx::core::Dtype t, int group_size = 32) {
  if (t == mlx::core::uint8) {
    return group_size == 16 ? kSuper16 : kSuper;
  }
  return t == mlx::core::float32 ? kF32 : (t == mlx::core::float16 ? kF16 : kBF16);
}

// Bytes of scales (or biases) per weight row of G groups in ScaleType st.
inline size_t scale_row_bytes(int st, int G) {
  if (st == kSuper) {
    return size_t(G / kSuperGroups) * kSuperBytes;
  }
  if (st == kSuper16) {
    return size_t(G / kSuper16Groups) * kSuper16Bytes;
  }
  return size_t(G) * (st == kF32 ? 4 : 2);
}

} // namespace duet_cpu
