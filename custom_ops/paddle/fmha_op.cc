// Paddle registration of the varlen FMHA operator: input checks, dispatch by place and
// dtype, shape/dtype inference. The math lives in custom_ops/kernels.
//
//   pu_fmha(Q [T,H,D], K [T,H,D], V [T,H,D], CuSeqlens [B+1] int32 (CPU),
//           RngState [2] int64 (optional: seed, offset))
//     attrs: max_seqlen (int64), scale (float), dropout (float), grouping (bool: GPU launch
//            by length bucket on a stream pool, or one launch; CPU ignores it)
//     -> Out [T,H,D], Lse [T,H] float32
#include <sstream>
#include <vector>

#include "fmha_gpu.h"  // GPU half (fmha_gpu.cu), declared only with PADDLE_WITH_CUDA
#include "kernels/common/cu_seqlens_checks.h"
#include "kernels/cpu/fmha_cpu.h"
#include "paddle/extension.h"
#include "op_common.h"  // same folder

namespace {

using paddle::DataType;
using paddle::Tensor;

using paddle_unpad::glue::dense;
using paddle_unpad::glue::place_name;
using paddle_unpad::glue::shape_str;

// Checks shared by forward and backward; returns the problem description.
paddle_unpad::FmhaProblem check_and_describe(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& cu, int64_t max_seqlen, float scale,
                                             float dropout) {
  PD_CHECK(q.shape().size() == 3, "fmha: q must be 3-D [total_tokens, heads, head_dim], got shape ",
           shape_str(q.shape()));
  PD_CHECK(k.shape() == q.shape(), "fmha: k shape ", shape_str(k.shape()), " differs from q shape ",
           shape_str(q.shape()));
  PD_CHECK(v.shape() == q.shape(), "fmha: v shape ", shape_str(v.shape()), " differs from q shape ",
           shape_str(q.shape()));
  PD_CHECK(k.dtype() == q.dtype(), "fmha: k dtype ", k.dtype(), " differs from q dtype ", q.dtype());
  PD_CHECK(v.dtype() == q.dtype(), "fmha: v dtype ", v.dtype(), " differs from q dtype ", q.dtype());
  PD_CHECK(k.place() == q.place(), "fmha: k is on ", place_name(k), " but q is on ", place_name(q));
  PD_CHECK(v.place() == q.place(), "fmha: v is on ", place_name(v), " but q is on ", place_name(q));
  PD_CHECK(cu.dtype() == DataType::INT32, "fmha: cu_seqlens must be int32, got ", cu.dtype());
  PD_CHECK(cu.shape().size() == 1, "fmha: cu_seqlens must be 1-D [batch + 1], got shape ",
           shape_str(cu.shape()));
  PD_CHECK(cu.is_cpu(), "fmha: cu_seqlens must be on the CPU (a host copy; the kernels read it "
           "without a device sync), got a tensor on ", place_name(cu));
  PD_CHECK(max_seqlen >= 0, "fmha: max_seqlen must be >= 0, got ", max_seqlen);
  PD_CHECK(dropout >= 0.0f && dropout < 1.0f, "fmha: dropout must be in [0, 1), got ", dropout);
  PD_CHECK(scale == scale, "fmha: scale must be a number, got NaN");

  paddle_unpad::FmhaProblem p;
  p.total = q.shape()[0];
  p.heads = q.shape()[1];
  p.head_dim = q.shape()[2];
  p.batch = cu.numel() - 1;
  p.scale = scale;
  p.dropout = dropout;
  p.cu_seqlens = p.batch >= 0 ? cu.data<int32_t>() : nullptr;
  // Checked here, where the values are read, for every caller (Python does not read them
  // on this path); paddle_unpad.varlen.check_cu_seqlens states the same rules in the same words.
  const std::string why =
      paddle_unpad::cu_seqlens_invalid(p.cu_seqlens, p.batch, p.total, max_seqlen);
  PD_CHECK(why.empty(), "fmha: ", why);
  return p;
}

void read_rng_state(const paddle::optional<Tensor>& rng, paddle_unpad::FmhaProblem* p) {
  if (p->dropout <= 0.0f) return;
  PD_CHECK(rng.is_initialized(), "fmha: dropout = ", p->dropout,
           " needs rng_state ([seed, offset] int64), got none");
  // The GPU kernels take the state by value too: a device copy (a traced program's
  // paddle.randint) is read back once here.
  const Tensor r = rng->is_cpu() ? *rng : rng->copy_to(paddle::CPUPlace(), true);
  PD_CHECK(r.dtype() == DataType::INT64 && r.numel() == 2,
           "fmha: rng_state must be int64 with 2 elements [seed, offset], got dtype ", r.dtype(),
           " with ", r.numel(), " elements");
  p->seed = static_cast<uint64_t>(r.data<int64_t>()[0]);
  p->offset = static_cast<uint64_t>(r.data<int64_t>()[1]);
}

void check_cpu_dtype_and_support(const Tensor& q, const paddle_unpad::FmhaProblem& p) {
  PD_CHECK(q.dtype() == DataType::FLOAT32, "fmha: q/k/v dtype ", q.dtype(),
           " is not supported on CPU (supported: float32)");
  const std::string why = paddle_unpad::fmha_cpu_unsupported(p);
  PD_CHECK(why.empty(), "fmha: ", why);
}

std::vector<Tensor> FmhaForward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu,
                                const paddle::optional<Tensor>& rng, int64_t max_seqlen, float scale,
                                float dropout, bool grouping) {
  auto p = check_and_describe(q, k, v, cu, max_seqlen, scale, dropout);
  read_rng_state(rng, &p);
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
    PD_THROW("fmha: no kernel for tensors on ", place_name(q),
             " in this build (paddle_unpad was built without CUDA kernels)");
  }
  return {out, lse};
}

