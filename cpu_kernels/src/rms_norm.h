// duet_cpu::rms_norm: x * rsqrt(mean(x^2, -1) + eps) * w as one lazy MLX op (mx.fast.rms_norm runs as
// ~8 separate ops on MLX's CPU backend). Same semantics as mx.fast.rms_norm: float32 accumulation, the
// normalized row rounded to the output dtype, then multiplied by w.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace duet_cpu {

// x (..., D) and w (D,) float32/float16/bfloat16; returns (..., D) in the promoted dtype of x and w.
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s = {});

class RMSNormCPU : public mx::Primitive {
 public:
  RMSNormCPU(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DuetRMSNormCPU";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float eps_;
};

} // namespace duet_cpu
