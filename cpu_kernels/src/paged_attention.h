// duet_cpu::paged_attention: each row's new query tokens (one in decode, a chunk in prefill or when
// verifying proposed tokens) attending causally over that row's keys and values where they live in
// the paged KV pool, read through its block table. On MLX's CPU backend the reference path gathers
// each row's whole context into a new array every step and layer, then runs SDPA's composed fallback
// (~10 ops); this is one op that reads the pool in place.
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace duet_cpu {

// q (B, Hq, L, D): the rows' last L tokens; k (slots, Hkv, D) and v (slots, Hkv, Dv), the pool's flat
// layout (slot = block * block_size + offset), same float dtype as q; table (B, max_blocks) int32;
// lens (B,) int32, the row's tokens including the L new ones. Query token i of row b sits at position
// p = len - L + i and attends over the row's tokens [max(0, p + 1 - window), p] (window 0: from 0),
// Hq / Hkv query heads per KV head. sinks (Hq,) float32: one extra logit per head in the softmax's
// denominator (no value). Returns (B, Hq, L, Dv) in q's dtype, float32 math.
mx::array paged_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& table,
    const mx::array& lens,
    float scale,
    int block_size,
    int window,
    const std::optional<mx::array>& sinks,
    mx::StreamOrDevice s = {});

class PagedAttentionCPU : public mx::Primitive {
 public:
  PagedAttentionCPU(mx::Stream stream, float scale, int block_size, int window, bool sinks)
      : mx::Primitive(stream), scale_(scale), block_size_(block_size), window_(window), sinks_(sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DuetPagedAttentionCPU";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  int block_size_;
  int window_;
  bool sinks_;
};

} // namespace duet_cpu
