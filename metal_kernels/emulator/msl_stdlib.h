// Metal Shading Language subset for the Duet CPU emulator: math, synchronisation, SIMD-group
// collectives and atomics.
#pragma once

#include "msl_runtime.h"
#include "msl_types.h"

namespace metal {

// ---- numeric limits ---------------------------------------------------------------------------
template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static half max() { return half(65504.0f); }
  static half min() { return half(6.103515625e-05f); }
  static half lowest() { return half(-65504.0f); }
  static half epsilon() { return half(0.0009765625f); }
  static half infinity() { return half(INFINITY); }
  static half quiet_NaN() { return half(NAN); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static bfloat bits(uint16_t b) {
    bfloat r;
    r.bits_ = b;
    return r;
  }
  static bfloat max() { return bits(0x7f7f); }
  static bfloat min() { return bits(0x0080); }
  static bfloat lowest() { return bits(0xff7f); }
  static bfloat epsilon() { return bits(0x3c00); }
  static bfloat infinity() { return bits(0x7f80); }
  static bfloat quiet_NaN() { return bits(0x7fc0); }
};

template <class To, class From>
inline To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To t;
  std::memcpy((void*)&t, (const void*)&f, sizeof(To));
  return t;
}

// ---- floating point math ------------------------------------------------------------------------
#define EMU_UNARY(NAME, EXPR)                                                      \
  inline float NAME(float x) { return EXPR; }                                      \
  inline half NAME(half x) { return half(NAME(float(x))); }                        \
  inline bfloat NAME(bfloat x) { return bfloat(NAME(float(x))); }                  \
  template <class T, int N>                                                        \
  inline vec<T, N> NAME(const vec<T, N>& a) {                                      \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; ++i) r.v[i] = NAME(a.v[i]);                             \
    return r;                                                                      \
  }
EMU_UNARY(exp, std::exp(x))
EMU_UNARY(exp2, std::exp2(x))
EMU_UNARY(exp10, std::pow(10.0f, x))
EMU_UNARY(log, std::log(x))
EMU_UNARY(log2, std::log2(x))
EMU_UNARY(log10, std::log10(x))
EMU_UNARY(sqrt, std::sqrt(x))
EMU_UNARY(rsqrt, 1.0f / std::sqrt(x))
EMU_UNARY(sin, std::sin(x))
EMU_UNARY(cos, std::cos(x))
EMU_UNARY(tan, std::tan(x))
EMU_UNARY(sinh, std::sinh(x))
EMU_UNARY(cosh, std::cosh(x))
EMU_UNARY(tanh, std::tanh(x))
EMU_UNARY(asin, std::asin(x))
EMU_UNARY(acos, std::acos(x))
EMU_UNARY(atan, std::atan(x))
EMU_UNARY(erf, std::erf(x))
EMU_UNARY(floor, std::floor(x))
EMU_UNARY(ceil, std::ceil(x))
EMU_UNARY(trunc, std::trunc(x))
EMU_UNARY(round, std::round(x))  // MSL round: halfway cases away from zero
EMU_UNARY(rint, std::nearbyint(x))
EMU_UNARY(fabs, std::fabs(x))
EMU_UNARY(fract, std::fmin(x - std::floor(x), 0x1.fffffep-1f))
EMU_UNARY(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
EMU_UNARY(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? 0.0f : x))))
#undef EMU_UNARY

inline float abs(float x) { return std::fabs(x); }
inline half abs(half x) { return half(std::fabs(float(x))); }
inline bfloat abs(bfloat x) { return bfloat(std::fabs(float(x))); }
using ::abs;
template <class T, int N>
inline vec<T, N> abs(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = abs(a.v[i]);
  return r;
}

#define EMU_BINARY_F(NAME, EXPR)                                                   \
  inline float NAME(float x, float y) { return EXPR; }                             \
  inline half NAME(half x, half y) { return half(NAME(float(x), float(y))); }      \
  inline bfloat NAME(bfloat x, bfloat y) { return bfloat(NAME(float(x), float(y))); } \
  template <class T, int N>                                                        \
  inline vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b) {                  \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; ++i) r.v[i] = NAME(a.v[i], b.v[i]);                     \
    return r;                                                                      \
  }
