// Forward FMHA kernels instantiated for __half (all head sizes and tile configurations).
#include "kernels/cuda/fmha_fwd.cuh"

namespace paddle_unpad::cuda {
template cudaError_t launch_fmha_fwd<__half>(const FmhaParams&, int, cudaStream_t);
}  // namespace paddle_unpad::cuda
