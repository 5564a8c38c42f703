// bias_dropout_residual_layer_norm forward (row teams, see fused_device.cuh):
//   z = residual + dropout(x + bias); mean, rstd of z; y = (z - mean) * rstd * w + b.
//
// Two kernels, the same arithmetic:
//   rows kernel    the row stays in registers between its three steps (sum, sum of
//                  squared deviations, output): each element is read once and written once.
//                  For rows of up to kRowTeamMax * kMaxOwn vectors.
//   wide kernel    any row length: each step reads the row again (from cache) and
//                  regenerates the dropout mask.
// Mean and variance are two-pass (no cancellation), as on the CPU. Types: x and bias TX,
// residual and y TR, ln_weight and ln_bias TW (launch_bdrln_fwd in fused_device.cuh).
#include "kernels/cuda/fused_device.cuh"

namespace paddle_unpad {
namespace cuda {
namespace {

template <typename TX, typename TR, typename TW, int N, int kOwn>
__global__ void __launch_bounds__(kRowTeamMax) bdrln_fwd_rows_kernel(const FusedArgs a) {
  __shared__ float2 scratch[2][32];
  const int t = static_cast<int>(threadIdx.x), ts = static_cast<int>(blockDim.x);
  const TW* w = static_cast<const TW*>(a.ln_weight);
  const TW* lb = static_cast<const TW*>(a.ln_bias);
  TR* y = static_cast<TR*>(a.y);
  const float n = static_cast<float>(a.cols);
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {  // uniform over the block
    float z[kOwn][N];
    float s = 0.0f, unused = 0.0f;
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
      const int v = t + i * ts;
      if (v < a.nvec) {
        float m[N];
        pre_norm<TX, TR, N>(a, r, v, z[i], m);
#pragma unroll
        for (int e = 0; e < N; ++e) s += z[i][e];
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) z[i][e] = 0.0f;
      }
    }
    block_sum2(s, unused, scratch[0]);
    const float mu = s / n;
    float q = 0.0f;
    unused = 0.0f;
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
      if (t + i * ts < a.nvec) {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const float d = z[i][e] - mu;
          q += d * d;
        }
      }
    }
    block_sum2(q, unused, scratch[1]);  // the other buffer: no barrier needed in between
    const float rs = 1.0f / sqrtf(q / n + a.epsilon);
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
      const int v = t + i * ts;
      if (v < a.nvec) {
        float wv[N], bv[N];
        load<TW, N>(w + static_cast<int64_t>(v) * N, wv);
        load<TW, N>(lb + static_cast<int64_t>(v) * N, bv);
#pragma unroll
        for (int e = 0; e < N; ++e) z[i][e] = (z[i][e] - mu) * rs * wv[e] + bv[e];
        store<TR, N>(y + r * a.cols + static_cast<int64_t>(v) * N, z[i]);
      }
    }
    if (t == 0) {
      a.mean[r] = mu;
      a.rstd[r] = rs;
    }
  }
}

template <typename TX, typename TR, typename TW, int N>
__global__ void __launch_bounds__(kRowTeamMax) bdrln_fwd_wide_kernel(const FusedArgs a) {
  __shared__ float2 scratch[2][32];
  const int t = static_cast<int>(threadIdx.x), ts = static_cast<int>(blockDim.x);
  const TW* w = static_cast<const TW*>(a.ln_weight);
  const TW* lb = static_cast<const TW*>(a.ln_bias);
  TR* y = static_cast<TR*>(a.y);
  const float n = static_cast<float>(a.cols);
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    float z[N], m[N];
    float s = 0.0f, unused = 0.0f;
    for (int v = t; v < a.nvec; v += ts) {
      pre_norm<TX, TR, N>(a, r, v, z, m);
#pragma unroll
      for (int e = 0; e < N; ++e) s += z[e];
    }
    block_sum2(s, unused, scratch[0]);
    const float mu = s / n;
    float q = 0.0f;
    unused = 0.0f;
    for (int v = t; v < a.nvec; v += ts) {
      pre_norm<TX, TR, N>(a, r, v, z, m);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float d = z[e] - mu;
        q += d * d;
      }
    }
    block_sum2(q, unused, scratch[1]);
    const float rs = 1.0f / sqrtf(q / n + a.epsilon);
    for (int v = t; v < a.nvec; v += ts) {
      pre_norm<TX, TR, N>(a, r, v, z, m);
      float wv[N], bv[N];
      load<TW, N>(w + static_cast<int64_t>(v) * N, wv);
      load<TW, N>(lb + static_cast<int64_t>(v) * N, bv);
#pragma unroll
      for (int e = 0; e < N; ++e) z[e] = (z[e] - mu) * rs * wv[e] + bv[e];
      store<TR, N>(y + r * a.cols + static_cast<int64_t>(v) * N, z);
    }
    if (t == 0) {
      a.mean[r] = mu;
      a.rstd[r] = rs;
    }
  }
}

template <typename TX, typename TR, typename TW, bool kVec>
cudaError_t fwd(const FusedArgs& a, cudaStream_t stream) {
  constexpr int N = vec_elems<TX, kVec>();
  const unsigned grid = static_cast<unsigned>(a.rows < 65535 ? a.rows : 65535);
  const unsigned block = static_cast<unsigned>(a.threads);
  switch (a.own) {
    case 1:
      bdrln_fwd_rows_kernel<TX, TR, TW, N, 1><<<grid, block, 0, stream>>>(a);
      break;
    case 2:
      bdrln_fwd_rows_kernel<TX, TR, TW, N, 2><<<grid, block, 0, stream>>>(a);
      break;
    default:
      bdrln_fwd_wide_kernel<TX, TR, TW, N><<<grid, block, 0, stream>>>(a);
      break;
  }
  return cudaGetLastError();
}

}  // namespace

template <typename TX, typename TR, typename TW>
cudaError_t launch_bdrln_fwd(const FusedArgs& a, cudaStream_t stream) {
  return a.vec ? fwd<TX, TR, TW, true>(a, stream) : fwd<TX, TR, TW, false>(a, stream);
}

#define PU_INSTANTIATE(TX, TR, TW) \
  template cudaError_t launch_bdrln_fwd<TX, TR, TW>(const FusedArgs&, cudaStream_t);
PU_BDRLN_DTYPE_COMBOS(PU_INSTANTIATE)
#undef PU_INSTANTIATE

}  // namespace cuda
}  // namespace paddle_unpad
