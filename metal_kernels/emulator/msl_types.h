// Metal Shading Language subset for the Duet CPU emulator: scalar and vector types.
// Written for the emulator; covers what the project's kernels and MLX's qmv_fast use.
#pragma once

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

// bfloat: 16-bit brain float, round-to-nearest-even from float, arithmetic through float.
struct bfloat {
  uint16_t bits_;
  bfloat() = default;
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      return uint16_t((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
  bfloat(float f) : bits_(from_float(f)) {}
  template <class U,
            std::enable_if_t<std::is_arithmetic<U>::value || std::is_same<U, _Float16>::value, int> = 0>
  bfloat(U u) : bits_(from_float(float(u))) {}
  operator float() const {
    uint32_t u = uint32_t(bits_) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

namespace emu {
template <class U>
struct is_scalar_t
    : std::integral_constant<bool, std::is_arithmetic<U>::value || std::is_same<U, _Float16>::value ||
                                       std::is_same<U, bfloat>::value> {};
// Result type of bfloat (op) U: floating partners promote to float, integers keep bfloat.
template <class U>
using bf_result = std::conditional_t<std::is_integral<U>::value, bfloat, float>;
template <class U>
using if_arith = std::enable_if_t<std::is_arithmetic<U>::value || std::is_same<U, _Float16>::value, int>;
}  // namespace emu

#define EMU_BF_BINOP(OP)                                                         \
  inline bfloat operator OP(bfloat a, bfloat b) { return bfloat(float(a) OP float(b)); } \
  template <class U, emu::if_arith<U> = 0>                                     \
  inline emu::bf_result<U> operator OP(bfloat a, U b) {                        \
    return emu::bf_result<U>(float(a) OP float(b));                            \
  }                                                                            \
  template <class U, emu::if_arith<U> = 0>                                     \
  inline emu::bf_result<U> operator OP(U a, bfloat b) {                        \
    return emu::bf_result<U>(float(a) OP float(b));                            \
  }                                                                            \
  template <class U, emu::if_arith<U> = 0>                                     \
  inline bfloat& operator OP##=(bfloat & a, U b) {                             \
    a = bfloat(float(a) OP float(b));                                          \
    return a;                                                                  \
  }                                                                            \
  inline bfloat& operator OP##=(bfloat & a, bfloat b) {                        \
    a = bfloat(float(a) OP float(b));                                          \
    return a;                                                                  \
  }
EMU_BF_BINOP(+)
EMU_BF_BINOP(-)
EMU_BF_BINOP(*)
EMU_BF_BINOP(/)
#undef EMU_BF_BINOP

#define EMU_BF_CMP(OP)                                                                        \
  inline bool operator OP(bfloat a, bfloat b) { return float(a) OP float(b); }                \
  template <class U, emu::if_arith<U> = 0>                                                  \
  inline bool operator OP(bfloat a, U b) { return float(a) OP float(b); }                   \
  template <class U, emu::if_arith<U> = 0>                                                  \
  inline bool operator OP(U a, bfloat b) { return float(a) OP float(b); }
EMU_BF_CMP(==)
EMU_BF_CMP(!=)
EMU_BF_CMP(<)
EMU_BF_CMP(<=)
EMU_BF_CMP(>)
EMU_BF_CMP(>=)
#undef EMU_BF_CMP

inline bfloat operator-(bfloat a) {
  bfloat r;
  r.bits_ = uint16_t(a.bits_ ^ 0x8000u);
  return r;
}
inline bfloat operator+(bfloat a) { return a; }

typedef half float16_t;
typedef bfloat bfloat16_t;

// ---------------------------------------------------------------------------------------------
// Vectors
// ---------------------------------------------------------------------------------------------
template <class T, int N>
struct vec;

template <class T, int N>
struct vec_ops {
  using V = vec<T, N>;
  using B = vec<bool, N>;
#define EMU_V_BIN(OP)                                                   \
  friend V operator OP(const V& a, const V& b) {                        \
    V r;                                                                \
    for (int i = 0; i < N; ++i) r.v[i] = T(a.v[i] OP b.v[i]);           \
    return r;                                                           \
  }                                                                     \
  friend V operator OP(const V& a, T b) {                               \
    V r;                                                                \
    for (int i = 0; i < N; ++i) r.v[i] = T(a.v[i] OP b);                \
    return r;                                                           \
  }                                                                     \
  friend V operator OP(T a, const V& b) {                               \
    V r;                                                                \
    for (int i = 0; i < N; ++i) r.v[i] = T(a OP b.v[i]);                \
    return r;                                                           \
  }                                                                     \
  friend V& operator OP##=(V & a, const V& b) {                         \
    for (int i = 0; i < N; ++i) a.v[i] = T(a.v[i] OP b.v[i]);           \
    return a;                                                           \
  }                                                                     \
  friend V& operator OP##=(V & a, T b) {                                \
    for (int i = 0; i < N; ++i) a.v[i] = T(a.v[i] OP b);                \
    return a;                                                           \
  }
  EMU_V_BIN(+)
  EMU_V_BIN(-)
  EMU_V_BIN(*)
  EMU_V_BIN(/)
  EMU_V_BIN(%)
  EMU_V_BIN(&)
  EMU_V_BIN(|)
  EMU_V_BIN(^)
  EMU_V_BIN(<<)
  EMU_V_BIN(>>)
#undef EMU_V_BIN
#define EMU_V_CMP(OP)                                                   \
  friend B operator OP(const V& a, const V& b) {                        \
    B r;                                                                \
    for (int i = 0; i < N; ++i) r.v[i] = a.v[i] OP b.v[i];              \
    return r;                                                           \
  }                                                                     \
  friend B operator OP(const V& a, T b) {                               \
    B r;                                                                \
    for (int i = 0; i < N; ++i) r.v[i] = a.v[i] OP b;                   \
    return r;                                                           \
  }                                                                     \
  friend B operator OP(T a, const V& b) {                               \
    B r;                                                                \
    for (int i = 0; i < N; ++i) r.v[i] = a OP b.v[i];                   \
    return r;                                                           \
  }
  EMU_V_CMP(==)
  EMU_V_CMP(!=)
  EMU_V_CMP(<)
  EMU_V_CMP(<=)
  EMU_V_CMP(>)
  EMU_V_CMP(>=)
  EMU_V_CMP(&&)
  EMU_V_CMP(||)
#undef EMU_V_CMP
  friend V operator-(const V& a) {
    V r;
    for (int i = 0; i < N; ++i) r.v[i] = T(-a.v[i]);
    return r;
  }
  friend V operator~(const V& a) {
    V r;
    for (int i = 0; i < N; ++i) r.v[i] = T(~a.v[i]);
    return r;
  }
  friend B operator!(const V& a) {
    B r;
    for (int i = 0; i < N; ++i) r.v[i] = !a.v[i];
    return r;
  }
};

