// Launch parameters shared by the FMHA host code (fmha_cuda.cu) and the kernels
// (fmha_fwd.cuh, fmha_bwd.cuh). Internal to kernels/cuda.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace paddle_unpad {
namespace cuda {

struct SeqSpan {
  int32_t start;  // first packed row of the sequence
  int32_t len;    // its length (> 0: empty sequences are never launched)
};

// The sequences of one launch travel in the kernel's parameter block (4 KB limit):
// no device copy of cu_seqlens and no host-to-device transfer is needed.
constexpr int kMaxSeqsPerLaunch = 440;

struct FmhaParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;       // [T, H]
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  float* delta;     // [T, H] backward workspace: rowsum(dout * out)
  int heads;        // row stride of every [T, H, D] tensor is heads * head_dim
  int head_dim;
  float scale;       // of q k^T
  float scale_log2;  // scale * log2(e)
  float* dq_accum;   // [T, H, D] fp32 scratch of the one-pass backward's dQ tiles
  int* dq_tiles;  // [T, H, kBwdDqWarps, 2] zeroed counters of those tiles (at a tile's first row)
  int dropout;  // 0 or 1
  uint32_t drop_threshold_hi;  // threshold16 << 16: a 16-bit draw below threshold16 is dropped
  float keep_scale;  // 1 / (1 - p)
  uint32_t seed_lo, seed_hi, offset;
  int num_seqs;  // entries used in seqs
  int max_len;  // longest sequence of this launch (sizes the grid)
  SeqSpan seqs[kMaxSeqsPerLaunch];
};
static_assert(sizeof(FmhaParams) <= 4000, "FmhaParams must fit the 4 KB kernel parameter limit");

// Forward tile configurations (query rows per block); the host picks one per group.
enum FwdTile : int { kFwdTileM64 = 0, kFwdTileM128 = 1 };
constexpr int fwd_tile_rows(int tile) { return tile == kFwdTileM64 ? 64 : 128; }
constexpr int kFwdBlockN = 64;  // keys per step of the forward kernel (every tile)

// The deterministic backward's dQ kernel owns kBwdQueriesPerBlock queries and walks the
// keys (the key-block kernel's blocking is per head size, in fmha_bwd.cuh).
constexpr int kBwdQueriesPerBlock = 64;
// Warps of the one-pass backward's key-block kernel that take a dQ tile each.
constexpr int kBwdDqWarps = 4;

template <typename T>
cudaError_t launch_fmha_fwd(const FmhaParams& p, int tile, cudaStream_t stream);

// delta[r] = sum_d dout[r, d] * out[r, d] over all rows r < rows (= T * H), and the dQ tile
// counters = 0 when p.dq_tiles is set.
template <typename T>
cudaError_t launch_fmha_bwd_prep(const FmhaParams& p, int64_t rows, cudaStream_t stream);

// dK, dV and dQ of the sequences in p: in one pass (dQ tiles through p.dq_accum), or in two
// kernels without atomics (deterministic). delta (and the zeroed tile counters) must be
// ready on the stream.
template <typename T>
cudaError_t launch_fmha_bwd(const FmhaParams& p, bool deterministic, cudaStream_t stream);

}  // namespace cuda
}  // namespace paddle_unpad
