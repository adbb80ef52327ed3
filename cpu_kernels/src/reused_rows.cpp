#include "reused_rows.h"

#include <cstring>
#include <mutex>
#include <vector>

namespace duet_cpu {

namespace {

struct Kept {
  uint64_t how = 0;
  mx::Dtype t = mx::float32;
  int M = 0, K = 0;
  std::vector<uint8_t> bytes;
  std::shared_ptr<const Q8Rows> rows;
};

std::mutex g_mu;
Kept g_kept;

} // namespace

std::shared_ptr<const Q8Rows> reused_rows(uint64_t how, const void* x, mx::Dtype t, int M, int K, const std::function<Q8Rows()>& make) {
  const size_t n = size_t(M) * K * mx::size_of(t);
  if (n > kReusedRowsBytes) {
    return std::make_shared<const Q8Rows>(make());
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_kept.rows && g_kept.how == how && g_kept.t == t && g_kept.M == M && g_kept.K == K &&
        std::memcmp(g_kept.bytes.data(), x, n) == 0) {
      return g_kept.rows;
    }
  }
  auto rows = std::make_shared<const Q8Rows>(make()); // outside the lock: another stream may prepare meanwhile
  std::lock_guard<std::mutex> lock(g_mu);
  g_kept.how = how;
  g_kept.t = t;
  g_kept.M = M;
  g_kept.K = K;
  g_kept.bytes.assign(static_cast<const uint8_t*>(x), static_cast<const uint8_t*>(x) + n);
  g_kept.rows = rows;
  return rows;
}

} // namespace duet_cpu
