// Host side of the fused CUDA kernels: checks, the choice of path (16-byte vectors or
// elements; row in registers or the wide path), the fixed row chunks of the column sums,
// dispatch by dtype, and the second stage of the column sums (chunks added in order).
#include <climits>
#include <cmath>
#include <initializer_list>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/common/bdrln_checks.h"
#include "kernels/cuda/fused_cuda.cuh"
#include "kernels/cuda/fused_device.cuh"

namespace paddle_unpad {
namespace cuda {

namespace {

// Column partials: rows per chunk from the shape only (never from the device), so
// results are bitwise reproducible. Enough chunks to fill a large GPU, few enough that
// the partials stay a small fraction of the traffic.
constexpr int64_t kGeluChunkRows = 64;   // bias_gelu: column-tile blocks of 256 threads
constexpr int64_t kGeluMaxChunks = 256;  //   also split the columns, so fewer chunks do
constexpr int64_t kLnChunkRows = 16;     // bdrln: a chunk is one row-team block
constexpr int64_t kLnMaxChunks = 1024;

int64_t rows_per_chunk(int64_t rows, int64_t min_rows, int64_t max_chunks) {
  const int64_t by_count = ceil_div(rows, max_chunks);
  return by_count > min_rows ? by_count : min_rows;
}

int chunks_of(int64_t rows, int64_t rpc) {
  return rows > 0 ? static_cast<int>(ceil_div(rows, rpc)) : 0;
}

int64_t round_up(int64_t x, int64_t m) { return ceil_div(x, m) * m; }

// Rows go as 16-byte vectors when they hold whole vectors and every pointer is aligned.
bool use_vectors(const FusedCudaOptions& opt, int64_t cols, DType dt,
                 std::initializer_list<const void*> ptrs) {
  if (!opt.vectorized || cols % (16 / dtype_bytes(dt)) != 0) return false;
  for (const void* p : ptrs)
    if ((reinterpret_cast<uintptr_t>(p) & 15u) != 0u) return false;
  return true;
}

FusedArgs base_args(int64_t rows, int64_t cols, DType dt, bool vec) {
  FusedArgs a{};
  a.rows = rows;
  a.cols = cols;
  a.vec = vec;
  a.nvec = static_cast<int>(vec ? cols / (16 / dtype_bytes(dt)) : cols);
  a.inv_cols = 1.0f / static_cast<float>(cols);
  a.keep_scale = 1.0f;
  return a;
}

// Row-team shape of the bdrln kernels: rows of up to kRowTeamMax vectors keep one
// vector per thread in registers, up to twice that two, longer rows take the wide path.
void pick_row_team(FusedArgs* a, const FusedCudaOptions& opt) {
  const int64_t nvec = a->nvec;
  if (!opt.force_wide && nvec <= kRowTeamMax) {
    a->own = 1;
    a->threads = static_cast<int>(round_up(nvec, 32));
  } else if (!opt.force_wide && nvec <= static_cast<int64_t>(kRowTeamMax) * kMaxOwn) {
    a->own = kMaxOwn;
    a->threads = static_cast<int>(round_up(ceil_div(nvec, kMaxOwn), 32));
  } else {
    a->own = 0;
    a->threads = static_cast<int>(nvec < kRowTeamMax ? round_up(nvec, 32) : kRowTeamMax);
  }
}

void set_dropout(FusedArgs* a, const BdrlnCudaProblem& p) {
  a->epsilon = p.epsilon;
  a->dropout = p.dropout > 0.0f ? 1 : 0;
  a->drop_threshold = dropout_threshold(static_cast<double>(p.dropout));
  a->keep_scale = p.dropout > 0.0f ? 1.0f / (1.0f - p.dropout) : 1.0f;
  a->seed_lo = static_cast<uint32_t>(p.seed);
  a->seed_hi = static_cast<uint32_t>(p.seed >> 32);
  a->offset = static_cast<uint32_t>(p.offset);
}

// ------------------------------------------------------------------ column sums, stage 2

struct SumJobs {
  const float* parts[3];  // [nparts][cols] each
  void* out[3];           // [cols] each, of out_dtype
  DType out_dtype[3];
};

template <typename T>
__device__ __forceinline__ void store_one(void* out, int64_t c, float v) {
  static_cast<T*>(out)[c] = from_float<T>(v);
}

// out[c] = sum over chunks k of parts[k][c]: thread row y adds chunks y, y + 8, ... in
// order, then the 8 sums are added in order (a fixed tree: deterministic). No chunks
// (no rows) gives zeros. blockIdx.y selects the job.
__global__ void __launch_bounds__(256)
    column_sums_kernel(const SumJobs jobs, int nparts, int64_t cols) {
  __shared__ float smem[8][33];
  const unsigned j = blockIdx.y;  // selects without indexing the parameter (no local copy)
  const float* parts = j == 0 ? jobs.parts[0] : (j == 1 ? jobs.parts[1] : jobs.parts[2]);
  void* out = j == 0 ? jobs.out[0] : (j == 1 ? jobs.out[1] : jobs.out[2]);
  const DType dt = j == 0 ? jobs.out_dtype[0] : (j == 1 ? jobs.out_dtype[1] : jobs.out_dtype[2]);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < cols)
    for (int k = static_cast<int>(threadIdx.y); k < nparts; k += 8)
      s += parts[static_cast<int64_t>(k) * cols + c];
  smem[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = smem[0][threadIdx.x];
    for (int y = 1; y < 8; ++y) total += smem[y][threadIdx.x];
    if (dt == DType::kFloat16)
      store_one<__half>(out, c, total);
    else if (dt == DType::kBFloat16)
      store_one<__nv_bfloat16>(out, c, total);
    else
      store_one<float>(out, c, total);
  }
}

cudaError_t column_sums(const SumJobs& jobs, int njobs, int nparts, int64_t cols,
                        cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, 32)), static_cast<unsigned>(njobs));
  column_sums_kernel<<<grid, dim3(32, 8), 0, stream>>>(jobs, nparts, cols);
  return cudaGetLastError();
}

