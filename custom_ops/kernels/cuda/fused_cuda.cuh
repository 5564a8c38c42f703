// Fused encoder operators, CUDA: bias+GELU and bias+dropout+residual+LayerNorm, forward
// and backward, float16 / bfloat16 / float32 tensors with fp32 arithmetic. Framework-free:
// raw device pointers, sizes, a stream; the Paddle glue (custom_ops/paddle/fused_gpu.cu)
// and the C-ABI harness (custom_ops/harness) are thin layers over these functions.
//
// Same definitions as the CPU kernels (kernels/cpu/fused_cpu.h), which the CPU tests pin
// down against float64:
//   bias_gelu   y = gelu(x + bias), gelu(u) = u * Phi(u) (exact, erf form)
//   bdrln       z = residual + dropout(x + bias); y = (z - mean) * rstd * ln_weight + ln_bias,
//               rstd = 1 / sqrt(biased var(z) + epsilon), per row; mean and rstd saved (fp32)
// and the same dropout: Philox4x32-10, the "row-wise dropout" counter layout of
// kernels/common/philox.h (counter (j / 4, row, 0xffffffff, offset), word j % 4), kept
// values scaled by 1 / (1 - p). A given (seed, offset) drops the same elements on CPU and
// GPU; the backward pass regenerates the mask instead of reading a stored one.
//
// Tensors: x, residual, y, dy, dx, dresidual [rows, cols] row-major, contiguous;
// bias, ln_weight, ln_bias and their gradients [cols]; mean, rstd [rows] fp32. bias_gelu:
// all of one dtype. bdrln: three dtypes (BdrlnCudaProblem), as AMP hands them over --
//   dtype           x, bias, dx, dbias              float16, bfloat16 or float32
//   residual_dtype  residual, y, dy, dresidual      dtype or float32 (O1: the residual
//                                                   stream stays float32)
//   ln_dtype        ln_weight, ln_bias, their grads dtype or float32 (O1 and O2: LayerNorm
//                                                   parameters stay float32)
// Any rows >= 0 and cols >= 1 (bias_gelu: cols >= 0). When cols is a multiple of
// 16 / sizeof(x's element) and every pointer is 16-byte aligned, rows are read and written
// as vectors of that many columns (16 bytes of x; a float32 residual moves 32); otherwise
// element by element (same results).
//
// Determinism: no atomics. A row's reductions (mean, variance, the two sums of the
// LayerNorm backward) run in a fixed order; column sums (dbias, dln_weight, dln_bias)
// are taken in two stages: per fixed chunk of rows into an fp32 workspace, then over the
// chunks in chunk order. Chunks depend on the shape only, so reruns are bitwise identical.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/common/problem_desc.h"
#include "kernels/cuda/cuda_dtype.cuh"

namespace paddle_unpad {
namespace cuda {

// How to run (tests compare the paths; the defaults pick the fastest one that applies).
struct FusedCudaOptions {
  bool vectorized = true;  // false: element-by-element loads even where vectors would do
  bool force_wide = false;  // bdrln: the general multi-pass path even for rows that fit registers
};

struct BiasGeluCudaProblem {
  int64_t rows = 0;  // N: every leading dimension flattened
  int64_t cols = 0;  // F
  DType dtype = DType::kFloat32;
};

struct BdrlnCudaProblem : BdrlnDesc {
  DType dtype = DType::kFloat32;  // x, bias (and their gradients)
  DType residual_dtype = DType::kFloat32;  // residual, y (and theirs): dtype or float32
  DType ln_dtype = DType::kFloat32;  // ln_weight, ln_bias (and theirs): dtype or float32
};

// Empty when the problem is supported, else why not (in words).
std::string bias_gelu_cuda_unsupported(const BiasGeluCudaProblem& p);
std::string bdrln_cuda_unsupported(const BdrlnCudaProblem& p);

cudaError_t bias_gelu_cuda_fwd(const BiasGeluCudaProblem& p, const void* x, const void* bias,
                               void* y, cudaStream_t stream, const FusedCudaOptions& opt = {});

// Device scratch of the backward pass (fp32 column partials), 16-byte aligned.
size_t bias_gelu_cuda_bwd_workspace_bytes(int64_t rows, int64_t cols);

cudaError_t bias_gelu_cuda_bwd(const BiasGeluCudaProblem& p, const void* x, const void* bias,
                               const void* dy, void* dx, void* dbias, void* workspace,
                               cudaStream_t stream, const FusedCudaOptions& opt = {});

cudaError_t bdrln_cuda_fwd(const BdrlnCudaProblem& p, const void* x, const void* bias,
                           const void* residual, const void* ln_weight, const void* ln_bias,
                           void* y, float* mean, float* rstd, cudaStream_t stream,
                           const FusedCudaOptions& opt = {});

// Device scratch of the backward pass (fp32 column partials and per-row sums), 16-byte aligned.
size_t bdrln_cuda_bwd_workspace_bytes(int64_t rows, int64_t cols);

cudaError_t bdrln_cuda_bwd(const BdrlnCudaProblem& p, const void* x, const void* bias,
                           const void* residual, const void* ln_weight, const float* mean,
                           const float* rstd, const void* dy, void* dx, void* dresidual,
                           void* dbias, void* dln_weight, void* dln_bias, void* workspace,
                           cudaStream_t stream, const FusedCudaOptions& opt = {});

}  // namespace cuda
}  // namespace paddle_unpad