// Swizzle proxy: reads as vec<T, sizeof...(I)>, assignable from one.
template <class T, int S, int... I>
struct swz : vec_ops<T, int(sizeof...(I))> {
  T d[S];
  using R = vec<T, int(sizeof...(I))>;
  operator R() const { return R(d[I]...); }
  swz& operator=(const R& r) {
    int k = 0;
    int idx[] = {I...};
    for (int j : idx) d[j] = r.v[k++];
    return *this;
  }
  swz& operator=(const swz& o) { return *this = R(o); }
};

namespace emu {
template <class U>
struct ncomp : std::integral_constant<int, 1> {};
template <class U, int M>
struct ncomp<vec<U, M>> : std::integral_constant<int, M> {};
template <class T, class U>
inline void put(T* dst, int& k, const U& u) {
  dst[k++] = T(u);
}
template <class T, class U, int M>
inline void put(T* dst, int& k, const vec<U, M>& u) {
  for (int i = 0; i < M; ++i) dst[k++] = T(u.v[i]);
}
}  // namespace emu

#define EMU_VEC_COMMON(N)                                                                 \
  vec() = default;                                                                        \
  vec(const vec& o) { std::memcpy((void*)this, (const void*)&o, sizeof(vec)); }          \
  vec& operator=(const vec& o) {                                                          \
    std::memcpy((void*)this, (const void*)&o, sizeof(vec));                               \
    return *this;                                                                         \
  }                                                                                       \
  template <class U, std::enable_if_t<emu::is_scalar_t<U>::value, int> = 0>               \
  vec(U s) {                                                                              \
    for (int i = 0; i < N; ++i) v[i] = T(s);                                              \
  }                                                                                       \
  template <class U>                                                                      \
  explicit vec(const vec<U, N>& o) {                                                      \
    for (int i = 0; i < N; ++i) v[i] = T(o.v[i]);                                         \
  }                                                                                       \
  template <class A, class B, class... C>                                                 \
  vec(const A& a, const B& b, const C&... c) {                                            \
    static_assert(emu::ncomp<A>::value + emu::ncomp<B>::value + (0 + ... + emu::ncomp<C>::value) == N, \
                  "vector constructor needs exactly N components");                       \
    int k = 0;                                                                            \
    emu::put(v, k, a);                                                                    \
    emu::put(v, k, b);                                                                    \
    (emu::put(v, k, c), ...);                                                             \
  }                                                                                       \
  T& operator[](int i) { return v[i]; }                                                   \
  const T& operator[](int i) const { return v[i]; }

