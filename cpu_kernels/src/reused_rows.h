// The last rows of x as the integer kernels read them (Q8Rows), kept for the next product of equal rows.
//
// A decode step multiplies one x by several matrices in a row: q_proj, k_proj and v_proj take the same
// normed hidden state, gate_proj and up_proj the same. Preparing a row (widen, hold for int16 math,
// split into planes, group sums) is serial work on the thread that calls the kernel while the pool's
// other threads wait: ~4% of a 1B model's decode step. The preparation is a pure function of the
// row's bytes and how it is prepared, so a product whose rows are byte for byte the last ones (memcmp,
// ~0.2 µs for a 2048-value row) takes the rows prepared then, and every other product prepares its own.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "qmm_shared.h"

namespace duet_cpu {

// Rows at most this many bytes (all rows of x together) are kept: decode and a few rows of a
// speculative verification or a small batch, where preparing is a visible part of the product.
constexpr size_t kReusedRowsBytes = size_t(64) << 10;

// The prepared rows of x (M rows of K values of dtype t, contiguous) for a preparation named by `how`
// (the caller's: distinct preparations must never share a value), from the last call with the same
// bytes and `how`, else make()'s (kept when the rows are small enough).
std::shared_ptr<const Q8Rows> reused_rows(uint64_t how, const void* x, mx::Dtype t, int M, int K, const std::function<Q8Rows()>& make);

} // namespace duet_cpu
