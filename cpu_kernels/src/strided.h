// Reading MLX arrays of any strides from the kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace mx = mlx::core;

namespace duet_cpu {

// The offsets (in elements) of a's elements in row-major order, for any strides (a transposed or
// broadcast view).
inline std::vector<int64_t> element_offsets(const mx::array& a) {
  std::vector<int64_t> offsets(a.size());
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = a.ndim();
  std::vector<int> idx(nd, 0);
  int64_t off = 0;
  for (size_t e = 0; e < a.size(); ++e) {
    offsets[e] = off;
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        off += strides[d];
        break;
      }
      off -= int64_t(strides[d]) * (shape[d] - 1);
      idx[d] = 0;
    }
  }
  return offsets;
}

// The elements of a (stored as S) in row-major order, as T, for any strides.
template <typename T, typename S = T>
std::vector<T> row_major_copy(const mx::array& a) {
  std::vector<T> out(a.size());
  const S* src = a.data<S>();
  if (a.flags().row_contiguous) {
    for (size_t e = 0; e < out.size(); ++e) {
      out[e] = static_cast<T>(src[e]);
    }
    return out;
  }
  const auto offsets = element_offsets(a);
  for (size_t e = 0; e < out.size(); ++e) {
    out[e] = static_cast<T>(src[offsets[e]]);
  }
  return out;
}

// A row-contiguous view of an input: the array itself when it is, else a row-major copy.
template <typename T>
struct Dense {
  std::vector<T> copy;
  const T* ptr;
  explicit Dense(const mx::array& a) {
    if (a.flags().row_contiguous) {
      ptr = a.data<T>();
    } else {
      copy = row_major_copy<T>(a);
      ptr = copy.data();
    }
  }
};

} // namespace duet_cpu
