// FMHA CPU kernel body, compiled once per instruction set.
//
// Included by fmha_cpu_<isa>.cc after `#pragma GCC target(...)` with
//   FMHA_ISA   namespace name (avx512, avx2, sse2)
//   FMHA_VLEN  floats per vector register
//   FMHA_MR    rows of the GEMM register tile
//   FMHA_NV    vectors per row of the GEMM register tile
// GCC vector extensions keep the code one source for every ISA while pinning the
// register tile; the compiler maps them onto zmm/ymm/xmm registers.
//
// Blocking: a query block of kBr rows meets key blocks of kBc keys. Every GEMM of the
// forward and backward pass is one call of `gemm` below:
//   C[M x N] (+)= A(m, k) * B[k][n],  A(m, k) = A[m * sam + k * sak],  N % VLEN == 0.
#ifndef FMHA_ISA
#error "fmha_cpu_impl.h is included by fmha_cpu_<isa>.cc only"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/common/philox.h"
#include "kernels/cpu/fmha_cpu.h"

namespace paddle_unpad {
namespace FMHA_ISA {

constexpr int V = FMHA_VLEN;
constexpr int MR = FMHA_MR;
constexpr int NV = FMHA_NV;  // vectors per register-tile row
constexpr int64_t kBr = 64;
constexpr int64_t kBc = 128;

#include "kernels/cpu/simd.h"
#define PU_SIMD_VLEN FMHA_VLEN
#include "kernels/cpu/philox_simd.h"

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <int R, int NVT>
static inline void gemm_tile(int64_t K, const float* A, int64_t sam, int64_t sak, const float* B,
                             int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  vf c[R][NVT];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NVT; ++v) c[r][v] = accumulate ? vload(C + r * ldc + v * V) : vf{};
  for (int64_t k = 0; k < K; ++k) {
    vf b[NVT];
    for (int v = 0; v < NVT; ++v) b[v] = vload(B + k * ldb + v * V);
    for (int r = 0; r < R; ++r) {
      const vf a = vsplat(A[r * sam + k * sak]);
      for (int v = 0; v < NVT; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NVT; ++v) vstore(C + r * ldc + v * V, c[r][v]);
}

template <int NVT>
static inline void gemm_cols(int64_t M, int64_t K, const float* A, int64_t sam, int64_t sak,
                             const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    gemm_tile<MR, NVT>(K, A + m * sam, sam, sak, B, ldb, C + m * ldc, ldc, accumulate);
  if (MR > 4)  // e.g. 64 = 10 * 6 + 4 rows: the 4 in one tile, not two latency-bound halves
    for (; m + 4 <= M; m += 4)
      gemm_tile<4, NVT>(K, A + m * sam, sam, sak, B, ldb, C + m * ldc, ldc, accumulate);
  for (; m + 2 <= M; m += 2)
    gemm_tile<2, NVT>(K, A + m * sam, sam, sak, B, ldb, C + m * ldc, ldc, accumulate);
  for (; m < M; ++m)
    gemm_tile<1, NVT>(K, A + m * sam, sam, sak, B, ldb, C + m * ldc, ldc, accumulate);
}

static void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
                 const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int64_t n = 0;
  // Column panels of B stay in L1 while the rows of A stream past them.
  for (; n + NV * V <= N; n += NV * V)
    gemm_cols<NV>(M, K, A, sam, sak, B + n, ldb, C + n, ldc, accumulate);
  if (NV > 2)
    for (; n + 2 * V <= N; n += 2 * V)
      gemm_cols<2>(M, K, A, sam, sak, B + n, ldb, C + n, ldc, accumulate);
  for (; n < N; n += V) gemm_cols<1>(M, K, A, sam, sak, B + n, ldb, C + n, ldc, accumulate);
}

// max(init, x[0 .. n)); x is readable up to round_up(n, V).
static inline float row_max(const float* x, int64_t n, float init) {
  vf mv = vsplat(init);
  for (int64_t j = 0; j < n; j += V) {
    const vf y = j + V <= n ? vload(x + j)
                            : vhead(vload(x + j), n - j, -std::numeric_limits<float>::infinity());
    mv = y > mv ? y : mv;
  }
  return vreduce_max(mv);
}

// Dropout draws of query rows [i0, i0 + rows) of the sequence whose first packed row is t0
// against keys [j0, j0 + n), i0 and j0 multiples of 16: draw j of row i0 + r is element
// r * stride + (j - j0) of the result, stride >= round_up(n, V) (set here); the buffer is
// per thread. In the attention layout (kernels/common/philox.h) the calls of rows i and
// i + 8 (i % 16 < 8) are counters (4 kb + c', t0 + i, h, offset) over key groups kb of 16
// and c' = 0..3: runs of consecutive counters, 8 rows (and the 8 below them) at a time, all
// key groups of a row at once, written straight into the rows (philox_words_rows, kRows).
static inline const uint16_t* dropout_draws(const FmhaProblem& P, int64_t t0, int64_t i0,
                                            int64_t rows, int64_t h, int64_t j0, int64_t n,
                                            int64_t* stride) {
  thread_local std::vector<uint32_t> draws;
  const int64_t groups =
      round_up((n + 15) / 16, std::max<int64_t>(1, L / 4));  // 4 groups blocks: multiple of L
  const int64_t row_words = 8 * groups, rows16 = round_up(rows, 16);
  if (draws.size() < static_cast<size_t>(row_words * rows16)) draws.resize(row_words * rows16);
  *stride = 2 * row_words;  // in draws
  for (int64_t a = 0; a < rows; a += 16)
    philox_words_rows<kAttentionPhiloxRounds, true>(
        draws.data() + a * row_words, static_cast<uint64_t>(4 * (j0 / 16)), 4 * groups,
        static_cast<uint32_t>(t0 + i0 + a), std::min<int64_t>(8, rows - a),
        static_cast<uint32_t>(h), static_cast<uint32_t>(P.offset), P.seed, row_words);
  return reinterpret_cast<const uint16_t*>(draws.data());
}

// x where the draws keep their keys (draw >= threshold, threshold < 2^16), 0 where they
// drop them. AVX-512BW compares the 16-bit draws as they are; the other paths widen them
// to 32-bit lanes (vpmovzxwd), where the signed compare is the unsigned one.
static inline vf vkeep(vf x, const uint16_t* draws, uint32_t threshold) {
#if FMHA_VLEN == 16
  const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(draws));
  const __mmask16 keep =
      _mm256_cmpge_epu16_mask(d, _mm256_set1_epi16(static_cast<int16_t>(threshold)));
  return (vf)_mm512_maskz_mov_ps(keep, (__m512)x);
#else
#if FMHA_VLEN == 8
  const vi w = (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(draws)));
#else
  const vi w = (vi)_mm_unpacklo_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(draws)),
                                      _mm_setzero_si128());
