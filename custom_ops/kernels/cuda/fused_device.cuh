// Internals of the fused CUDA kernels (fused_cuda.cuh): the launch arguments, device
// helpers (vector loads, GELU, row-wise dropout, fixed-order reductions) and the
// launchers that fused_cuda.cu calls, implemented in bias_gelu_cuda.cu,
// bdrln_fwd_cuda.cu and bdrln_bwd_cuda.cu. CUDA headers only.
//
// Two kernel shapes:
//   column tiles  blockDim (bx, by), bx * by = 256: thread x owns one vector of columns
//                 and walks rows y, y + by, ... of its row chunk (bias_gelu; the
//                 general-path bdrln backward). The vector of bias stays in registers,
//                 and the thread's column sums too; they are summed over threadIdx.y in
//                 order at the end of the chunk.
//   row teams     one block per row at a time (bdrln): threads own the vectors
//                 v = t, t + blockDim.x, ... of the row; row sums are a butterfly in each
//                 warp, then the warp sums in warp order.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/philox.h"

namespace paddle_unpad {
namespace cuda {

// Everything a fused kernel needs, filled by the host code in fused_cuda.cu. Passed by
// value (well under the 4 KB parameter limit).
struct FusedArgs {
  const void* x;
  const void* bias;
  const void* residual;
  const void* ln_weight;
  const void* ln_bias;
  void* y;
  float* mean;  // [rows]
  float* rstd;  // [rows]
  const void* dy;
  void* dx;
  void* dresidual;
  float* partials;   // column partials, [arrays][nchunks][cols] (bias_gelu: 1 array, bdrln: 3)
  float2* row_sums;  // general-path bdrln backward: per row (mean(g w), mean(g w xhat))
  int64_t rows;
  int64_t cols;
  int nvec;                // vectors per row: cols / elements per vector
  int64_t rows_per_chunk;  // rows of one column-partial chunk (backward)
  int nchunks;
  float epsilon;
  float inv_cols;  // 1 / cols, as the CPU backward multiplies by it
  int dropout;     // 0 or 1
  uint32_t drop_threshold;
  float keep_scale;  // 1 / (1 - p)
  uint32_t seed_lo, seed_hi, offset;
  bool vec;     // 16-byte vectors (else one element at a time)
  int threads;  // row kernels: block size (a multiple of 32)
  int own;      // row kernels: vectors per thread kept in registers (1 or 2); 0 = general path
};

constexpr int kColTileThreads = 256;  // threads of a column-tile block
constexpr int kRowTeamMax = 512;      // threads of a row-team block, at most
constexpr int kMaxOwn = 2;            // vectors per thread a row kernel keeps in registers

// Elements per vector: 16 bytes, or 1 on the element-wise path.
template <typename T, bool kVec>
constexpr int vec_elems() {
  return kVec ? static_cast<int>(16 / sizeof(T)) : 1;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Column-tile block shape for rows of nvec vectors: bx a power of two <= 32 covering
// them when they are few (small hidden sizes keep most threads busy).
inline dim3 col_tile_block(int nvec) {
  int bx = 1;
  while (bx < nvec && bx < 32) bx <<= 1;
  return dim3(static_cast<unsigned>(bx), static_cast<unsigned>(kColTileThreads / bx));
}

// ---------------------------------------------------------------------- element access

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N elements in one access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T e[N];
};

// Elements of T per access when N are moved: at most 16 bytes at a time (a float row
// next to a half one moves twice the bytes per vector of columns).
template <typename T, int N>
__host__ __device__ constexpr int access_elems() {
  return N * static_cast<int>(sizeof(T)) > 16 ? static_cast<int>(16 / sizeof(T)) : N;
}

template <typename T, int N>
__device__ __forceinline__ void load(const T* __restrict__ p, float (&out)[N]) {
  constexpr int C = access_elems<T, N>();
  static_assert(N % C == 0, "a vector is whole accesses");
#pragma unroll
  for (int k = 0; k < N / C; ++k) {
    const Pack<T, C> v = *reinterpret_cast<const Pack<T, C>*>(p + k * C);
#pragma unroll
    for (int i = 0; i < C; ++i) out[k * C + i] = to_float(v.e[i]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store(T* __restrict__ p, const float (&in)[N]) {
  constexpr int C = access_elems<T, N>();
  static_assert(N % C == 0, "a vector is whole accesses");
#pragma unroll
  for (int k = 0; k < N / C; ++k) {
    Pack<T, C> v;
#pragma unroll
    for (int i = 0; i < C; ++i) v.e[i] = from_float<T>(in[k * C + i]);
    *reinterpret_cast<Pack<T, C>*>(p + k * C) = v;
  }
}

// ---------------------------------------------------------------------- GELU (erf form)

// Phi(u) = erfc(-u / sqrt(2)) / 2: erfc keeps its relative precision in the lower tail,
// where 1 + erf(u / sqrt(2)) would cancel (the CPU kernel computes it the same way).
__device__ __forceinline__ float gelu_cdf(float u) {
  return 0.5f * erfcf(-0.70710678118654752f * u);
}

__device__ __forceinline__ float gelu(float u) { return u * gelu_cdf(u); }

// gelu'(u) = Phi(u) + u * phi(u), phi the standard normal density.
__device__ __forceinline__ float gelu_grad(float u) {
  return gelu_cdf(u) + u * (0.3989422804014327f * expf(-0.5f * u * u));
}

// ---------------------------------------------------------------------- row-wise dropout

// Multipliers (0 = dropped, keep_scale = kept) of columns j0 .. j0 + N - 1 of row r, in
// the row-wise layout of common/philox.h: counter (j / 4, r, 0xffffffff, offset), word
// j % 4. N is 1 or a multiple of 4 with j0 % 4 == 0 (one Philox call per 4 columns).
template <int N>
__device__ __forceinline__ void dropout_mult(const FusedArgs& a, uint32_t r, uint32_t j0,
                                             float (&m)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int b = 0; b < N / 4; ++b) {
      const Philox4 w = philox4x32_10(j0 / 4u + static_cast<uint32_t>(b), r, 0xffffffffu, a.offset,
                                      a.seed_lo, a.seed_hi);
#pragma unroll
      for (int i = 0; i < 4; ++i) m[4 * b + i] = w.v[i] < a.drop_threshold ? 0.0f : a.keep_scale;
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const uint32_t j = j0 + static_cast<uint32_t>(e);
      const Philox4 w = philox4x32_10(j >> 2, r, 0xffffffffu, a.offset, a.seed_lo, a.seed_hi);
      const uint32_t q = j & 3u;
      const uint32_t word = q == 0u ? w.v[0] : (q == 1u ? w.v[1] : (q == 2u ? w.v[2] : w.v[3]));
      m[e] = word < a.drop_threshold ? 0.0f : a.keep_scale;
    }
  }
}

// z = residual + dropout(x + bias) for the N columns of vector v of row r; m receives the
// dropout multipliers (1 without dropout). The same expression as the CPU kernel:
// (x + bias) * m, then + residual. x and bias are TX, the residual TR (TX or float: AMP's
// O1 keeps the residual stream in float32 while the GEMM output is half).
template <typename TX, typename TR, int N>
__device__ __forceinline__ void pre_norm(const FusedArgs& a, int64_t r, int v, float (&z)[N],
                                         float (&m)[N]) {
  const int64_t o = r * a.cols + static_cast<int64_t>(v) * N;
  float xb[N], b[N], res[N];
  load<TX, N>(static_cast<const TX*>(a.x) + o, xb);
  load<TX, N>(static_cast<const TX*>(a.bias) + static_cast<int64_t>(v) * N, b);
  load<TR, N>(static_cast<const TR*>(a.residual) + o, res);
  if (a.dropout) {
    dropout_mult<N>(a, static_cast<uint32_t>(r), static_cast<uint32_t>(v) * N, m);
#pragma unroll
    for (int e = 0; e < N; ++e) z[e] = res[e] + (xb[e] + b[e]) * m[e];
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      m[e] = 1.0f;
      z[e] = res[e] + (xb[e] + b[e]);
    }
  }
}

// ---------------------------------------------------------------------- fixed-order sums

// Sums a and b over a row-team block (blockDim.x a multiple of 32, blockDim.y == 1); every
// thread gets the same bits: the xor butterfly pairs lanes symmetrically (x + y == y + x),
// then all threads add the warp sums in warp order. scratch: 32 entries, not reused by
// the next call (alternate two buffers: the barrier of the call in between orders them).
__device__ __forceinline__ void block_sum2(float& a, float& b, float2* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  const int warps = static_cast<int>(blockDim.x) >> 5;
  if (warps == 1) return;
  if ((threadIdx.x & 31u) == 0u) scratch[threadIdx.x >> 5] = make_float2(a, b);
  __syncthreads();
  float2 s = scratch[0];
  for (int w = 1; w < warps; ++w) {
    s.x += scratch[w].x;
    s.y += scratch[w].y;
  }
  a = s.x;
  b = s.y;
}

// Column-tile blocks: acc[k][e] summed over threadIdx.y = 0, 1, ... in order, left in the
// threads with threadIdx.y == 0. smem: K * N * kColTileThreads floats. Every thread of the
// block must call it (it has a barrier).
template <int K, int N>
__device__ __forceinline__ void sum_over_block_rows(float (&acc)[K][N], float* smem) {
  const int tid = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int e = 0; e < N; ++e) smem[(k * N + e) * kColTileThreads + tid] = acc[k][e];
  __syncthreads();
  if (threadIdx.y != 0) return;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float* col = smem + (k * N + e) * kColTileThreads + threadIdx.x;
      float s = col[0];
      for (unsigned y = 1; y < blockDim.y; ++y) s += col[y * blockDim.x];
      acc[k][e] = s;
    }
}

