// Philox4x32-R (common/philox.h) on vectors: the dropout words of the CPU kernels.
//
// Included INSIDE a kernel's per-ISA namespace after simd.h (needs V), with PU_SIMD_VLEN
// defined to the same width; <immintrin.h> must be included before the file's
// `#pragma GCC target`. The 32x32->64-bit multiply is (v)pmuludq picked by that width
// (16: AVX-512, 8: AVX2, 4: SSE2): the portable form would become a 64x64-bit multiply or,
// for a constant factor, shifts and adds.
#pragma once

constexpr int L = V / 2;  // 64-bit lanes per vector: Philox blocks generated at once

typedef uint32_t vu __attribute__((vector_size(V * 4)));
typedef uint64_t vu64 __attribute__((vector_size(V * 4)));
typedef int64_t vi64 __attribute__((vector_size(V * 4)));
typedef uint32_t vu_u __attribute__((vector_size(V * 4), aligned(4)));

static inline vu vloadu(const uint32_t* p) { return *reinterpret_cast<const vu_u*>(p); }

// Low 32 bits of each 64-bit lane of a times those of b, as 64-bit products.
static inline vu64 mul_lo32(vu64 a, vu64 b) {
#if PU_SIMD_VLEN == 16  // maskz: plain _mm512_mul_epu32 trips a GCC 12 -Wmaybe-uninitialized
  return (vu64)_mm512_maskz_mul_epu32((__mmask8)0xff, (__m512i)a, (__m512i)b);
#elif PU_SIMD_VLEN == 8
  return (vu64)_mm256_mul_epu32((__m256i)a, (__m256i)b);
#elif PU_SIMD_VLEN == 4
  return (vu64)_mm_mul_epu32((__m128i)a, (__m128i)b);
#else
#error "PU_SIMD_VLEN must be 16, 8 or 4"
#endif
}

// Lane k of the result takes lane first + k/2 of a (k even) or of b (k odd).
static inline vi64 interleave_mask(int first) {
  vi64 m = vi64{};
  for (int k = 0; k < L; ++k) m[k] = first + k / 2 + (k % 2 ? L : 0);
  return m;
}

// Element j of the words of the attention layout's rows (kRows below): from two vectors of
// L blocks, a = word 0 (or 2), b = word 1 (or 3), per 4 blocks (one key group of 16 keys) the
// low halves of a's 4 lanes, then of b's; L = 2 holds half a group: [a0, a1, b0, b1].
static inline vi rows_mask() {
  vi m = vi{};
  for (int j = 0; j < V; ++j) {
    const int q = j / 8, r = j % 8;
    m[j] = L == 2 ? (j < 2 ? 2 * j : V + 2 * (j - 2)) : 2 * (4 * q + r % 4) + (r < 4 ? 0 : V);
  }
  return m;
}

