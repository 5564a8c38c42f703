// bias_dropout_residual_layer_norm backward, the CPU kernel's formula per row:
//   xhat = (z - mean) * rstd, g = dy * w,
//   dz = rstd * (g - mean(g) - xhat * mean(g * xhat)),  dresidual = dz,  dx = dz * mask,
// with the column sums dbias = sum dx, dln_weight = sum dy * xhat, dln_bias = sum dy taken
// per chunk of rows into fp32 partials (fused_cuda.cu adds the chunks in order).
//
//   rows kernel    one block per chunk, one row at a time (row team): the row's xhat, g and
//                  mask bits stay in registers between the row sums and the outputs, the
//                  thread's column partials in registers across the chunk. One read of
//                  x, residual, dy and one write of dx, dresidual. Rows of up to
//                  kRowTeamMax * kMaxOwn vectors.
//   wide path      any row length: a row-team kernel computes the two row means into the
//                  workspace, then a column-tile kernel recomputes xhat and writes the
//                  outputs and the partials (x, residual, dy are read twice).
// Types: x, bias, dx TX; residual, dy, dresidual TR; ln_weight TW (fused_device.cuh).
#include "kernels/cuda/fused_device.cuh"

namespace paddle_unpad {
namespace cuda {
namespace {

// z and the dropout multipliers m of vector v of row r (pre_norm), the gradient of y there (g,
// from dy) and ln_weight (wv, from w).
template <typename TX, typename TR, typename TW, int N>
__device__ __forceinline__ void grad_inputs(const FusedArgs& a, const TR* dy, const TW* w,
                                            int64_t r, int v, float (&z)[N], float (&m)[N],
                                            float (&g)[N], float (&wv)[N]) {
  pre_norm<TX, TR, N>(a, r, v, z, m);
  load<TR, N>(dy + r * a.cols + static_cast<int64_t>(v) * N, g);
  load<TW, N>(w + static_cast<int64_t>(v) * N, wv);
}

template <typename TX, typename TR, typename TW, int N, int kOwn>
__global__ void __launch_bounds__(kRowTeamMax) bdrln_bwd_rows_kernel(const FusedArgs a) {
  static_assert(kOwn * N <= 32, "mask bits of a thread's row elements must fit 32 bits");
  __shared__ float2 scratch[2][32];
  const int t = static_cast<int>(threadIdx.x), ts = static_cast<int>(blockDim.x);
  const TW* w = static_cast<const TW*>(a.ln_weight);
  const TR* dy = static_cast<const TR*>(a.dy);
  TX* dx = static_cast<TX*>(a.dx);
  TR* dres = static_cast<TR*>(a.dresidual);
  const float keep_mult = a.dropout ? a.keep_scale : 1.0f;
  float p_dbias[kOwn][N], p_dw[kOwn][N], p_db[kOwn][N];
#pragma unroll
  for (int i = 0; i < kOwn; ++i)
#pragma unroll
    for (int e = 0; e < N; ++e) p_dbias[i][e] = p_dw[i][e] = p_db[i][e] = 0.0f;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * a.rows_per_chunk;
  const int64_t r1 = min(a.rows, r0 + a.rows_per_chunk);
  int buf = 0;
  for (int64_t r = r0; r < r1; ++r) {  // uniform over the block
    const float mu = a.mean[r], rs = a.rstd[r];
    float xh[kOwn][N], gw[kOwn][N];
    uint32_t kept = 0u;  // bit i * N + e: element e of owned vector i survived dropout
    float sg = 0.0f, sgx = 0.0f;
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
      const int v = t + i * ts;
      if (v < a.nvec) {
        float z[N], m[N], g[N], wv[N];
        grad_inputs<TX, TR, TW, N>(a, dy, w, r, v, z, m, g, wv);
#pragma unroll
        for (int e = 0; e < N; ++e) {
          xh[i][e] = (z[e] - mu) * rs;
          gw[i][e] = g[e] * wv[e];
          sg += gw[i][e];
          sgx += gw[i][e] * xh[i][e];
          p_dw[i][e] += g[e] * xh[i][e];
          p_db[i][e] += g[e];
          kept |= (m[e] != 0.0f ? 1u : 0u) << (i * N + e);
        }
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) xh[i][e] = gw[i][e] = 0.0f;
      }
    }
    block_sum2(sg, sgx, scratch[buf]);
    buf ^= 1;
    const float c1 = sg * a.inv_cols, c2 = sgx * a.inv_cols;
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
      const int v = t + i * ts;
      if (v < a.nvec) {
        float dz[N], dv[N];
#pragma unroll
        for (int e = 0; e < N; ++e) {
          dz[e] = (gw[i][e] - c1 - xh[i][e] * c2) * rs;
          dv[e] = dz[e] * (((kept >> (i * N + e)) & 1u) ? keep_mult : 0.0f);
          p_dbias[i][e] += dv[e];
        }
        const int64_t o = r * a.cols + static_cast<int64_t>(v) * N;
        store<TR, N>(dres + o, dz);
        store<TX, N>(dx + o, dv);
      }
    }
  }
  // This chunk's column partials: each column belongs to exactly one thread.
  const int64_t plane = static_cast<int64_t>(a.nchunks) * a.cols;
  float* out = a.partials + static_cast<int64_t>(blockIdx.x) * a.cols;
#pragma unroll
  for (int i = 0; i < kOwn; ++i) {
    const int v = t + i * ts;
    if (v < a.nvec) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const int64_t c = static_cast<int64_t>(v) * N + e;
        out[c] = p_dbias[i][e];
        out[plane + c] = p_dw[i][e];
        out[2 * plane + c] = p_db[i][e];
      }
    }
  }
}

