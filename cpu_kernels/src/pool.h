// A small thread pool for the kernels: the caller runs task 0 and n - 1 workers run the rest.
//
// Workers spin for a short while after each job before they sleep, so the back-to-back matmuls of
// a decode step do not pay a futex wake-up each (tens of microseconds on a loaded machine).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace duet_cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const {
    return size_;
  }

  // Runs fn(0) .. fn(n_tasks - 1), n_tasks <= size(), and returns when all are done. Calls from
  // several threads are serialised.
  void run(int n_tasks, const std::function<void(int)>& fn);

 private:
  void work(int id);

  int size_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;
  std::mutex sleep_mu_;
  std::condition_variable wake_;
  // generation << 8 | number of tasks: one word, so a worker reads both at once.
  std::atomic<uint64_t> job_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* fn_ = nullptr;
};

// The process-wide pool with the configured number of threads (created on first use, and again in a
// child after fork).
std::shared_ptr<ThreadPool> shared_pool();
void set_num_threads(int threads);
int num_threads();

} // namespace duet_cpu
