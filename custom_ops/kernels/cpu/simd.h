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

// exp(x), ~1 ulp, for x in [-87, 88] (clamped outside: never inf, NaN or a denormal):
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2 (ln2 split in two so n * ln2_hi is
// exact), degree-7 Taylor polynomial (truncation < 6e-9 relative), 2^n through the
// exponent bits.
static inline vf vexp(vf x) {
  const vf lo = vsplat(-87.0f), hi = vsplat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = vsplat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = x * 1.44269504088896341f + magic;
  const vf n = t - magic;
  const vi ni = (vi)t - 0x4B400000;  // the integer n, read from t's mantissa
  vf r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  vf p = vsplat(1.0f / 5040.0f);
  p = p * r + (1.0f / 720.0f);
  p = p * r + (1.0f / 120.0f);
  p = p * r + (1.0f / 24.0f);
  p = p * r + (1.0f / 6.0f);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * (vf)((ni + 127) << 23);
}
