// duet_cpu::moe_route: a mixture-of-experts layer's routing for a few tokens in one op: the router's
// logits (x @ w.T), their softmax, the k largest probabilities and, if asked, those renormalised to
// sum to 1 (Qwen3-MoE's norm_topk_prob). On MLX's CPU backend the same is ~8 ops (a BLAS call, softmax,
// argpartition, slice, gather, sum, divide), each with its per-op cost, per layer and decode step.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace duet_cpu {

// x (..., D) and w (E, D), float32/float16/bfloat16, 1 <= k <= E: returns {indices (..., k) uint32,
// scores (..., k) of x and w's promoted dtype}, the experts by descending probability (ties: the lower
// index first).
std::vector<mx::array> moe_route(const mx::array& x, const mx::array& w, int k, bool normalize, mx::StreamOrDevice s = {});

class MoeRouteCPU : public mx::Primitive {
 public:
  MoeRouteCPU(mx::Stream stream, int k, bool normalize) : mx::Primitive(stream), k_(k), normalize_(normalize) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DuetMoeRouteCPU";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MoeRouteCPU&>(other);
    return k_ == o.k_ && normalize_ == o.normalize_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = k_;
    return {shape, shape};
  }

 private:
  int k_;
  bool normalize_;
};

} // namespace duet_cpu
