// Paddle registration of the varlen FMHA operator: input checks, dispatch by place and
// dtype, shape/dtype inference. The math lives in custom_ops/kernels.
//
//   pu_fmha(Q [T,H,D], K [T,H,D], V [T,H,D], CuSeqlens [B+1] int32 (CPU),
//           RngState [2] int64 (optional: seed, offset))
//     attrs: max_seqlen (int64), scale (float), dropout (float), grouping (bool: GPU launch
//            by length bucket on a stream pool, or one launch; CPU ignores it),
//            deterministic (bool: GPU backward in two kernels without atomics, bitwise on
//            reruns, or in one pass; the CPU backward is bitwise reproducible either way)
//     -> Out [T,H,D], Lse [T,H] float32
#include <sstream>
#include <vector>

#include "fmha_gpu.h"  // GPU half (fmha_gpu.cu), declared only with PADDLE_WITH_CUDA
#include "kernels/cpu/fmha_cpu.h"
#include "paddle/extension.h"
#include "fmha_op_common.h"  // same folder
#include "op_names.h"

namespace paddle_unpad::glue {
namespace {

// Checks shared by forward and backward; returns the problem description.
paddle_unpad::FmhaProblem check_and_describe(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& cu, int64_t max_seqlen, float scale,
                                             float dropout) {
  PD_CHECK(q.shape().size() == 3, kFmha,
           ": q must be 3-D [total_tokens, heads, head_dim], got shape ", shape_str(q.shape()));
  PD_CHECK(k.shape() == q.shape(), kFmha, ": k shape ", shape_str(k.shape()),
           " differs from q shape ", shape_str(q.shape()));
  PD_CHECK(v.shape() == q.shape(), kFmha, ": v shape ", shape_str(v.shape()),
           " differs from q shape ", shape_str(q.shape()));
  PD_CHECK(k.dtype() == q.dtype(), kFmha, ": k dtype ", k.dtype(), " differs from q dtype ",
           q.dtype());
  PD_CHECK(v.dtype() == q.dtype(), kFmha, ": v dtype ", v.dtype(), " differs from q dtype ",
           q.dtype());
  PD_CHECK(k.place() == q.place(), kFmha, ": k is on ", place_name(k), " but q is on ",
           place_name(q));
  PD_CHECK(v.place() == q.place(), kFmha, ": v is on ", place_name(v), " but q is on ",
           place_name(q));
  return paddle_unpad::glue::fmha_problem(kFmha, cu, q.shape()[0], q.shape()[1], q.shape()[2],
                                          max_seqlen, scale, dropout);
}

void check_cpu_dtype_and_support(const Tensor& q, const paddle_unpad::FmhaProblem& p) {
  PD_CHECK(q.dtype() == DataType::FLOAT32, kFmha, ": q/k/v dtype ", q.dtype(),
           " is not supported on CPU (supported: float32)");
  const std::string why = paddle_unpad::fmha_cpu_unsupported(p);
  PD_CHECK(why.empty(), kFmha, ": ", why);
}

std::vector<Tensor> FmhaForward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu,
                                const paddle::optional<Tensor>& rng, int64_t max_seqlen,
                                float scale, float dropout, bool grouping, bool deterministic) {
  static_cast<void>(deterministic);  // a backward setting
  auto p = check_and_describe(q, k, v, cu, max_seqlen, scale, dropout);
  read_rng_state(kFmha, rng, &p);
  Tensor out = paddle::empty(q.shape(), q.dtype(), q.place());
  Tensor lse = paddle::empty({p.total, p.heads}, DataType::FLOAT32, q.place());
  if (q.is_cpu()) {
    static_cast<void>(grouping);  // one kernel call over the batch: nothing to group
    check_cpu_dtype_and_support(q, p);
    const Tensor qc = dense(q), kc = dense(k), vc = dense(v);
    paddle_unpad::fmha_fwd_cpu(p, qc.data<float>(), kc.data<float>(), vc.data<float>(),
                               out.data<float>(), lse.data<float>());
#if defined(PADDLE_WITH_CUDA)
  } else if (q.is_gpu()) {
    paddle_unpad::FmhaForwardGpu(p, grouping, q, k, v, &out, &lse);
#endif
  } else {
    PD_THROW(kFmha, ": no kernel for tensors on ", place_name(q),
             " in this build (paddle_unpad was built without CUDA kernels)");
  }
  return {out, lse};
}

std::vector<Tensor> FmhaBackward(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& cu, const paddle::optional<Tensor>& rng,
                                 const Tensor& out, const Tensor& lse, const Tensor& dout,
                                 int64_t max_seqlen, float scale, float dropout, bool grouping,
                                 bool deterministic) {
  auto p = check_and_describe(q, k, v, cu, max_seqlen, scale, dropout);
  read_rng_state(kFmha, rng, &p);
  PD_CHECK(dout.shape() == q.shape(), kFmha, ": grad of out has shape ", shape_str(dout.shape()),
           ", expected ", shape_str(q.shape()));
  Tensor dq = paddle::empty(q.shape(), q.dtype(), q.place());
  Tensor dk = paddle::empty(q.shape(), q.dtype(), q.place());
  Tensor dv = paddle::empty(q.shape(), q.dtype(), q.place());
  if (q.is_cpu()) {
    static_cast<void>(grouping);
    static_cast<void>(deterministic);  // the CPU backward is always bitwise reproducible
    check_cpu_dtype_and_support(q, p);
    const Tensor qc = dense(q), kc = dense(k), vc = dense(v), g = dense(dout);
    paddle_unpad::fmha_bwd_cpu(p, qc.data<float>(), kc.data<float>(), vc.data<float>(),
                               out.data<float>(), lse.data<float>(), g.data<float>(),
                               dq.data<float>(), dk.data<float>(), dv.data<float>());
#if defined(PADDLE_WITH_CUDA)
  } else if (q.is_gpu()) {
    paddle_unpad::FmhaBackwardGpu(p, grouping, deterministic, q, k, v, out, lse, dout, &dq, &dk,
                                  &dv);
#endif
  } else {
    PD_THROW(kFmha, ": no kernel for tensors on ", place_name(q),
             " in this build (paddle_unpad was built without CUDA kernels)");
  }
  return {dq, dk, dv};
}

std::vector<std::vector<int64_t>> FmhaInferShape(
    const std::vector<int64_t>& q, const std::vector<int64_t>& k, const std::vector<int64_t>& v,
    const std::vector<int64_t>& cu, const paddle::optional<std::vector<int64_t>>& rng) {
  return {q, {q[0], q[1]}};
}

std::vector<DataType> FmhaInferDtype(DataType q, DataType k, DataType v, DataType cu,
                                     const paddle::optional<DataType>& rng) {
  return {q, DataType::FLOAT32};
}

std::vector<std::vector<int64_t>> FmhaGradInferShape(
    const std::vector<int64_t>& q, const std::vector<int64_t>& k, const std::vector<int64_t>& v,
    const std::vector<int64_t>& cu, const paddle::optional<std::vector<int64_t>>& rng,
    const std::vector<int64_t>& out, const std::vector<int64_t>& lse,
    const std::vector<int64_t>& dout) {
  return {q, k, v};
}

std::vector<DataType> FmhaGradInferDtype(DataType q, DataType k, DataType v, DataType cu,
                                         const paddle::optional<DataType>& rng, DataType out,
                                         DataType lse, DataType dout) {
  return {q, k, v};
}

}  // namespace
}  // namespace paddle_unpad::glue

PU_BUILD_OP(PU_OP_FMHA)
    .Inputs({"Q", "K", "V", "CuSeqlens", paddle::Optional("RngState")})
    .Outputs({"Out", "Lse"})
    .Attrs({"max_seqlen: int64_t", "scale: float", "dropout: float", "grouping: bool",
            "deterministic: bool"})
    .SetKernelFn(PD_KERNEL(paddle_unpad::glue::FmhaForward))
    .SetInferShapeFn(PD_INFER_SHAPE(paddle_unpad::glue::FmhaInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(paddle_unpad::glue::FmhaInferDtype));

PU_BUILD_GRAD_OP(PU_OP_FMHA)
    .Inputs({"Q", "K", "V", "CuSeqlens", paddle::Optional("RngState"), "Out", "Lse",
             paddle::Grad("Out")})
    .Outputs({paddle::Grad("Q"), paddle::Grad("K"), paddle::Grad("V")})
    .Attrs({"max_seqlen: int64_t", "scale: float", "dropout: float", "grouping: bool",
            "deterministic: bool"})
    .SetKernelFn(PD_KERNEL(paddle_unpad::glue::FmhaBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(paddle_unpad::glue::FmhaGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(paddle_unpad::glue::FmhaGradInferDtype));