#endif
  return w < static_cast<int32_t>(threshold) ? vf{} : x;
#endif
}

// max(lo, x) in one instruction; a NaN x stays NaN (maxps returns its second operand when
// either is NaN).
static inline vf vmax_keep_nan(vf lo, vf x) {
#if FMHA_VLEN == 16
  return (vf)_mm512_max_ps((__m512)lo, (__m512)x);
#elif FMHA_VLEN == 8
  return (vf)_mm256_max_ps((__m256)lo, (__m256)x);
#else
  return (vf)_mm_max_ps((__m128)lo, (__m128)x);
#endif
}

// exp(x) for the softmax's x = s - max <= 0, clamped at -87 (e^-87 is still a normal
// float). AVX-512 rounds and scales with vrndscaleps and vscalefps instead of the
// magic-number rounding and the exponent bits.
static inline vf softmax_exp(vf x) {
  x = vmax_keep_nan(vsplat(-87.0f), x);
#if FMHA_VLEN == 16
  const vf n =
      (vf)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT);
  return (vf)_mm512_scalef_ps((__m512)vexp_poly5(vexp_residual(x, n)), (__m512)n);
#else
  return vexp5(x);
#endif
}

// One vector of exp_row below: p = exp(s[j..] - m) (zeros past n), added into acc, returned
// with the dropped keys zeroed under kDrop.
template <bool kDrop = false>
static inline vf exp_vec(float* s, int64_t j, int64_t n, vf mv, const uint16_t* draws,
                         uint32_t threshold, vf& acc) {
  vf p = softmax_exp(vload(s + j) - mv);
  if (j + V > n) p = vhead(p, n - j, 0.0f);  // the tail: zeros after the valid part
  acc += p;
  if (kDrop) p = vkeep(p, draws + j, threshold);
  return p;
}

