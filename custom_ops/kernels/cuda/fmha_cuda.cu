// Host side of the CUDA FMHA: argument checks, the grouped multi-stream launch, and
// dispatch by dtype to the kernels instantiated in fmha_{fwd,bwd}_{fp16,bf16}.cu.
//
// Grouped launch (after arXiv 2208.08124, generalised): the host copy of cu_seqlens is
// split into length buckets (<= 64, 128, 256, 512, 1024, 2048, longer). Each bucket is
// launched with the forward tile configuration that wastes the fewest padded query rows
// for its lengths, and with a grid sized to its own longest sequence (so short
// sequences no longer pay for the empty blocks of long ones). Buckets are spread over
// the caller's stream plus a small per-device pool of streams (largest first, onto the
// least-loaded stream), forked from and joined back to the caller's stream with events:
// everything after the call on the caller's stream sees the results, as with one launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <vector>

#include "kernels/common/cu_seqlens_checks.h"
#include "kernels/common/philox.h"
#include "kernels/cuda/fmha_cuda.cuh"
#include "kernels/cuda/fmha_params.cuh"

namespace paddle_unpad {
namespace cuda {

namespace {

constexpr int kMaxStreams = 16;

struct Group {
  std::vector<SeqSpan> seqs;  // longest first
  int tile = kFwdTileM128;
  double cost = 0.0;
};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Padded query rows the forward kernel computes for these sequences with a tile.
int64_t padded_rows(const std::vector<SeqSpan>& seqs, int tile) {
  int64_t r = 0;
  for (const SeqSpan& s : seqs) r += round_up(s.len, fwd_tile_rows(tile));
  return r;
}

std::vector<Group> plan_groups(const FmhaCudaProblem& p, bool grouping) {
  std::vector<SeqSpan> spans;
  spans.reserve(static_cast<size_t>(p.batch));
  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t len = p.cu_seqlens[b + 1] - p.cu_seqlens[b];
    if (len > 0) spans.push_back({p.cu_seqlens[b], len});
  }
  std::stable_sort(spans.begin(), spans.end(),
                   [](const SeqSpan& a, const SeqSpan& b) { return a.len > b.len; });
  std::vector<Group> groups;
  if (spans.empty()) return groups;
  auto cost_of = [](const std::vector<SeqSpan>& seqs) {
    double c = 0.0;
    for (const SeqSpan& s : seqs) c += static_cast<double>(s.len) * round_up(s.len, kFwdBlockN);
    return c;
  };
  if (!grouping) {
    Group g;
    g.seqs = std::move(spans);
    g.tile = kFwdTileM128;
    g.cost = cost_of(g.seqs);
    groups.push_back(std::move(g));
    return groups;
  }
  static const int32_t kEdges[] = {64, 128, 256, 512, 1024, 2048, INT32_MAX};
  for (size_t e = 0; e < sizeof(kEdges) / sizeof(kEdges[0]); ++e) {
    const int32_t lo = e == 0 ? 0 : kEdges[e - 1], hi = kEdges[e];
    Group g;
    for (const SeqSpan& s : spans)
      if (s.len > lo && s.len <= hi) g.seqs.push_back(s);
    if (g.seqs.empty()) continue;
    // The bigger tile reuses each K/V tile for twice the rows; take it unless it pads
    // noticeably more query rows than the smaller one.
    const int64_t r64 = padded_rows(g.seqs, kFwdTileM64), r128 = padded_rows(g.seqs, kFwdTileM128);
    g.tile = r128 * 8 <= r64 * 9 ? kFwdTileM128 : kFwdTileM64;
    g.cost = cost_of(g.seqs);
    groups.push_back(std::move(g));
  }
  std::stable_sort(groups.begin(), groups.end(),
                   [](const Group& a, const Group& b) { return a.cost > b.cost; });
  return groups;
}

// Per-device pool of side streams and the events that fork and join them. The mutex is
// held while a call enqueues, so the reused events are never recorded by two calls at
// once (a wait captures the event's state when it is enqueued).
struct StreamPool {
  std::mutex mu;
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> join;
  cudaEvent_t fork = nullptr;
};

StreamPool* pool_for_current_device(cudaError_t* err) {
  static std::mutex registry_mu;
  static std::vector<std::unique_ptr<StreamPool>> pools;
  int dev = 0;
  *err = cudaGetDevice(&dev);
  if (*err != cudaSuccess) return nullptr;
  std::lock_guard<std::mutex> lock(registry_mu);
  if (static_cast<int>(pools.size()) <= dev) pools.resize(static_cast<size_t>(dev) + 1);
  if (!pools[dev]) pools[dev].reset(new StreamPool());
  return pools[dev].get();
}

// Make sure the pool has n side streams (and their events). Caller holds pool->mu.
cudaError_t grow_pool(StreamPool* pool, int n) {
  if (!pool->fork) {
    const cudaError_t e = cudaEventCreateWithFlags(&pool->fork, cudaEventDisableTiming);
    if (e != cudaSuccess) return e;
  }
  while (static_cast<int>(pool->streams.size()) < n) {
    cudaStream_t s;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) return e;
    cudaEvent_t ev;
    e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) return e;
    pool->streams.push_back(s);
    pool->join.push_back(ev);
  }
  return cudaSuccess;
}