std::vector<Tensor> FmhaBackward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu,
                                 const paddle::optional<Tensor>& rng, const Tensor& out,
                                 const Tensor& lse, const Tensor& dout, int64_t max_seqlen,
                                 float scale, float dropout, bool grouping) {
  auto p = check_and_describe(q, k, v, cu, max_seqlen, scale, dropout);
  read_rng_state(rng, &p);
  PD_CHECK(dout.shape() == q.shape(), "fmha: grad of out has shape ", shape_str(dout.shape()),
           ", expected ", shape_str(q.shape()));
  Tensor dq = paddle::empty(q.shape(), q.dtype(), q.place());
  Tensor dk = paddle::empty(q.shape(), q.dtype(), q.place());
  Tensor dv = paddle::empty(q.shape(), q.dtype(), q.place());
  if (q.is_cpu()) {
    static_cast<void>(grouping);
    check_cpu_dtype_and_support(q, p);
    const Tensor qc = dense(q), kc = dense(k), vc = dense(v), g = dense(dout);
    paddle_unpad::fmha_bwd_cpu(p, qc.data<float>(), kc.data<float>(), vc.data<float>(),
                               out.data<float>(), lse.data<float>(), g.data<float>(),
                               dq.data<float>(), dk.data<float>(), dv.data<float>());
#if defined(PADDLE_WITH_CUDA)
  } else if (q.is_gpu()) {
    paddle_unpad::FmhaBackwardGpu(p, grouping, q, k, v, out, lse, dout, &dq, &dk, &dv);
#endif
  } else {
    PD_THROW("fmha: no kernel for tensors on ", place_name(q),
             " in this build (paddle_unpad was built without CUDA kernels)");
  }
  return {dq, dk, dv};
}

std::vector<std::vector<int64_t>> FmhaInferShape(const std::vector<int64_t>& q,
                                                 const std::vector<int64_t>& k,
                                                 const std::vector<int64_t>& v,
                                                 const std::vector<int64_t>& cu,
                                                 const paddle::optional<std::vector<int64_t>>& rng) {
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

PD_BUILD_OP(pu_fmha)
    .Inputs({"Q", "K", "V", "CuSeqlens", paddle::Optional("RngState")})
    .Outputs({"Out", "Lse"})
    .Attrs({"max_seqlen: int64_t", "scale: float", "dropout: float", "grouping: bool"})
    .SetKernelFn(PD_KERNEL(FmhaForward))
    .SetInferShapeFn(PD_INFER_SHAPE(FmhaInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(FmhaInferDtype));

PD_BUILD_GRAD_OP(pu_fmha)
    .Inputs({"Q", "K", "V", "CuSeqlens", paddle::Optional("RngState"), "Out", "Lse",
             paddle::Grad("Out")})
    .Outputs({paddle::Grad("Q"), paddle::Grad("K"), paddle::Grad("V")})
    .Attrs({"max_seqlen: int64_t", "scale: float", "dropout: float", "grouping: bool"})
    .SetKernelFn(PD_KERNEL(FmhaBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(FmhaGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(FmhaGradInferDtype));
