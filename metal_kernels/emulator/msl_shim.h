// Duet Metal emulator shim: lets translated Metal kernel source compile as C++17 with g++/clang++.
// Included first by every translated kernel. See metal_kernels/emulator/translate.py for the source
// rewrites (attributes stripped, threadgroup declarations moved to the group arena, half literals).
#pragma once

#include "msl_stdlib.h"

using namespace metal;

#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310
#endif
#define METAL_FUNC inline __attribute__((always_inline))
#define M_PI_F 3.14159265358979323846f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#ifndef MAXFLOAT
#define MAXFLOAT FLT_MAX
#endif
#define HALF_MAX ((half)65504.0f)
#define HUGE_VALH ((half)INFINITY)

// Address spaces carry no meaning on the CPU (threadgroup declarations are rewritten beforehand).
#define device
#define constant
#define thread
#define threadgroup
#define kernel

// The part of MLX's utils.h prelude (prepended to every custom kernel on a Mac) kernels here use.
template <class U>
struct Limits {
  static inline const U max = metal::numeric_limits<U>::max();
  static inline const U min = metal::numeric_limits<U>::min();
  static inline const U finite_max = metal::numeric_limits<U>::max();
  static inline const U finite_min = metal::numeric_limits<U>::min();
};
#define EMU_FLOAT_LIMITS(U)                                                      \
  template <>                                                                    \
  struct Limits<U> {                                                             \
    static inline const U max = metal::numeric_limits<U>::infinity();           \
    static inline const U min = -metal::numeric_limits<U>::infinity();          \
    static inline const U finite_max = metal::numeric_limits<U>::max();         \
    static inline const U finite_min = -metal::numeric_limits<U>::max();        \
  };
EMU_FLOAT_LIMITS(float)
EMU_FLOAT_LIMITS(half)
EMU_FLOAT_LIMITS(bfloat)
#undef EMU_FLOAT_LIMITS

namespace emu {
inline uint3 attr_u3(const uint32_t* p) { return uint3(p[0], p[1], p[2]); }
inline uint3 thread_position_in_threadgroup() { return attr_u3(g_cur->pos); }
inline uint3 threadgroup_position_in_grid() { return attr_u3(g_group.group_pos); }
inline uint3 threads_per_threadgroup() { return attr_u3(g_group.tg_size); }
inline uint3 dispatch_threads_per_threadgroup() { return attr_u3(g_group.dispatch_tg); }
inline uint3 threadgroups_per_grid() { return attr_u3(g_group.groups); }
inline uint3 threads_per_grid() { return attr_u3(g_group.grid); }
inline uint3 grid_size() { return attr_u3(g_group.grid); }
inline uint3 grid_origin() { return uint3(0u, 0u, 0u); }
inline uint3 thread_position_in_grid() {
  uint3 r;
  for (int d = 0; d < 3; ++d) r.v[d] = g_group.group_pos[d] * g_group.dispatch_tg[d] + g_cur->pos[d];
  return r;
}
inline uint thread_index_in_threadgroup() { return uint(g_cur->index); }
inline uint thread_index_in_simdgroup() { return uint(g_cur->lane); }
inline uint simdgroup_index_in_threadgroup() { return uint(g_cur->simd); }
inline uint thread_index_in_quadgroup() { return uint(g_cur->index % 4); }
inline uint quadgroup_index_in_threadgroup() { return uint(g_cur->index / 4); }
inline uint simdgroups_per_threadgroup() { return uint((g_group.nthreads + SIMD_WIDTH - 1) / SIMD_WIDTH); }
inline uint quadgroups_per_threadgroup() { return uint((g_group.nthreads + 3) / 4); }
inline uint dispatch_simdgroups_per_threadgroup() {
  uint n = g_group.dispatch_tg[0] * g_group.dispatch_tg[1] * g_group.dispatch_tg[2];
  return (n + SIMD_WIDTH - 1) / SIMD_WIDTH;
}
inline uint dispatch_quadgroups_per_threadgroup() {
  uint n = g_group.dispatch_tg[0] * g_group.dispatch_tg[1] * g_group.dispatch_tg[2];
  return (n + 3) / 4;
}
inline uint thread_execution_width() { return uint(SIMD_WIDTH); }
inline uint threads_per_simdgroup() { return uint(SIMD_WIDTH); }
}  // namespace emu