// p[j] = exp(s[j] - m) for j < n, 0 for n <= j < n_pad (n_pad % V == 0; s is readable
// there); returns the lanes' sums of p (reduced once per query block by the forward).
// With kDrop, the p of dropped keys (draw < threshold) are stored as 0 while the sum
// keeps them: the forward's dropout, done in the pass that writes p.
template <bool kDrop = false>
static inline vf exp_row(float* s, int64_t n, int64_t n_pad, float m,
                         const uint16_t* draws = nullptr, uint32_t threshold = 0) {
  const vf mv = vsplat(m);
  vf acc0 = vf{}, acc1 = vf{};
  int64_t j = 0;
  // two vectors per step: exp is a chain of a dozen dependent operations, and a row of a
  // key block has only kBc / V vectors for the out-of-order window to overlap
  for (; j + 2 * V <= n_pad; j += 2 * V) {
    const vf p0 = exp_vec<kDrop>(s, j, n, mv, draws, threshold, acc0);
    const vf p1 = exp_vec<kDrop>(s, j + V, n, mv, draws, threshold, acc1);
    vstore(s + j, p0);
    vstore(s + j + V, p1);
  }
  if (j < n_pad) vstore(s + j, exp_vec<kDrop>(s, j, n, mv, draws, threshold, acc0));
  return acc0 + acc1;
}

// Dropout multipliers (0 or 1/(1-p)) of n keys from their draws.
static inline void dropout_row(float* z, const uint16_t* draws, int64_t n, uint32_t threshold,
                               float keep_scale) {
  const vf keep = vsplat(keep_scale);
  int64_t j = 0;
  for (; j + V <= n; j += V) vstore(z + j, vkeep(keep, draws + j, threshold));
  for (; j < n; ++j) z[j] = draws[j] < threshold ? 0.0f : keep_scale;
}

// Asks for the head slices x[t][h0 .. h0 + D) of rows t in [t_begin, t_end) of a [T, H, D]
// tensor (row stride HD; 3HD in a packed QKV), into L1, or into L2 only with kL2 (for rows
// needed after a query block's work, which streams more than L1 holds past them). An item reads 4*D
// bytes per token at a stride of 4*H*D bytes, which the hardware prefetchers follow too
// late: without this, the loads of q and k were about 7% of the forward at head size 32.
template <bool kL2 = false>
static inline void prefetch_rows(const float* x, int64_t t_begin, int64_t t_end, int64_t HD,
                                 int64_t h0, int64_t D) {
  for (int64_t t = t_begin; t < t_end; ++t)
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(x + t * HD + h0 + d, 0, kL2 ? 2 : 3);
}

// dst[d * ld + j] = x[j * stride + d] for j < n, d < D (n rows of D floats, transposed):
// V x V blocks through registers, the edges one float at a time.
static inline void transpose_rows(const float* x, int64_t stride, int64_t n, int64_t D, float* dst,
                                  int64_t ld) {
  int64_t j = 0;
  for (; j + V <= n; j += V) {
    int64_t d = 0;
    for (; d + V <= D; d += V) {
      vf r[V];
      for (int jj = 0; jj < V; ++jj) r[jj] = vload(x + (j + jj) * stride + d);
      vtranspose(r);
      for (int dd = 0; dd < V; ++dd) vstore(dst + (d + dd) * ld + j, r[dd]);
    }
    for (; d < D; ++d)
      for (int jj = 0; jj < V; ++jj) dst[d * ld + j + jj] = x[(j + jj) * stride + d];
  }
  for (; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) dst[d * ld + j] = x[j * stride + d];
}

// dst[d * ld + j] += bias[d] for d < D, j < n: a bias of k or v, added to its transposed
// rows (the same single rounding as adding it before the transpose).
static inline void add_bias_rows(float* dst, int64_t ld, int64_t n, int64_t D, const float* bias) {
  for (int64_t d = 0; d < D; ++d) {
    const float b = bias[d];
    for (int64_t j = 0; j < n; ++j) dst[d * ld + j] += b;
  }
}

// n rows of D floats, x[j * stride ..] (+ bias) -> dst[j * ld ..], zeros from D up to ld.
static inline void copy_rows(const float* x, int64_t stride, int64_t n, int64_t D,
                             const float* bias, float* dst, int64_t ld) {
  for (int64_t j = 0; j < n; ++j) {
    const float* src = x + j * stride;
    float* row = dst + j * ld;
    if (bias)
      for (int64_t d = 0; d < D; ++d) row[d] = src[d] + bias[d];
    else
      std::memcpy(row, src, sizeof(float) * D);
    for (int64_t d = D; d < ld; ++d) row[d] = 0.0f;
  }
}

