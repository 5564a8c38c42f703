// Element type of the tensors handed to the framework-free CUDA kernels (fmha_cuda.cuh,
// fused_cuda.cuh). Host-side only: the kernels are templates on the CUDA type itself.
#pragma once

namespace paddle_unpad {
namespace cuda {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

inline const char* dtype_name(DType t) {
  return t == DType::kFloat16 ? "float16" : (t == DType::kBFloat16 ? "bfloat16" : "float32");
}

inline int dtype_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

}  // namespace cuda
}  // namespace paddle_unpad
