// GPU kernels of the fused encoder operators: Paddle tensors -> raw pointers and the
// tensor's stream -> kernels/cuda/fused_cuda.cuh. Argument checks shared with the CPU
// path (shapes, places, dropout, epsilon) are done by fused_ops.cc before these
// functions are called; here: the dtype, and what only the GPU kernels refuse.
#include "fused_gpu.h"

#include <string>

#include "kernels/cuda/fused_cuda.cuh"
#include "op_common.h"  // same folder
#include "op_names.h"

namespace paddle_unpad {
namespace {

using glue::dense;
using glue::kBdrln;
using glue::kBiasGelu;
using paddle::DataType;
using paddle::Tensor;

cuda::DType gpu_dtype(const char* op, const Tensor& x, const char* name = "x") {
  const DataType t = x.dtype();
  PD_CHECK(t == DataType::FLOAT16 || t == DataType::BFLOAT16 || t == DataType::FLOAT32, op, ": ",
           name, " dtype ", t, " is not supported on GPU (supported: float16, bfloat16, float32)");
  if (t == DataType::FLOAT16) return cuda::DType::kFloat16;
  return t == DataType::BFLOAT16 ? cuda::DType::kBFloat16 : cuda::DType::kFloat32;
}

int64_t rows_of(const Tensor& x) {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < x.shape().size(); ++i) n *= x.shape()[i];
  return x.shape().back() > 0 ? n : 0;
}

void check_launch(const char* op, const char* pass, cudaError_t e) {
  PD_CHECK(e == cudaSuccess, op, ": CUDA ", pass, " launch failed: ", cudaGetErrorName(e), ": ",
           cudaGetErrorString(e));
}

void check_grad_dtype(const char* op, const Tensor& dy, const Tensor& x) {
  PD_CHECK(dy.dtype() == x.dtype(), op, ": grad of y has dtype ", dy.dtype(), ", expected ",
           x.dtype());
}

Tensor workspace(size_t bytes, const Tensor& x) {
  return paddle::empty({static_cast<int64_t>((bytes + 3) / 4)}, DataType::FLOAT32, x.place());
}

cuda::BiasGeluCudaProblem gelu_problem(const Tensor& x) {
  cuda::BiasGeluCudaProblem c;
  c.rows = rows_of(x);
  c.cols = x.shape().back();
  c.dtype = gpu_dtype(kBiasGelu, x);
  const std::string why = cuda::bias_gelu_cuda_unsupported(c);
  PD_CHECK(why.empty(), kBiasGelu, ": ", why);
  return c;
}

cuda::BdrlnCudaProblem ln_problem(const BdrlnProblem& p, const Tensor& x, const Tensor& residual,
                                  const Tensor& ln_weight) {
  const cuda::BdrlnCudaProblem c{p, gpu_dtype(kBdrln, x), gpu_dtype(kBdrln, residual, "residual"),
                                 gpu_dtype(kBdrln, ln_weight, "ln_weight")};
  const std::string why = cuda::bdrln_cuda_unsupported(c);
  PD_CHECK(why.empty(), kBdrln, ": ", why);
  return c;
}

}  // namespace

void BiasGeluForwardGpu(const Tensor& x, const Tensor& bias, Tensor* y) {
  const cuda::BiasGeluCudaProblem c = gelu_problem(x);
  const Tensor xc = dense(x), bc = dense(bias);
  check_launch(kBiasGelu, "forward",
               cuda::bias_gelu_cuda_fwd(c, xc.data(), bc.data(), y->data(), x.stream()));
}

void BiasGeluBackwardGpu(const Tensor& x, const Tensor& bias, const Tensor& dy, Tensor* dx,
                         Tensor* dbias) {
  const cuda::BiasGeluCudaProblem c = gelu_problem(x);
  check_grad_dtype(kBiasGelu, dy, x);
  const Tensor xc = dense(x), bc = dense(bias), g = dense(dy);
  Tensor ws = workspace(cuda::bias_gelu_cuda_bwd_workspace_bytes(c.rows, c.cols), x);
  check_launch(kBiasGelu, "backward",
               cuda::bias_gelu_cuda_bwd(c, xc.data(), bc.data(), g.data(), dx->data(),
                                        dbias->data(), ws.data(), x.stream()));
}

void BdrlnForwardGpu(const BdrlnProblem& p, const Tensor& x, const Tensor& bias,
                     const Tensor& residual, const Tensor& ln_weight, const Tensor& ln_bias,
                     Tensor* y, Tensor* mean, Tensor* rstd) {
  const cuda::BdrlnCudaProblem c = ln_problem(p, x, residual, ln_weight);
  const Tensor xc = dense(x), bc = dense(bias), rc = dense(residual), wc = dense(ln_weight),
               lbc = dense(ln_bias);
  check_launch(
      kBdrln, "forward",
      cuda::bdrln_cuda_fwd(c, xc.data(), bc.data(), rc.data(), wc.data(), lbc.data(), y->data(),
                           mean->data<float>(), rstd->data<float>(), x.stream()));
}

void BdrlnBackwardGpu(const BdrlnProblem& p, const Tensor& x, const Tensor& bias,
                      const Tensor& residual, const Tensor& ln_weight, const Tensor& mean,
                      const Tensor& rstd, const Tensor& dy, Tensor* dx, Tensor* dresidual,
                      Tensor* dbias, Tensor* dln_weight, Tensor* dln_bias) {
  const cuda::BdrlnCudaProblem c = ln_problem(p, x, residual, ln_weight);
  check_grad_dtype(kBdrln, dy, residual);  // y has the residual's dtype
  PD_CHECK(mean.dtype() == DataType::FLOAT32 && rstd.dtype() == DataType::FLOAT32, kBdrln,
           ": saved mean/rstd must be float32, got ", mean.dtype(), "/", rstd.dtype());
  const Tensor xc = dense(x), bc = dense(bias), rc = dense(residual), wc = dense(ln_weight),
               mc = dense(mean), sc = dense(rstd), g = dense(dy);
  Tensor ws = workspace(cuda::bdrln_cuda_bwd_workspace_bytes(c.rows, c.cols), x);
  check_launch(
      kBdrln, "backward",
      cuda::bdrln_cuda_bwd(c, xc.data(), bc.data(), rc.data(), wc.data(), mc.data<float>(),
                           sc.data<float>(), g.data(), dx->data(), dresidual->data(), dbias->data(),
                           dln_weight->data(), dln_bias->data(), ws.data(), x.stream()));
}

}  // namespace paddle_unpad
