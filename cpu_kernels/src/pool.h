// A small thread pool for the kernels. The caller and the workers claim a job's tasks from one
// counter, so a worker the OS has not scheduled yet delays nothing: whoever runs takes the next
// task, and on a busy machine the caller may do them all.
//
// Workers wait for a short while after each job before they sleep, so the back-to-back matmuls of
// a decode step do not pay a futex wake-up each (tens of microseconds on a loaded machine); while
// they wait they yield their core to any thread that has work (pool.cpp).
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

  // Runs fn(0) .. fn(n_tasks - 1) on the caller and the workers and returns when all are done.
  // Calls from several threads are serialised.
  void run(int n_tasks, const std::function<void(int)>& fn);

 private:
  void work();
  // Claims and runs tasks of generation `generation` until none is left.
  void drain(uint64_t generation);

  int size_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;
  std::mutex sleep_mu_;
  std::condition_variable wake_;
  // generation << 40 | n_tasks << 20 | next unclaimed task (pool.cpp): a claim succeeds only within
  // its own job.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};
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
