// GPU half of the fused encoder operators (custom_ops/paddle/fused_gpu.cu), called by the
// registrations in fused_ops.cc after their shared argument checks. Compiled only into
// builds with CUDA (PADDLE_WITH_CUDA); the kernels live in custom_ops/kernels/cuda.
#pragma once
#if defined(PADDLE_WITH_CUDA)
#include "kernels/cpu/fused_cpu.h"  // BdrlnProblem: the checked problem, shared with the CPU path
#include "paddle/extension.h"

namespace paddle_unpad {

// y [..., F] (x's dtype), already allocated on x's GPU.
void BiasGeluForwardGpu(const paddle::Tensor& x, const paddle::Tensor& bias, paddle::Tensor* y);

// dx [..., F] and dbias [F], already allocated on x's GPU; dy is initialised.
void BiasGeluBackwardGpu(const paddle::Tensor& x, const paddle::Tensor& bias,
                         const paddle::Tensor& dy, paddle::Tensor* dx, paddle::Tensor* dbias);

// y (the residual's dtype), mean and rstd [N] fp32, already allocated on x's GPU. x and
// bias share a dtype; the residual and the LayerNorm parameters have x's or float32.
void BdrlnForwardGpu(const BdrlnProblem& p, const paddle::Tensor& x, const paddle::Tensor& bias,
                     const paddle::Tensor& residual, const paddle::Tensor& ln_weight,
                     const paddle::Tensor& ln_bias, paddle::Tensor* y, paddle::Tensor* mean,
                     paddle::Tensor* rstd);

// dx, dresidual [..., F] and dbias, dln_weight, dln_bias [F], already allocated on x's GPU.
void BdrlnBackwardGpu(const BdrlnProblem& p, const paddle::Tensor& x, const paddle::Tensor& bias,
                      const paddle::Tensor& residual, const paddle::Tensor& ln_weight,
                      const paddle::Tensor& mean, const paddle::Tensor& rstd,
                      const paddle::Tensor& dy, paddle::Tensor* dx, paddle::Tensor* dresidual,
                      paddle::Tensor* dbias, paddle::Tensor* dln_weight, paddle::Tensor* dln_bias);

}  // namespace paddle_unpad
#endif