// ---------------------------------------------------------------------- launchers

// bias_gelu: y; and dx plus the column partials of dbias (one array).
template <typename T>
cudaError_t launch_bias_gelu_fwd(const FusedArgs& a, cudaStream_t stream);
template <typename T>
cudaError_t launch_bias_gelu_bwd(const FusedArgs& a, cudaStream_t stream);

// bdrln: y, mean, rstd; and dx, dresidual plus the column partials of dbias, dln_weight,
// dln_bias (three arrays, in that order). TX: x, bias, dx; TR: residual, y, dy,
// dresidual; TW: ln_weight (and ln_bias). TR and TW are TX or float (fused_cuda.cuh).
template <typename TX, typename TR, typename TW>
cudaError_t launch_bdrln_fwd(const FusedArgs& a, cudaStream_t stream);
template <typename TX, typename TR, typename TW>
cudaError_t launch_bdrln_bwd(const FusedArgs& a, cudaStream_t stream);

// Every (TX, TR, TW) the bdrln kernels are built for: TX float, half or bfloat16; TR and TW
// each TX or float. X(TX, TR, TW) is expanded once per combination.
// A list of X(...) entries, one dtype family per line, which clang-format would re-flow.
// clang-format off
#define PU_BDRLN_DTYPE_COMBOS(X)                                                  \
  X(float, float, float)                                                          \
  X(__half, __half, __half) X(__half, __half, float) X(__half, float, __half)     \
  X(__half, float, float)                                                         \
  X(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16) X(__nv_bfloat16, __nv_bfloat16, float) \
  X(__nv_bfloat16, float, __nv_bfloat16) X(__nv_bfloat16, float, float)
// clang-format on

}  // namespace cuda
}  // namespace paddle_unpad
