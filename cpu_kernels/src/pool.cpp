#include "pool.h"

#include <pthread.h>

#include <chrono>
#include <new>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DUET_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define DUET_PAUSE() asm volatile("yield")
#else
#define DUET_PAUSE() ((void)0)
#endif

namespace duet_cpu {

namespace {
constexpr auto kSpin = std::chrono::microseconds(200);
// claim_ = generation << 40 | n_tasks << 20 | next unclaimed task. The job's task count travels in the
// same word as the index it bounds: a thread still holding an old generation's word can never pair
// that word's index with a newer job's count (which once let a straggler claim a task of a finished
// job under the next job's count, so `done_` skipped past n and run() spun for ever, or returned
// while a task still ran).
constexpr int kTaskBits = 20;
constexpr uint64_t kTaskMask = (uint64_t(1) << kTaskBits) - 1;
constexpr uint64_t kGenerationMask = (uint64_t(1) << 24) - 1;

uint64_t generation_of(uint64_t c) {
  return c >> (2 * kTaskBits);
}
int tasks_of(uint64_t c) {
  return int((c >> kTaskBits) & kTaskMask);
}
int index_of(uint64_t c) {
  return int(c & kTaskMask);
}
} // namespace

ThreadPool::ThreadPool(int threads) : size_(threads < 1 ? 1 : threads) {
  for (int id = 1; id < size_; ++id) {
    workers_.emplace_back([this] { work(); });
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  {
    std::lock_guard<std::mutex> lock(sleep_mu_);
  }
  wake_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
}

void ThreadPool::drain(uint64_t generation) {
  uint64_t c = claim_.load();
  while (generation_of(c) == generation && index_of(c) < tasks_of(c)) {
    if (claim_.compare_exchange_weak(c, c + 1)) {
      // The claimed task keeps this job from finishing, so fn_ is this job's.
      (*fn_)(index_of(c));
      done_.fetch_add(1);
      c = claim_.load();
    }
  }
}

void ThreadPool::work() {
  uint64_t seen = 0; // the generation before the first job, whenever this thread starts
  while (true) {
    uint64_t c = claim_.load();
    if (generation_of(c) == seen && !stop_.load()) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      int spins = 0;
      while (generation_of(c = claim_.load()) == seen && !stop_.load()) {
        // A few pauses, then yields: a worker waiting for the next job must not hold its core from
        // a thread that has work, above all the one building the decode step's graph while the
        // kernels run (mx.async_eval): with pure spinning, 2 kernel threads on 2 cores decoded slower
        // than 1 (bench/out/synthetic/moe-16x4-Q4_K_M.gguf: 11.9 vs 14.4 tok/s, yielding 15.2 vs 13.6).
        if (spins < 64) {
          DUET_PAUSE();
        } else {
          std::this_thread::yield();
        }
        if (++spins % 16 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(sleep_mu_);
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_of(claim_.load()) != seen || stop_.load(); });
          sleeping_.fetch_sub(1);
        }
      }
    }
    if (stop_.load()) {
      return;
    }
    seen = generation_of(c);
    drain(seen);
  }
}

void ThreadPool::run(int n_tasks, const std::function<void(int)>& fn) {
  if (n_tasks <= 1 || size_ == 1) {
    for (int i = 0; i < n_tasks; ++i) {
      fn(i);
    }
    return;
  }
  if (uint64_t(n_tasks) > kTaskMask) {
    throw std::invalid_argument("too many tasks for one ThreadPool::run");
  }
  std::lock_guard<std::mutex> serial(run_mu_);
  fn_ = &fn;
  done_.store(0);
  const uint64_t generation = (generation_of(claim_.load()) + 1) & kGenerationMask;
  claim_.store(generation << (2 * kTaskBits) | uint64_t(n_tasks) << kTaskBits);
  if (sleeping_.load() > 0) {
    {
      std::lock_guard<std::mutex> lock(sleep_mu_);
    }
    wake_.notify_all();
  }
  drain(generation);
  int spins = 0;
  while (done_.load() != n_tasks) {
    DUET_PAUSE();
    if (++spins > 1024) {
      std::this_thread::yield();
    }
  }
}

namespace {
std::mutex g_mu;
// Leaked in a forked child, whose copy has no threads behind it (joining them would hang).
alignas(std::shared_ptr<ThreadPool>) unsigned char g_pool_storage[sizeof(std::shared_ptr<ThreadPool>)];
std::shared_ptr<ThreadPool>& g_pool = *new (g_pool_storage) std::shared_ptr<ThreadPool>();
int g_threads = 1;
std::once_flag g_atfork;

void after_fork_in_child() {
  new (g_pool_storage) std::shared_ptr<ThreadPool>();
}
} // namespace

std::shared_ptr<ThreadPool> shared_pool() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::call_once(g_atfork, [] { pthread_atfork(nullptr, nullptr, after_fork_in_child); });
  if (g_pool == nullptr || g_pool->size() != g_threads) {
    g_pool = std::make_shared<ThreadPool>(g_threads);
  }
  return g_pool;
}

void set_num_threads(int threads) {
  if (threads < 1 || threads > 1024) {
    throw std::invalid_argument("threads must be between 1 and 1024");
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_threads = threads;
}

int num_threads() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_threads;
}

} // namespace duet_cpu