// Dispatch on the element type: f<T>() for float, __half or __nv_bfloat16.
template <typename F>
cudaError_t by_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::kFloat32:
      return f(static_cast<float*>(nullptr));
    case DType::kFloat16:
      return f(static_cast<__half*>(nullptr));
    case DType::kBFloat16:
      return f(static_cast<__nv_bfloat16*>(nullptr));
  }
  return cudaErrorInvalidValue;
}

// f<T>() for T = TX, or float when dt is float32: the residual and LayerNorm dtypes of
// bdrln, which are x's dtype or float32 (checked before).
template <typename TX, typename F>
cudaError_t same_or_float(DType dt, F&& f) {
  if (dt == DType::kFloat32) return f(static_cast<float*>(nullptr));
  return f(static_cast<TX*>(nullptr));
}

// launch<TX, TR, TW>(): the bdrln kernels of the problem's three dtypes.
template <typename F>
cudaError_t by_bdrln_dtypes(const BdrlnCudaProblem& p, F&& launch) {
  return by_dtype(p.dtype, [&](auto* tx) {
    using TX = std::remove_pointer_t<decltype(tx)>;
    return same_or_float<TX>(p.residual_dtype, [&](auto* tr) {
      using TR = std::remove_pointer_t<decltype(tr)>;
      return same_or_float<TX>(p.ln_dtype, [&](auto* tw) {
        using TW = std::remove_pointer_t<decltype(tw)>;
        return launch(static_cast<TX*>(nullptr), static_cast<TR*>(nullptr),
                      static_cast<TW*>(nullptr));
      });
    });
  });
}

bool known_dtype(DType dt) {
  return dt == DType::kFloat32 || dt == DType::kFloat16 || dt == DType::kBFloat16;
}

std::string dtype_unsupported(DType dt) {
  if (!known_dtype(dt))
    return "dtype code " + std::to_string(static_cast<int>(dt)) +
           " is not supported on GPU (supported: float16, bfloat16, float32)";
  return "";
}

// bdrln's residual / LayerNorm dtype `dt` next to x's dtype `x`: x's own or float32.
std::string companion_unsupported(const char* what, DType dt, DType x) {
  if (!known_dtype(dt))
    return std::string(what) + " dtype code " + std::to_string(static_cast<int>(dt)) +
           " is not supported on GPU";
  if (dt != x && dt != DType::kFloat32)
    return std::string(what) + " dtype " + dtype_name(dt) + " is not supported with x dtype " +
           dtype_name(x) + " on GPU (supported: x's dtype or float32)";
  return "";
}

}  // namespace

