// GPU half of the pu_fmha operator (custom_ops/paddle/fmha_gpu.cu), called by the one
// registration in fmha_op.cc after its shared argument checks. Compiled only into
// builds with CUDA (PADDLE_WITH_CUDA); the kernels live in custom_ops/kernels/cuda.
#pragma once
#if defined(PADDLE_WITH_CUDA)
#include "kernels/cpu/fmha_cpu.h"
#include "paddle/extension.h"

namespace paddle_unpad {

// Fills out [T, H, D] (q's dtype) and lse [T, H] fp32, both already allocated on q's GPU.
// grouping: the op's attribute (length-bucketed multi-stream launch, or one launch).
void FmhaForwardGpu(const FmhaProblem& p, bool grouping, const paddle::Tensor& q,
                    const paddle::Tensor& k, const paddle::Tensor& v, paddle::Tensor* out,
                    paddle::Tensor* lse);

// Fills dq, dk, dv [T, H, D], already allocated on q's GPU. deterministic: the op's
// attribute (the two-kernel backward, bitwise on reruns, or the one-pass backward).
void FmhaBackwardGpu(const FmhaProblem& p, bool grouping, bool deterministic,
                     const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v,
                     const paddle::Tensor& out, const paddle::Tensor& lse,
                     const paddle::Tensor& dout, paddle::Tensor* dq, paddle::Tensor* dk,
                     paddle::Tensor* dv);

}  // namespace paddle_unpad
#endif
