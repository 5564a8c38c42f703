// Vector helpers of the CPU kernels, on GCC vector extensions.
//
// Included INSIDE a kernel's per-ISA namespace, after `constexpr int V` (floats per
// vector register) is defined there: each *_<isa>.cc gets its own copy compiled for its
// instruction set (see fmha_cpu_impl.h, fused_cpu_impl.h).
#pragma once

typedef float vf __attribute__((vector_size(V * 4)));
typedef int32_t vi __attribute__((vector_size(V * 4)));
typedef float vf_u __attribute__((vector_size(V * 4), aligned(4)));

static inline vf vload(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
static inline void vstore(float* p, vf x) { *reinterpret_cast<vf_u*>(p) = x; }

// A constructor with V equal elements is a broadcast (vbroadcastss from memory). Not
// vf{} + a: adding +0 is not an identity for -0, so a real add would stay in the
// GEMM's inner loop; nor a loop of element stores, which becomes masked broadcasts.
template <size_t... I>
static inline vf vsplat_impl(float a, std::index_sequence<I...>) {
  return vf{((void)I, a)...};
}
static inline vf vsplat(float a) { return vsplat_impl(a, std::make_index_sequence<V>{}); }

template <size_t... I>
static inline vi viota_impl(std::index_sequence<I...>) {
  return vi{static_cast<int32_t>(I)...};
}
// Lane e holds e.
static inline vi viota() { return viota_impl(std::make_index_sequence<V>{}); }
// Lanes [0, n) of x, the rest `fill`.
static inline vf vhead(vf x, int64_t n, float fill) {
  return viota() < static_cast<int32_t>(n) ? x : vsplat(fill);
}

// Lane e of x moved to lane e ^ W: a butterfly step.
template <int W, size_t... I>
static inline vf vswap_impl(vf x, std::index_sequence<I...>) {
  return __builtin_shuffle(x, vi{static_cast<int32_t>(I ^ W)...});
}
template <int W>
static inline vf vswap(vf x) {
  return vswap_impl<W>(x, std::make_index_sequence<V>{});
}

// Sum and maximum of the lanes, in log2(V) butterfly steps (a serial sum of the lanes
// would be a chain of V dependent adds, once per attention row and key block).
template <int W = V / 2>
static inline float vreduce_add(vf x) {
  if constexpr (W == 0) {
    return x[0];
  } else {
    return vreduce_add<W / 2>(x + vswap<W>(x));
  }
}
template <int W = V / 2>
static inline float vreduce_max(vf x) {
  if constexpr (W == 0) {
    return x[0];
  } else {
    const vf y = vswap<W>(x);
    return vreduce_max<W / 2>(y > x ? y : x);
  }
}

// One butterfly step of an in-register transpose: rows i and i | W (bit W of i clear)
// swap the bit W of row and lane index where the two differ.
template <int W, size_t... I>
static inline void vtranspose_step(vf* r, std::index_sequence<I...>) {
  for (int i = 0; i < V; ++i) {
    if (i & W) continue;
    const vf a = r[i], b = r[i | W];
    r[i] = __builtin_shuffle(a, b, vi{static_cast<int32_t>((I & W) ? I - W + V : I)...});
    r[i | W] = __builtin_shuffle(a, b, vi{static_cast<int32_t>((I & W) ? I + V : I + W)...});
  }
}
// r[0 .. V) holds the rows of a V x V block; afterwards, its columns.
template <int W = V / 2>
static inline void vtranspose(vf* r) {
  if constexpr (W > 0) {
    vtranspose_step<W>(r, std::make_index_sequence<V>{});
    vtranspose<W / 2>(r);
  }
}

// The reduction of exp(x) for x in [-87, 88]: x = n ln2 + r, |r| <= ln2/2. Returns n
// (rounded by adding 1.5 * 2^23) and sets *two_n = 2^n through the exponent bits.
static inline vf vexp_round(vf x, vf* two_n) {
  const vf magic = vsplat(12582912.0f);
  const vf t = x * 1.44269504088896341f + magic;
  const vi ni = (vi)t - 0x4B400000;  // the integer n, read from t's mantissa
  *two_n = (vf)((ni + 127) << 23);
  return t - magic;
}
// r = x - n ln2 with ln2 split in two so that n * ln2_hi is exact (Cody-Waite).
static inline vf vexp_residual(vf x, vf n) {
  const vf r = x - n * 0.693145751953125f;
  return r - n * 1.428606765330187045e-06f;
}

// exp(x), ~1 ulp, for x in [-87, 88] (clamped outside: never inf, NaN or a denormal):
// the reduction above, degree-7 Taylor polynomial (truncation < 6e-9 relative).
static inline vf vexp(vf x) {
  const vf lo = vsplat(-87.0f), hi = vsplat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  vf two_n;
  const vf r = vexp_residual(x, vexp_round(x, &two_n));
  vf p = vsplat(1.0f / 5040.0f);
  p = p * r + (1.0f / 720.0f);
  p = p * r + (1.0f / 120.0f);
  p = p * r + (1.0f / 24.0f);
  p = p * r + (1.0f / 6.0f);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * two_n;
}

// e^r for |r| <= ln2 / 2: degree-5 minimax polynomial (relative error 1.7e-7 in float;
// the Taylor one of degree 7 is 6e-9, below float rounding, and two multiply-adds longer).
static inline vf vexp_poly5(vf r) {
  vf p = vsplat(0.008290315046906471f);
  p = p * r + 0.04189793020486832f;
  p = p * r + 0.1666763573884964f;
  p = p * r + 0.4999915063381195f;
  p = p * r + 0.9999997019767761f;
  return p * r + 1.0f;
}

// exp(x) for x in [-87, 88] (the caller clamps), ~1.5 ulp: the degree-5 polynomial.
static inline vf vexp5(vf x) {
  vf two_n;
  const vf r = vexp_residual(x, vexp_round(x, &two_n));
  return vexp_poly5(r) * two_n;
}
