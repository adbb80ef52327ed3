// duet_cpu::gather_quantized_matmul: mx.gather_qmm's product for mixture-of-experts layers (each
// row of x times the quantized matrix of the expert its index names) as a lazy MLX op, evaluated by
// the quantized matmul's row kernel (kernels.h) with the rows grouped by expert.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace duet_cpu {

// x (..., M, K) float32/float16/bfloat16; w uint32 (E, N, K * bits / 32), each expert packed as
// mx.quantize packs a matrix; scales and biases (E, N, K / group_size); indices integers whose shape
// broadcasts with x's batch dims (...). Returns (broadcast(..., indices.shape), M, N) in the promoted
// dtype of x and scales: out[b, m] = x[b, m] @ dequantize(w[indices[b]]).T (mx.gather_qmm with
// rhs_indices and transpose=True). An index outside [0, E) gives a row of zeros. planes: how x meets
// the weights (1 int8, 2 int16, 3 exact), as quantized_matmul's.
mx::array gather_quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    const mx::array& indices,
    int group_size,
    int bits,
    int planes = 3,
    mx::StreamOrDevice s = {});

class GatherQuantizedMatmulCPU : public mx::Primitive {
 public:
  GatherQuantizedMatmulCPU(mx::Stream stream, int group_size, int bits, int planes)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), planes_(planes) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DuetGatherQuantizedMatmulCPU";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  int planes_;
};

} // namespace duet_cpu
