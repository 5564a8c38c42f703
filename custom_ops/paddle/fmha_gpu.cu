// GPU kernels of the pu_fmha operator: Paddle tensors -> raw pointers and the tensor's
// stream -> kernels/cuda/fmha_cuda.cuh. Argument checks shared with the CPU path are
// done by fmha_op.cc before these functions are called.
//
// Launch options: grouping and the backward's mode come from the op's `grouping` and
// `deterministic` attributes (pu.fmha(..., grouping=, deterministic=); their defaults are
// the FMHA_GROUPING and FMHA_DETERMINISTIC settings), the size of the stream pool from
// RuntimeSettings::fmha_streams (the FMHA_STREAMS setting, default 4).
#include "fmha_gpu.h"

#include <string>

#include "kernels/common/runtime_settings.h"
#include "kernels/cuda/fmha_cuda.cuh"
#include "op_names.h"  // same folder
#include "paddle_compat.h"

namespace paddle_unpad {
namespace {

using paddle::DataType;
using paddle::Tensor;

cuda::FmhaLaunchOptions launch_options(bool grouping, bool deterministic = false) {
  cuda::FmhaLaunchOptions o;
  o.grouping = grouping;
  o.deterministic = deterministic;
  o.num_streams = runtime_settings().fmha_streams;
  return o;
}

using compat::dense;
using glue::kFmha;

cuda::FmhaCudaProblem to_cuda_problem(const FmhaProblem& p, const Tensor& q) {
  cuda::FmhaCudaProblem c{p};  // what the CPU and the CUDA kernels share of p
  if (q.dtype() == DataType::FLOAT16) {
    c.dtype = cuda::DType::kFloat16;
  } else if (q.dtype() == DataType::BFLOAT16) {
    c.dtype = cuda::DType::kBFloat16;
  } else {
    PD_THROW(kFmha, ": q/k/v dtype ", q.dtype(),
             " is not supported on GPU (supported: float16, bfloat16)");
  }
  const std::string why = cuda::fmha_cuda_unsupported(c);
  PD_CHECK(why.empty(), kFmha, ": ", why);
  return c;
}

void check_aligned(const std::vector<const void*>& ptrs, const std::vector<const char*>& names) {
  const std::string why =
      cuda::fmha_cuda_misaligned(ptrs.data(), names.data(), static_cast<int>(ptrs.size()));
  PD_CHECK(why.empty(), kFmha, ": ", why);
}

}  // namespace

void FmhaForwardGpu(const FmhaProblem& p, bool grouping, const Tensor& q, const Tensor& k,
                    const Tensor& v, Tensor* out, Tensor* lse) {
  const cuda::FmhaCudaProblem c = to_cuda_problem(p, q);
  if (p.total == 0) return;
  const Tensor qc = dense(q), kc = dense(k), vc = dense(v);
  check_aligned({qc.data(), kc.data(), vc.data(), out->data(), lse->data()},
                {"q", "k", "v", "out", "lse"});
  const cudaError_t e = cuda::fmha_cuda_fwd(c, launch_options(grouping), qc.data(), kc.data(),
                                            vc.data(), out->data(), lse->data<float>(), q.stream());
  PD_CHECK(e == cudaSuccess, kFmha, ": CUDA forward launch failed: ", cudaGetErrorName(e), ": ",
           cudaGetErrorString(e));
}

void FmhaBackwardGpu(const FmhaProblem& p, bool grouping, bool deterministic, const Tensor& q,
                     const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                     const Tensor& dout, Tensor* dq, Tensor* dk, Tensor* dv) {
  const cuda::FmhaCudaProblem c = to_cuda_problem(p, q);
  if (p.total == 0) return;
  PD_CHECK(dout.dtype() == q.dtype(), kFmha, ": grad of out has dtype ", dout.dtype(),
           ", expected ", q.dtype());
  const Tensor qc = dense(q), kc = dense(k), vc = dense(v), oc = dense(out), lc = dense(lse),
               g = dense(dout);
  const int64_t ws_floats = static_cast<int64_t>(
      cuda::fmha_cuda_bwd_workspace_bytes(p.total, p.heads, p.head_dim, deterministic) /
      sizeof(float));
  Tensor ws = paddle::empty({ws_floats}, DataType::FLOAT32, q.place());
  check_aligned({qc.data(), kc.data(), vc.data(), oc.data(), lc.data(), g.data(), dq->data(),
                 dk->data(), dv->data(), ws.data()},
                {"q", "k", "v", "out", "lse", "grad of out", "dq", "dk", "dv", "workspace"});
  const cudaError_t e = cuda::fmha_cuda_bwd(
      c, launch_options(grouping, deterministic), qc.data(), kc.data(), vc.data(), oc.data(),
      lc.data<float>(), g.data(), dq->data(), dk->data(), dv->data(), ws.data(), q.stream());
  PD_CHECK(e == cudaSuccess, kFmha, ": CUDA backward launch failed: ", cudaGetErrorName(e), ": ",
           cudaGetErrorString(e));
}

}  // namespace paddle_unpad
