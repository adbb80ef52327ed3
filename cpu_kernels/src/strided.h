// Reading MLX arrays of any strides from the kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace mx = mlx::core;

namespace duet_cpu {

// The elements of a (any strides, e.g. a transposed or broadcast view) in row-major order.
template <typename T>
std::vector<T> row_major_copy(const mx::array& a) {
  std::vector<T> out(a.size());
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = a.ndim();
  std::vector<int> idx(nd, 0);
  const T* src = a.data<T>();
  int64_t off = 0;
  for (size_t e = 0; e < out.size(); ++e) {
    out[e] = src[off];
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        off += strides[d];
        break;
      }
      off -= int64_t(strides[d]) * (shape[d] - 1);
      idx[d] = 0;
    }
  }
  return out;
}

} // namespace duet_cpu
