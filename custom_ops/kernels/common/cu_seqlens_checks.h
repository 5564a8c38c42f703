// The rules for cu_seqlens that every fmha entry point shares: the Paddle op on CPU and
// GPU (custom_ops/paddle/fmha_op.cc) and the CUDA layer with its C-ABI harness
// (kernels/cuda/fmha_cuda.cu). paddle_unpad.varlen.check_cu_seqlens says the same in the
// same words for Python callers, so that an error reads alike whichever side catches it.
// Host code only: cu_seqlens is a host array.
#pragma once
#include <cstdint>
#include <sstream>
#include <string>

namespace paddle_unpad {

// Empty when the batch + 1 values at cu start at 0, never decrease, end at total (the
// rows of q) and hold no sequence longer than max_seqlen; else why not, in words naming
// the argument and the value. A caller without a bound of its own passes INT32_MAX (no
// int32 length is longer).
inline std::string cu_seqlens_invalid(const int32_t* cu, int64_t batch, int64_t total,
                                      int64_t max_seqlen) {
  std::ostringstream why;
  if (batch < 0) {
    why << "cu_seqlens must have at least one element (0), got none";
  } else if (cu == nullptr) {
    why << "cu_seqlens (host memory) is missing";
  } else if (cu[0] != 0) {
    why << "cu_seqlens[0] must be 0, got " << cu[0];
  } else {
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; ++b) {
      if (cu[b + 1] < cu[b]) {
        why << "cu_seqlens must be non-decreasing, but cu_seqlens[" << b + 1 << "] = " << cu[b + 1]
            << " < cu_seqlens[" << b << "] = " << cu[b];
        return why.str();
      }
      if (cu[b + 1] - cu[b] > longest) longest = cu[b + 1] - cu[b];
    }
    if (cu[batch] != total)
      why << "cu_seqlens[-1] = " << cu[batch]
          << " must equal the number of packed tokens q.shape[0] = " << total;
    else if (longest > max_seqlen)
      why << "max_seqlen = " << max_seqlen
          << " is smaller than the longest sequence in cu_seqlens (" << longest << ")";
  }
  return why.str();
}

}  // namespace paddle_unpad
