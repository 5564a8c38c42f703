// FMHA forward kernel (flash-attention-2 style), included by fmha_fwd_{fp16,bf16}.cu.
//
// One thread block = one (query block, sequence, head); kWarps warps, each owning 16
// query rows. Q of the block is loaded once (cp.async -> shared -> registers); K and V
// tiles of kFwdBlockN keys stream through shared memory: the V load of step j overlaps
// Q K_j^T, the K load of step j+1 overlaps P_j V_j. Scores live in registers (mma.sync
// accumulators), the softmax is online (running max m and sum l per row), and the
// probabilities go from the accumulators straight into the A operand of P V.
//
// Per row the result does not depend on the tile configuration (kWarps): every row sees
// the same key blocks in the same order with the same instructions.
#pragma once
#include <type_traits>

#include "kernels/common/philox.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/fmha_params.cuh"

namespace paddle_unpad {
namespace cuda {

// Attention dropout of one lane's elements of two adjacent m16n8 accumulator tiles (16 keys
// from j16 = a multiple of 16 plus 2c: columns 2c, 2c + 1 of each tile; rows g and g + 8, the
// row pair whose Philox counter word 1 is t_pair): one Philox call holds exactly these eight
// draws (the attention layout of kernels/common/philox.h), so no lane repeats another's call
// and every bit is used. Word 0: row g of tile 0, 1: row g of tile 1, 2 and 3: row g + 8.
__device__ __forceinline__ Philox4 dropout_call(const FmhaParams& p, uint32_t j16, uint32_t t_pair,
                                                uint32_t h) {
  return philox4x32<kAttentionPhiloxRounds>(attention_counter0(j16), t_pair, h, p.offset, p.seed_lo,
                                            p.seed_hi);
}

// Zero the dropped elements of the two tiles x0, x1 that call r covers; the 1/(1-p) of the
// kept ones is the caller's to apply once. thr_hi = threshold16 << 16: a word is below it
// iff its high draw is below threshold16; the low draw is compared the same way, shifted up.
__device__ __forceinline__ void apply_dropout(float (&x0)[4], float (&x1)[4], const Philox4& r,
                                              uint32_t thr_hi) {
  const uint32_t w[4] = {r.v[0], r.v[1], r.v[2], r.v[3]};
  float* x[4][2] = {{&x0[0], &x0[1]}, {&x1[0], &x1[1]}, {&x0[2], &x0[3]}, {&x1[2], &x1[3]}};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if ((w[i] << 16) < thr_hi) *x[i][0] = 0.0f;
    if (w[i] < thr_hi) *x[i][1] = 0.0f;
  }
}

// The dropout of a warp's 16 rows (row pair t_pair) by kNT 8-key tiles of scores (keys j0..,
// this lane's columns 2c, 2c + 1 of each): one call per 16 keys.
template <int kNT>
__device__ __forceinline__ void drop_tiles(const FmhaParams& p, float (&x)[kNT][4], int j0, int c,
                                           uint32_t t_pair, int h) {
#pragma unroll
  for (int n2 = 0; n2 < kNT / 2; ++n2)
    apply_dropout(x[2 * n2], x[2 * n2 + 1],
                  dropout_call(p, static_cast<uint32_t>(j0 + n2 * 16 + 2 * c), t_pair,
                               static_cast<uint32_t>(h)),
                  p.drop_threshold_hi);
}

template <int N>
__device__ __forceinline__ void zero_tiles(float (&x)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[n][e] = 0.0f;
}

// acc0 += a B0 and acc1 += a B1 for two adjacent 8-column tiles of B in shared memory, read
// by one ldmatrix at src (kTrans: B is stored k-major, as V in P V).
template <typename T, bool kTrans>
__device__ __forceinline__ void mma_two_tiles(float (&acc0)[4], float (&acc1)[4],
                                              const uint32_t (&a)[4], const T* src) {
  uint32_t b[4];
  if (kTrans)
    ldmatrix_x4_trans(b, src);
  else
    ldmatrix_x4(b, src);
  mma16816<T>(acc0, a, b[0], b[1]);
  mma16816<T>(acc1, a, b[2], b[3]);
}

// The A fragment (16 x 16) held by two adjacent 8-column accumulator tiles: how the
// probabilities go from the accumulators of one mma straight into the next.
template <typename T>
__device__ __forceinline__ void a_fragment(uint32_t (&a)[4], const float (&c0)[4],
                                           const float (&c1)[4]) {
  a[0] = ElemTraits<T>::pack(c0[0], c0[1]);
  a[1] = ElemTraits<T>::pack(c0[2], c0[3]);
  a[2] = ElemTraits<T>::pack(c1[0], c1[1]);
  a[3] = ElemTraits<T>::pack(c1[2], c1[3]);
}

// acc += P B for a warp's 16 rows: P the kCols / 8 score tiles sc (16 keys = one A fragment per
// step), B kCols rows of D in shared memory (b, kStride apart) read transposed: O += P V of the
// forward, dQ += dS K of the deterministic backward.
template <typename T, int D, int kCols, int kStride>
__device__ __forceinline__ void mma_scores_b(float (&acc)[D / 8][4],
                                             const float (&sc)[kCols / 8][4], const T* b,
                                             int lane) {
#pragma unroll
  for (int kt = 0; kt < kCols / 16; ++kt) {
    uint32_t a[4];
    a_fragment<T>(a, sc[2 * kt], sc[2 * kt + 1]);
#pragma unroll
    for (int d2 = 0; d2 < D / 16; ++d2) {
      const T* src =
          b + (kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + d2 * 16 + (lane >> 4) * 8;
      mma_two_tiles<T, true>(acc[2 * d2], acc[2 * d2 + 1], a, src);
    }
  }
}

// Where a thread block of an FMHA kernel works, once it has rows to work on: the head
// (blockIdx.z) and sequence seq (blockIdx.y) in the packed [T, H, D] tensors, their rows ld
// apart, each tensor's (sequence, head) origin, and which lane of which warp this thread is.
// Every kernel builds it the same way, after leaving a block past the end of its sequence.
template <typename T, int D>
struct VarlenTile {
  int head;
  int64_t ld;    // row stride of every [T, H, D] tensor
  int64_t base;  // offset of (seq.start, head)
  const T* q;
  const T* k;
  const T* v;
  int warp, lane;
  int g, c;  // this lane's rows (g, g + 8) and column pair (2c, 2c + 1) in an mma fragment

  __device__ __forceinline__ VarlenTile(const FmhaParams& p, const SeqSpan& seq)
      : head(static_cast<int>(blockIdx.z)),
        ld(static_cast<int64_t>(p.heads) * D),
        base(static_cast<int64_t>(seq.start) * ld + static_cast<int64_t>(head) * D),
        q(static_cast<const T*>(p.q) + base),
        k(static_cast<const T*>(p.k) + base),
        v(static_cast<const T*>(p.v) + base),
        warp(static_cast<int>(threadIdx.x) / 32),
        lane(static_cast<int>(threadIdx.x) % 32),
        g(lane / 4),
        c(lane % 4) {}
  // The (sequence, head) origin of another tensor of p (dout, set only for the backward;
  // an output).
  __device__ __forceinline__ const T* in(const void* t) const {
    return static_cast<const T*>(t) + base;
  }
  __device__ __forceinline__ T* out(void* t) const { return static_cast<T*>(t) + base; }
};

// The end of an FMHA kernel: this warp's 16 rows of output, its accumulators acc (D / 8
// tiles) times scale_g (row g) and scale_g8 (row g + 8), staged in the warp's own 16 rows of
// smem (kStride apart; no other warp reads them), then stored in 16-byte chunks to the rows
// row0 + 16 warp + r that exist (< s) of the tensor t of p. The scales and t are references so
// that they are read where they are used: loaded at the call, before the barriers, they would
// reorder the kernels' instruction schedule.
template <typename T, int D, int kStride>
__device__ __forceinline__ void store_warp_rows(const VarlenTile<T, D>& tile,
                                                const float (&acc)[D / 8][4], const float& scale_g,
                                                const float& scale_g8, T* smem, void* const& t,
                                                int row0, int s) {
  const int warp = tile.warp, lane = tile.lane, g = tile.g, c = tile.c;
  T* stage = smem + warp * 16 * kStride;
  __syncwarp();
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float& scale = i == 0 ? scale_g : scale_g8;
      *reinterpret_cast<uint32_t*>(stage + (g + 8 * i) * kStride + dt * 8 + 2 * c) =
          ElemTraits<T>::pack(acc[dt][2 * i] * scale, acc[dt][2 * i + 1] * scale);
    }
  __syncwarp();
  T* out = tile.out(t);
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int it = 0; it < 16 * kChunks / 32; ++it) {
    const int idx = it * 32 + lane;
    const int r = idx / kChunks, ch = idx % kChunks;
    const int row = row0 + warp * 16 + r;
    if (row < s)
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * tile.ld + ch * 8) =
          *reinterpret_cast<const uint4*>(stage + r * kStride + ch * 8);
  }
}

