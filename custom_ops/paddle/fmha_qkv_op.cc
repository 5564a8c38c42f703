// Paddle registration of the packed-QKV FMHA operator (CPU): attention straight from the
// output of the one QKV GEMM, with its bias added as q, k and v are read. It replaces
// add(bias) + split + fmha, whose forward copies and backward concat and column sums
// are whole passes over [T, 3h]; the math is that of pu_fmha (custom_ops/kernels).
//
//   pu_fmha_qkv(QKV [T,3,H,D], Bias [3,H,D], CuSeqlens [B+1] int32 (CPU),
//               RngState [2] int64 (optional: seed, offset))
//     attrs: max_seqlen (int64), scale (float), dropout (float)
//     -> Out [T,H,D], Lse [T,H] float32
//   Out and Lse are bitwise those of pu_fmha on q, k, v = split(QKV + Bias); the gradient
//   of QKV is bitwise that of q, k and v; that of Bias is the column sum of it.
#include <vector>

#include "kernels/cpu/fmha_cpu.h"
#include "kernels/cpu/fused_cpu.h"
#include "paddle/extension.h"
#include "fmha_op_common.h"  // same folder
#include "op_names.h"

namespace paddle_unpad::glue {
namespace {

paddle_unpad::FmhaProblem describe(const Tensor& qkv, const Tensor& bias, const Tensor& cu,
                                   const paddle::optional<Tensor>& rng, int64_t max_seqlen,
                                   float scale, float dropout) {
  PD_CHECK(qkv.shape().size() == 4 && qkv.shape()[1] == 3, kFmhaQkvpacked,
           ": qkv must be 4-D [total_tokens, 3, heads, head_dim], got shape ",
           shape_str(qkv.shape()));
  PD_CHECK(bias.shape() == std::vector<int64_t>({3, qkv.shape()[2], qkv.shape()[3]}),
           kFmhaQkvpacked, ": bias must have shape [3, heads, head_dim] = [3, ", qkv.shape()[2],
           ", ", qkv.shape()[3], "], got ", shape_str(bias.shape()));
  PD_CHECK(qkv.is_cpu(), kFmhaQkvpacked, ": the native kernel runs on the CPU, qkv is on ",
           place_name(qkv), " (", kFmhaQkvpacked, " splits qkv for fmha there)");
  PD_CHECK(bias.is_cpu(), kFmhaQkvpacked, ": bias is on ", place_name(bias),
           " but qkv is on the CPU");
  PD_CHECK(qkv.dtype() == DataType::FLOAT32, kFmhaQkvpacked, ": qkv dtype ", qkv.dtype(),
           " is not supported on CPU (supported: float32)");
  PD_CHECK(bias.dtype() == qkv.dtype(), kFmhaQkvpacked, ": bias dtype ", bias.dtype(),
           " differs from qkv dtype ", qkv.dtype());
  auto p = paddle_unpad::glue::fmha_problem(kFmhaQkvpacked, cu, qkv.shape()[0], qkv.shape()[2],
                                            qkv.shape()[3], max_seqlen, scale, dropout);
  p.qkv_stride = 3 * p.heads * p.head_dim;
  const std::string unsupported = paddle_unpad::fmha_cpu_unsupported(p);
  PD_CHECK(unsupported.empty(), kFmhaQkvpacked, ": ", unsupported);
  paddle_unpad::glue::read_rng_state(kFmhaQkvpacked, rng, &p);
  return p;
}

// bq, bk, bv: the three [H, D] rows of the [3, H, D] bias.
void set_biases(paddle_unpad::FmhaProblem* p, const float* bias) {
  const int64_t hd = p->heads * p->head_dim;
  p->q_bias = bias;
  p->k_bias = bias + hd;
  p->v_bias = bias + 2 * hd;
}

std::vector<Tensor> FmhaQkvForward(const Tensor& qkv, const Tensor& bias, const Tensor& cu,
                                   const paddle::optional<Tensor>& rng, int64_t max_seqlen,
                                   float scale, float dropout) {
  auto p = describe(qkv, bias, cu, rng, max_seqlen, scale, dropout);
  const Tensor x = dense(qkv), b = dense(bias);
  set_biases(&p, b.data<float>());
  Tensor out = paddle::empty({p.total, p.heads, p.head_dim}, qkv.dtype(), qkv.place());
  Tensor lse = paddle::empty({p.total, p.heads}, DataType::FLOAT32, qkv.place());
  // q, k and v are views into the packed rows, H * D floats apart within a token
  const float* q = x.data<float>();
  const int64_t hd = p.heads * p.head_dim;
  paddle_unpad::fmha_fwd_cpu(p, q, q + hd, q + 2 * hd, out.data<float>(), lse.data<float>());
  return {out, lse};
}

std::vector<Tensor> FmhaQkvBackward(const Tensor& qkv, const Tensor& bias, const Tensor& cu,
                                    const paddle::optional<Tensor>& rng, const Tensor& out,
                                    const Tensor& lse, const Tensor& dout, int64_t max_seqlen,
                                    float scale, float dropout) {
  auto p = describe(qkv, bias, cu, rng, max_seqlen, scale, dropout);
  PD_CHECK(dout.shape() == out.shape(), kFmhaQkvpacked, ": grad of out has shape ",
           shape_str(dout.shape()), ", expected ", shape_str(out.shape()));
  const Tensor x = dense(qkv), b = dense(bias), g = dense(dout);
  set_biases(&p, b.data<float>());
  Tensor dqkv = paddle::empty(qkv.shape(), qkv.dtype(), qkv.place());
  Tensor dbias = paddle::empty(bias.shape(), bias.dtype(), bias.place());
  const float* q = x.data<float>();
  float* d = dqkv.data<float>();
  const int64_t hd = p.heads * p.head_dim;
  paddle_unpad::fmha_bwd_cpu(p, q, q + hd, q + 2 * hd, out.data<float>(), lse.data<float>(),
                             g.data<float>(), d, d + hd, d + 2 * hd);
  paddle_unpad::column_sums_cpu(p.total, 3 * hd, d, dbias.data<float>());
  return {dqkv, dbias};
}

std::vector<std::vector<int64_t>> FmhaQkvInferShape(
    const std::vector<int64_t>& qkv, const std::vector<int64_t>& bias,
    const std::vector<int64_t>& cu, const paddle::optional<std::vector<int64_t>>& rng) {
  return {{qkv[0], qkv[2], qkv[3]}, {qkv[0], qkv[2]}};
}

std::vector<DataType> FmhaQkvInferDtype(DataType qkv, DataType bias, DataType cu,
                                        const paddle::optional<DataType>& rng) {
  return {qkv, DataType::FLOAT32};
}

std::vector<std::vector<int64_t>> FmhaQkvGradInferShape(
    const std::vector<int64_t>& qkv, const std::vector<int64_t>& bias,
    const std::vector<int64_t>& cu, const paddle::optional<std::vector<int64_t>>& rng,
    const std::vector<int64_t>& out, const std::vector<int64_t>& lse,
    const std::vector<int64_t>& dout) {
  return {qkv, bias};
}

std::vector<DataType> FmhaQkvGradInferDtype(DataType qkv, DataType bias, DataType cu,
                                            const paddle::optional<DataType>& rng, DataType out,
                                            DataType lse, DataType dout) {
  return {qkv, bias};
}

}  // namespace
}  // namespace paddle_unpad::glue

PU_BUILD_OP(PU_OP_FMHA_QKVPACKED)
    .Inputs({"QKV", "Bias", "CuSeqlens", paddle::Optional("RngState")})
    .Outputs({"Out", "Lse"})
    .Attrs({"max_seqlen: int64_t", "scale: float", "dropout: float"})
    .SetKernelFn(PD_KERNEL(paddle_unpad::glue::FmhaQkvForward))
    .SetInferShapeFn(PD_INFER_SHAPE(paddle_unpad::glue::FmhaQkvInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(paddle_unpad::glue::FmhaQkvInferDtype));

PU_BUILD_GRAD_OP(PU_OP_FMHA_QKVPACKED)
    .Inputs({"QKV", "Bias", "CuSeqlens", paddle::Optional("RngState"), "Out", "Lse",
             paddle::Grad("Out")})
    .Outputs({paddle::Grad("QKV"), paddle::Grad("Bias")})
    .Attrs({"max_seqlen: int64_t", "scale: float", "dropout: float"})
    .SetKernelFn(PD_KERNEL(paddle_unpad::glue::FmhaQkvBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(paddle_unpad::glue::FmhaQkvGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(paddle_unpad::glue::FmhaQkvGradInferDtype));