static inline float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Forward of one work item: sequence b, head h, query blocks [qb0, qb1). K^T and V of
// the sequence are packed once per item and shared by its query blocks; the result of
// a query block does not depend on how blocks are grouped into items.
void fwd_item(const FmhaProblem& P, const float* q, const float* k, const float* v, float* out,
              float* lse, int64_t b, int64_t h, int64_t qb0, int64_t qb1) {
  const int64_t H = P.heads, D = P.head_dim, HD = H * D;
  const int64_t LD = P.qkv_stride ? P.qkv_stride : HD;  // token stride of q, k, v
  const float* bq = P.q_bias ? P.q_bias + h * D : nullptr;
  const float* bk = P.k_bias ? P.k_bias + h * D : nullptr;
  const float* bv = P.v_bias ? P.v_bias + h * D : nullptr;
  const int64_t Dp = round_up(D, V);
  const int64_t t0 = P.cu_seqlens[b], s = P.cu_seqlens[b + 1] - t0;
  const int64_t sp = round_up(s, kBc);  // K^T row stride; multiple of V
  const bool dropout = P.dropout > 0.0f;
  const uint32_t threshold = dropout_threshold(P.dropout, kAttentionDrawBits);
  const float keep_scale = dropout ? 1.0f / (1.0f - P.dropout) : 1.0f;

  thread_local std::vector<float> seq_buf, blk_buf;
  float* Kt = scratch(seq_buf, D * sp + sp * Dp);  // [D][sp], then V [sp][Dp]
  float* Vp = Kt + D * sp;
  float* Qs = scratch(blk_buf, kBr * Dp + kBr * kBc + kBr * Dp + kBr + kBr * V);
  float* S = Qs + kBr * Dp;
  float* O = S + kBr * kBc;
  float* m = O + kBr * Dp;
  float* l = m + kBr;  // [kBr][V]: row i's sum of p, by lane

  constexpr int64_t kAhead = 32;  // tokens: a DRAM latency's worth of the packing loop
  prefetch_rows(q, t0 + qb0 * kBr, t0 + std::min(s, qb0 * kBr + kBr), LD, h * D, D);
  prefetch_rows(k, t0, t0 + std::min(s, kAhead), LD, h * D, D);
  prefetch_rows(v, t0, t0 + std::min(s, kAhead), LD, h * D, D);
  for (int64_t j = 0; j < s; j += V) {
    const int64_t n = std::min<int64_t>(V, s - j);
    prefetch_rows(k, t0 + j + kAhead, t0 + std::min(s, j + kAhead + V), LD, h * D, D);
    prefetch_rows(v, t0 + j + kAhead, t0 + std::min(s, j + kAhead + V), LD, h * D, D);
    transpose_rows(k + (t0 + j) * LD + h * D, LD, n, D, Kt + j, sp);
    copy_rows(v + (t0 + j) * LD + h * D, LD, n, D, bv, Vp + j * Dp, Dp);
  }
  if (bk) add_bias_rows(Kt, sp, s, D, bk);
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = s; j < sp; ++j) Kt[d * sp + j] = 0.0f;

  for (int64_t qb = qb0; qb < qb1; ++qb) {
    const int64_t i0 = qb * kBr, br = std::min(kBr, s - i0);
    if (qb + 1 < qb1)
      prefetch_rows<true>(q, t0 + i0 + kBr, t0 + std::min(s, i0 + 2 * kBr), LD, h * D, D);
    prefetch_rows<true>(out, t0 + i0, t0 + i0 + br, HD, h * D, D);  // written at the block's end
    for (int64_t i = 0; i < br; ++i) {
      const float* src = q + (t0 + i0 + i) * LD + h * D;
      if (bq)
        for (int64_t d = 0; d < D; ++d) Qs[i * Dp + d] = (src[d] + bq[d]) * P.scale;
      else
        for (int64_t d = 0; d < D; ++d) Qs[i * Dp + d] = src[d] * P.scale;
      m[i] = -std::numeric_limits<float>::infinity();
      vstore(l + i * V, vf{});
    }
    std::memset(O, 0, sizeof(float) * br * Dp);

    for (int64_t j0 = 0; j0 < s; j0 += kBc) {
      const int64_t bc = std::min(kBc, s - j0), bcp = round_up(bc, V);
      gemm(br, bcp, D, Qs, Dp, 1, Kt + j0, sp, S, kBc, false);
      int64_t dstride = 0;
      const uint16_t* draws =
          dropout ? dropout_draws(P, t0, i0, br, h, j0, bcp, &dstride) : nullptr;
      for (int64_t i = 0; i < br; ++i) {
        float* row = S + i * kBc;
        const float mx = row_max(row, bc, m[i]);
        // 0 on the first block (m = -inf); often exactly 1 later, without calling exp
        const float alpha = mx == m[i] ? 1.0f : std::exp(m[i] - mx);
        // dropped probabilities are zeroed as they are written; the common 1/(1-p) is
        // applied once, to the output row
        const vf sum = dropout ? exp_row<true>(row, bc, bcp, mx, draws + i * dstride, threshold)
                               : exp_row(row, bc, bcp, mx);
        vstore(l + i * V, vload(l + i * V) * alpha + sum);
        m[i] = mx;
        if (alpha != 1.0f) {
          float* o = O + i * Dp;
          for (int64_t d = 0; d < Dp; d += V) vstore(o + d, vload(o + d) * alpha);
        }
      }
      gemm(br, Dp, bc, S, kBc, 1, Vp + j0 * Dp, Dp, O, Dp, true);
    }

    for (int64_t i = 0; i < br; ++i) {
      const float li = vreduce_add(vload(l + i * V));
      const float inv = keep_scale / li;
      float* dst = out + (t0 + i0 + i) * HD + h * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = O[i * Dp + d] * inv;
      lse[(t0 + i0 + i) * H + h] = m[i] + std::log(li);
    }
  }
}