// kDropout: a separate instantiation, so that the kernel without dropout holds no Philox
// code and gets the registers it needs without it.
template <typename T, int D, int kWarps, bool kDropout>
__global__ void __launch_bounds__(kWarps * 32)
    fmha_fwd_kernel(const __grid_constant__ FmhaParams p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kBlockM = 16 * kWarps;
  constexpr int kBlockN = kFwdBlockN;
  constexpr int kStride = D + 8;
  constexpr int kKT = D / 16;       // k-steps of Q K^T
  constexpr int kNT = kBlockN / 8;  // 8-wide score tiles per row block
  constexpr int kDT = D / 8;        // 8-wide output tiles

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kStride;
  T* sV = sK + kBlockN * kStride;

  const SeqSpan seq = p.seqs[blockIdx.y];
  const int s = seq.len, q0 = static_cast<int>(blockIdx.x) * kBlockM;
  if (q0 >= s) return;
  const VarlenTile<T, D> tile(p, seq);
  const int h = tile.head, warp = tile.warp, lane = tile.lane, g = tile.g, c = tile.c;

  load_rows_async<T, D, kBlockM, kThreads>(sQ, tile.q, q0, s, tile.ld);
  cp_async_commit();
  load_rows_async<T, D, kBlockN, kThreads>(sK, tile.k, 0, s, tile.ld);
  cp_async_commit();

  uint32_t qf[kKT][4];
  cp_async_wait<1>();
  __syncthreads();  // Q landed
#pragma unroll
  for (int kk = 0; kk < kKT; ++kk)
    ldmatrix_x4(qf[kk], sQ + (warp * 16 + (lane & 15)) * kStride + kk * 16 + (lane >> 4) * 8);
  float o[kDT][4];
  zero_tiles(o);
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  // Philox counter word 1 of this lane's rows g and g + 8 (philox.h: t0 + (i & ~8)).
  const uint32_t t_pair = attention_counter1(static_cast<uint32_t>(seq.start),
                                             static_cast<uint32_t>(q0 + warp * 16 + g));

  const int nkb = (s + kBlockN - 1) / kBlockN;
  for (int kb = 0; kb < nkb; ++kb) {
    const int j0 = kb * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K_kb landed; every warp is done with V_{kb-1}
    load_rows_async<T, D, kBlockN, kThreads>(sV, tile.v, j0, s, tile.ld);
    cp_async_commit();

    // S = Q K^T for this warp's 16 rows and kBlockN keys.
    float sc[kNT][4];
    zero_tiles(sc);
#pragma unroll
    for (int kk = 0; kk < kKT; ++kk) {
#pragma unroll
      for (int n2 = 0; n2 < kNT / 2; ++n2) {
        const T* src = sK + (n2 * 16 + (lane & 7) + (lane >> 4) * 8) * kStride + kk * 16 +
                       ((lane >> 3) & 1) * 8;
        mma_two_tiles<T, false>(sc[2 * n2], sc[2 * n2 + 1], qf[kk], src);
      }
    }

    // Online softmax in base 2: x = scale * log2(e) * s; keys past the end are -inf.
    const int valid = s - j0;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * c + (e & 1);
        const float x = col < valid ? sc[nt][e] * p.scale_log2 : -INFINITY;
        sc[nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float mn = fmaxf(m[i], quad_max(mx[i]));  // finite: every block has a valid key
      alpha[i] = fast_exp2(m[i] - mn);                 // 0 on the first block (m = -inf)
      m[i] = mn;
    }
    float rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = fast_exp2(sc[nt][e] - m[e >> 1]);
        sc[nt][e] = pv;
        rs[e >> 1] += pv;
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + rs[i];  // thread-partial sums
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[dt][e] *= alpha[e >> 1];
    // after the row sum: l normalises the undropped probabilities
    if (kDropout) drop_tiles(p, sc, j0, c, t_pair, h);

    cp_async_wait<0>();
    __syncthreads();  // V_kb landed; every warp is done with K_kb
    if (kb + 1 < nkb) {
      load_rows_async<T, D, kBlockN, kThreads>(sK, tile.k, j0 + kBlockN, s, tile.ld);
      cp_async_commit();
    }

    mma_scores_b<T, D, kBlockN, kStride>(o, sc, sV, lane);  // O += P V_kb
  }

  // Epilogue: normalise, stage this warp's 16 rows in its own rows of sQ (no other warp
  // reads them), then 16-byte stores of the rows that exist.
  float inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] = quad_sum(l[i]);
    inv[i] = (kDropout ? p.keep_scale : 1.0f) / l[i];  // the kept probabilities' 1/(1-p)
  }
  store_warp_rows<T, D, kStride>(tile, o, inv[0], inv[1], sQ, p.out, q0, s);
  if (c == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = q0 + warp * 16 + g + 8 * i;
      if (row < s)
        p.lse[static_cast<int64_t>(seq.start + row) * p.heads + h] = (m[i] + log2f(l[i])) * kLn2;
    }
  }
}

