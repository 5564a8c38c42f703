// Paddle registration of the fused encoder operators: input checks, dispatch by place
// and dtype, shape/dtype inference. The math lives in custom_ops/kernels/cpu/fused_cpu*
// (CPU, float32) and custom_ops/kernels/cuda/fused_cuda* (GPU, float16 / bfloat16 /
// float32; glue in fused_gpu.cu, compiled when PADDLE_WITH_CUDA).
//
//   pu_bias_gelu(X [..., F], Bias [F]) -> Y [..., F]          y = gelu_erf(x + bias)
//
//   pu_bias_dropout_residual_layer_norm(X [..., F], Bias [F], Residual [..., F],
//       LnWeight [F], LnBias [F], RngState [2] int64 (optional: seed, offset))
//     attrs: dropout (float), epsilon (float)
//     -> Y [..., F], Mean [N], Rstd [N] float32 (N = product of the leading dims)
//     y = LayerNorm(residual + dropout(x + bias)) * ln_weight + ln_bias
//     dtypes: x and bias one dtype; on GPU, the residual (and y) and the LayerNorm
//     parameters x's dtype or float32 each (what AMP hands over); on CPU all float32.
#include <algorithm>
#include <cmath>
#include <sstream>
#include <vector>

#include "fused_gpu.h"  // GPU half (fused_gpu.cu), declared only with PADDLE_WITH_CUDA
#include "kernels/cpu/fused_cpu.h"
#include "paddle/extension.h"
#include "op_common.h"  // same folder
#include "op_names.h"