EMU_BINARY_F(pow, std::pow(x, y))
EMU_BINARY_F(powr, std::pow(x, y))
EMU_BINARY_F(fmax, std::fmax(x, y))
EMU_BINARY_F(fmin, std::fmin(x, y))
EMU_BINARY_F(fmod, std::fmod(x, y))
EMU_BINARY_F(atan2, std::atan2(x, y))
EMU_BINARY_F(copysign, std::copysign(x, y))
EMU_BINARY_F(step, (y < x ? 0.0f : 1.0f))
#undef EMU_BINARY_F

// min/max: MSL returns the other operand when one is NaN (like fmin/fmax) for floats.
#define EMU_MINMAX_INT(T)                                         \
  inline T min(T a, T b) { return b < a ? b : a; }                \
  inline T max(T a, T b) { return a < b ? b : a; }                \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
EMU_MINMAX_INT(int)
EMU_MINMAX_INT(uint)
EMU_MINMAX_INT(short)
EMU_MINMAX_INT(ushort)
EMU_MINMAX_INT(char)
EMU_MINMAX_INT(uchar)
EMU_MINMAX_INT(signed char)
EMU_MINMAX_INT(long)
EMU_MINMAX_INT(ulong)
EMU_MINMAX_INT(long long)
EMU_MINMAX_INT(unsigned long long)
#undef EMU_MINMAX_INT
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline half min(half a, half b) { return half(std::fmin(float(a), float(b))); }
inline half max(half a, half b) { return half(std::fmax(float(a), float(b))); }
inline bfloat min(bfloat a, bfloat b) { return bfloat(std::fmin(float(a), float(b))); }
inline bfloat max(bfloat a, bfloat b) { return bfloat(std::fmax(float(a), float(b))); }
inline float clamp(float x, float lo, float hi) { return min(max(x, lo), hi); }
inline half clamp(half x, half lo, half hi) { return min(max(x, lo), hi); }
inline bfloat clamp(bfloat x, bfloat lo, bfloat hi) { return min(max(x, lo), hi); }
template <class T, int N>
inline vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = min(a.v[i], b.v[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = max(a.v[i], b.v[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> clamp(const vec<T, N>& x, const vec<T, N>& lo, const vec<T, N>& hi) {
  return min(max(x, lo), hi);
}

inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline half fma(half a, half b, half c) { return half(std::fma(float(a), float(b), float(c))); }
inline bfloat fma(bfloat a, bfloat b, bfloat c) { return bfloat(std::fma(float(a), float(b), float(c))); }
template <class T, int N>
inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
template <class T>
inline T mix(T x, T y, T a) {
  return x + (y - x) * a;
}

template <class T, std::enable_if_t<emu::is_scalar_t<T>::value, int> = 0>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = c.v[i] ? b.v[i] : a.v[i];
  return r;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) {
  return c ? b : a;
}

template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s += a.v[i] * b.v[i];
  return s;
}
template <int N>
inline bool all(const vec<bool, N>& a) {
  for (int i = 0; i < N; ++i)
    if (!a.v[i]) return false;
  return true;
}
template <int N>
inline bool any(const vec<bool, N>& a) {
  for (int i = 0; i < N; ++i)
    if (a.v[i]) return true;
  return false;
}
inline bool all(bool a) { return a; }
inline bool any(bool a) { return a; }

inline bool isnan(float x) { return std::isnan(x); }
inline bool isnan(half x) { return std::isnan(float(x)); }
inline bool isnan(bfloat x) { return std::isnan(float(x)); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isinf(half x) { return std::isinf(float(x)); }
inline bool isinf(bfloat x) { return std::isinf(float(x)); }
inline bool isfinite(float x) { return std::isfinite(x); }
inline bool isfinite(half x) { return std::isfinite(float(x)); }
inline bool isfinite(bfloat x) { return std::isfinite(float(x)); }
inline bool signbit(float x) { return std::signbit(x); }

inline uint popcount(uint x) { return uint(__builtin_popcount(x)); }
inline uint clz(uint x) { return x ? uint(__builtin_clz(x)) : 32u; }
inline uint ctz(uint x) { return x ? uint(__builtin_ctz(x)) : 32u; }
inline uint mulhi(uint a, uint b) { return uint((uint64_t(a) * uint64_t(b)) >> 32); }

namespace fast {
using metal::abs;
using metal::ceil;
using metal::clamp;
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::fabs;
using metal::floor;
using metal::fmax;
using metal::fmin;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::powr;
using metal::round;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
using metal::trunc;
}  // namespace fast
namespace precise {
using metal::abs;
using metal::ceil;
using metal::clamp;
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::fabs;
using metal::floor;
using metal::fmax;
using metal::fmin;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::powr;
using metal::round;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
using metal::trunc;
}  // namespace precise

// ---- synchronisation -----------------------------------------------------------------------------
enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                             mem_threadgroup_imageblock = 8, mem_object_data = 16 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

// Call sites are source lines (default arguments evaluate at the caller), so code duplication by
// the optimiser never makes one source-level call look like two.
#define EMU_SITE_PARAMS int emu_line = __builtin_LINE()
#define EMU_SITE reinterpret_cast<const void*>(uintptr_t(emu_line))

inline void threadgroup_barrier(mem_flags f = mem_flags::mem_none, EMU_SITE_PARAMS) {
  (void)f;
  emu::barrier_wait(EMU_SITE);
}

// ---- SIMD-group and quad-group collectives -----------------------------------------------------
namespace emu_ops {
enum : int {
  SUM = 1, PRODUCT, MAX, MIN, AND, OR, XOR, ALL, ANY, PREFIX_EXCL_SUM, PREFIX_INCL_SUM,
  PREFIX_EXCL_PRODUCT, PREFIX_INCL_PRODUCT, SHUFFLE, SHUFFLE_DOWN, SHUFFLE_UP, SHUFFLE_XOR,
  SHUFFLE_ROTATE_DOWN, SHUFFLE_ROTATE_UP, BROADCAST, BROADCAST_FIRST, IS_FIRST, BARRIER,
  QUAD = 64
};
}  // namespace emu_ops

template <class T>
struct RedSum { static T f(const T& a, const T& b) { return a + b; } };
template <class T>
struct RedProd { static T f(const T& a, const T& b) { return a * b; } };
template <class T>
struct RedMax { static T f(const T& a, const T& b) { return max(a, b); } };
template <class T>
struct RedMin { static T f(const T& a, const T& b) { return min(a, b); } };
template <class T>
struct RedAnd { static T f(const T& a, const T& b) { return a & b; } };
template <class T>
struct RedOr { static T f(const T& a, const T& b) { return a | b; } };
template <class T>
struct RedXor { static T f(const T& a, const T& b) { return a ^ b; } };

template <class T>
inline T lane_in(emu::Thread* t) {
  T v;
  std::memcpy((void*)&v, t->in, sizeof(T));
  return v;
}
template <class T>
inline void lane_out(emu::Thread* t, const T& v) {
  std::memcpy(t->out, (const void*)&v, sizeof(T));
}

// Reduction over the participating lanes of each group of `width` lanes (32 = SIMD-group, 4 = quad).
template <class T, class R, int width>
void eval_reduce(emu::Thread** lanes, int n) {
  for (int k = 0; k < n; ++k) {
    int base = lanes[k]->lane / width;
    bool have = false;
    T acc{};
    for (int j = 0; j < n; ++j) {
      if (lanes[j]->lane / width != base) continue;
      T v = lane_in<T>(lanes[j]);
      acc = have ? R::f(acc, v) : v;
      have = true;
    }
    lane_out<T>(lanes[k], acc);
  }
}

template <class T, class R, int width, bool inclusive>
void eval_prefix(emu::Thread** lanes, int n) {
  for (int k = 0; k < n; ++k) {
    int base = lanes[k]->lane / width;
    T acc = T(0);
    if (std::is_same<R, RedProd<T>>::value) acc = T(1);
    for (int j = 0; j < n; ++j) {
      if (lanes[j]->lane / width != base) continue;
      if (lanes[j]->lane > lanes[k]->lane || (!inclusive && lanes[j]->lane == lanes[k]->lane)) continue;
      acc = R::f(acc, lane_in<T>(lanes[j]));
    }
    lane_out<T>(lanes[k], acc);
  }
}

// Shuffles: the source lane must be participating, otherwise the result is poison (0xFF bytes).
template <class T, int kind, int width>
void eval_shuffle(emu::Thread** lanes, int n) {
  emu::Thread* by_lane[emu::SIMD_WIDTH] = {nullptr};
  for (int j = 0; j < n; ++j) by_lane[lanes[j]->lane] = lanes[j];
  int first = lanes[0]->lane;
  for (int j = 1; j < n; ++j) first = lanes[j]->lane < first ? lanes[j]->lane : first;
  for (int k = 0; k < n; ++k) {
    emu::Thread* t = lanes[k];
    int base = (t->lane / width) * width;
    int l = t->lane - base;
    int a = t->iarg;
    int src = -1;
    bool own = false;
    switch (kind) {
      case emu_ops::SHUFFLE:
      case emu_ops::BROADCAST: src = a; break;
      case emu_ops::SHUFFLE_DOWN: src = l + a; own = src >= width; break;
      case emu_ops::SHUFFLE_UP: src = l - a; own = src < 0; break;
      case emu_ops::SHUFFLE_XOR: src = l ^ a; break;
      case emu_ops::SHUFFLE_ROTATE_DOWN: src = ((l + a) % width + width) % width; break;
      case emu_ops::SHUFFLE_ROTATE_UP: src = ((l - a) % width + width) % width; break;
      case emu_ops::BROADCAST_FIRST: src = first - base; break;
    }
    if (own) {
      std::memcpy(t->out, t->in, sizeof(T));
      continue;
    }
    emu::Thread* s = (src >= 0 && src < width) ? by_lane[base + src] : nullptr;
    if (s) {
      std::memcpy(t->out, s->in, sizeof(T));
    } else {
      std::memset(t->out, 0xFF, sizeof(T));
    }
  }
}

inline void eval_is_first(emu::Thread** lanes, int n) {
  int first = lanes[0]->lane;
  for (int j = 1; j < n; ++j) first = lanes[j]->lane < first ? lanes[j]->lane : first;
  for (int k = 0; k < n; ++k) lane_out<bool>(lanes[k], lanes[k]->lane == first);
}
inline void eval_nothing(emu::Thread** lanes, int n) {
  (void)lanes;
  (void)n;
}

#define EMU_RED(NAME, OP, RED, W)                                                             \
  template <class T>                                                                          \
  T NAME(T x, EMU_SITE_PARAMS) {                                                              \
    return emu::collective<T>(OP, x, 0, &eval_reduce<T, RED<T>, W>, EMU_SITE);                \
  }
EMU_RED(simd_sum, emu_ops::SUM, RedSum, 32)
EMU_RED(simd_product, emu_ops::PRODUCT, RedProd, 32)
EMU_RED(simd_max, emu_ops::MAX, RedMax, 32)
EMU_RED(simd_min, emu_ops::MIN, RedMin, 32)
EMU_RED(simd_and, emu_ops::AND, RedAnd, 32)
EMU_RED(simd_or, emu_ops::OR, RedOr, 32)
EMU_RED(simd_xor, emu_ops::XOR, RedXor, 32)
EMU_RED(quad_sum, emu_ops::QUAD + emu_ops::SUM, RedSum, 4)
EMU_RED(quad_product, emu_ops::QUAD + emu_ops::PRODUCT, RedProd, 4)
EMU_RED(quad_max, emu_ops::QUAD + emu_ops::MAX, RedMax, 4)
EMU_RED(quad_min, emu_ops::QUAD + emu_ops::MIN, RedMin, 4)
EMU_RED(quad_and, emu_ops::QUAD + emu_ops::AND, RedAnd, 4)
EMU_RED(quad_or, emu_ops::QUAD + emu_ops::OR, RedOr, 4)
EMU_RED(quad_xor, emu_ops::QUAD + emu_ops::XOR, RedXor, 4)
#undef EMU_RED

inline bool simd_all(bool x, EMU_SITE_PARAMS) {
  return emu::collective<bool>(emu_ops::ALL, x, 0, &eval_reduce<bool, RedAnd<bool>, 32>, EMU_SITE);
}
inline bool simd_any(bool x, EMU_SITE_PARAMS) {
  return emu::collective<bool>(emu_ops::ANY, x, 0, &eval_reduce<bool, RedOr<bool>, 32>, EMU_SITE);
}
inline bool quad_all(bool x, EMU_SITE_PARAMS) {
  return emu::collective<bool>(emu_ops::QUAD + emu_ops::ALL, x, 0, &eval_reduce<bool, RedAnd<bool>, 4>,
                               EMU_SITE);
}
inline bool quad_any(bool x, EMU_SITE_PARAMS) {
  return emu::collective<bool>(emu_ops::QUAD + emu_ops::ANY, x, 0, &eval_reduce<bool, RedOr<bool>, 4>,
                               EMU_SITE);
}
inline bool simd_is_first(EMU_SITE_PARAMS) {
  return emu::collective<bool>(emu_ops::IS_FIRST, false, 0, &eval_is_first, EMU_SITE);
}

#define EMU_PREFIX(NAME, OP, RED, INCL)                                                       \
  template <class T>                                                                          \
  T NAME(T x, EMU_SITE_PARAMS) {                                                              \
    return emu::collective<T>(OP, x, 0, &eval_prefix<T, RED<T>, 32, INCL>, EMU_SITE);         \
  }
EMU_PREFIX(simd_prefix_exclusive_sum, emu_ops::PREFIX_EXCL_SUM, RedSum, false)
EMU_PREFIX(simd_prefix_inclusive_sum, emu_ops::PREFIX_INCL_SUM, RedSum, true)
EMU_PREFIX(simd_prefix_exclusive_product, emu_ops::PREFIX_EXCL_PRODUCT, RedProd, false)
EMU_PREFIX(simd_prefix_inclusive_product, emu_ops::PREFIX_INCL_PRODUCT, RedProd, true)
#undef EMU_PREFIX

#define EMU_SHUF(NAME, OP, KIND, W)                                                           \
  template <class T, class I>                                                                 \
  T NAME(T x, I arg, EMU_SITE_PARAMS) {                                                       \
    return emu::collective<T>(OP, x, int(arg), &eval_shuffle<T, KIND, W>, EMU_SITE);          \
  }
EMU_SHUF(simd_shuffle, emu_ops::SHUFFLE, emu_ops::SHUFFLE, 32)
EMU_SHUF(simd_shuffle_down, emu_ops::SHUFFLE_DOWN, emu_ops::SHUFFLE_DOWN, 32)
EMU_SHUF(simd_shuffle_up, emu_ops::SHUFFLE_UP, emu_ops::SHUFFLE_UP, 32)
EMU_SHUF(simd_shuffle_xor, emu_ops::SHUFFLE_XOR, emu_ops::SHUFFLE_XOR, 32)
EMU_SHUF(simd_shuffle_rotate_down, emu_ops::SHUFFLE_ROTATE_DOWN, emu_ops::SHUFFLE_ROTATE_DOWN, 32)
EMU_SHUF(simd_shuffle_rotate_up, emu_ops::SHUFFLE_ROTATE_UP, emu_ops::SHUFFLE_ROTATE_UP, 32)
EMU_SHUF(simd_broadcast, emu_ops::BROADCAST, emu_ops::BROADCAST, 32)
EMU_SHUF(quad_shuffle, emu_ops::QUAD + emu_ops::SHUFFLE, emu_ops::SHUFFLE, 4)
EMU_SHUF(quad_shuffle_down, emu_ops::QUAD + emu_ops::SHUFFLE_DOWN, emu_ops::SHUFFLE_DOWN, 4)
EMU_SHUF(quad_shuffle_up, emu_ops::QUAD + emu_ops::SHUFFLE_UP, emu_ops::SHUFFLE_UP, 4)
EMU_SHUF(quad_shuffle_xor, emu_ops::QUAD + emu_ops::SHUFFLE_XOR, emu_ops::SHUFFLE_XOR, 4)
EMU_SHUF(quad_broadcast, emu_ops::QUAD + emu_ops::BROADCAST, emu_ops::BROADCAST, 4)
#undef EMU_SHUF

template <class T>
T simd_broadcast_first(T x, EMU_SITE_PARAMS) {
  return emu::collective<T>(emu_ops::BROADCAST_FIRST, x, 0, &eval_shuffle<T, emu_ops::BROADCAST_FIRST, 32>,
                            EMU_SITE);
}

inline void simdgroup_barrier(mem_flags f = mem_flags::mem_none, EMU_SITE_PARAMS) {
  (void)f;
  emu::collective<int>(emu_ops::BARRIER, 0, 0, &eval_nothing, EMU_SITE);
}
#undef EMU_SITE
#undef EMU_SITE_PARAMS

// ---- atomics (execution is sequential, so plain read-modify-write is exact) ---------------------
enum memory_order { memory_order_relaxed = 0, memory_order_seq_cst = 5 };
template <class T>
struct atomic {
  T v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;

template <class T, class U>
inline void atomic_store_explicit(atomic<T>* a, U v, memory_order) {
  a->v = T(v);
}
template <class T>
inline T atomic_load_explicit(const atomic<T>* a, memory_order) {
  return a->v;
}
template <class T, class U>
inline T atomic_exchange_explicit(atomic<T>* a, U v, memory_order) {
  T old = a->v;
  a->v = T(v);
  return old;
}
#define EMU_ATOMIC_RMW(NAME, EXPR)                                 \
  template <class T, class U>                                      \
  inline T NAME(atomic<T>* a, U v, memory_order) {                 \
    T old = a->v;                                                  \
    T x = T(v);                                                    \
    a->v = EXPR;                                                   \
    return old;                                                    \
  }
EMU_ATOMIC_RMW(atomic_fetch_add_explicit, T(old + x))
EMU_ATOMIC_RMW(atomic_fetch_sub_explicit, T(old - x))
EMU_ATOMIC_RMW(atomic_fetch_and_explicit, T(old & x))
EMU_ATOMIC_RMW(atomic_fetch_or_explicit, T(old | x))
EMU_ATOMIC_RMW(atomic_fetch_xor_explicit, T(old ^ x))
EMU_ATOMIC_RMW(atomic_fetch_max_explicit, (old < x ? x : old))
EMU_ATOMIC_RMW(atomic_fetch_min_explicit, (x < old ? x : old))
#undef EMU_ATOMIC_RMW
template <class T, class U>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* a, T* expected, U desired, memory_order,
                                                  memory_order) {
  if (a->v == *expected) {
    a->v = T(desired);
    return true;
  }
  *expected = a->v;
  return false;
}

}  // namespace metal

namespace emu {
static const char* op_name(int op) {
  using namespace metal::emu_ops;
  const char* quad = (op >= QUAD) ? "quad_" : "simd_";
  static char buf[48];
  const char* base = "collective";
  switch (op % QUAD) {
    case SUM: base = "sum"; break;
    case PRODUCT: base = "product"; break;
    case MAX: base = "max"; break;
    case MIN: base = "min"; break;
    case AND: base = "and"; break;
    case OR: base = "or"; break;
    case XOR: base = "xor"; break;
    case ALL: base = "all"; break;
    case ANY: base = "any"; break;
    case SHUFFLE: base = "shuffle"; break;
    case SHUFFLE_DOWN: base = "shuffle_down"; break;
    case SHUFFLE_UP: base = "shuffle_up"; break;
    case SHUFFLE_XOR: base = "shuffle_xor"; break;
    case BROADCAST: base = "broadcast"; break;
    case BROADCAST_FIRST: base = "broadcast_first"; break;
    case BARRIER: base = "group_barrier"; break;
    default: break;
  }
  std::snprintf(buf, sizeof buf, "%s%s", quad, base);
  return buf;
}
}  // namespace emu