// ------------------------------------------------------------------------- bias_gelu

std::string bias_gelu_cuda_unsupported(const BiasGeluCudaProblem& p) {
  std::ostringstream why;
  const std::string dt = dtype_unsupported(p.dtype);
  if (!dt.empty())
    why << dt;
  else if (p.rows < 0)
    why << "the number of rows (product of x.shape[:-1]) must be >= 0, got " << p.rows;
  else if (p.cols < 0 || p.cols > INT_MAX)
    why << "the feature size x.shape[-1] must be in 0..2^31-1 on GPU, got " << p.cols;
  return why.str();
}

cudaError_t bias_gelu_cuda_fwd(const BiasGeluCudaProblem& p, const void* x, const void* bias,
                               void* y, cudaStream_t stream, const FusedCudaOptions& opt) {
  if (!bias_gelu_cuda_unsupported(p).empty()) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  FusedArgs a = base_args(p.rows, p.cols, p.dtype, use_vectors(opt, p.cols, p.dtype, {x, bias, y}));
  a.x = x;
  a.bias = bias;
  a.y = y;
  return by_dtype(p.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return launch_bias_gelu_fwd<T>(a, stream);
  });
}

size_t bias_gelu_cuda_bwd_workspace_bytes(int64_t rows, int64_t cols) {
  const int64_t n = chunks_of(rows, rows_per_chunk(rows, kGeluChunkRows, kGeluMaxChunks));
  const int64_t bytes = n * (cols > 0 ? cols : 0) * static_cast<int64_t>(sizeof(float));
  return static_cast<size_t>(bytes > 16 ? bytes : 16);
}

cudaError_t bias_gelu_cuda_bwd(const BiasGeluCudaProblem& p, const void* x, const void* bias,
                               const void* dy, void* dx, void* dbias, void* workspace,
                               cudaStream_t stream, const FusedCudaOptions& opt) {
  if (!bias_gelu_cuda_unsupported(p).empty()) return cudaErrorInvalidValue;
  if (p.cols == 0) return cudaSuccess;
  if (p.rows == 0)  // dbias is a sum over no rows
    return cudaMemsetAsync(dbias, 0, static_cast<size_t>(p.cols) * dtype_bytes(p.dtype), stream);
  FusedArgs a =
      base_args(p.rows, p.cols, p.dtype, use_vectors(opt, p.cols, p.dtype, {x, bias, dy, dx}));
  a.x = x;
  a.bias = bias;
  a.dy = dy;
  a.dx = dx;
  a.partials = static_cast<float*>(workspace);
  a.rows_per_chunk = rows_per_chunk(p.rows, kGeluChunkRows, kGeluMaxChunks);
  a.nchunks = chunks_of(p.rows, a.rows_per_chunk);
  const SumJobs jobs{
      {a.partials, nullptr, nullptr}, {dbias, nullptr, nullptr}, {p.dtype, p.dtype, p.dtype}};
  return by_dtype(p.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const cudaError_t e = launch_bias_gelu_bwd<T>(a, stream);
    return e != cudaSuccess ? e : column_sums(jobs, 1, a.nchunks, p.cols, stream);
  });
}

// ------------------------------------------------------------------------- bdrln

std::string bdrln_cuda_unsupported(const BdrlnCudaProblem& p) {
  std::string dt = dtype_unsupported(p.dtype);
  if (dt.empty()) dt = companion_unsupported("residual", p.residual_dtype, p.dtype);
  if (dt.empty()) dt = companion_unsupported("ln_weight/ln_bias", p.ln_dtype, p.dtype);
  if (!dt.empty()) return dt;
  if (p.cols > INT_MAX) {
    std::ostringstream why;
    why << "the normalised size x.shape[-1] must be below 2^31 on GPU, got " << p.cols;
    return why.str();
  }
  return bdrln_problem_unsupported(p.rows, p.cols, p.dropout, p.epsilon);
}