// Wide path, step 1: row_sums[r] = (mean(g w), mean(g w xhat)) of every row.
template <typename TX, typename TR, typename TW, int N>
__global__ void __launch_bounds__(kRowTeamMax) bdrln_bwd_row_sums_kernel(const FusedArgs a) {
  __shared__ float2 scratch[2][32];
  const int t = static_cast<int>(threadIdx.x), ts = static_cast<int>(blockDim.x);
  const TW* w = static_cast<const TW*>(a.ln_weight);
  const TR* dy = static_cast<const TR*>(a.dy);
  int buf = 0;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const float mu = a.mean[r], rs = a.rstd[r];
    float sg = 0.0f, sgx = 0.0f;
    for (int v = t; v < a.nvec; v += ts) {
      float z[N], m[N], g[N], wv[N];
      grad_inputs<TX, TR, TW, N>(a, dy, w, r, v, z, m, g, wv);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float gw = g[e] * wv[e];
        sg += gw;
        sgx += gw * ((z[e] - mu) * rs);
      }
    }
    block_sum2(sg, sgx, scratch[buf]);
    buf ^= 1;
    if (t == 0) a.row_sums[r] = make_float2(sg * a.inv_cols, sgx * a.inv_cols);
  }
}

// Wide path, step 2 (column tiles, chunk blockIdx.y): dx, dresidual and the partials.
template <typename TX, typename TR, typename TW, int N>
__global__ void __launch_bounds__(kColTileThreads) bdrln_bwd_cols_kernel(const FusedArgs a) {
  __shared__ float smem[3 * N * kColTileThreads];
  const int v = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const bool col_ok = v < a.nvec;
  float acc[3][N];  // dbias, dln_weight, dln_bias
#pragma unroll
  for (int k = 0; k < 3; ++k)
#pragma unroll
    for (int e = 0; e < N; ++e) acc[k][e] = 0.0f;
  if (col_ok) {
    const TR* dy = static_cast<const TR*>(a.dy);
    TX* dx = static_cast<TX*>(a.dx);
    TR* dres = static_cast<TR*>(a.dresidual);
    const float keep_mult = a.dropout ? a.keep_scale : 1.0f;
    float wv[N];
    load<TW, N>(static_cast<const TW*>(a.ln_weight) + static_cast<int64_t>(v) * N, wv);
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * a.rows_per_chunk;
    const int64_t r1 = min(a.rows, r0 + a.rows_per_chunk);
    for (int64_t r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
      const float mu = a.mean[r], rs = a.rstd[r];
      const float2 c = a.row_sums[r];
      const int64_t o = r * a.cols + static_cast<int64_t>(v) * N;
      float z[N], m[N], g[N], dz[N], dv[N];
      pre_norm<TX, TR, N>(a, r, v, z, m);
      load<TR, N>(dy + o, g);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float xh = (z[e] - mu) * rs;
        const float gw = g[e] * wv[e];
        dz[e] = (gw - c.x - xh * c.y) * rs;
        dv[e] = dz[e] * (m[e] != 0.0f ? keep_mult : 0.0f);
        acc[0][e] += dv[e];
        acc[1][e] += g[e] * xh;
        acc[2][e] += g[e];
      }
      store<TR, N>(dres + o, dz);
      store<TX, N>(dx + o, dv);
    }
  }
  sum_over_block_rows<3, N>(acc, smem);
  if (threadIdx.y == 0 && col_ok) {
    const int64_t plane = static_cast<int64_t>(a.nchunks) * a.cols;
    float* out =
        a.partials + static_cast<int64_t>(blockIdx.y) * a.cols + static_cast<int64_t>(v) * N;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      out[e] = acc[0][e];
      out[plane + e] = acc[1][e];
      out[2 * plane + e] = acc[2][e];
    }
  }
}

template <typename TX, typename TR, typename TW, bool kVec>
cudaError_t bwd(const FusedArgs& a, cudaStream_t stream) {
  constexpr int N = vec_elems<TX, kVec>();
  const unsigned block = static_cast<unsigned>(a.threads);
  if (a.own == 1 || a.own == 2) {
    const unsigned grid = static_cast<unsigned>(a.nchunks);
    if (a.own == 1)
      bdrln_bwd_rows_kernel<TX, TR, TW, N, 1><<<grid, block, 0, stream>>>(a);
    else
      bdrln_bwd_rows_kernel<TX, TR, TW, N, 2><<<grid, block, 0, stream>>>(a);
    return cudaGetLastError();
  }
  const unsigned rows_grid = static_cast<unsigned>(a.rows < 65535 ? a.rows : 65535);
  bdrln_bwd_row_sums_kernel<TX, TR, TW, N><<<rows_grid, block, 0, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const dim3 tile = col_tile_block(a.nvec);
  const dim3 grid(static_cast<unsigned>(ceil_div(a.nvec, tile.x)),
                  static_cast<unsigned>(a.nchunks));
  bdrln_bwd_cols_kernel<TX, TR, TW, N><<<grid, tile, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

template <typename TX, typename TR, typename TW>
cudaError_t launch_bdrln_bwd(const FusedArgs& a, cudaStream_t stream) {
  return a.vec ? bwd<TX, TR, TW, true>(a, stream) : bwd<TX, TR, TW, false>(a, stream);
}

#define PU_INSTANTIATE(TX, TR, TW) \
  template cudaError_t launch_bdrln_bwd<TX, TR, TW>(const FusedArgs&, cudaStream_t);
PU_BDRLN_DTYPE_COMBOS(PU_INSTANTIATE)
#undef PU_INSTANTIATE

}  // namespace cuda
}  // namespace paddle_unpad
