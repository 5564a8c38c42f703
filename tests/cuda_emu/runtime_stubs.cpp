// The few CUDA runtime calls the fused host code makes, on host memory; and stand-ins for
// the FMHA entry points the harness links against (FMHA is not emulated).
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "kernels/cuda/fmha_cuda.cuh"

extern "C" cudaError_t cudaGetLastError() { return cudaSuccess; }
extern "C" cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}
extern "C" const char* cudaGetErrorName(cudaError_t) { return "emulated"; }
extern "C" const char* cudaGetErrorString(cudaError_t) { return "emulated"; }

namespace paddle_unpad {
namespace cuda {
std::string fmha_cuda_unsupported(const FmhaCudaProblem&) { return "fmha is not emulated"; }
std::string fmha_cuda_misaligned(const void* const*, const char* const*, int) { return ""; }
cudaError_t fmha_cuda_fwd(const FmhaCudaProblem&, const FmhaLaunchOptions&, const void*, const void*,
                          const void*, void*, float*, cudaStream_t) {
  return cudaErrorNotSupported;
}
size_t fmha_cuda_bwd_workspace_bytes(int64_t, int64_t) { return 0; }
cudaError_t fmha_cuda_bwd(const FmhaCudaProblem&, const FmhaLaunchOptions&, const void*, const void*,
                          const void*, const void*, const float*, const void*, void*, void*, void*,
                          void*, cudaStream_t) {
  return cudaErrorNotSupported;
}
}  // namespace cuda
}  // namespace paddle_unpad