// G groups of L Philox blocks: group g has counters (c0[g] + i, c1[g], c2, c3), i in [0, L),
// its words written to out[g][4 * i ..] in element order. With kRows, out[g] is instead the
// draw words of a row of the attention layout (kernels/common/philox.h) at the group's key
// group (+ 2 for the second half of a group when L = 2): blocks 4 kb + c' hold, in word w,
// the draws of keys 16 kb + 8 (w % 2) + 2 c' of row g (w < 2) and g + 8 (w >= 2), so word 0
// (then 1) of 4 consecutive blocks is the row's next 4 (then 4) draw words, and the row
// 8 below starts hi_offset words later. G independent dependency chains per round keep the
// multiplier busy (one chain is latency-bound: mul -> shift -> xor -> next mul).
template <int G, int kRounds, bool kRows = false>
static inline void philox_groups(uint32_t* const* out, const uint64_t* c0, const uint32_t* c1,
                                 uint32_t c2, uint32_t c3, uint64_t seed, int64_t hi_offset = 0) {
  const vu64 m0 = vu64{} + 0xD2511F53ull, m1 = vu64{} + 0xCD9E8D57ull;
  const vu64 lo32 = vu64{} + 0xffffffffull;
  vu64 lane = vu64{};
  for (int e = 0; e < L; ++e) lane[e] = static_cast<uint64_t>(e);
  vu64 x0[G], x1[G], x2[G], x3[G];
  for (int g = 0; g < G; ++g) {
    x0[g] = lane + c0[g];
    x1[g] = vu64{} + static_cast<uint64_t>(c1[g]);
    x2[g] = vu64{} + static_cast<uint64_t>(c2);
    x3[g] = vu64{} + static_cast<uint64_t>(c3);
  }
  // The high halves of the lanes may hold garbage inside the rounds (the keys' carries
  // too): the multiplies read the low 32 bits only, and the words are masked at the end.
  vu64 k0 = vu64{} + (seed & 0xffffffffull), k1 = vu64{} + (seed >> 32);
#pragma GCC unroll 10
  for (int round = 0; round < kRounds; ++round) {
    for (int g = 0; g < G; ++g) {
      const vu64 p0 = mul_lo32(x0[g], m0);
      const vu64 p1 = mul_lo32(x2[g], m1);
      x0[g] = (p1 >> 32) ^ x1[g] ^ k0;
      x1[g] = p1;
      x2[g] = (p0 >> 32) ^ x3[g] ^ k1;
      x3[g] = p0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  if (kRows) {
    for (int g = 0; g < G; ++g) {
      const vu lo = __builtin_shuffle((vu)x0[g], (vu)x1[g], rows_mask());
      const vu hi = __builtin_shuffle((vu)x2[g], (vu)x3[g], rows_mask());
      if (L == 2) {  // half a key group: 2 words of each half of the row's 8
        std::memcpy(out[g], &lo, 8);
        std::memcpy(out[g] + 4, reinterpret_cast<const uint32_t*>(&lo) + 2, 8);
        std::memcpy(out[g] + hi_offset, &hi, 8);
        std::memcpy(out[g] + hi_offset + 4, reinterpret_cast<const uint32_t*>(&hi) + 2, 8);
      } else {
        *reinterpret_cast<vu_u*>(out[g]) = lo;
        *reinterpret_cast<vu_u*>(out[g] + hi_offset) = hi;
      }
    }
    return;
  }
  for (int g = 0; g < G; ++g) {
    // Interleave to element order: (x1 << 32 | x0) holds words 0, 1 of each block and
    // (x3 << 32 | x2) words 2, 3 (little-endian); alternating their 64-bit lanes gives
    // block e's four words at 4e.. (one two-source permute per half).
    const vu64 w01 = (x1[g] << 32) | (x0[g] & lo32), w23 = (x3[g] << 32) | (x2[g] & lo32);
    vu_u* w = reinterpret_cast<vu_u*>(out[g]);
    w[0] = (vu)__builtin_shuffle(w01, w23, interleave_mask(0));
    w[1] = (vu)__builtin_shuffle(w01, w23, interleave_mask(L / 2));
  }
}

// Chains per philox_groups call: as many as the registers hold (4 state vectors each;
// AVX2 and SSE2 have 16 vector registers, and a fourth chain there spills to the stack
// every round: 3 chains are a third faster than 4 with AVX2).
constexpr int kChains = PU_SIMD_VLEN == 16 ? 4 : 3;

// The words of `rows` runs of nblocks blocks: run r has counters (c0 + i, c1 + r, c2, c3),
// i in [0, nblocks), and its words at words + 4 * nblocks * r, in element order (word e of
// block i at 4 i + e); or, with kRows, the attention layout's draw words of rows r and r + 8
// at words + row_words * r and + row_words * (r + 8) (8 words per key group of 4 blocks).
// nblocks % L == 0. The groups of L blocks of all runs are generated kChains at a time, so
// that short runs (an attention row's key block is 2 groups with AVX-512) still keep every
// chain busy.
template <int kRounds, bool kRows = false>
static inline void philox_words_rows(uint32_t* words, uint64_t c0, int64_t nblocks, uint32_t c1,
                                     int64_t rows, uint32_t c2, uint32_t c3, uint64_t seed,
                                     int64_t row_words = 0) {
  const int64_t per_run = nblocks / L, units = per_run * rows;
  uint32_t* out[kChains];
  uint64_t ctr0[kChains];
  uint32_t ctr1[kChains];
  auto unit = [&](int64_t u, int g) {
    const int64_t r = u / per_run, i = (u % per_run) * L;
    out[g] = kRows ? words + r * row_words + 8 * (i / 4) + i % 4 : words + 4 * (r * nblocks + i);
    ctr0[g] = c0 + static_cast<uint64_t>(i);
    ctr1[g] = c1 + static_cast<uint32_t>(r);
  };
  int64_t u = 0;
  for (; u + kChains <= units; u += kChains) {
    for (int g = 0; g < kChains; ++g) unit(u + g, g);
    philox_groups<kChains, kRounds, kRows>(out, ctr0, ctr1, c2, c3, seed, 8 * row_words);
  }
  for (; u < units; ++u) {
    unit(u, 0);
    philox_groups<1, kRounds, kRows>(out, ctr0, ctr1, c2, c3, seed, 8 * row_words);
  }
}

// The Philox4x32-10 words of blocks with counters (c0 + i, c1, c2, c3), i in [0, nblocks), in
// element order: words[4 i + e] = word e of block i. nblocks % L == 0.
static inline void philox_words(uint32_t* words, uint64_t c0, int64_t nblocks, uint32_t c1,
                                uint32_t c2, uint32_t c3, uint64_t seed) {
  philox_words_rows<10>(words, c0, nblocks, c1, 1, c2, c3, seed);
}
