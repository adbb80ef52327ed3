// Scales (or biases) in the kernels' two-level form (kernels.h: kSuper), from float32 per-group values.
#pragma once

#include <optional>

#include "mlx/array.h"

namespace duet_cpu {

// float32 values (..., G), G a multiple of 8, as uint8 (..., G / 8 * 10): per 8 groups a float16 step
// (the largest magnitude / 63, what a Q4_K / Q5_K super-block holds) and 8 uint8 multiples of it; none
// unless every value is exactly step * multiple in float32. Evaluates values; runs on the caller.
std::optional<mlx::core::array> two_level_scales(const mlx::core::array& values);

} // namespace duet_cpu
