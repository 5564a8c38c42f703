// Backward FMHA kernels instantiated for __nv_bfloat16 (all head sizes).
#include "kernels/cuda/fmha_bwd.cuh"

namespace paddle_unpad::cuda {
template cudaError_t launch_fmha_bwd_prep<__nv_bfloat16>(const FmhaParams&, int64_t, cudaStream_t);
template cudaError_t launch_fmha_bwd<__nv_bfloat16>(const FmhaParams&, bool, cudaStream_t);
}  // namespace paddle_unpad::cuda