namespace paddle_unpad::glue {
namespace {

// `t` next to x: x's dtype, or -- where `float32_ok` (bdrln's residual and LayerNorm
// parameters, which AMP leaves in float32 next to a half GEMM output) -- float32.
void check_dtype_next_to_x(const char* op, const char* name, const Tensor& t, const Tensor& x,
                           bool float32_ok) {
  if (float32_ok) {
    PD_CHECK(t.dtype() == x.dtype() || t.dtype() == DataType::FLOAT32, op, ": ", name, " dtype ",
             t.dtype(), " must be x's dtype ", x.dtype(), " or float32");
  } else {
    PD_CHECK(t.dtype() == x.dtype(), op, ": ", name, " dtype ", t.dtype(), " differs from x dtype ",
             x.dtype());
  }
}

// The 1-D per-feature vector `name` of op `op` must be [F] on x's place, of x's dtype
// (or float32 where `float32_ok`).
void check_vector(const char* op, const char* name, const Tensor& t, const Tensor& x,
                  bool float32_ok = false) {
  const int64_t F = x.shape().back();
  PD_CHECK(t.shape().size() == 1 && t.shape()[0] == F, op, ": ", name, " must be 1-D [", F,
           "] (F = x.shape[-1]), got shape ", shape_str(t.shape()));
  check_dtype_next_to_x(op, name, t, x, float32_ok);
  PD_CHECK(t.place() == x.place(), op, ": ", name, " is on ", place_name(t), " but x is on ",
           place_name(x));
}

void check_x(const char* op, const Tensor& x) {
  PD_CHECK(x.shape().size() >= 1, op,
           ": x must have at least 1 dimension [..., F], got a 0-D tensor");
}

void check_cpu_float32(const char* op, const Tensor& x) {
  PD_CHECK(x.dtype() == DataType::FLOAT32, op, ": x dtype ", x.dtype(),
           " is not supported on CPU (supported: float32)");
}

int64_t rows_of(const Tensor& x) {
  const int64_t F = x.shape().back();
  int64_t n = 1;
  for (size_t i = 0; i + 1 < x.shape().size(); ++i) n *= x.shape()[i];
  return F > 0 ? n : 0;
}

[[noreturn]] void no_kernel(const char* op, const Tensor& x) {
#if defined(PADDLE_WITH_CUDA)
  PD_THROW(op, ": no kernel for tensors on ", place_name(x), " (kernels exist for CPU and GPU)");
#else
  PD_THROW(op, ": no kernel for tensors on ", place_name(x),
           " in this build (paddle_unpad was built without CUDA kernels)");
#endif
}

// The gradient of a tensor when y does not reach the loss (dy uninitialised): zeros.
Tensor zero_grad_like(const Tensor& t) {
  return paddle::full(t.shape(), 0.0, t.dtype(), t.place());
}

// ------------------------------------------------------------------------------ bias_gelu

std::vector<Tensor> BiasGeluForward(const Tensor& x, const Tensor& bias) {
  check_x(kBiasGelu, x);
  check_vector(kBiasGelu, "bias", bias, x);
  Tensor y = paddle::empty(x.shape(), x.dtype(), x.place());
  if (x.is_cpu()) {
    check_cpu_float32(kBiasGelu, x);
    const Tensor xc = dense(x), bc = dense(bias);
    paddle_unpad::bias_gelu_fwd_cpu(rows_of(x), x.shape().back(), xc.data<float>(),
                                    bc.data<float>(), y.data<float>());
#if defined(PADDLE_WITH_CUDA)
  } else if (x.is_gpu()) {
    paddle_unpad::BiasGeluForwardGpu(x, bias, &y);
#endif
  } else {
    no_kernel(kBiasGelu, x);
  }
  return {y};
}

std::vector<Tensor> BiasGeluBackward(const Tensor& x, const Tensor& bias, const Tensor& dy) {
  check_x(kBiasGelu, x);
  check_vector(kBiasGelu, "bias", bias, x);
  if (x.is_cpu()) check_cpu_float32(kBiasGelu, x);
  if (!dy.initialized())
    return {zero_grad_like(x), zero_grad_like(bias)};  // y does not reach the loss
  PD_CHECK(dy.shape() == x.shape(), kBiasGelu, ": grad of y has shape ", shape_str(dy.shape()),
           ", expected ", shape_str(x.shape()));
  Tensor dx = paddle::empty(x.shape(), x.dtype(), x.place());
  Tensor dbias = paddle::empty(bias.shape(), bias.dtype(), bias.place());
  if (x.is_cpu()) {
    const Tensor xc = dense(x), bc = dense(bias), g = dense(dy);
    paddle_unpad::bias_gelu_bwd_cpu(rows_of(x), x.shape().back(), xc.data<float>(),
                                    bc.data<float>(), g.data<float>(), dx.data<float>(),
                                    dbias.data<float>());
#if defined(PADDLE_WITH_CUDA)
  } else if (x.is_gpu()) {
    paddle_unpad::BiasGeluBackwardGpu(x, bias, dy, &dx, &dbias);
#endif
  } else {
    no_kernel(kBiasGelu, x);
  }
  return {dx, dbias};
}

std::vector<std::vector<int64_t>> BiasGeluInferShape(const std::vector<int64_t>& x,
                                                     const std::vector<int64_t>& bias) {
  return {x};
}

std::vector<DataType> BiasGeluInferDtype(DataType x, DataType bias) { return {x}; }

std::vector<std::vector<int64_t>> BiasGeluGradInferShape(const std::vector<int64_t>& x,
                                                         const std::vector<int64_t>& bias,
                                                         const std::vector<int64_t>& dy) {
  return {x, bias};
}

std::vector<DataType> BiasGeluGradInferDtype(DataType x, DataType bias, DataType dy) {
  return {x, bias};
}

// ------------------------------------------------------------ bias_dropout_residual_layer_norm

paddle_unpad::BdrlnProblem check_and_describe_ln(const Tensor& x, const Tensor& bias,
                                                 const Tensor& residual, const Tensor& ln_weight,
                                                 const Tensor& ln_bias, float dropout,
                                                 float epsilon) {
  check_x(kBdrln, x);
  PD_CHECK(residual.shape() == x.shape(), kBdrln, ": residual shape ", shape_str(residual.shape()),
           " differs from x shape ", shape_str(x.shape()));
  check_dtype_next_to_x(kBdrln, "residual", residual, x, true);
  PD_CHECK(residual.place() == x.place(), kBdrln, ": residual is on ", place_name(residual),
           " but x is on ", place_name(x));
  check_vector(kBdrln, "bias", bias, x);
  check_vector(kBdrln, "ln_weight", ln_weight, x, true);
  check_vector(kBdrln, "ln_bias", ln_bias, x, true);
  PD_CHECK(ln_bias.dtype() == ln_weight.dtype(), kBdrln, ": ln_bias dtype ", ln_bias.dtype(),
           " differs from ln_weight dtype ", ln_weight.dtype());
  PD_CHECK(x.shape().back() >= 1, kBdrln,
           ": the normalised size x.shape[-1] must be at least 1, got ", x.shape().back());
  PD_CHECK(dropout >= 0.0f && dropout < 1.0f, kBdrln, ": dropout must be in [0, 1), got ", dropout);
  PD_CHECK(epsilon > 0.0f && std::isfinite(epsilon), kBdrln,
           ": epsilon must be a finite number > 0, got ", epsilon);
  paddle_unpad::BdrlnProblem p;
  p.rows = rows_of(x);
  p.cols = x.shape().back();
  p.dropout = dropout;
  p.epsilon = epsilon;
  return p;
}

void read_rng_state(const paddle::optional<Tensor>& rng, paddle_unpad::BdrlnProblem* p) {
  if (p->dropout <= 0.0f) return;
  PD_CHECK(rng.is_initialized(), kBdrln, ": dropout = ", p->dropout,
           " needs rng_state ([seed, offset] int64), got none");
  // The kernels take the state by value: a device copy (a traced program's
  // paddle.randint on a GPU) is read back once here.
  const Tensor r = rng->is_cpu() ? *rng : rng->copy_to(paddle::CPUPlace(), true);
  PD_CHECK(r.dtype() == DataType::INT64 && r.numel() == 2, kBdrln,
           ": rng_state must be int64 with 2 elements [seed, offset], got dtype ", r.dtype(),
           " with ", r.numel(), " elements");
  p->seed = static_cast<uint64_t>(r.data<int64_t>()[0]);
  p->offset = static_cast<uint64_t>(r.data<int64_t>()[1]);
}

// CPU-only limits (the GPU path checks its own in fused_gpu.cu): every tensor float32.
void check_ln_cpu(const Tensor& x, const Tensor& residual, const Tensor& ln_weight,
                  const paddle_unpad::BdrlnProblem& p) {
  check_cpu_float32(kBdrln, x);
  PD_CHECK(residual.dtype() == DataType::FLOAT32 && ln_weight.dtype() == DataType::FLOAT32, kBdrln,
           ": residual / ln_weight dtypes ", residual.dtype(), " / ", ln_weight.dtype(),
           " are not supported on CPU (supported: float32)");
  const std::string why = paddle_unpad::bdrln_cpu_unsupported(p);
  PD_CHECK(why.empty(), kBdrln, ": ", why);
}

std::vector<Tensor> BdrlnForward(const Tensor& x, const Tensor& bias, const Tensor& residual,
                                 const Tensor& ln_weight, const Tensor& ln_bias,
                                 const paddle::optional<Tensor>& rng, float dropout,
                                 float epsilon) {
  auto p = check_and_describe_ln(x, bias, residual, ln_weight, ln_bias, dropout, epsilon);
  read_rng_state(rng, &p);
  Tensor y =
      paddle::empty(x.shape(), residual.dtype(), x.place());  // AMP: the residual stream's dtype
  Tensor mean = paddle::empty({p.rows}, DataType::FLOAT32, x.place());
  Tensor rstd = paddle::empty({p.rows}, DataType::FLOAT32, x.place());
  if (x.is_cpu()) {
    check_ln_cpu(x, residual, ln_weight, p);
    const Tensor xc = dense(x), bc = dense(bias), rc = dense(residual), wc = dense(ln_weight),
                 lbc = dense(ln_bias);
    paddle_unpad::bdrln_fwd_cpu(p, xc.data<float>(), bc.data<float>(), rc.data<float>(),
                                wc.data<float>(), lbc.data<float>(), y.data<float>(),
                                mean.data<float>(), rstd.data<float>());
#if defined(PADDLE_WITH_CUDA)
  } else if (x.is_gpu()) {
    paddle_unpad::BdrlnForwardGpu(p, x, bias, residual, ln_weight, ln_bias, &y, &mean, &rstd);
#endif
  } else {
    no_kernel(kBdrln, x);
  }
  return {y, mean, rstd};
}

std::vector<Tensor> BdrlnBackward(const Tensor& x, const Tensor& bias, const Tensor& residual,
                                  const Tensor& ln_weight, const paddle::optional<Tensor>& rng,
                                  const Tensor& mean, const Tensor& rstd, const Tensor& dy,
                                  float dropout, float epsilon) {
  // ln_bias does not enter the backward; ln_weight stands in for it in the shape checks.
  auto p = check_and_describe_ln(x, bias, residual, ln_weight, ln_weight, dropout, epsilon);
  read_rng_state(rng, &p);
  if (x.is_cpu()) check_ln_cpu(x, residual, ln_weight, p);
  if (!dy.initialized())  // y does not reach the loss
    return {zero_grad_like(x), zero_grad_like(bias), zero_grad_like(residual),
            zero_grad_like(ln_weight), zero_grad_like(ln_weight)};
  PD_CHECK(dy.shape() == x.shape(), kBdrln, ": grad of y has shape ", shape_str(dy.shape()),
           ", expected ", shape_str(x.shape()));
  PD_CHECK(mean.numel() == p.rows && rstd.numel() == p.rows, kBdrln, ": saved mean/rstd have ",
           mean.numel(), "/", rstd.numel(), " elements, expected ", p.rows);
  Tensor dx = paddle::empty(x.shape(), x.dtype(), x.place());
  Tensor dres = paddle::empty(x.shape(), residual.dtype(), x.place());
  Tensor dbias = paddle::empty(bias.shape(), bias.dtype(), bias.place());
  Tensor dw = paddle::empty(ln_weight.shape(), ln_weight.dtype(), ln_weight.place());
  Tensor db = paddle::empty(ln_weight.shape(), ln_weight.dtype(), ln_weight.place());
  if (x.is_cpu()) {
    const Tensor xc = dense(x), bc = dense(bias), rc = dense(residual), wc = dense(ln_weight),
                 g = dense(dy);
    paddle_unpad::bdrln_bwd_cpu(p, xc.data<float>(), bc.data<float>(), rc.data<float>(),
                                wc.data<float>(), mean.data<float>(), rstd.data<float>(),
                                g.data<float>(), dx.data<float>(), dres.data<float>(),
                                dbias.data<float>(), dw.data<float>(), db.data<float>());
#if defined(PADDLE_WITH_CUDA)
  } else if (x.is_gpu()) {
    paddle_unpad::BdrlnBackwardGpu(p, x, bias, residual, ln_weight, mean, rstd, dy, &dx, &dres,
                                   &dbias, &dw, &db);
#endif
  } else {
    no_kernel(kBdrln, x);
  }
  return {dx, dbias, dres, dw, db};
}

int64_t rows_of_shape(const std::vector<int64_t>& x) {
  if (x.empty()) return 1;
  int64_t n = 1;
  for (size_t i = 0; i + 1 < x.size(); ++i) {
    if (x[i] < 0) return -1;  // unknown while tracing
    n *= x[i];
  }
  return n;
}

std::vector<std::vector<int64_t>> BdrlnInferShape(
    const std::vector<int64_t>& x, const std::vector<int64_t>& bias,
    const std::vector<int64_t>& residual, const std::vector<int64_t>& ln_weight,
    const std::vector<int64_t>& ln_bias, const paddle::optional<std::vector<int64_t>>& rng) {
  const int64_t n = rows_of_shape(x);
  return {x, {n}, {n}};
}

std::vector<DataType> BdrlnInferDtype(DataType x, DataType bias, DataType residual,
                                      DataType ln_weight, DataType ln_bias,
                                      const paddle::optional<DataType>& rng) {
  return {residual, DataType::FLOAT32, DataType::FLOAT32};
}

std::vector<std::vector<int64_t>> BdrlnGradInferShape(
    const std::vector<int64_t>& x, const std::vector<int64_t>& bias,
    const std::vector<int64_t>& residual, const std::vector<int64_t>& ln_weight,
    const paddle::optional<std::vector<int64_t>>& rng, const std::vector<int64_t>& mean,
    const std::vector<int64_t>& rstd, const std::vector<int64_t>& dy) {
  return {x, bias, residual, ln_weight, ln_weight};
}

std::vector<DataType> BdrlnGradInferDtype(DataType x, DataType bias, DataType residual,
                                          DataType ln_weight, const paddle::optional<DataType>& rng,
                                          DataType mean, DataType rstd, DataType dy) {
  return {x, bias, residual, ln_weight, ln_weight};
}

}  // namespace
}  // namespace paddle_unpad::glue