FmhaParams base_params(const FmhaCudaProblem& p, const void* q, const void* k, const void* v) {
  FmhaParams fp;
  std::memset(&fp, 0, sizeof(fp));
  fp.q = q;
  fp.k = k;
  fp.v = v;
  fp.heads = static_cast<int>(p.heads);
  fp.head_dim = static_cast<int>(p.head_dim);
  fp.scale = p.scale;
  fp.scale_log2 = p.scale * 1.4426950408889634f;
  fp.dropout = p.dropout > 0.0f ? 1 : 0;
  fp.drop_threshold_hi = dropout_threshold(static_cast<double>(p.dropout), kAttentionDrawBits)
                         << 16;
  fp.keep_scale = p.dropout > 0.0f ? 1.0f / (1.0f - p.dropout) : 1.0f;
  fp.seed_lo = static_cast<uint32_t>(p.seed);
  fp.seed_hi = static_cast<uint32_t>(p.seed >> 32);
  fp.offset = static_cast<uint32_t>(p.offset);
  return fp;
}

// Launch `fn(params, tile, stream)` for every chunk of every group; groups spread over
// the caller's stream and the pool.
template <typename Fn>
cudaError_t run_groups(const std::vector<Group>& groups, const FmhaParams& base, int num_streams,
                       cudaStream_t stream, Fn fn) {
  auto launch_group = [&](const Group& g, cudaStream_t st) -> cudaError_t {
    FmhaParams fp = base;
    for (size_t i0 = 0; i0 < g.seqs.size(); i0 += kMaxSeqsPerLaunch) {
      const size_t n = std::min(g.seqs.size() - i0, static_cast<size_t>(kMaxSeqsPerLaunch));
      std::copy(g.seqs.begin() + i0, g.seqs.begin() + i0 + n, fp.seqs);
      fp.num_seqs = static_cast<int>(n);
      fp.max_len = g.seqs[i0].len;  // longest first
      const cudaError_t e = fn(fp, g.tile, st);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  };
  const int lanes =
      std::max(1, std::min({num_streams, kMaxStreams, static_cast<int>(groups.size())}));
  if (lanes == 1) {
    for (const Group& g : groups) {
      const cudaError_t e = launch_group(g, stream);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }
  cudaError_t e;
  StreamPool* pool = pool_for_current_device(&e);
  if (!pool) return e;
  std::lock_guard<std::mutex> lock(pool->mu);
  e = grow_pool(pool, lanes - 1);
  if (e != cudaSuccess) return e;
  // Lane 0 is the caller's stream; lanes 1.. are pool streams. Largest groups first,
  // each onto the lane with the least work so far.
  std::vector<double> load(static_cast<size_t>(lanes), 0.0);
  std::vector<int> lane_of(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    const int l = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    lane_of[i] = l;
    load[static_cast<size_t>(l)] += groups[i].cost;
  }
  e = cudaEventRecord(pool->fork, stream);
  if (e != cudaSuccess) return e;
  for (int l = 1; l < lanes; ++l) {
    e = cudaStreamWaitEvent(pool->streams[static_cast<size_t>(l - 1)], pool->fork, 0);
    if (e != cudaSuccess) return e;
  }
  cudaError_t first = cudaSuccess;
  for (size_t i = 0; i < groups.size() && first == cudaSuccess; ++i) {
    const int l = lane_of[i];
    first = launch_group(groups[i], l == 0 ? stream : pool->streams[static_cast<size_t>(l - 1)]);
  }
  // Join even after a failed launch, so the caller's stream never runs ahead of work
  // already queued on a side stream.
  for (int l = 1; l < lanes; ++l) {
    e = cudaEventRecord(pool->join[static_cast<size_t>(l - 1)],
                        pool->streams[static_cast<size_t>(l - 1)]);
    if (e == cudaSuccess)
      e = cudaStreamWaitEvent(stream, pool->join[static_cast<size_t>(l - 1)], 0);
    if (e != cudaSuccess && first == cudaSuccess) first = e;
  }
  return first;
}

}  // namespace

std::string fmha_cuda_unsupported(const FmhaCudaProblem& p) {
  std::ostringstream why;
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    why << "q/k/v dtype float32 is not supported on GPU (supported: float16, bfloat16)";
  } else if (p.head_dim != 32 && p.head_dim != 64 && p.head_dim != 128) {
    why << "head size (q.shape[2]) " << p.head_dim
        << " is not supported on GPU: supported are 32, 64, 128";
  } else if (p.heads < 1 || p.heads > 65535) {
    why << "number of heads (q.shape[1]) must be in 1..65535 on GPU, got " << p.heads;
  } else if (!(p.dropout >= 0.0f && p.dropout < 1.0f)) {
    why << "dropout must be in [0, 1), got " << p.dropout;
  } else if (p.total < 0 || p.total > INT32_MAX) {
    why << "total tokens (q.shape[0]) must be below 2^31 on GPU, got " << p.total;
  } else {
    // No max_seqlen here: each launch is sized from the lengths themselves.
    why << cu_seqlens_invalid(p.cu_seqlens, p.batch, p.total, INT32_MAX);
  }
  return why.str();
}

