#include "two_level.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "pool.h"
#include "qmm_shared.h"

namespace mx = mlx::core;

namespace duet_cpu {

namespace {

constexpr float kTopMultiple = 63.0f; // llama.cpp rounds a K-quant super-block's largest sub-scale to 63
constexpr float kRound = 12582912.0f; // 1.5 * 2^23

// One super-block's 8 values as its 10 bytes; false unless exact. Branch-free over the 8 values (a
// 1B model has ~50M of them): the multiple is v times the step's reciprocal, rounded, which for an
// exact v = step * m (m <= 255) is within 255 * 2^-23 of m; the check below is exact either way.
bool pack_block(const float* v, uint8_t* out) {
  float top = v[0];
  for (int g = 1; g < kSuperGroups; ++g) {
    top = std::fabs(v[g]) > std::fabs(top) ? v[g] : top;
  }
  const mx::float16_t step16(top / kTopMultiple);
  const float step = static_cast<float>(step16);
  const float inv = step == 0.0f ? 0.0f : 1.0f / step;
  bool exact = true;
  for (int g = 0; g < kSuperGroups; ++g) {
    // rounded to nearest by adding and taking away 1.5 * 2^23 (no libm call on baseline x86-64); a
    // product past 2^22 (never an exact one) comes out past 255 or below 0 and fails the check
    const float m = (v[g] * inv + kRound) - kRound;
    exact &= m >= 0.0f && m <= 255.0f && step * m == v[g]; // false for NaN and infinities too
    out[2 + g] = static_cast<uint8_t>(m > 0.0f ? (m < 255.0f ? m : 255.0f) : 0.0f); // NaN: 0
  }
  std::memcpy(out, &step16, 2);
  return exact;
}

} // namespace

std::optional<mx::array> two_level_scales(const mx::array& values) {
  if (values.dtype() != mx::float32 || values.ndim() < 1 || values.shape(-1) % kSuperGroups != 0) {
    throw std::invalid_argument("two_level_scales takes float32 (..., G) with G a multiple of 8");
  }
  mx::array v = values;
  v.eval();
  const DenseBytes dense = dense_bytes(v);
  const size_t blocks = v.size() / kSuperGroups;
  std::vector<uint8_t> out(blocks * kSuperBytes);
  const auto* src = static_cast<const float*>(dense.data);
  // on the pool's threads, in stretches of blocks; any inexact block ends every stretch
  std::atomic<bool> exact{true};
  auto pool = shared_pool();
  const int tasks = blocks < 65536 ? 1 : pool->size();
  pool->run(tasks, [&](int t) {
    const size_t b1 = blocks * (t + 1) / tasks;
    for (size_t b = blocks * t / tasks; b < b1 && exact.load(std::memory_order_relaxed); ++b) {
      if (!pack_block(src + b * kSuperGroups, out.data() + b * kSuperBytes)) {
        exact.store(false, std::memory_order_relaxed);
      }
    }
  });
  if (!exact.load()) {
    return std::nullopt;
  }
  mx::Shape shape = values.shape();
  shape.back() = shape.back() / kSuperGroups * kSuperBytes;
  return mx::array(out.begin(), shape, mx::uint8);
}

} // namespace duet_cpu