PU_BUILD_OP(PU_OP_BIAS_GELU)
    .Inputs({"X", "Bias"})
    .Outputs({"Y"})
    .SetKernelFn(PD_KERNEL(paddle_unpad::glue::BiasGeluForward))
    .SetInferShapeFn(PD_INFER_SHAPE(paddle_unpad::glue::BiasGeluInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(paddle_unpad::glue::BiasGeluInferDtype));

PU_BUILD_GRAD_OP(PU_OP_BIAS_GELU)
    .Inputs({"X", "Bias", paddle::Grad("Y")})
    .Outputs({paddle::Grad("X"), paddle::Grad("Bias")})
    .SetKernelFn(PD_KERNEL(paddle_unpad::glue::BiasGeluBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(paddle_unpad::glue::BiasGeluGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(paddle_unpad::glue::BiasGeluGradInferDtype));

PU_BUILD_OP(PU_OP_BIAS_DROPOUT_RESIDUAL_LAYER_NORM)
    .Inputs({"X", "Bias", "Residual", "LnWeight", "LnBias", paddle::Optional("RngState")})
    .Outputs({"Y", "Mean", "Rstd"})
    .Attrs({"dropout: float", "epsilon: float"})
    .SetKernelFn(PD_KERNEL(paddle_unpad::glue::BdrlnForward))
    .SetInferShapeFn(PD_INFER_SHAPE(paddle_unpad::glue::BdrlnInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(paddle_unpad::glue::BdrlnInferDtype));

PU_BUILD_GRAD_OP(PU_OP_BIAS_DROPOUT_RESIDUAL_LAYER_NORM)
    .Inputs({"X", "Bias", "Residual", "LnWeight", paddle::Optional("RngState"), "Mean", "Rstd",
             paddle::Grad("Y")})
    .Outputs({paddle::Grad("X"), paddle::Grad("Bias"), paddle::Grad("Residual"),
              paddle::Grad("LnWeight"), paddle::Grad("LnBias")})
    .Attrs({"dropout: float", "epsilon: float"})
    .SetKernelFn(PD_KERNEL(paddle_unpad::glue::BdrlnBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(paddle_unpad::glue::BdrlnGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(paddle_unpad::glue::BdrlnGradInferDtype));

// Instruction set the fused CPU kernels dispatch to on this machine (read with ctypes).
extern "C" const char* paddle_unpad_fused_cpu_isa() { return paddle_unpad::fused_cpu_isa(); }
