// Scheduling, column reductions and ISA dispatch of the fused encoder kernels (the row
// math is in fused_cpu_impl.h).
#include "kernels/cpu/fused_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>
#include <vector>

#include "kernels/common/bdrln_checks.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/cpu/thread_pool.h"

namespace paddle_unpad {

PU_DECLARE_PER_ISA(
    void gelu_fwd_rows(int64_t, int64_t, int64_t, const float*, const float*, float*);
    void gelu_bwd_chunk(int64_t, int64_t, int64_t, const float*, const float*, const float*, float*,
                        float*);
    void ln_fwd_rows(const BdrlnProblem&, int64_t, int64_t, const float*, const float*,
                     const float*, const float*, const float*, float*, float*, float*);
    void ln_bwd_chunk(const BdrlnProblem&, int64_t, int64_t, const float*, const float*,
                      const float*, const float*, const float*, const float*, const float*, float*,
                      float*, float*, float*, float*);)

namespace {

// The entry points of one instruction set.
struct Isa {
  const char* name;
  decltype(&sse2::gelu_fwd_rows) gelu_fwd;
  decltype(&sse2::gelu_bwd_chunk) gelu_bwd;
  decltype(&sse2::ln_fwd_rows) ln_fwd;
  decltype(&sse2::ln_bwd_chunk) ln_bwd;
};

const Isa& isa() {
#define PU_ISA(isa) \
  {#isa, isa::gelu_fwd_rows, isa::gelu_bwd_chunk, isa::ln_fwd_rows, isa::ln_bwd_chunk},
  static const Isa by_isa[] = {PU_CPU_ISAS(PU_ISA)};
#undef PU_ISA
  return chosen_isa(by_isa);
}

// Elements per work item: big enough to amortise scheduling, small enough to balance.
constexpr int64_t kItemElems = 32768;
// At most this many reduction chunks (bounds the memory of the column partials).
constexpr int64_t kMaxChunks = 256;
// Columns per item of the final reduction of column partials.
constexpr int64_t kReduceCols = 1024;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Column partials: rows of a stride padded to 16 floats, 64-byte aligned, uninitialised
// (each chunk zeroes its own rows).
struct Partials {
  explicit Partials(int64_t n)
      : p(static_cast<float*>(std::aligned_alloc(64, ceil_div(n, 16) * 64 + 64))) {
    if (!p) throw std::bad_alloc();
  }
  ~Partials() { std::free(p); }
  Partials(const Partials&) = delete;
  Partials& operator=(const Partials&) = delete;
  float* p;
};
int64_t padded_stride(int64_t cols) { return ceil_div(cols, 16) * 16; }

// out[c] = sum over k in order of parts[k * stride + c]; zeros when there are no parts.
void reduce_partials(const float* parts, int64_t nparts, int64_t stride, int64_t cols, float* out) {
  parallel_for(ceil_div(cols, kReduceCols), [&](int64_t i, int) {
    const int64_t c0 = i * kReduceCols, c1 = std::min(cols, c0 + kReduceCols);
    float* o = out + c0;
    if (nparts == 0) {
      std::memset(o, 0, sizeof(float) * (c1 - c0));
      return;
    }
    std::memcpy(o, parts + c0, sizeof(float) * (c1 - c0));
    for (int64_t k = 1; k < nparts; ++k) {
      const float* p = parts + k * stride + c0;
      for (int64_t c = 0; c < c1 - c0; ++c) o[c] += p[c];
    }
  });
}

}  // namespace

const char* fused_cpu_isa() { return isa().name; }

int64_t fused_rows_per_chunk(int64_t rows, int64_t cols) {
  const int64_t by_size = std::max<int64_t>(1, kItemElems / std::max<int64_t>(cols, 1));
  const int64_t by_count = ceil_div(std::max<int64_t>(rows, 0), kMaxChunks);
  return std::max(by_size, by_count);
}

void bias_gelu_fwd_cpu(int64_t rows, int64_t cols, const float* x, const float* bias, float* y) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t rpc = fused_rows_per_chunk(rows, cols);
  const auto fwd = isa().gelu_fwd;
  parallel_for(ceil_div(rows, rpc), [&](int64_t i, int) {
    fwd(i * rpc, std::min(rows, (i + 1) * rpc), cols, x, bias, y);
  });
}

void bias_gelu_bwd_cpu(int64_t rows, int64_t cols, const float* x, const float* bias,
                       const float* dy, float* dx, float* dbias) {
  if (cols <= 0) return;
  const int64_t rpc = fused_rows_per_chunk(rows, cols);
  const int64_t nchunks = rows > 0 ? ceil_div(rows, rpc) : 0;
  const int64_t stride = padded_stride(cols);
  Partials parts(nchunks * stride);
  const auto bwd = isa().gelu_bwd;
  parallel_for(nchunks, [&](int64_t i, int) {
    bwd(i * rpc, std::min(rows, (i + 1) * rpc), cols, x, bias, dy, dx, parts.p + i * stride);
  });
  reduce_partials(parts.p, nchunks, stride, cols, dbias);
}

void column_sums_cpu(int64_t rows, int64_t cols, const float* x, float* out) {
  if (cols <= 0) return;
  const int64_t rpc = fused_rows_per_chunk(rows, cols);
  const int64_t nchunks = rows > 0 ? ceil_div(rows, rpc) : 0;
  const int64_t stride = padded_stride(cols);
  Partials parts(nchunks * stride);
  parallel_for(nchunks, [&](int64_t i, int) {
    float* acc = parts.p + i * stride;
    std::memset(acc, 0, sizeof(float) * cols);
    for (int64_t r = i * rpc; r < std::min(rows, (i + 1) * rpc); ++r) {
      const float* row = x + r * cols;
      for (int64_t c = 0; c < cols; ++c) acc[c] += row[c];
    }
  });
  reduce_partials(parts.p, nchunks, stride, cols, out);
}

std::string bdrln_cpu_unsupported(const BdrlnProblem& p) {
  return bdrln_problem_unsupported(p.rows, p.cols, p.dropout, p.epsilon);
}

void bdrln_fwd_cpu(const BdrlnProblem& p, const float* x, const float* bias, const float* residual,
                   const float* ln_weight, const float* ln_bias, float* y, float* mean,
                   float* rstd) {
  if (p.rows <= 0) return;
  const int64_t rpc = fused_rows_per_chunk(p.rows, p.cols);
  const auto fwd = isa().ln_fwd;
  parallel_for(ceil_div(p.rows, rpc), [&](int64_t i, int) {
    fwd(p, i * rpc, std::min(p.rows, (i + 1) * rpc), x, bias, residual, ln_weight, ln_bias, y, mean,
        rstd);
  });
}

void bdrln_bwd_cpu(const BdrlnProblem& p, const float* x, const float* bias, const float* residual,
                   const float* ln_weight, const float* mean, const float* rstd, const float* dy,
                   float* dx, float* dresidual, float* dbias, float* dln_weight, float* dln_bias) {
  const int64_t F = p.cols;
  const int64_t rpc = fused_rows_per_chunk(p.rows, F);
  const int64_t nchunks = p.rows > 0 ? ceil_div(p.rows, rpc) : 0;
  const int64_t Fp = padded_stride(F);  // whole-vector access to every partial row
  Partials parts(3 * nchunks * Fp);
  float* p_dbias = parts.p;
  float* p_dw = p_dbias + nchunks * Fp;
  float* p_db = p_dw + nchunks * Fp;
  const auto bwd = isa().ln_bwd;
  parallel_for(nchunks, [&](int64_t i, int) {
    bwd(p, i * rpc, std::min(p.rows, (i + 1) * rpc), x, bias, residual, ln_weight, mean, rstd, dy,
        dx, dresidual, p_dbias + i * Fp, p_dw + i * Fp, p_db + i * Fp);
  });
  reduce_partials(p_dbias, nchunks, Fp, F, dbias);
  reduce_partials(p_dw, nchunks, Fp, F, dln_weight);
  reduce_partials(p_db, nchunks, Fp, F, dln_bias);
}

}  // namespace paddle_unpad
