// Philox4x32-10 counter-based generator and the dropout counter layouts built on it.
//
// Shared by the CPU and CUDA kernels (and mirrored by paddle_unpad/philox.py) so that
// a given (seed, offset) drops the same attention elements on every device. The mask
// is never stored: forward and backward both regenerate it from the counter.
//
// Layout for attention dropout (query row t of the packed tensor, key j of the same
// sequence, head h), 16 bits per element:
//   key     = (seed & 0xffffffff, seed >> 32)
//   counter = (j / 8, t, h, offset & 0xffffffff)
//   word    = philox(counter, key)[(j % 8) / 2]
//   draw    = j even ? word & 0xffff : word >> 16
//   dropped iff draw < threshold16, threshold16 = min(floor(p * 2^16), 2^16 - 1)
// (one Philox block per 8 keys: at head size 32 a 32-bit draw per element cost about a
// fifth of the CPU forward; p is resolved to 2^-16.)
//
// Layout for row-wise dropout in the fused encoder ops (bias_dropout_residual_layer_norm:
// element (r, j) of the [N, F] tensor, r = row with all leading dimensions flattened,
// j = column, r < 2^32):
//   key     = (seed & 0xffffffff, seed >> 32)
//   counter = (j / 4, r, 0xffffffff, offset & 0xffffffff)
//   word    = philox(counter, key)[j % 4]
//   dropped iff word < threshold, threshold = min(floor(p * 2^32), 2^32 - 1);
//   kept values are scaled by 1 / (1 - p) (in both layouts)
// Counter word 2 is 0xffffffff, a value the attention layout never uses (it holds the
// head index there), so the two layouts never share a counter under one (seed, offset).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define PU_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PU_HOST_DEVICE inline
#endif

namespace paddle_unpad {

struct Philox4 {
  uint32_t v[4];
};

PU_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

PU_HOST_DEVICE Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                     uint32_t k0, uint32_t k1) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  const uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)  // device pass only: the host compiler warns on it
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(M0, c0, &hi0, &lo0);
    philox_mulhilo(M1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += W0;
    k1 += W1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Bits of one attention-dropout draw (the row-wise layout draws a whole 32-bit word).
constexpr int kAttentionDrawBits = 16;

// Threshold below which a `bits`-bit draw means "drop" for drop probability p in [0, 1):
// min(floor(p * 2^bits), 2^bits - 1).
PU_HOST_DEVICE uint32_t dropout_threshold(double p, int bits = 32) {
  const double range = static_cast<double>(uint64_t{1} << bits);
  const double t = p * range;
  if (t >= range - 1.0) return static_cast<uint32_t>(range - 1.0);
  if (t <= 0.0) return 0u;
  return static_cast<uint32_t>(t);  // truncation == floor for t >= 0
}

}  // namespace paddle_unpad
