// Backward FMHA kernels instantiated for __half (all head sizes).
#include "kernels/cuda/fmha_bwd.cuh"

namespace paddle_unpad::cuda {
template cudaError_t launch_fmha_bwd_prep<__half>(const FmhaParams&, int64_t, cudaStream_t);
template cudaError_t launch_fmha_bwd<__half>(const FmhaParams&, bool, cudaStream_t);
}  // namespace paddle_unpad::cuda
