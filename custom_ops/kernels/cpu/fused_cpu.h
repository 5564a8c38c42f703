// Fused element-wise / row-wise encoder operators, CPU, fp32. Framework-free: raw
// pointers and sizes only (the Paddle glue lives in custom_ops/paddle/fused_ops.cc).
//
// Every tensor is a dense row-major [rows, cols] matrix (leading dimensions of the
// framework tensor flattened into rows); the per-feature vectors are [cols].
//
// bias_gelu                      y = gelu(x + bias), gelu(u) = u * Phi(u) (exact, erf form)
//   forward   x [rows, cols], bias [cols]               -> y [rows, cols]
//   backward  x, bias, dy [rows, cols]                  -> dx [rows, cols], dbias [cols]
//
// bias_dropout_residual_layer_norm (post-LN residual block of BERT)
//   z = residual + dropout(x + bias);  y = (z - mean(z)) * rstd * ln_weight + ln_bias,
//   rstd = 1 / sqrt(var(z) + epsilon), mean / biased variance over each row.
//   forward   x, residual [rows, cols], bias, ln_weight, ln_bias [cols]
//             -> y [rows, cols], mean [rows], rstd [rows]
//   backward  x, bias, residual, ln_weight, mean, rstd, dy
//             -> dx, dresidual [rows, cols], dbias, dln_weight, dln_bias [cols]
//   The dropout mask is regenerated from (seed, offset) by Philox (common/philox.h,
//   "row-wise dropout" layout), never stored.
//
// Determinism: a row is always computed by one work item with a fixed order of
// operations; column sums (dbias, dln_weight, dln_bias) are reduced per fixed chunk of
// rows (its size depends on the shape only) and the chunk partials are added in chunk
// order.
// So results are bitwise independent of the thread count.
#pragma once
#include <cstdint>
#include <string>

#include "kernels/common/problem_desc.h"

namespace paddle_unpad {

void bias_gelu_fwd_cpu(int64_t rows, int64_t cols, const float* x, const float* bias, float* y);

// out[c] = sum over r of x[r * cols + c], in the chunks and order of the other column
// sums here (a bias gradient, e.g. that of a packed QKV from its gradient).
void column_sums_cpu(int64_t rows, int64_t cols, const float* x, float* out);

void bias_gelu_bwd_cpu(int64_t rows, int64_t cols, const float* x, const float* bias,
                       const float* dy, float* dx, float* dbias);

using BdrlnProblem = BdrlnDesc;  // the CPU kernels take nothing more

// Returns an empty string when the problem is supported, else why not (in words).
std::string bdrln_cpu_unsupported(const BdrlnProblem& p);

void bdrln_fwd_cpu(const BdrlnProblem& p, const float* x, const float* bias, const float* residual,
                   const float* ln_weight, const float* ln_bias, float* y, float* mean,
                   float* rstd);

void bdrln_bwd_cpu(const BdrlnProblem& p, const float* x, const float* bias, const float* residual,
                   const float* ln_weight, const float* mean, const float* rstd, const float* dy,
                   float* dx, float* dresidual, float* dbias, float* dln_weight, float* dln_bias);

// Rows per work item, and per reduction chunk of the backward passes: a function of the
// shape only, never of the thread count.
int64_t fused_rows_per_chunk(int64_t rows, int64_t cols);

// Name of the instruction set the fused kernels dispatched to ("avx512", "avx2", "sse2").
const char* fused_cpu_isa();

}  // namespace paddle_unpad
