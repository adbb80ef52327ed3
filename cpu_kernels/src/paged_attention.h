// duet_cpu::paged_decode_attention: one query token per row attending over that row's keys and values
// where they live in the paged KV pool, read through its block table. On MLX's CPU backend the
// reference path gathers each row's whole context into a new array every step and layer, then runs
// SDPA's composed fallback (~10 ops); this is one op that reads the pool in place.
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace duet_cpu {

// q (B, Hq, D); k (slots, Hkv, D) and v (slots, Hkv, Dv), the pool's flat layout (slot = block *
// block_size + offset), same float dtype as q; table (B, max_blocks) int32; lens (B,) int32, the
// row's tokens including the new one. Row b's query attends over its tokens [max(0, len - window),
// len) (window 0: all), Hq / Hkv query heads per KV head. sinks (Hq,) float32: one extra logit per
// head in the softmax's denominator (no value). Returns (B, Hq, Dv) in q's dtype, float32 math.
mx::array paged_decode_attention(
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

class PagedDecodeCPU : public mx::Primitive {
 public:
  PagedDecodeCPU(mx::Stream stream, float scale, int block_size, int window, bool sinks)
      : mx::Primitive(stream), scale_(scale), block_size_(block_size), window_(window), sinks_(sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DuetPagedDecodeCPU";
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