template <class T>
struct vec<T, 2> : vec_ops<T, 2> {
  union {
    T v[2];
    struct {
      T x, y;
    };
    struct {
      T r, g;
    };
    swz<T, 2, 1, 0> yx;
    swz<T, 2, 0, 0> xx;
    swz<T, 2, 1, 1> yy;
    swz<T, 2, 0, 1> xy;
  };
  EMU_VEC_COMMON(2)
};

template <class T>
struct vec<T, 3> : vec_ops<T, 3> {
  union {
    T v[4];
    struct {
      T x, y, z;
    };
    struct {
      T r, g, b;
    };
    swz<T, 4, 0, 1> xy;
    swz<T, 4, 1, 2> yz;
    swz<T, 4, 0, 2> xz;
    swz<T, 4, 0, 1, 2> xyz;
    swz<T, 4, 0, 1, 2> rgb;
  };
  EMU_VEC_COMMON(3)
};

template <class T>
struct vec<T, 4> : vec_ops<T, 4> {
  union {
    T v[4];
    struct {
      T x, y, z, w;
    };
    struct {
      T r, g, b, a;
    };
    swz<T, 4, 0, 1> xy;
    swz<T, 4, 1, 2> yz;
    swz<T, 4, 2, 3> zw;
    swz<T, 4, 0, 2> xz;
    swz<T, 4, 1, 3> yw;
    swz<T, 4, 0, 1> rg;
    swz<T, 4, 2, 3> ba;
    swz<T, 4, 0, 1, 2> xyz;
    swz<T, 4, 1, 2, 3> yzw;
    swz<T, 4, 0, 1, 2> rgb;
    swz<T, 4, 0, 1, 2, 3> xyzw;
    swz<T, 4, 0, 1, 2, 3> rgba;
    swz<T, 4, 3, 2, 1, 0> wzyx;
  };
  EMU_VEC_COMMON(4)
};
#undef EMU_VEC_COMMON

#define EMU_VEC_TYPEDEFS(T, NAME)         \
  typedef vec<T, 2> NAME##2;              \
  typedef vec<T, 3> NAME##3;              \
  typedef vec<T, 4> NAME##4;              \
  typedef vec<T, 2> packed_##NAME##2;     \
  typedef vec<T, 3> packed_##NAME##3;     \
  typedef vec<T, 4> packed_##NAME##4;
EMU_VEC_TYPEDEFS(float, float)
EMU_VEC_TYPEDEFS(half, half)
EMU_VEC_TYPEDEFS(bfloat, bfloat)
EMU_VEC_TYPEDEFS(int, int)
EMU_VEC_TYPEDEFS(uint, uint)
EMU_VEC_TYPEDEFS(short, short)
EMU_VEC_TYPEDEFS(ushort, ushort)
EMU_VEC_TYPEDEFS(char, char)
EMU_VEC_TYPEDEFS(uchar, uchar)
EMU_VEC_TYPEDEFS(long, long)
EMU_VEC_TYPEDEFS(ulong, ulong)
EMU_VEC_TYPEDEFS(bool, bool)
#undef EMU_VEC_TYPEDEFS
