// Duet Metal emulator runtime: runs every Metal thread of a threadgroup as a fiber.
//
// One threadgroup at a time. Threads run until they finish or block at a threadgroup barrier or a
// SIMD-group collective; when every live thread is blocked the scheduler releases collectives
// (per SIMD-group) first, then barriers. Thread order within each phase is forward, reverse or a
// seeded permutation. Strict mode turns divergent collectives, divergent barriers and barriers after
// an early return into errors. Threadgroup memory lives in a per-group arena poisoned with 0xFF
// (NaN for every float type) and limited to 32 KB.
#pragma once

#if defined(__x86_64__) && defined(__ELF__)
#define EMU_ASM_SWITCH 1  // hand-written context switch; ucontext elsewhere
#elif defined(__APPLE__)
#define _XOPEN_SOURCE 600  // macOS only exposes the ucontext routines with it
#define _DARWIN_C_SOURCE 1
#endif

#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(EMU_ASM_SWITCH)
#include <ucontext.h>
#endif

namespace emu {

enum State : int { RUNNABLE = 0, AT_BARRIER = 1, AT_COLLECTIVE = 2, DONE = 3 };
enum Order : int { FORWARD = 0, REVERSE = 1, RANDOM = 2 };

struct Thread;
typedef void (*CollectiveEval)(Thread** lanes, int n);

struct alignas(16) Thread {
  void* sp;
#if !defined(EMU_ASM_SWITCH)
  ucontext_t uc;
#endif
  char* stack;
  int state;
  int index;  // thread_index_in_threadgroup
  int lane;   // thread_index_in_simdgroup
  int simd;   // simdgroup_index_in_threadgroup
  uint32_t pos[3];
  const void* site;
  int op;
  int iarg;
  CollectiveEval eval;
  alignas(16) unsigned char in[64];
  alignas(16) unsigned char out[64];
};

struct LaunchParams {
  int64_t grid[3];
  int64_t threadgroup[3];
  int32_t order;
  int32_t strict;
  uint64_t seed;
  int64_t tg_mem_limit;
  int64_t stack_size;
};

constexpr int SIMD_WIDTH = 32;
constexpr int MAX_THREADS = 1024;
constexpr int MAX_TG_VARS = 256;
constexpr int64_t ARENA_BYTES = 1 << 20;

struct GroupInfo {
  uint32_t group_pos[3];
  uint32_t groups[3];
  uint32_t tg_size[3];        // actual size of this (possibly edge) threadgroup
  uint32_t dispatch_tg[3];    // threadgroup size given at dispatch
  uint32_t grid[3];
  int nthreads;
};

// ---- global state for one launch (launches are serialised by the Python side) ----
static Thread* g_threads = nullptr;
static char* g_stack_mem = nullptr;
static size_t g_stack_bytes = 0;
static int g_stack_count = 0;
static int64_t g_stack_size = 0;
static Thread* g_cur = nullptr;
static void* g_sched_sp = nullptr;
#if !defined(EMU_ASM_SWITCH)
static ucontext_t g_sched_uc;
#endif
static GroupInfo g_group;
static LaunchParams g_params;
static unsigned char* g_arena = nullptr;
static int64_t g_arena_used = 0;
static int64_t g_tg_offsets[MAX_TG_VARS];
static char* g_err = nullptr;
static int g_errlen = 0;
static int g_failed = 0;
static sigjmp_buf g_fault_jmp;
static volatile sig_atomic_t g_in_launch = 0;

static void (*g_body)() = nullptr;

// ---------------------------------------------------------------------------------------------
// Context switching
// ---------------------------------------------------------------------------------------------
#if defined(EMU_ASM_SWITCH)
extern "C" void emu_swap_ctx(void** save_sp, void* new_sp);
extern "C" void emu_fiber_entry();
asm(R"(
.text
.p2align 4
.hidden emu_swap_ctx
.globl emu_swap_ctx
.type emu_swap_ctx,@function
emu_swap_ctx:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_swap_ctx, .-emu_swap_ctx
.p2align 4
.hidden emu_fiber_entry
.globl emu_fiber_entry
.type emu_fiber_entry,@function
emu_fiber_entry:
  movq %rbx, %rdi
  call emu_fiber_main
  ud2
.size emu_fiber_entry, .-emu_fiber_entry
)");
#endif

extern "C" __attribute__((visibility("hidden"), used)) void emu_fiber_main(Thread* t);

static inline void switch_to_scheduler() {
  Thread* t = g_cur;
#if defined(EMU_ASM_SWITCH)
  emu_swap_ctx(&t->sp, g_sched_sp);
#else
  swapcontext(&t->uc, &g_sched_uc);
#endif
}

static inline void resume(Thread* t) {
  g_cur = t;
#if defined(EMU_ASM_SWITCH)
  emu_swap_ctx(&g_sched_sp, t->sp);
#else
  swapcontext(&g_sched_uc, &t->uc);
#endif
  g_cur = nullptr;
}

#if !defined(EMU_ASM_SWITCH)
static void uc_trampoline(unsigned int hi, unsigned int lo) {
  uintptr_t p = (uintptr_t(hi) << 32) | uintptr_t(lo);
  emu_fiber_main(reinterpret_cast<Thread*>(p));
}
#endif

static void fiber_init(Thread* t) {
  // Poison the top of the stack so uninitialised thread-private values read as NaN bytes.
  char* top = t->stack + g_stack_size;
  std::memset(top - 2048, 0xFF, 2048);
#if defined(EMU_ASM_SWITCH)
  uintptr_t p = (reinterpret_cast<uintptr_t>(top) - 64) & ~uintptr_t(15);
  uint64_t* s = reinterpret_cast<uint64_t*>(p);
  // layout popped by emu_swap_ctx: [mxcsr|fpucw] r15 r14 r13 r12 rbx rbp ret
  s -= 8;
  uint32_t mx;
  uint16_t cw;
  asm volatile("stmxcsr %0" : "=m"(mx));
  asm volatile("fnstcw %0" : "=m"(cw));
  uint64_t ctl = uint64_t(mx) | (uint64_t(cw) << 32);
  s[0] = ctl;
  s[1] = 0;                                      // r15
  s[2] = 0;                                      // r14
  s[3] = 0;                                      // r13
  s[4] = 0;                                      // r12
  s[5] = reinterpret_cast<uint64_t>(t);          // rbx -> first argument of emu_fiber_main
  s[6] = 0;                                      // rbp
  s[7] = reinterpret_cast<uint64_t>(&emu_fiber_entry);
  t->sp = s;
#else
  getcontext(&t->uc);
  t->uc.uc_stack.ss_sp = t->stack;
  t->uc.uc_stack.ss_size = g_stack_size - 2048;
  t->uc.uc_link = nullptr;
  uintptr_t p = reinterpret_cast<uintptr_t>(t);
  makecontext(&t->uc, (void (*)())uc_trampoline, 2, (unsigned int)(p >> 32), (unsigned int)(p & 0xffffffffu));
#endif
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------
static void set_error(const char* fmt, ...) {
  if (g_failed) return;
  g_failed = 1;
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(g_err, g_errlen, fmt, ap);
  va_end(ap);
}

// Called from inside a fiber: record the error and never resume this thread.
[[noreturn]] static void fail(const char* what) {
  set_error("%s (threadgroup %u,%u,%u thread %d)", what, g_group.group_pos[0], g_group.group_pos[1],
            g_group.group_pos[2], g_cur ? g_cur->index : -1);
  g_cur->state = DONE;
  switch_to_scheduler();
  __builtin_unreachable();
}

static void on_fault(int sig) {
  if (g_in_launch) siglongjmp(g_fault_jmp, sig);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// ---------------------------------------------------------------------------------------------
// Threadgroup memory
// ---------------------------------------------------------------------------------------------
template <class T>
static T* tg_var(int id) {
  if (id >= MAX_TG_VARS) fail("too many threadgroup variables");
  if (g_tg_offsets[id] < 0) {
    int64_t off = (g_arena_used + 15) & ~int64_t(15);
    int64_t end = off + int64_t(sizeof(T));
    if (end > g_params.tg_mem_limit) {
      char msg[160];
      std::snprintf(msg, sizeof msg, "threadgroup memory limit exceeded: %lld bytes > %lld", (long long)end,
                    (long long)g_params.tg_mem_limit);
      fail(msg);
    }
    g_tg_offsets[id] = off;
    g_arena_used = end;
  }
  return reinterpret_cast<T*>(g_arena + g_tg_offsets[id]);
}

// ---------------------------------------------------------------------------------------------
// Blocking operations (called from fibers)
// ---------------------------------------------------------------------------------------------
__attribute__((noinline)) static void barrier_wait(const void* site) {
  Thread* t = g_cur;
  t->state = AT_BARRIER;
  t->site = site;
  switch_to_scheduler();
}

template <class T>
static T collective(int op, const T& value, int iarg, CollectiveEval eval, const void* site) {
  static_assert(sizeof(T) <= 64, "collective value too large");
  Thread* t = g_cur;
  std::memcpy(t->in, &value, sizeof(T));
  t->op = op;
  t->iarg = iarg;
  t->eval = eval;
  t->site = site;
  t->state = AT_COLLECTIVE;
  switch_to_scheduler();
  T r;
  std::memcpy(&r, t->out, sizeof(T));
  return r;
}

// ---------------------------------------------------------------------------------------------
// Scheduler
// ---------------------------------------------------------------------------------------------
static uint64_t rng_state = 1;
static inline uint64_t rng_next() {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  rng_state = x;
  return x;
}

static void make_order(int* idx, int n) {
  for (int i = 0; i < n; ++i) idx[i] = (g_params.order == REVERSE) ? n - 1 - i : i;
  if (g_params.order == RANDOM) {
    for (int i = n - 1; i > 0; --i) {
      int j = int(rng_next() % uint64_t(i + 1));
      int tmp = idx[i];
      idx[i] = idx[j];
      idx[j] = tmp;
    }
  }
}

static const char* op_name(int op);

// Evaluate the collectives of SIMD-group `s`, all of whose live lanes are blocked. Lanes waiting at
// the same call site and op form one active-lane group. Returns true if any lane was released.
static bool release_collectives(int s, int n) {
  const int first = s * SIMD_WIDTH;
  const int launched = (n - first) < SIMD_WIDTH ? (n - first) : SIMD_WIDTH;
  int waiting = 0;
  for (int l = 0; l < launched; ++l) waiting += g_threads[first + l].state == AT_COLLECTIVE;
  if (waiting == 0) return false;
  if (g_params.strict && waiting != launched) {
    int who = first;
    while (g_threads[who].state != AT_COLLECTIVE) ++who;
    set_error("strict: divergent SIMD-group collective %s in simdgroup %d of threadgroup %u,%u,%u: "
              "%d of %d lanes arrived (others returned early or wait elsewhere)",
              op_name(g_threads[who].op), s, g_group.group_pos[0], g_group.group_pos[1],
              g_group.group_pos[2], waiting, launched);
    return false;
  }
  bool done[SIMD_WIDTH] = {false};
  Thread* lanes[SIMD_WIDTH];
  for (int l = 0; l < launched; ++l) {
    Thread* a = &g_threads[first + l];
    if (a->state != AT_COLLECTIVE || done[l]) continue;
    int count = 0;
    for (int m = l; m < launched; ++m) {
      Thread* b = &g_threads[first + m];
      if (b->state == AT_COLLECTIVE && !done[m] && b->site == a->site && b->op == a->op) {
        lanes[count++] = b;
        done[m] = true;
      }
    }
    if (g_params.strict && count != launched) {
      set_error("strict: lanes of simdgroup %d in threadgroup %u,%u,%u wait at different collectives", s,
                g_group.group_pos[0], g_group.group_pos[1], g_group.group_pos[2]);
      return false;
    }
    a->eval(lanes, count);
    for (int k = 0; k < count; ++k) lanes[k]->state = RUNNABLE;
  }
  return true;
}

static void release_barrier(int n) {
  const void* site = nullptr;
  int finished = 0;
  for (int i = 0; i < n; ++i) {
    Thread* t = &g_threads[i];
    if (t->state == DONE) {
      finished++;
      continue;
    }
    if (site == nullptr) site = t->site;
    if (g_params.strict && t->site != site) {
      set_error("strict: threads of threadgroup %u,%u,%u wait at different threadgroup_barrier calls",
                g_group.group_pos[0], g_group.group_pos[1], g_group.group_pos[2]);
      return;
    }
  }
  if (g_params.strict && finished > 0) {
    set_error("strict: threadgroup_barrier reached after %d thread(s) of threadgroup %u,%u,%u returned early",
              finished, g_group.group_pos[0], g_group.group_pos[1], g_group.group_pos[2]);
    return;
  }
  for (int i = 0; i < n; ++i) {
    if (g_threads[i].state == AT_BARRIER) g_threads[i].state = RUNNABLE;
  }
}

static void run_group() {
  int n = g_group.nthreads;
  std::memset(g_arena, 0xFF, size_t(g_params.tg_mem_limit));
  g_arena_used = 0;
  for (int i = 0; i < MAX_TG_VARS; ++i) g_tg_offsets[i] = -1;
  uint32_t tx = g_group.tg_size[0], ty = g_group.tg_size[1];
  for (int i = 0; i < n; ++i) {
    Thread* t = &g_threads[i];
    t->state = RUNNABLE;
    t->index = i;
    t->lane = i % SIMD_WIDTH;
    t->simd = i / SIMD_WIDTH;
    t->pos[0] = uint32_t(i) % tx;
    t->pos[1] = (uint32_t(i) / tx) % ty;
    t->pos[2] = uint32_t(i) / (tx * ty);
    t->site = nullptr;
    fiber_init(t);
  }
  // Each SIMD-group runs ahead on its own from one threadgroup barrier to the next (collectives only
  // wait for its own lanes), SIMD-groups one after another in the chosen order; then the barrier.
  const int nsimd = (n + SIMD_WIDTH - 1) / SIMD_WIDTH;
  int simd_order[MAX_THREADS / SIMD_WIDTH];
  int lane_order[SIMD_WIDTH];
  while (!g_failed) {
    make_order(simd_order, nsimd);
    for (int k = 0; k < nsimd && !g_failed; ++k) {
      const int s = simd_order[k];
      const int first = s * SIMD_WIDTH;
      const int launched = (n - first) < SIMD_WIDTH ? (n - first) : SIMD_WIDTH;
      do {
        make_order(lane_order, launched);
        for (int j = 0; j < launched && !g_failed; ++j) {
          Thread* t = &g_threads[first + lane_order[j]];
          if (t->state == RUNNABLE) resume(t);
        }
      } while (!g_failed && release_collectives(s, n));
    }
    if (g_failed) return;
    bool any_live = false;
    for (int i = 0; i < n; ++i) any_live |= g_threads[i].state != DONE;
    if (!any_live) return;
    release_barrier(n);
  }
}

static bool ensure_stacks(int n) {
  int64_t size = g_params.stack_size;
  if (g_stack_mem && g_stack_count >= n && g_stack_size == size) return true;
  if (g_stack_mem) munmap(g_stack_mem, g_stack_bytes);
  long page = sysconf(_SC_PAGESIZE);
  size_t per = size_t(size) + size_t(page);  // guard page below each stack
  g_stack_bytes = per * size_t(n);
  void* mem = mmap(nullptr, g_stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    g_stack_mem = nullptr;
    return false;
  }
  g_stack_mem = static_cast<char*>(mem);
  for (int i = 0; i < n; ++i) mprotect(g_stack_mem + per * size_t(i), size_t(page), PROT_NONE);
  g_stack_count = n;
  g_stack_size = size;
  return true;
}

static int launch(void (*body)(), const LaunchParams* params, char* err, int errlen) {
  g_params = *params;
  g_err = err;
  g_errlen = errlen;
  g_failed = 0;
  g_body = body;
  if (g_params.tg_mem_limit > ARENA_BYTES) g_params.tg_mem_limit = ARENA_BYTES;
  int64_t tg[3], groups[3];
  int64_t nth = 1;
  for (int d = 0; d < 3; ++d) {
    if (params->grid[d] <= 0 || params->threadgroup[d] <= 0) {
      set_error("grid and threadgroup dimensions must be positive");
      return 1;
    }
    tg[d] = params->threadgroup[d] < params->grid[d] ? params->threadgroup[d] : params->grid[d];
    groups[d] = (params->grid[d] + tg[d] - 1) / tg[d];
    nth *= tg[d];
  }
  if (nth > MAX_THREADS) {
    set_error("threadgroup of %lld threads exceeds the maximum of %d", (long long)nth, MAX_THREADS);
    return 1;
  }
  if (!g_threads) {
    g_threads = static_cast<Thread*>(std::aligned_alloc(64, sizeof(Thread) * MAX_THREADS));
    g_arena = static_cast<unsigned char*>(std::aligned_alloc(64, size_t(ARENA_BYTES)));
  }
  if (!ensure_stacks(int(nth))) {
    set_error("could not allocate fiber stacks");
    return 1;
  }
  rng_state = params->seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  if (rng_state == 0) rng_state = 1;

  long page = sysconf(_SC_PAGESIZE);
  size_t per = size_t(g_stack_size) + size_t(page);
  for (int i = 0; i < int(nth); ++i) g_threads[i].stack = g_stack_mem + per * size_t(i) + size_t(page);

  // Signals: a wild access inside the kernel becomes an error instead of killing the process.
  static char altstack[65536];
  stack_t ss, old_ss;
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  struct sigaction sa, old_segv, old_bus, old_fpe;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_fault;
  sa.sa_flags = SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  sigaction(SIGFPE, &sa, &old_fpe);

  int64_t total = groups[0] * groups[1] * groups[2];
  // RANDOM group order: a seeded affine permutation k -> (k * stride + seed) mod total, stride coprime.
  uint64_t group_stride = 1;
  if (total > 1) {
    group_stride = (params->seed * 2654435761ull) % uint64_t(total);
    if (group_stride == 0) group_stride = 1;
    while (true) {
      uint64_t a = group_stride, b = uint64_t(total);
      while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
      }
      if (a == 1) break;
      group_stride++;
    }
  }
  int sig = sigsetjmp(g_fault_jmp, 1);
  if (sig != 0) {
    g_in_launch = 0;
    char what[64];
    std::snprintf(what, sizeof what, "%s", sig == SIGFPE ? "arithmetic fault (SIGFPE)" : "memory fault (SIGSEGV/SIGBUS)");
    set_error("%s inside the kernel in threadgroup %u,%u,%u thread %d: out-of-bounds access?", what,
              g_group.group_pos[0], g_group.group_pos[1], g_group.group_pos[2], g_cur ? g_cur->index : -1);
  } else {
    g_in_launch = 1;
    for (int64_t k = 0; k < total && !g_failed; ++k) {
      int64_t lin = k;
      if (g_params.order == REVERSE) lin = total - 1 - k;
      if (g_params.order == RANDOM && total > 1) {
        lin = int64_t((uint64_t(k) * group_stride + params->seed) % uint64_t(total));
      }
      int64_t gx = lin % groups[0];
      int64_t gy = (lin / groups[0]) % groups[1];
      int64_t gz = lin / (groups[0] * groups[1]);
      int64_t gp[3] = {gx, gy, gz};
      int n = 1;
      for (int d = 0; d < 3; ++d) {
        int64_t start = gp[d] * tg[d];
        int64_t sz = params->grid[d] - start < tg[d] ? params->grid[d] - start : tg[d];
        g_group.group_pos[d] = uint32_t(gp[d]);
        g_group.groups[d] = uint32_t(groups[d]);
        g_group.tg_size[d] = uint32_t(sz);
        g_group.dispatch_tg[d] = uint32_t(tg[d]);
        g_group.grid[d] = uint32_t(params->grid[d]);
        n *= int(sz);
      }
      g_group.nthreads = n;
      run_group();
    }
  }
  g_in_launch = 0;
  g_cur = nullptr;
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaction(SIGFPE, &old_fpe, nullptr);
  sigaltstack(&old_ss, nullptr);
  return g_failed ? 1 : 0;
}

}  // namespace emu

extern "C" __attribute__((visibility("hidden"), used)) void emu_fiber_main(emu::Thread* t) {
  (void)t;
  emu::g_body();
  emu::g_cur->state = emu::DONE;
  emu::switch_to_scheduler();
  __builtin_unreachable();
}
