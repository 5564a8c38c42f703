// Forward FMHA kernels instantiated for __nv_bfloat16 (all head sizes and tile configurations).
#include "kernels/cuda/fmha_fwd.cuh"

namespace paddle_unpad::cuda {
template cudaError_t launch_fmha_fwd<__nv_bfloat16>(const FmhaParams&, int, cudaStream_t);
}  // namespace paddle_unpad::cuda
