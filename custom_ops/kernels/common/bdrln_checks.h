// The problem rules of bias_dropout_residual_layer_norm that the CPU and the CUDA kernels
// share (the CUDA side adds its dtype and int32 limits first). Host code only.
#pragma once
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

namespace paddle_unpad {

// Empty when rows x cols, dropout and epsilon make a valid problem, else why not (in words).
inline std::string bdrln_problem_unsupported(int64_t rows, int64_t cols, float dropout,
                                             float epsilon) {
  std::ostringstream why;
  if (cols < 1)
    why << "the normalised size (x.shape[-1]) must be at least 1, got " << cols;
  else if (rows < 0 || rows > 0xffffffffll)  // rows are a Philox counter word
    why << "the number of rows (product of x.shape[:-1]) must be below 2^32, got " << rows;
  else if (!(dropout >= 0.0f && dropout < 1.0f))
    why << "dropout must be in [0, 1), got " << dropout;
  else if (!(epsilon > 0.0f) || !std::isfinite(epsilon))
    why << "epsilon must be a finite number > 0, got " << epsilon;
  return why.str();
}

}  // namespace paddle_unpad
