// bias_gelu kernels (column tiles, see fused_device.cuh): y = gelu(x + bias) and its
// backward dx = dy * gelu'(x + bias) with the column partials of dbias.
#include "kernels/cuda/fused_device.cuh"

namespace paddle_unpad {
namespace cuda {
namespace {

template <typename T, int N>
__global__ void __launch_bounds__(kColTileThreads) bias_gelu_fwd_kernel(const FusedArgs a) {
  const int v = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (v >= a.nvec) return;  // no barrier in this kernel
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  float b[N];
  load<T, N>(static_cast<const T*>(a.bias) + static_cast<int64_t>(v) * N, b);
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < a.rows;
       r += step) {
    const int64_t o = r * a.cols + static_cast<int64_t>(v) * N;
    float u[N];
    load<T, N>(x + o, u);
#pragma unroll
    for (int e = 0; e < N; ++e) u[e] = gelu(u[e] + b[e]);
    store<T, N>(y + o, u);
  }
}

// Block (bx, by) of chunk blockIdx.y: dx of its rows, and the chunk's column sums of dx
// (fp32, before rounding to T) into partials[blockIdx.y][cols].
template <typename T, int N>
__global__ void __launch_bounds__(kColTileThreads) bias_gelu_bwd_kernel(const FusedArgs a) {
  __shared__ float smem[N * kColTileThreads];
  const int v = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const bool col_ok = v < a.nvec;
  float acc[1][N];
#pragma unroll
  for (int e = 0; e < N; ++e) acc[0][e] = 0.0f;
  if (col_ok) {
    const T* x = static_cast<const T*>(a.x);
    const T* dy = static_cast<const T*>(a.dy);
    T* dx = static_cast<T*>(a.dx);
    float b[N];
    load<T, N>(static_cast<const T*>(a.bias) + static_cast<int64_t>(v) * N, b);
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * a.rows_per_chunk;
    const int64_t r1 = min(a.rows, r0 + a.rows_per_chunk);
    for (int64_t r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
      const int64_t o = r * a.cols + static_cast<int64_t>(v) * N;
      float u[N], g[N];
      load<T, N>(x + o, u);
      load<T, N>(dy + o, g);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        g[e] *= gelu_grad(u[e] + b[e]);
        acc[0][e] += g[e];
      }
      store<T, N>(dx + o, g);
    }
  }
  sum_over_block_rows<1, N>(acc, smem);
  if (threadIdx.y == 0 && col_ok) {
    float* out =
        a.partials + static_cast<int64_t>(blockIdx.y) * a.cols + static_cast<int64_t>(v) * N;
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = acc[0][e];
  }
}

template <typename T, bool kVec>
cudaError_t fwd(const FusedArgs& a, cudaStream_t stream) {
  const dim3 block = col_tile_block(a.nvec);
  const int64_t groups = ceil_div(a.rows, block.y);  // rows beyond the grid: grid-stride loop
  const dim3 grid(static_cast<unsigned>(ceil_div(a.nvec, block.x)),
                  static_cast<unsigned>(groups < 65535 ? groups : 65535));
  bias_gelu_fwd_kernel<T, vec_elems<T, kVec>()><<<grid, block, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, bool kVec>
cudaError_t bwd(const FusedArgs& a, cudaStream_t stream) {
  const dim3 block = col_tile_block(a.nvec);
  const dim3 grid(static_cast<unsigned>(ceil_div(a.nvec, block.x)),
                  static_cast<unsigned>(a.nchunks));
  bias_gelu_bwd_kernel<T, vec_elems<T, kVec>()><<<grid, block, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t launch_bias_gelu_fwd(const FusedArgs& a, cudaStream_t stream) {
  return a.vec ? fwd<T, true>(a, stream) : fwd<T, false>(a, stream);
}

template <typename T>
cudaError_t launch_bias_gelu_bwd(const FusedArgs& a, cudaStream_t stream) {
  return a.vec ? bwd<T, true>(a, stream) : bwd<T, false>(a, stream);
}

template cudaError_t launch_bias_gelu_fwd<float>(const FusedArgs&, cudaStream_t);
template cudaError_t launch_bias_gelu_fwd<__half>(const FusedArgs&, cudaStream_t);
template cudaError_t launch_bias_gelu_fwd<__nv_bfloat16>(const FusedArgs&, cudaStream_t);
template cudaError_t launch_bias_gelu_bwd<float>(const FusedArgs&, cudaStream_t);
template cudaError_t launch_bias_gelu_bwd<__half>(const FusedArgs&, cudaStream_t);
template cudaError_t launch_bias_gelu_bwd<__nv_bfloat16>(const FusedArgs&, cudaStream_t);

}  // namespace cuda
}  // namespace paddle_unpad
