// Philox4x32 counter-based generator and the dropout counter layouts built on it.
//
// Shared by the CPU and CUDA kernels (and mirrored by paddle_unpad/ops/philox.py) so that
// a given (seed, offset) drops the same attention elements on every device. The mask
// is never stored: forward and backward both regenerate it from the counter.
//
// Layout for attention dropout (query i and key j of one sequence, whose first row is t0
// in the packed tensor; head h), 16 bits per element, 8 elements per Philox4x32-7 call
// (kAttentionPhiloxRounds, below):
//   key     = (seed & 0xffffffff, seed >> 32)
//   counter = (4 * (j / 16) + (j / 2) % 4,  t0 + (i & ~8),  h,  offset & 0xffffffff)
//   word    = philox(counter, key)[2 * ((i / 8) % 2) + (j / 8) % 2]
//   draw    = j even ? word & 0xffff : word >> 16
//   dropped iff draw < threshold16, threshold16 = min(floor(p * 2^16), 2^16 - 1)
// One call covers queries {i, i ^ 8} x keys {j, j ^ 1, j ^ 8, j ^ 9} inside an aligned
// 16 x 16 block: exactly the eight elements one lane holds of two adjacent m16n8 accumulator
// tiles (rows g, g + 8, columns 2c, 2c + 1 of each), the tiles every GPU kernel keeps its
// scores in. So each lane makes the calls of its own elements and uses all 128 bits, in the
// forward and in the backward alike, and the CPU kernels make the same calls for whole rows
// (four consecutive counters cover 16 keys of two rows). p is resolved to 2^-16.
//
// Layout for row-wise dropout in the fused encoder ops (bias_dropout_residual_layer_norm:
// element (r, j) of the [N, F] tensor, r = row with all leading dimensions flattened,
// j = column, r < 2^32), Philox4x32-10:
//   key     = (seed & 0xffffffff, seed >> 32)
//   counter = (j / 4, r, 0xffffffff, offset & 0xffffffff)
//   word    = philox(counter, key)[j % 4]
//   dropped iff word < threshold, threshold = min(floor(p * 2^32), 2^32 - 1);
//   kept values are scaled by 1 / (1 - p) (in both layouts)
// Counter word 2 is 0xffffffff, a value the attention layout never uses (it holds the
// head index there, < 2^16), so the two layouts never share a counter under one (seed, offset).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define PU_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PU_HOST_DEVICE inline
#endif
// The CUDA emulation counts the calls the kernels make (tests/cuda_emu); nothing elsewhere.
#ifndef PU_COUNT_PHILOX_CALL
#define PU_COUNT_PHILOX_CALL()
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

// Philox4x32-R (Random123): R rounds on counter (c0..c3) with key (k0, k1).
template <int kRounds>
PU_HOST_DEVICE Philox4 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                  uint32_t k1) {
  PU_COUNT_PHILOX_CALL();
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  const uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)  // device pass only: the host compiler warns on it
#pragma unroll
#endif
  for (int r = 0; r < kRounds; ++r) {
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

// The row-wise layout's generator.
PU_HOST_DEVICE Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                     uint32_t k0, uint32_t k1) {
  return philox4x32<10>(c0, c1, c2, c3, k0, k1);
}

// Rounds of the attention layout's generator: Philox4x32-7, as FlashAttention's dropout.
// Random123's authors found seven rounds the fewest for Philox4x32 that pass TestU01's
// BigCrush (ten is their margin); a dropout mask needs statistical quality, not the margin,
// and the attention kernels make one call per eight elements of the tensor-core loop, where
// the three rounds cost about 1.5 instructions per element.
constexpr int kAttentionPhiloxRounds = 7;

// Bits of one attention-dropout draw (the row-wise layout draws a whole 32-bit word).
constexpr int kAttentionDrawBits = 16;

// The attention layout's counter words 0 and 1 and its word index (see above).
PU_HOST_DEVICE uint32_t attention_counter0(uint32_t j) { return ((j >> 4) << 2) | ((j >> 1) & 3u); }
PU_HOST_DEVICE uint32_t attention_counter1(uint32_t t0, uint32_t i) { return t0 + (i & ~8u); }
PU_HOST_DEVICE int attention_word(uint32_t i, uint32_t j) {
  return static_cast<int>(((i >> 2) & 2u) | ((j >> 3) & 1u));
}

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