std::string fmha_cuda_misaligned(const void* const* ptrs, const char* const* names, int n) {
  std::ostringstream why;
  for (int i = 0; i < n; ++i)
    if (ptrs[i] && (reinterpret_cast<uintptr_t>(ptrs[i]) % 16) != 0) {
      why << names[i] << " must be 16-byte aligned on GPU (its data pointer is not)";
      break;
    }
  return why.str();
}

cudaError_t fmha_cuda_fwd(const FmhaCudaProblem& p, const FmhaLaunchOptions& opt, const void* q,
                          const void* k, const void* v, void* out, float* lse,
                          cudaStream_t stream) {
  if (!fmha_cuda_unsupported(p).empty()) return cudaErrorInvalidValue;
  FmhaParams base = base_params(p, q, k, v);
  base.out = out;
  base.lse = lse;
  const std::vector<Group> groups = plan_groups(p, opt.grouping);
  const int streams = opt.grouping ? opt.num_streams : 1;
  if (p.dtype == DType::kFloat16)
    return run_groups(groups, base, streams, stream, launch_fmha_fwd<__half>);
  return run_groups(groups, base, streams, stream, launch_fmha_fwd<__nv_bfloat16>);
}

namespace {
// The backward's workspace, in floats: delta [T, H]; then, for the one-pass backward, the dQ
// tile counters [T, H, kBwdDqWarps, 2] and the dQ accumulator [T, H, D], each starting on a
// 128-byte line (the accumulator's lines are dropped from L2 one by one).
int64_t line_floats(int64_t n) { return round_up(std::max<int64_t>(n, 1), 32); }
int64_t tiles_at(int64_t total, int64_t heads) { return line_floats(total * heads); }
int64_t accum_at(int64_t total, int64_t heads) {
  return tiles_at(total, heads) + line_floats(total * heads * kBwdDqWarps * 2);
}
}  // namespace

size_t fmha_cuda_bwd_workspace_bytes(int64_t total, int64_t heads, int64_t head_dim,
                                     bool deterministic) {
  // + one line: the accumulator is moved up to the next 128-byte boundary
  const int64_t floats = deterministic
                             ? tiles_at(total, heads)
                             : accum_at(total, heads) + line_floats(total * heads * head_dim) + 32;
  return static_cast<size_t>(floats) * sizeof(float);
}

cudaError_t fmha_cuda_bwd(const FmhaCudaProblem& p, const FmhaLaunchOptions& opt, const void* q,
                          const void* k, const void* v, const void* out, const float* lse,
                          const void* dout, void* dq, void* dk, void* dv, void* workspace,
                          cudaStream_t stream) {
  if (!fmha_cuda_unsupported(p).empty()) return cudaErrorInvalidValue;
  FmhaParams base = base_params(p, q, k, v);
  base.out = const_cast<void*>(out);
  base.lse = const_cast<float*>(lse);
  base.dout = dout;
  base.dq = dq;
  base.dk = dk;
  base.dv = dv;
  base.delta = static_cast<float*>(workspace);
  if (!opt.deterministic) {
    base.dq_tiles = reinterpret_cast<int*>(base.delta + tiles_at(p.total, p.heads));
    const uintptr_t at = reinterpret_cast<uintptr_t>(base.delta + accum_at(p.total, p.heads));
    base.dq_accum = reinterpret_cast<float*>((at + 127) & ~uintptr_t{127});
  }
  const int64_t rows = p.total * p.heads;
  const bool f16 = p.dtype == DType::kFloat16;
  cudaError_t e = f16 ? launch_fmha_bwd_prep<__half>(base, rows, stream)
                      : launch_fmha_bwd_prep<__nv_bfloat16>(base, rows, stream);
  if (e != cudaSuccess) return e;
  const std::vector<Group> groups = plan_groups(p, opt.grouping);
  const int streams = opt.grouping ? opt.num_streams : 1;
  const bool det = opt.deterministic;
  auto bwd16 = [det](const FmhaParams& fp, int, cudaStream_t st) {
    return launch_fmha_bwd<__half>(fp, det, st);
  };
  auto bwdbf = [det](const FmhaParams& fp, int, cudaStream_t st) {
    return launch_fmha_bwd<__nv_bfloat16>(fp, det, st);
  };
  return f16 ? run_groups(groups, base, streams, stream, bwd16)
             : run_groups(groups, base, streams, stream, bwdbf);
}

}  // namespace cuda
}  // namespace paddle_unpad
