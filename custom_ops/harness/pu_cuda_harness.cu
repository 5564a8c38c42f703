// C ABI over the framework-free CUDA kernels, for checks on a GPU machine without Paddle
// (tests/gpu load it with ctypes; tensors are torch/CuPy device buffers). Raw device
// pointers, sizes and a cudaStream_t (NULL = legacy default stream); host cu_seqlens.
//
// Every function returns 0 on success, else a non-zero code; pu_harness_last_error()
// then says why (per thread). dtype: 0 = float16, 1 = bfloat16, 2 = float32. bdrln takes
// three: x's (x, bias), the residual's (residual, y) and the LayerNorm parameters'.
//
// Fused ops (bias_gelu, bdrln = bias_dropout_residual_layer_norm): rows x cols tensors,
// `path` bit 0 forces element-wise loads (no 16-byte vectors), bit 1 the general (wide)
// bdrln path; 0 = what the Paddle op runs.
#include <cstdint>
#include <string>

#include "kernels/cuda/fmha_cuda.cuh"
#include "kernels/cuda/fused_cuda.cuh"

namespace {

using paddle_unpad::cuda::DType;

thread_local std::string g_last_error;

int fail(const std::string& why) {
  g_last_error = why;
  return 1;
}

constexpr const char* kBdrln = "bias_dropout_residual_layer_norm";

// 0 where the kernels take the call (`why` empty), else fail() with `op` named first
int refuse(const char* op, const std::string& why) {
  return why.empty() ? 0 : fail(std::string(op) + ": " + why);
}

int from_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) {
    g_last_error.clear();
    return 0;
  }
  return fail(std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

// The problems from the functions' arguments, which follow the order of the structs' fields.
paddle_unpad::cuda::FmhaCudaProblem problem(const int32_t* cu, int64_t batch, int64_t total,
                                            int64_t heads, int64_t head_dim, int dtype, float scale,
                                            float dropout, uint64_t seed, uint64_t offset) {
  const DType dt = dtype == 0 ? DType::kFloat16 : (dtype == 1 ? DType::kBFloat16 : DType::kFloat32);
  return {{cu, batch, total, heads, head_dim, scale, dropout, seed, offset}, dt};
}

paddle_unpad::cuda::FusedCudaOptions fused_options(int path) {
  paddle_unpad::cuda::FusedCudaOptions o;
  o.vectorized = (path & 1) == 0;
  o.force_wide = (path & 2) != 0;
  return o;
}

paddle_unpad::cuda::BiasGeluCudaProblem gelu_problem(int64_t rows, int64_t cols, int dtype) {
  return {rows, cols, static_cast<DType>(dtype)};
}

paddle_unpad::cuda::BdrlnCudaProblem bdrln_problem(int64_t rows, int64_t cols, int dtype,
                                                   int residual_dtype, int ln_dtype, float dropout,
                                                   float epsilon, uint64_t seed, uint64_t offset) {
  return {{rows, cols, dropout, epsilon, seed, offset},
          static_cast<DType>(dtype),
          static_cast<DType>(residual_dtype),
          static_cast<DType>(ln_dtype)};
}

paddle_unpad::cuda::FmhaLaunchOptions options(int grouping, int num_streams) {
  paddle_unpad::cuda::FmhaLaunchOptions o;
  o.grouping = grouping != 0;
  o.num_streams = num_streams < 1 ? 1 : num_streams;
  return o;
}

}  // namespace

