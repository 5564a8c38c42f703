// Checks and problem set-up shared by the FMHA operators (pu_fmha, pu_fmha_qkv): the
// cu_seqlens / max_seqlen / dropout / scale rules and the Philox state, in the same words
// for both; every message starts with the caller's public name (`op`).
#pragma once
#include <string>

#include "kernels/common/cu_seqlens_checks.h"
#include "kernels/cpu/fmha_cpu.h"
#include "op_common.h"  // same folder

namespace paddle_unpad {
namespace glue {

// The problem of `total` tokens of `heads` x `head_dim`, after the checks of the scalar
// arguments and of cu_seqlens' values (read here, where the kernels read them).
inline FmhaProblem fmha_problem(const char* op, const paddle::Tensor& cu, int64_t total,
                                int64_t heads, int64_t head_dim, int64_t max_seqlen, float scale,
                                float dropout) {
  PD_CHECK(cu.dtype() == paddle::DataType::INT32, op, ": cu_seqlens must be int32, got ",
           cu.dtype());
  PD_CHECK(cu.shape().size() == 1, op, ": cu_seqlens must be 1-D [batch + 1], got shape ",
           shape_str(cu.shape()));
  PD_CHECK(cu.is_cpu(), op,
           ": cu_seqlens must be on the CPU (a host copy; the kernels read it "
           "without a device sync), got a tensor on ",
           place_name(cu));
  PD_CHECK(max_seqlen >= 0, op, ": max_seqlen must be >= 0, got ", max_seqlen);
  PD_CHECK(dropout >= 0.0f && dropout < 1.0f, op, ": dropout must be in [0, 1), got ", dropout);
  PD_CHECK(scale == scale, op, ": scale must be a number, got NaN");

  FmhaProblem p;
  p.total = total;
  p.heads = heads;
  p.head_dim = head_dim;
  p.batch = cu.numel() - 1;
  p.scale = scale;
  p.dropout = dropout;
  p.cu_seqlens = p.batch >= 0 ? cu.data<int32_t>() : nullptr;
  // paddle_unpad.varlen.check_cu_seqlens states the same rules in the same words.
  const std::string why = cu_seqlens_invalid(p.cu_seqlens, p.batch, p.total, max_seqlen);
  PD_CHECK(why.empty(), op, ": ", why);
  return p;
}

// Seed and offset of the dropout mask from rng_state ([seed, offset] int64), when dropout > 0.
inline void read_rng_state(const char* op, const paddle::optional<paddle::Tensor>& rng,
                           FmhaProblem* p) {
  if (p->dropout <= 0.0f) return;
  PD_CHECK(rng.is_initialized(), op, ": dropout = ", p->dropout,
           " needs rng_state ([seed, offset] int64), got none");
  // The GPU kernels take the state by value too: a device copy (a traced program's
  // paddle.randint) is read back once here.
  const paddle::Tensor r = rng->is_cpu() ? *rng : rng->copy_to(paddle::CPUPlace(), true);
  PD_CHECK(r.dtype() == paddle::DataType::INT64 && r.numel() == 2, op,
           ": rng_state must be int64 with 2 elements [seed, offset], got dtype ", r.dtype(),
           " with ", r.numel(), " elements");
  p->seed = static_cast<uint64_t>(r.data<int64_t>()[0]);
  p->offset = static_cast<uint64_t>(r.data<int64_t>()[1]);
}

}  // namespace glue
}  // namespace paddle_unpad