// Backward of one (sequence b, head h) work item: keys in the outer loop (dK, dV of a
// key block are finished before the next), queries inside; dQ accumulates in scratch
// owned by this item, so no two threads ever write the same output element.
void bwd_item(const FmhaProblem& P, const float* q, const float* k, const float* v,
              const float* out, const float* lse, const float* dout, float* dq, float* dk,
              float* dv, int64_t b, int64_t h) {
  const int64_t H = P.heads, D = P.head_dim, HD = H * D;
  const int64_t LD = P.qkv_stride ? P.qkv_stride : HD;  // token stride of q, k, v, dq, dk, dv
  const float* bq = P.q_bias ? P.q_bias + h * D : nullptr;
  const float* bk = P.k_bias ? P.k_bias + h * D : nullptr;
  const float* bv = P.v_bias ? P.v_bias + h * D : nullptr;
  const int64_t Dp = round_up(D, V);
  const int64_t t0 = P.cu_seqlens[b], s = P.cu_seqlens[b + 1] - t0;
  const bool dropout = P.dropout > 0.0f;
  const uint32_t threshold = dropout_threshold(P.dropout, kAttentionDrawBits);
  const float keep_scale = dropout ? 1.0f / (1.0f - P.dropout) : 1.0f;

  thread_local std::vector<float> seq_buf, blk_buf;
  float* Qs = scratch(seq_buf, 3 * s * Dp + 2 * s);
  float* dOp = Qs + s * Dp;
  float* dQ = dOp + s * Dp;
  float* delta = dQ + s * Dp;
  float* lse_s = delta + s;  // this sequence's LSE rows
  float* Kt = scratch(blk_buf, 2 * D * kBc + 3 * kBc * Dp + 3 * kBr * kBc);
  float* Vt = Kt + D * kBc;
  float* Kp = Vt + D * kBc;
  float* dK = Kp + kBc * Dp;
  float* dV = dK + kBc * Dp;
  float* Pm = dV + kBc * Dp;  // P, then dS in place
  float* Pd = Pm + kBr * kBc;  // dropped P (only with dropout)
  float* dP = Pd + kBr * kBc;

  for (int64_t i = 0; i < s; ++i) {
    const int64_t t = t0 + i;
    const float* qs = q + t * LD + h * D;
    const float* gs = dout + t * HD + h * D;
    const float* os = out + t * HD + h * D;
    // q's own loop: a bias must not change how the compiler builds delta's sum below
    if (bq)
      for (int64_t d = 0; d < D; ++d) Qs[i * Dp + d] = (qs[d] + bq[d]) * P.scale;
    else
      for (int64_t d = 0; d < D; ++d) Qs[i * Dp + d] = qs[d] * P.scale;
    float dlt = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      dOp[i * Dp + d] = gs[d];
      dlt += gs[d] * os[d];
    }
    for (int64_t d = D; d < Dp; ++d) Qs[i * Dp + d] = dOp[i * Dp + d] = 0.0f;
    delta[i] = dlt;
    lse_s[i] = lse[t * H + h];
  }
  std::memset(dQ, 0, sizeof(float) * s * Dp);

  for (int64_t j0 = 0; j0 < s; j0 += kBc) {
    const int64_t bc = std::min(kBc, s - j0), bcp = round_up(bc, V);
    transpose_rows(k + (t0 + j0) * LD + h * D, LD, bc, D, Kt, kBc);
    transpose_rows(v + (t0 + j0) * LD + h * D, LD, bc, D, Vt, kBc);
    if (bk) add_bias_rows(Kt, kBc, bc, D, bk);
    if (bv) add_bias_rows(Vt, kBc, bc, D, bv);
    copy_rows(k + (t0 + j0) * LD + h * D, LD, bc, D, bk, Kp, Dp);
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = bc; j < bcp; ++j) Kt[d * kBc + j] = Vt[d * kBc + j] = 0.0f;
    std::memset(dK, 0, sizeof(float) * bc * Dp);
    std::memset(dV, 0, sizeof(float) * bc * Dp);

    for (int64_t i0 = 0; i0 < s; i0 += kBr) {
      const int64_t br = std::min(kBr, s - i0);
      const float* Qb = Qs + i0 * Dp;
      const float* dOb = dOp + i0 * Dp;
      gemm(br, bcp, D, Qb, Dp, 1, Kt, kBc, Pm, kBc, false);
      for (int64_t i = 0; i < br; ++i) exp_row(Pm + i * kBc, bc, bcp, lse_s[i0 + i]);
      if (dropout) {
        int64_t dstride = 0;
        const uint16_t* draws = dropout_draws(P, t0, i0, br, h, j0, bc, &dstride);
        for (int64_t i = 0; i < br; ++i) {
          float* z = Pd + i * kBc;
          dropout_row(z, draws + i * dstride, bc, threshold, keep_scale);
          for (int64_t j = bc; j < bcp; ++j) z[j] = 0.0f;
        }
      }
      gemm(br, bcp, D, dOb, Dp, 1, Vt, kBc, dP, kBc, false);  // dP' = dO V^T
      // dS = P * (dP' * Z - delta) goes into Pm; the P that multiplies into dV (P * Z
      // with dropout, P without) goes into Pd or, without dropout, into dP's buffer.
      float* Pv = dropout ? Pd : dP;
      for (int64_t i = 0; i < br; ++i) {
        float* p = Pm + i * kBc;
        float* g = dP + i * kBc;
        float* pv = Pv + i * kBc;
        const float dl = delta[i0 + i];
        const vf dlv = vsplat(dl);
        // Explicit vectors: the buffers may alias as far as the compiler knows (Pv is
        // dP's buffer without dropout), which would keep these loops scalar.
        if (dropout) {
          for (int64_t j = 0; j < bcp; j += V) {
            const vf pj = vload(p + j), zj = vload(pv + j);
            vstore(p + j, pj * (vload(g + j) * zj - dlv));
            vstore(pv + j, pj * zj);
          }
        } else {
          for (int64_t j = 0; j < bcp; j += V) {
            const vf pj = vload(p + j);
            vstore(p + j, pj * (vload(g + j) - dlv));
            vstore(pv + j, pj);
          }
        }
      }
      gemm(bc, Dp, br, Pv, 1, kBc, dOb, Dp, dV, Dp, true);  // dV += (P Z)^T dO
      gemm(bc, Dp, br, Pm, 1, kBc, Qb, Dp, dK, Dp, true);                   // dK += dS^T Qs
      gemm(br, Dp, bc, Pm, kBc, 1, Kp, Dp, dQ + i0 * Dp, Dp, true);         // dQ += dS K
    }
    for (int64_t j = 0; j < bc; ++j) {
      std::memcpy(dk + (t0 + j0 + j) * LD + h * D, dK + j * Dp, sizeof(float) * D);
      std::memcpy(dv + (t0 + j0 + j) * LD + h * D, dV + j * Dp, sizeof(float) * D);
    }
  }
  for (int64_t i = 0; i < s; ++i) {
    float* dst = dq + (t0 + i) * LD + h * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = dQ[i * Dp + d] * P.scale;
  }
}

}  // namespace FMHA_ISA
}  // namespace paddle_unpad