extern "C" {

int pu_harness_abi_version() {
  return 4;
}  // 2: fused ops; 3: bdrln's three dtypes; 4: fmha bwd mode

const char* pu_harness_last_error() { return g_last_error.c_str(); }

int pu_fmha_fwd(const int32_t* cu_seqlens_host, int64_t batch, int64_t total, int64_t heads,
                int64_t head_dim, int dtype, float scale, float dropout, uint64_t seed,
                uint64_t offset, int grouping, int num_streams, const void* q, const void* k,
                const void* v, void* out, float* lse, void* stream) {
  const auto p =
      problem(cu_seqlens_host, batch, total, heads, head_dim, dtype, scale, dropout, seed, offset);
  if (const int rc = refuse("fmha", paddle_unpad::cuda::fmha_cuda_unsupported(p))) return rc;
  const void* ptrs[] = {q, k, v, out, lse};
  const char* names[] = {"q", "k", "v", "out", "lse"};
  if (const int rc = refuse("fmha", paddle_unpad::cuda::fmha_cuda_misaligned(ptrs, names, 5)))
    return rc;
  return from_cuda(paddle_unpad::cuda::fmha_cuda_fwd(p, options(grouping, num_streams), q, k, v,
                                                     out, lse, static_cast<cudaStream_t>(stream)),
                   "fmha forward");
}

int64_t pu_fmha_bwd_workspace_bytes(int64_t total, int64_t heads, int64_t head_dim,
                                    int deterministic) {
  return static_cast<int64_t>(paddle_unpad::cuda::fmha_cuda_bwd_workspace_bytes(
      total, heads, head_dim, deterministic != 0));
}

int pu_fmha_bwd(const int32_t* cu_seqlens_host, int64_t batch, int64_t total, int64_t heads,
                int64_t head_dim, int dtype, float scale, float dropout, uint64_t seed,
                uint64_t offset, int grouping, int num_streams, int deterministic, const void* q,
                const void* k, const void* v, const void* out, const float* lse, const void* dout,
                void* dq, void* dk, void* dv, void* workspace, void* stream) {
  const auto p =
      problem(cu_seqlens_host, batch, total, heads, head_dim, dtype, scale, dropout, seed, offset);
  if (const int rc = refuse("fmha", paddle_unpad::cuda::fmha_cuda_unsupported(p))) return rc;
  const void* ptrs[] = {q, k, v, out, lse, dout, dq, dk, dv, workspace};
  const char* names[] = {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "workspace"};
  if (const int rc = refuse("fmha", paddle_unpad::cuda::fmha_cuda_misaligned(ptrs, names, 10)))
    return rc;
  paddle_unpad::cuda::FmhaLaunchOptions opt = options(grouping, num_streams);
  opt.deterministic = deterministic != 0;
  return from_cuda(paddle_unpad::cuda::fmha_cuda_bwd(p, opt, q, k, v, out, lse, dout, dq, dk, dv,
                                                     workspace, static_cast<cudaStream_t>(stream)),
                   "fmha backward");
}

// ----------------------------------------------------------------------------- bias_gelu

int pu_bias_gelu_fwd(int64_t rows, int64_t cols, int dtype, int path, const void* x,
                     const void* bias, void* y, void* stream) {
  const auto p = gelu_problem(rows, cols, dtype);
  if (const int rc = refuse("bias_gelu", paddle_unpad::cuda::bias_gelu_cuda_unsupported(p)))
    return rc;
  return from_cuda(paddle_unpad::cuda::bias_gelu_cuda_fwd(
                       p, x, bias, y, static_cast<cudaStream_t>(stream), fused_options(path)),
                   "bias_gelu forward");
}

int64_t pu_bias_gelu_bwd_workspace_bytes(int64_t rows, int64_t cols) {
  return static_cast<int64_t>(paddle_unpad::cuda::bias_gelu_cuda_bwd_workspace_bytes(rows, cols));
}

int pu_bias_gelu_bwd(int64_t rows, int64_t cols, int dtype, int path, const void* x,
                     const void* bias, const void* dy, void* dx, void* dbias, void* workspace,
                     void* stream) {
  const auto p = gelu_problem(rows, cols, dtype);
  if (const int rc = refuse("bias_gelu", paddle_unpad::cuda::bias_gelu_cuda_unsupported(p)))
    return rc;
  return from_cuda(paddle_unpad::cuda::bias_gelu_cuda_bwd(p, x, bias, dy, dx, dbias, workspace,
                                                          static_cast<cudaStream_t>(stream),
                                                          fused_options(path)),
                   "bias_gelu backward");
}

// ----------------------------------------------------------------------------- bdrln

int pu_bdrln_fwd(int64_t rows, int64_t cols, int dtype, int residual_dtype, int ln_dtype,
                 float dropout, float epsilon, uint64_t seed, uint64_t offset, int path,
                 const void* x, const void* bias, const void* residual, const void* ln_weight,
                 const void* ln_bias, void* y, float* mean, float* rstd, void* stream) {
  const auto p =
      bdrln_problem(rows, cols, dtype, residual_dtype, ln_dtype, dropout, epsilon, seed, offset);
  if (const int rc = refuse(kBdrln, paddle_unpad::cuda::bdrln_cuda_unsupported(p))) return rc;
  return from_cuda(
      paddle_unpad::cuda::bdrln_cuda_fwd(p, x, bias, residual, ln_weight, ln_bias, y, mean, rstd,
                                         static_cast<cudaStream_t>(stream), fused_options(path)),
      "bias_dropout_residual_layer_norm forward");
}

int64_t pu_bdrln_bwd_workspace_bytes(int64_t rows, int64_t cols) {
  return static_cast<int64_t>(paddle_unpad::cuda::bdrln_cuda_bwd_workspace_bytes(rows, cols));
}

int pu_bdrln_bwd(int64_t rows, int64_t cols, int dtype, int residual_dtype, int ln_dtype,
                 float dropout, float epsilon, uint64_t seed, uint64_t offset, int path,
                 const void* x, const void* bias, const void* residual, const void* ln_weight,
                 const float* mean, const float* rstd, const void* dy, void* dx, void* dresidual,
                 void* dbias, void* dln_weight, void* dln_bias, void* workspace, void* stream) {
  const auto p =
      bdrln_problem(rows, cols, dtype, residual_dtype, ln_dtype, dropout, epsilon, seed, offset);
  if (const int rc = refuse(kBdrln, paddle_unpad::cuda::bdrln_cuda_unsupported(p))) return rc;
  return from_cuda(
      paddle_unpad::cuda::bdrln_cuda_bwd(p, x, bias, residual, ln_weight, mean, rstd, dy, dx,
                                         dresidual, dbias, dln_weight, dln_bias, workspace,
                                         static_cast<cudaStream_t>(stream), fused_options(path)),
      "bias_dropout_residual_layer_norm backward");
}

}  // extern "C"
