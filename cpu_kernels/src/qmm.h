// duet_cpu::quantized_matmul: x @ dequantize(w, scales, biases).T as a lazy MLX op evaluated by the
// CPU kernels (kernels.h), multi-threaded over output rows.
#pragma once

#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace duet_cpu {

// x (..., K) float32/float16/bfloat16; w uint32 (N, K * bits / 32) as mx.quantize packs it;
// scales and biases (N, K / group_size). Returns (..., N) in the promoted dtype of x and scales.
// planes: how x meets the weights (cpu_math): 1, quantized to int8 per run of 32 ("int8": the int8
// kernel, int8_impl.inc); 2, two int8 planes, x to within 2^-15 of a run's largest value ("int16": every
// integer kernel on them, the row kernel with x's third piece zeroed; exact math's kernels where the
// variant has no integer kernels); 3, the float32-accurate kernels ("exact").
mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    int planes = 3,
    mx::StreamOrDevice s = {});

// dequantize(w, scales, biases) as float32 (N, K): the operand of a dense GEMM when x has many rows
// (prefill), where a BLAS GEMM beats the fused kernel.
mx::array dequantize(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// The instruction set the kernels run with on this CPU: "avx512", "avx2" or "base".
std::string isa();
// Force a kernel variant ("avx512", "avx2", "base"; "" = best available); for tests and benchmarks.
void set_isa(const std::string& name);

class QuantizedMatmulCPU : public mx::Primitive {
 public:
  QuantizedMatmulCPU(mx::Stream stream, int group_size, int bits, int planes)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), planes_(planes) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DuetQuantizedMatmulCPU";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  int planes_;
};

class DequantizeCPU : public mx::Primitive {
 public:
  DequantizeCPU(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DuetDequantizeCPU";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
};

} // namespace duet_cpu
