// duet_cpu::rope: rotary position embedding as one lazy MLX op, mx.fast.rope's semantics (on MLX's CPU
// backend mx.fast.rope runs as a composed fallback of ~25 ops).
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace duet_cpu {

// x (B, *, T, D) float32/float16/bfloat16; offset an integer array, a scalar or (B,) (one start
// position per batch row). The first `dims` features rotate: pairs (i, i + dims/2), or (2i, 2i+1) when
// traditional, by angle (offset + t) * scale * theta_i with theta_i = base^(-2i/dims), or 1/freqs[i]
// when freqs (dims/2,) is given (base then unused). Angles and their sines in double, products in float32.
mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& freqs = std::nullopt,
    mx::StreamOrDevice s = {});

class RoPECPU : public mx::Primitive {
 public:
  RoPECPU(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DuetRoPECPU";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

} // namespace duet_cpu