// kernel<<<blocks of rows_per_block rows of every sequence and head, threads, smem>>>(p), allowed
// more than the default 48 KB of shared memory where it needs them.
template <typename Kernel>
cudaError_t launch_varlen(Kernel kernel, const FmhaParams& p, int rows_per_block, int threads,
                          size_t smem, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  const dim3 grid((p.max_len + rows_per_block - 1) / rows_per_block, p.num_seqs, p.heads);
  kernel<<<grid, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

// f(std::integral_constant<int, D>) for the head size D = head_dim (the sizes compiled).
template <typename F>
cudaError_t by_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 32:
      return f(std::integral_constant<int, 32>());
    case 64:
      return f(std::integral_constant<int, 64>());
    case 128:
      return f(std::integral_constant<int, 128>());
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T, int D, int kWarps>
cudaError_t launch_fwd_config(const FmhaParams& p, cudaStream_t stream) {
  constexpr int kBlockM = 16 * kWarps;
  constexpr size_t kSmem = static_cast<size_t>(kBlockM + 2 * kFwdBlockN) * (D + 8) * sizeof(T);
  return launch_varlen(
      p.dropout ? fmha_fwd_kernel<T, D, kWarps, true> : fmha_fwd_kernel<T, D, kWarps, false>, p,
      kBlockM, kWarps * 32, kSmem, stream);
}

template <typename T>
cudaError_t launch_fmha_fwd(const FmhaParams& p, int tile, cudaStream_t stream) {
  return by_head_dim(p.head_dim, [&](auto d) {
    constexpr int D = decltype(d)::value;
    return tile == kFwdTileM64 ? launch_fwd_config<T, D, 4>(p, stream)
                               : launch_fwd_config<T, D, 8>(p, stream);
  });
}

}  // namespace cuda
}  // namespace paddle_unpad