cudaError_t bdrln_cuda_fwd(const BdrlnCudaProblem& p, const void* x, const void* bias,
                           const void* residual, const void* ln_weight, const void* ln_bias,
                           void* y, float* mean, float* rstd, cudaStream_t stream,
                           const FusedCudaOptions& opt) {
  if (!bdrln_cuda_unsupported(p).empty()) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  FusedArgs a =
      base_args(p.rows, p.cols, p.dtype,
                use_vectors(opt, p.cols, p.dtype, {x, bias, residual, ln_weight, ln_bias, y}));
  a.x = x;
  a.bias = bias;
  a.residual = residual;
  a.ln_weight = ln_weight;
  a.ln_bias = ln_bias;
  a.y = y;
  a.mean = mean;
  a.rstd = rstd;
  set_dropout(&a, p);
  pick_row_team(&a, opt);
  return by_bdrln_dtypes(p, [&](auto* tx, auto* tr, auto* tw) {
    return launch_bdrln_fwd<std::remove_pointer_t<decltype(tx)>,
                            std::remove_pointer_t<decltype(tr)>,
                            std::remove_pointer_t<decltype(tw)>>(a, stream);
  });
}

namespace {
// Workspace of the bdrln backward: 3 planes of column partials, then per-row sums.
int64_t ln_partial_bytes(int64_t rows, int64_t cols) {
  const int64_t n = chunks_of(rows, rows_per_chunk(rows, kLnChunkRows, kLnMaxChunks));
  return round_up(3 * n * cols * static_cast<int64_t>(sizeof(float)), 16);
}
}  // namespace

size_t bdrln_cuda_bwd_workspace_bytes(int64_t rows, int64_t cols) {
  rows = rows > 0 ? rows : 0;
  cols = cols > 0 ? cols : 0;
  const int64_t bytes = ln_partial_bytes(rows, cols) + rows * static_cast<int64_t>(sizeof(float2));
  return static_cast<size_t>(bytes > 16 ? bytes : 16);
}

cudaError_t bdrln_cuda_bwd(const BdrlnCudaProblem& p, const void* x, const void* bias,
                           const void* residual, const void* ln_weight, const float* mean,
                           const float* rstd, const void* dy, void* dx, void* dresidual,
                           void* dbias, void* dln_weight, void* dln_bias, void* workspace,
                           cudaStream_t stream, const FusedCudaOptions& opt) {
  if (!bdrln_cuda_unsupported(p).empty()) return cudaErrorInvalidValue;
  if (p.rows == 0) {  // the vector gradients are sums over no rows
    const std::pair<void*, DType> outs[] = {
        {dbias, p.dtype}, {dln_weight, p.ln_dtype}, {dln_bias, p.ln_dtype}};
    for (const auto& out : outs) {
      const cudaError_t e = cudaMemsetAsync(
          out.first, 0, static_cast<size_t>(p.cols) * dtype_bytes(out.second), stream);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }
  const bool vec =
      use_vectors(opt, p.cols, p.dtype, {x, bias, residual, ln_weight, dy, dx, dresidual});
  FusedArgs a = base_args(p.rows, p.cols, p.dtype, vec);
  a.x = x;
  a.bias = bias;
  a.residual = residual;
  a.ln_weight = ln_weight;
  a.mean = const_cast<float*>(mean);
  a.rstd = const_cast<float*>(rstd);
  a.dy = dy;
  a.dx = dx;
  a.dresidual = dresidual;
  set_dropout(&a, p);
  pick_row_team(&a, opt);
  a.rows_per_chunk = rows_per_chunk(p.rows, kLnChunkRows, kLnMaxChunks);
  a.nchunks = chunks_of(p.rows, a.rows_per_chunk);
  a.partials = static_cast<float*>(workspace);
  a.row_sums =
      reinterpret_cast<float2*>(static_cast<char*>(workspace) + ln_partial_bytes(p.rows, p.cols));
  const int64_t plane = static_cast<int64_t>(a.nchunks) * p.cols;
  const SumJobs jobs{{a.partials, a.partials + plane, a.partials + 2 * plane},
                     {dbias, dln_weight, dln_bias},
                     {p.dtype, p.ln_dtype, p.ln_dtype}};
  return by_bdrln_dtypes(p, [&](auto* tx, auto* tr, auto* tw) {
    const cudaError_t e =
        launch_bdrln_bwd<std::remove_pointer_t<decltype(tx)>, std::remove_pointer_t<decltype(tr)>,
                         std::remove_pointer_t<decltype(tw)>>(a, stream);
    return e != cudaSuccess ? e : column_sums(jobs, 3, a.nchunks, p.cols, stream);
  });
}

}  // namespace cuda
}  // namespace paddle_unpad
