// Fused multi-head attention over packed variable-length sequences, CPU, fp32.
// Framework-free: raw pointers and sizes only (the Paddle glue lives in custom_ops/paddle).
//
// Tensors (T = total tokens, H = heads, D = head size, B = sequences):
//   q, k, v, out, dout, dq, dk, dv : [T, H, D] fp32, contiguous (q, k, v, dq, dk, dv may
//                                    instead be views of a packed [T, 3, H, D], qkv_stride)
//   lse                            : [T, H] fp32, log-sum-exp of each scaled score row
//   cu_seqlens                     : [B + 1] int32, 0 = cu[0] <= cu[1] <= ... <= cu[B] = T
//
// Flash-attention style: per (sequence, head, query block) work items with an online
// softmax; no [S, S] buffer of any sequence is ever materialised, and the dropout mask
// is regenerated from (seed, offset) by Philox (common/philox.h) in the backward pass.
#pragma once
#include <cstdint>
#include <string>

#include "kernels/common/problem_desc.h"

namespace paddle_unpad {

struct FmhaProblem : FmhaDesc {
  // Packed QKV (the output of one QKV GEMM, [T, 3, H, D]): q, k, v and dq, dk, dv are then
  // views into it, `qkv_stride` floats from one token to the next (0: H * D, separate
  // tensors); out, dout and lse keep their own layout.
  int64_t qkv_stride = 0;
  // Per-(head, dim) biases added to q, k and v as they are read ([H * D] each), or null.
  const float* q_bias = nullptr;
  const float* k_bias = nullptr;
  const float* v_bias = nullptr;
};

constexpr int64_t kFmhaMaxHeadDim = 256;

// Returns an empty string when the problem is supported, else why not (in words).
std::string fmha_cpu_unsupported(const FmhaProblem& p);

void fmha_fwd_cpu(const FmhaProblem& p, const float* q, const float* k, const float* v, float* out,
                  float* lse);

void fmha_bwd_cpu(const FmhaProblem& p, const float* q, const float* k, const float* v,
                  const float* out, const float* lse, const float* dout, float* dq, float* dk,
                  float* dv);

// Name of the instruction set the kernels dispatched to ("avx512", "avx2", "sse2").
const char* fmha_cpu_isa();

}  // namespace paddle_unpad
