// FMHA backward kernels, included by fmha_bwd_{fp16,bf16}.cu. Two passes, chosen per call
// (FmhaLaunchOptions::deterministic):
//
// One pass (the default), after FlashAttention-2's backward:
//   1. prep: delta = rowsum(dO * O) [T, H] (fp32 workspace), dQ tile counters = 0;
//   2. key-block kernel, one block per (key block of 16 * kWarps keys, sequence, head): warp w
//      owns 16 keys, keeps their K and V fragments, dK and dV in registers, and walks the
//      query blocks of kBlockM queries (double-buffered Q / dO tiles):
//        S = Q K^T, dP = dO V^T                  (rows = queries, as in the forward)
//        P = exp2(S * scale_log2 - lse_log2), Z = the dropout mask from the lane's own Philox
//        calls (made once per tile), dS = P (dP Z - delta)
//        dV += (P Z)^T dO, dK += dS^T Q           (P Z and dS transposed in registers)
//        dS -> shared memory; dQ of the query block = dS K by four warps, each tile added
//        into an fp32 accumulator (dq_tile_out: the first key block to arrive stores its
//        part, the others add theirs with atomics, the last converts the tile into dq).
//   Five matmuls per tile. The atomics add in the order the blocks arrive, so dQ's last bits
//   may differ between runs (dK and dV never do). The accumulator of the tiles in flight
//   stays in L2 (no zeroing pass, no conversion pass, its lines dropped unwritten).
// Deterministic: prep computes delta only; the same key-block kernel without dS / dQ, then a
// dQ kernel per (query block, sequence, head) that recomputes S and dP for its 64 queries while
// it walks the key blocks (seven matmuls per tile); every output element is written by one
// thread in a fixed order, so reruns are bitwise identical.
//
// Why this shape (per 64 x 64 tile at D = 64, sm_90; benchmarks/kernel_static.py has the
// measured numbers): with warps owning 16 keys the key-side operands (K, V as B fragments)
// never leave registers, and S in the forward's row layout lets each lane make the dropout
// calls of its own elements (kernels/common/philox.h). Four of the five matmuls stream one
// 16-row operand from shared memory (8 B per attention element each); dQ needs dS of all
// the block's keys, so it goes through shared memory once, and 32 x 32 dQ tiles on four
// warps read 7.8 B per element where 16 x 32 tiles on eight would read 11.7. Key blocks of
// 128 halve the dQ atomics against blocks of 64 (one float2 RED per 8 elements at D = 64).
// Registers (about 225 of 255 at eight warps, one block per SM with 92 KB of shared memory)
// leave no room for a second block; the eight warps' independent MMA chains hide latency.
#pragma once
#include "kernels/cuda/fmha_fwd.cuh"

namespace paddle_unpad {
namespace cuda {

// delta[r] = sum_d dout[r, d] * out[r, d] for every row r < rows (= T * H), and, when
// dq_tiles is set, the kBwdDqWarps counter pairs of row r = 0 (the one-pass backward's dQ tiles).
template <typename T, int D>
__global__ void __launch_bounds__(256)
    fmha_bwd_prep_kernel(const T* __restrict__ out, const T* __restrict__ dout,
                         float* __restrict__ delta, int* __restrict__ dq_tiles, int64_t rows) {
  constexpr int kLanes = D / 8;  // threads per row, 8 elements (16 bytes) each
  constexpr int kRowsPerBlock = 256 / kLanes;
  using Tr = ElemTraits<T>;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  const int ch = static_cast<int>(threadIdx.x) % kLanes;
  float acc = 0.0f;
  if (r < rows) {
    const uint4 a = *reinterpret_cast<const uint4*>(out + r * D + ch * 8);
    const uint4 b = *reinterpret_cast<const uint4*>(dout + r * D + ch * 8);
    const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = Tr::unpack(av[i]), y = Tr::unpack(bv[i]);
      acc += x.x * y.x + x.y * y.y;
    }
    static_assert(kBwdDqWarps == 4, "two int4 of counters per row");
    if (dq_tiles != nullptr && ch < 2)
      reinterpret_cast<int4*>(dq_tiles + r * 2 * kBwdDqWarps)[ch] = make_int4(0, 0, 0, 0);
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (r < rows && ch == 0) delta[r] = acc;
}

// A warp's part of the dQ of one query block (acc: kM16 x kN8 accumulator tiles; rows from
// packed row t_first, `rows` of them existing; columns col0..), added into dq. Every key block
// of the sequence adds a part to the same tile, in any order; the tile's two counters (parts
// arrived, parts written) let the first part to arrive be stored into
// dq_accum as it is (no zeroing pass), the others be added with atomics once that store is
// visible, and the last part's warp convert the finished tile into dq and drop its lines from
// L2 unwritten (no conversion pass; the accumulator of the tiles in flight never reaches
// DRAM). Deadlock-free: only the first arrival is waited for, and it is running and waits for
// nothing. With one key block its part is the tile: straight into dq.
template <typename T, int D, int kM16, int kN8>
__device__ __forceinline__ void dq_tile_out(const FmhaParams& p, const float (&acc)[kM16][kN8][4],
                                            int* counter, int nkb, int64_t t_first, int rows,
                                            int col0, int h, int lane) {
  using Tr = ElemTraits<T>;
  const int g = lane / 4, c = lane % 4;
  auto offset = [&](int r) { return ((t_first + r) * p.heads + h) * D + col0 + 2 * c; };
  auto to_dq = [&](int r, int n, float a, float b) {
    *reinterpret_cast<uint32_t*>(static_cast<T*>(p.dq) + offset(r) + n * 8) =
        Tr::pack(a * p.scale, b * p.scale);
  };
  if (nkb == 1) {
#pragma unroll
    for (int m = 0; m < kM16; ++m)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        if (m * 16 + g + 8 * i < rows)
#pragma unroll
          for (int n = 0; n < kN8; ++n)
            to_dq(m * 16 + g + 8 * i, n, acc[m][n][2 * i], acc[m][n][2 * i + 1]);
    return;
  }
  int arrival = 0;
  if (lane == 0) arrival = atomicAdd(counter, 1);
  arrival = __shfl_sync(0xffffffffu, arrival, 0);
  if (arrival != 0) {
    if (lane == 0) wait_nonzero(counter + 1);  // the first part is stored
    __syncwarp();
    __threadfence();
  }
#pragma unroll
  for (int m = 0; m < kM16; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i)
      if (m * 16 + g + 8 * i < rows) {
        float* dst = p.dq_accum + offset(m * 16 + g + 8 * i);
#pragma unroll
        for (int n = 0; n < kN8; ++n) {
          if (arrival == 0)
            *reinterpret_cast<float2*>(dst + n * 8) =
                make_float2(acc[m][n][2 * i], acc[m][n][2 * i + 1]);
          else
            red_add_f32x2(dst + n * 8, acc[m][n][2 * i], acc[m][n][2 * i + 1]);
        }
      }
  __threadfence();  // this lane's part is visible before the count says so
  __syncwarp();
  int written = 0;
  if (lane == 0) written = atomicAdd(counter + 1, 1);
  written = __shfl_sync(0xffffffffu, written, 0);
  if (written != nkb - 1) return;
  __threadfence();  // every other part is visible: read them from L2, past this SM's L1
#pragma unroll
  for (int m = 0; m < kM16; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i)
      if (m * 16 + g + 8 * i < rows) {
        const float* src = p.dq_accum + offset(m * 16 + g + 8 * i);
#pragma unroll
        for (int n = 0; n < kN8; ++n) {
          const float2 v = __ldcg(reinterpret_cast<const float2*>(src + n * 8));
          to_dq(m * 16 + g + 8 * i, n, v.x, v.y);
        }
      }
  static_assert(kN8 * 8 * sizeof(float) % 128 == 0, "a tile row is whole 128-byte lines");
  __syncwarp();  // every lane has read the tile
  for (int r = lane; r < kM16 * 16 && r < rows; r += 32)
#pragma unroll
    for (int l = 0; l < kN8 * 8 * static_cast<int>(sizeof(float)) / 128; ++l)
      discard_l2_line(p.dq_accum + ((t_first + r) * p.heads + h) * D + col0 + l * 32);
}

// The 16 x 16 A fragment of the transpose of the 16 x 16 block whose packed rows t holds
// ([n-tile of 8 columns][rows g / g + 8], as accumulators pack): a0 = columns 0-7 x rows 0-7
// = the transpose of t[0][0], a1 = columns 8-15 x rows 0-7, a2 = columns 0-7 x rows 8-15.
__device__ __forceinline__ void transposed_a(uint32_t (&a)[4], const uint32_t (&t)[2][2]) {
  a[0] = movmatrix_trans(t[0][0]);
  a[1] = movmatrix_trans(t[1][0]);
  a[2] = movmatrix_trans(t[0][1]);
  a[3] = movmatrix_trans(t[1][1]);
}

// The wait at the top of a step of a double-buffered loop: issues the next step's loads
// (load_next, one commit group) when there is a next step, then waits for this step's.
template <typename F>
__device__ __forceinline__ void wait_stage(bool has_next, F&& load_next) {
  if (has_next) {
    load_next();
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
}

// P Z and dS of one m-tile (16 queries from local row r0 - g, this warp's 16 keys) from its S
// and dP accumulators, packed for the next products ([n-tile][rows g / g + 8]): P = exp2(S *
// scale_log2 - lse_log2) (keys past the end: 0; queries past it have lse = +inf), Z the
// dropout mask of the tile's lane-owned Philox call (made once: it drops from P Z and from
// dP Z alike), dS = P (dP Z - delta). The 1/(1-p) of P Z is left to dV's epilogue. ap and as:
// the transposes of P Z and dS as A fragments (the left operands of dV += (P Z)^T dO and
// dK += dS^T Q). pz (P Z packed) is the caller's scratch, declared with ap and as before them: as
// a local of this function it would renumber the key-block kernel's values, and ptxas would
// allocate its registers differently.
template <typename T, bool kDropout>
__device__ __forceinline__ void grad_tile(const FmhaParams& p, float (&sc)[2][4], float (&dp)[2][4],
                                          const float* lse_s, const float* dl_s, int r0, int kvalid,
                                          int c, uint32_t key16, uint32_t t_pair, uint32_t h,
                                          uint32_t (&pz)[2][2], uint32_t (&ds)[2][2],
                                          uint32_t (&ap)[4], uint32_t (&as)[4]) {
  using Tr = ElemTraits<T>;
  const float lse2[2] = {lse_s[r0], lse_s[r0 + 8]}, dl[2] = {dl_s[r0], dl_s[r0 + 8]};
  float pr[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = n * 8 + 2 * c + (e & 1);
      pr[n][e] = col < kvalid ? fast_exp2(sc[n][e] * p.scale_log2 - lse2[e >> 1]) : 0.0f;
      sc[n][e] = pr[n][e];
    }
  if (kDropout) {
    const Philox4 r = dropout_call(p, key16, t_pair, h);
    apply_dropout(sc[0], sc[1], r, p.drop_threshold_hi);
    apply_dropout(dp[0], dp[1], r, p.drop_threshold_hi);
  }
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    float d[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      d[e] = pr[n][e] * ((kDropout ? dp[n][e] * p.keep_scale : dp[n][e]) - dl[e >> 1]);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      pz[n][i] = Tr::pack(sc[n][2 * i], sc[n][2 * i + 1]);
      ds[n][i] = Tr::pack(d[2 * i], d[2 * i + 1]);
    }
  }
  transposed_a(ap, pz);
  transposed_a(as, ds);
}

// How the key-block kernel's dQ of one query block (kBlockM x D) is split: four warps, each a
// kM x kN tile (32 x 32 where the block allows: the fewest shared-memory reads per element).
template <int D, int kBlockM>
struct BwdDqTiling {
  static constexpr int kWarps = kBwdDqWarps;
  static constexpr int kM = kBlockM * D >= 4 * 32 * 32 ? 32 : 16;
  static constexpr int kN = kBlockM * D / (kWarps * kM);
  static constexpr int kRowTiles = kBlockM / kM;
  static_assert(kN % 16 == 0 && kRowTiles * (D / kN) == kWarps, "dQ tiling must cover the block");
};

// dK, dV, and (kDq) dQ through dq_accum. kWarps * 16 keys per block; kBlockM queries per
// step; kKVInRegs: keep this warp's K and V fragments in registers across the query loop
// (else reload them from shared memory each step); kDropout: a separate instantiation, so
// that the kernel without dropout holds no Philox code.
template <typename T, int D, int kWarps, int kBlockM, bool kKVInRegs, bool kDropout, bool kDq>
__global__ void __launch_bounds__(kWarps * 32)
    fmha_bwd_kv_kernel(const __grid_constant__ FmhaParams p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kBlockN = 16 * kWarps;
  constexpr int kStride = D + 8;
  constexpr int kSStride = kBlockN + 8;  // dS rows in shared memory
  constexpr int kKT = D / 16;
  constexpr int kMT = kBlockM / 16;  // m-tiles of 16 queries per step
  constexpr int kDT = D / 8;
  constexpr int kFr = kKVInRegs ? kKT : 1;
  // Q and dO transposed in registers (movmatrix) for the dV / dK products: the A fragments of
  // one m-tile (D / 4 registers each) must stay live until then, which the registers of D = 128
  // (dK, dV: 128 of them) do not allow; D = 128 reads the tiles again, transposed, instead.
  constexpr bool kMovT = D <= 64;
  static_assert(kMovT == kKVInRegs, "the m-tile-at-a-time step takes K and V from registers");
  using Tr = ElemTraits<T>;
  using Dq = BwdDqTiling<D, kBlockM>;
  static_assert(Dq::kWarps <= kWarps, "dQ needs four warps");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * kStride;
  T* sQ = sV + kBlockN * kStride;    // [2][kBlockM][kStride]
  T* sdO = sQ + 2 * kBlockM * kStride;  // [2][kBlockM][kStride]
  float* sLse = reinterpret_cast<float*>(sdO + 2 * kBlockM * kStride);  // [2][kBlockM], * log2(e)
  float* sDelta = sLse + 2 * kBlockM;  // [2][kBlockM]
  T* sdS = reinterpret_cast<T*>(sDelta + 2 * kBlockM);  // [kBlockM][kSStride], kDq only

  const SeqSpan seq = p.seqs[blockIdx.y];
  const int s = seq.len, j0 = static_cast<int>(blockIdx.x) * kBlockN;
  if (j0 >= s) return;
  const VarlenTile<T, D> tile(p, seq);
  const int h = tile.head, warp = tile.warp, lane = tile.lane, g = tile.g, c = tile.c;

  auto issue_q = [&](int qb, int st) {
    load_rows_async<T, D, kBlockM, kThreads>(sQ + st * kBlockM * kStride, tile.q, qb * kBlockM, s,
                                             tile.ld);
    load_rows_async<T, D, kBlockM, kThreads>(sdO + st * kBlockM * kStride, tile.in(p.dout),
                                             qb * kBlockM, s, tile.ld);
    static_assert(kBlockM <= kThreads, "one thread per query row of a step");
    const int i = static_cast<int>(threadIdx.x);
    if (i < kBlockM) {
      const int r = qb * kBlockM + i;
      const bool ok = r < s;
      const int64_t row = static_cast<int64_t>(seq.start + (ok ? r : 0)) * p.heads + h;
      // Queries past the end get lse = +inf: P = 0, so they add nothing to dK and dV.
      sLse[st * kBlockM + i] = ok ? p.lse[row] * kLog2e : INFINITY;
      sDelta[st * kBlockM + i] = ok ? p.delta[row] : 0.0f;
    }
  };

  load_rows_async<T, D, kBlockN, kThreads>(sK, tile.k, j0, s, tile.ld);
  load_rows_async<T, D, kBlockN, kThreads>(sV, tile.v, j0, s, tile.ld);
  cp_async_commit();
  issue_q(0, 0);
  cp_async_commit();

  float dk[kDT][4], dv[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;
  const int kr0 = warp * 16;  // this warp's keys within the block
  const int kvalid = s - (j0 + kr0);  // how many of them exist
  // ldmatrix rows of a 16-key B operand: lane 8i + r gives key (i / 2) * 8 + r, d (i % 2) * 8
  const int b_row = (kr0 + (lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8;
  uint32_t kf[kFr][4], vf[kFr][4];  // B fragments of this warp's 16 keys, d = 16 kk ..
  if (kKVInRegs) {
    cp_async_wait<1>();
    __syncthreads();  // K and V landed
#pragma unroll
    for (int kk = 0; kk < kFr; ++kk) {
      ldmatrix_x4(kf[kk], sK + b_row + kk * 16);
      ldmatrix_x4(vf[kk], sV + b_row + kk * 16);
    }
  }
  const uint32_t key16 = static_cast<uint32_t>(j0 + kr0 + 2 * c);  // dropout: keys 2c.. of the 16

  const int nqb = (s + kBlockM - 1) / kBlockM;
  for (int qb = 0; qb < nqb; ++qb) {
    const int st = qb & 1;
    wait_stage(qb + 1 < nqb, [&] { issue_q(qb + 1, st ^ 1); });  // stage st (and K, V) landed
    const T* qs = sQ + st * kBlockM * kStride;
    const T* dos = sdO + st * kBlockM * kStride;
    const float* lse_s = sLse + st * kBlockM;
    const float* dl_s = sDelta + st * kBlockM;
    // Philox counter word 1 of row pair r (philox.h: t0 + (i & ~8)) is step_t0 + r, r % 16 < 8
    const uint32_t step_t0 =
        attention_counter1(static_cast<uint32_t>(seq.start), static_cast<uint32_t>(qb * kBlockM));

    uint32_t ds[kMT][2][2];  // dS packed: [m-tile][n-tile][rows g / g + 8], for dK and dQ
    if constexpr (kMovT) {
      // One m-tile of 16 queries at a time: S = Q K^T and dP = dO V^T (this warp's 16 keys),
      // P Z and dS, then their products with dO and Q into dV and dK. The B operands of those
      // products (dO and Q with the queries as rows of k) are the transposes of the 8x8 blocks
      // of the A fragments S and dP were made from: movmatrix instead of a second read of the
      // tiles from shared memory.
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        uint32_t qa[kKT][4], da[kKT][4];
        float sc[2][4], dp[2][4];
        zero_tiles(sc);
        zero_tiles(dp);
#pragma unroll
        for (int kk = 0; kk < kKT; ++kk) {
          const int a_off = (mt * 16 + (lane & 15)) * kStride + kk * 16 + (lane >> 4) * 8;
          ldmatrix_x4(qa[kk], qs + a_off);
          ldmatrix_x4(da[kk], dos + a_off);
          mma16816<T>(sc[0], qa[kk], kf[kk][0], kf[kk][1]);
          mma16816<T>(sc[1], qa[kk], kf[kk][2], kf[kk][3]);
          mma16816<T>(dp[0], da[kk], vf[kk][0], vf[kk][1]);
          mma16816<T>(dp[1], da[kk], vf[kk][2], vf[kk][3]);
        }
        uint32_t pz[2][2], ap[4], as[4];
        grad_tile<T, kDropout>(p, sc, dp, lse_s, dl_s, mt * 16 + g, kvalid, c, key16,
                               step_t0 + static_cast<uint32_t>(mt * 16 + g),
                               static_cast<uint32_t>(h), pz, ds[mt], ap, as);
#pragma unroll
        for (int kk = 0; kk < kKT; ++kk)
#pragma unroll
          for (int hi = 0; hi < 2;
               ++hi) {  // d-tile 2 kk + hi: queries 0-7 and 8-15 of the A blocks
            mma16816<T>(dv[2 * kk + hi], ap, movmatrix_trans(da[kk][2 * hi]),
                        movmatrix_trans(da[kk][2 * hi + 1]));
            mma16816<T>(dk[2 * kk + hi], as, movmatrix_trans(qa[kk][2 * hi]),
                        movmatrix_trans(qa[kk][2 * hi + 1]));
          }
      }
    } else {
      // S and dP of every m-tile first, each k-step's K and V fragments read once for all of
      // them; then P Z, dS, and the dV / dK products with dO and Q read again, transposed.
      float sc[kMT][2][4], dp[kMT][2][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        zero_tiles(sc[mt]);
        zero_tiles(dp[mt]);
      }
#pragma unroll
      for (int kk = 0; kk < kKT; ++kk) {
        uint32_t kb[4], vb[4];
        ldmatrix_x4(kb, sK + b_row + kk * 16);
        ldmatrix_x4(vb, sV + b_row + kk * 16);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const int a_off = (mt * 16 + (lane & 15)) * kStride + kk * 16 + (lane >> 4) * 8;
          uint32_t a[4], b[4];
          ldmatrix_x4(a, qs + a_off);
          ldmatrix_x4(b, dos + a_off);
          mma16816<T>(sc[mt][0], a, kb[0], kb[1]);
          mma16816<T>(sc[mt][1], a, kb[2], kb[3]);
          mma16816<T>(dp[mt][0], b, vb[0], vb[1]);
          mma16816<T>(dp[mt][1], b, vb[2], vb[3]);
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        uint32_t pz[2][2], ap[4], as[4];
        grad_tile<T, kDropout>(p, sc[mt], dp[mt], lse_s, dl_s, mt * 16 + g, kvalid, c, key16,
                               step_t0 + static_cast<uint32_t>(mt * 16 + g),
                               static_cast<uint32_t>(h), pz, ds[mt], ap, as);
#pragma unroll
        for (int d2 = 0; d2 < D / 16; ++d2) {
          const int off =
              (mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + d2 * 16 + (lane >> 4) * 8;
          mma_two_tiles<T, true>(dv[2 * d2], dv[2 * d2 + 1], ap, dos + off);
          mma_two_tiles<T, true>(dk[2 * d2], dk[2 * d2 + 1], as, qs + off);
        }
      }
    }

    if (kDq) {
      // dS of the whole block goes through shared memory (rows = queries); then four warps
      // take dQ = dS K of the query block, K transposed out of shared memory, and add their
      // tile into dq (rows that exist only: the rows past the end are another sequence's).
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int i = 0; i < 2; ++i)
            *reinterpret_cast<uint32_t*>(sdS + (mt * 16 + g + 8 * i) * kSStride + kr0 + n * 8 +
                                         2 * c) = ds[mt][n][i];
      __syncthreads();  // dS complete; every warp is also done with stage st
      if (warp < Dq::kWarps) {
        constexpr int kM16 = Dq::kM / 16, kN8 = Dq::kN / 8;
        const int qr0 = (warp % Dq::kRowTiles) * Dq::kM;
        const int dc0 = (warp / Dq::kRowTiles) * Dq::kN;
        float acc[kM16][kN8][4];
#pragma unroll
        for (int m = 0; m < kM16; ++m)
#pragma unroll
          for (int n = 0; n < kN8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
#pragma unroll
        for (int kt = 0; kt < kBlockN / 16; ++kt) {
          uint32_t a[kM16][4];
#pragma unroll
          for (int m = 0; m < kM16; ++m)
            ldmatrix_x4(a[m],
                        sdS + (qr0 + m * 16 + (lane & 15)) * kSStride + kt * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int n2 = 0; n2 < kN8 / 2; ++n2) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, sK + (kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride +
                                     dc0 + n2 * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int m = 0; m < kM16; ++m) {
              mma16816<T>(acc[m][2 * n2], a[m], b[0], b[1]);
              mma16816<T>(acc[m][2 * n2 + 1], a[m], b[2], b[3]);
            }
          }
        }
        const int q_first = qb * kBlockM + qr0;
        dq_tile_out<T, D, kM16, kN8>(
            p, acc,
            p.dq_tiles +
                ((static_cast<int64_t>(seq.start + qb * kBlockM) * p.heads + h) * kBwdDqWarps +
                 warp) *
                    2,
            (s + kBlockN - 1) / kBlockN, seq.start + q_first, s - q_first, dc0, h, lane);
      }
      // The next step writes dS after its first barrier, which every warp reaches only
      // after this dQ.
    } else {
      __syncthreads();  // every warp is done with stage st before it is refilled
    }
  }
  if (kDq) __syncthreads();  // the last dQ has read K: the epilogue reuses its rows

  // Epilogue: stage in this warp's own rows of sK / sV, 16-byte stores of existing keys.
  const float dv_scale = kDropout ? p.keep_scale : 1.0f;
  T* sk_w = sK + kr0 * kStride;
  T* sv_w = sV + kr0 * kStride;
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int off = (g + 8 * i) * kStride + dt * 8 + 2 * c;
      *reinterpret_cast<uint32_t*>(sk_w + off) =
          Tr::pack(dk[dt][2 * i] * p.scale, dk[dt][2 * i + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(sv_w + off) =
          Tr::pack(dv[dt][2 * i] * dv_scale, dv[dt][2 * i + 1] * dv_scale);
    }
  __syncwarp();
  T* gdk = tile.out(p.dk);
  T* gdv = tile.out(p.dv);
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int it = 0; it < 16 * kChunks / 32; ++it) {
    const int idx = it * 32 + lane;
    const int r = idx / kChunks, ch = idx % kChunks;
    const int key = j0 + kr0 + r;
    if (key < s) {
      const int64_t go = static_cast<int64_t>(key) * tile.ld + ch * 8;
      *reinterpret_cast<uint4*>(gdk + go) =
          *reinterpret_cast<const uint4*>(sk_w + r * kStride + ch * 8);
      *reinterpret_cast<uint4*>(gdv + go) =
          *reinterpret_cast<const uint4*>(sv_w + r * kStride + ch * 8);
    }
  }
}

// Two warp GEMMs of one shape: acc_a = A_a B_a^T and acc_b = A_b B_b^T, with A this warp's 16
// rows of D (registers fr_* when kInRegs, else shared memory at the lane's fragment row sa_*)
// and B kCols rows of D in shared memory (b_*, kStride apart): S = Q K^T and dP = dO V^T of
// the deterministic dQ kernel.
template <typename T, int D, int kCols, int kStride, bool kInRegs, int kFr>
__device__ __forceinline__ void warp_gemm_pair_abt(float (&acc_a)[kCols / 8][4],
                                                   float (&acc_b)[kCols / 8][4],
                                                   const uint32_t (&fr_a)[kFr][4],
                                                   const uint32_t (&fr_b)[kFr][4], const T* sa_a,
                                                   const T* sa_b, const T* b_a, const T* b_b,
                                                   int lane) {
#pragma unroll
  for (int t = 0; t < kCols / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_a[t][e] = acc_b[t][e] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4], b[4];
    if (kInRegs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = fr_a[kInRegs ? kk : 0][i];
        b[i] = fr_b[kInRegs ? kk : 0][i];
      }
    } else {
      ldmatrix_x4(a, sa_a + kk * 16);
      ldmatrix_x4(b, sa_b + kk * 16);
    }
#pragma unroll
    for (int c2 = 0; c2 < kCols / 16; ++c2) {
      const int off =
          (c2 * 16 + (lane & 7) + (lane >> 4) * 8) * kStride + kk * 16 + ((lane >> 3) & 1) * 8;
      mma_two_tiles<T, false>(acc_a[2 * c2], acc_a[2 * c2 + 1], a, b_a + off);
      mma_two_tiles<T, false>(acc_b[2 * c2], acc_b[2 * c2 + 1], b, b_b + off);
    }
  }
}

// Deterministic dQ. kBlockN: keys per step; kQInRegs: keep this warp's Q and dO A-fragments
// in registers.
template <typename T, int D, int kBlockN, bool kQInRegs, bool kDropout>
__global__ void __launch_bounds__(128) fmha_bwd_dq_kernel(const __grid_constant__ FmhaParams p) {
  constexpr int kThreads = 128;
  constexpr int kBlockM = kBwdQueriesPerBlock;  // 4 warps x 16 queries
  static_assert(kBlockM == 64, "4 warps own 16 queries each");
  constexpr int kStride = D + 8;
  constexpr int kKT = D / 16;
  constexpr int kNT = kBlockN / 8;
  constexpr int kDT = D / 8;
  constexpr int kFr = kQInRegs ? kKT : 1;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kBlockM * kStride;
  T* sK = sdO + kBlockM * kStride;  // [2][kBlockN][kStride]
  T* sV = sK + 2 * kBlockN * kStride;  // [2][kBlockN][kStride]

  const SeqSpan seq = p.seqs[blockIdx.y];
  const int s = seq.len, q0 = static_cast<int>(blockIdx.x) * kBlockM;
  if (q0 >= s) return;
  const VarlenTile<T, D> tile(p, seq);
  const int h = tile.head, warp = tile.warp, lane = tile.lane, g = tile.g, c = tile.c;

  load_rows_async<T, D, kBlockM, kThreads>(sQ, tile.q, q0, s, tile.ld);
  load_rows_async<T, D, kBlockM, kThreads>(sdO, tile.in(p.dout), q0, s, tile.ld);
  cp_async_commit();
  load_rows_async<T, D, kBlockN, kThreads>(sK, tile.k, 0, s, tile.ld);
  load_rows_async<T, D, kBlockN, kThreads>(sV, tile.v, 0, s, tile.ld);
  cp_async_commit();

  // lse (base 2) and delta of this thread's rows g, g + 8.
  float lse2[2], dl[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = q0 + warp * 16 + g + 8 * i;
    const bool ok = r < s;
    const int64_t row = static_cast<int64_t>(seq.start + (ok ? r : 0)) * p.heads + h;
    lse2[i] = ok ? p.lse[row] * kLog2e : INFINITY;
    dl[i] = ok ? p.delta[row] : 0.0f;
  }
  const uint32_t t_pair = attention_counter1(static_cast<uint32_t>(seq.start),
                                             static_cast<uint32_t>(q0 + warp * 16 + g));

  uint32_t qf[kFr][4], df[kFr][4];
  float dq[kDT][4];
  zero_tiles(dq);
  const T* sQw = sQ + (warp * 16 + (lane & 15)) * kStride + (lane >> 4) * 8;
  const T* sdOw = sdO + (warp * 16 + (lane & 15)) * kStride + (lane >> 4) * 8;
  if (kQInRegs) {
    cp_async_wait<1>();
    __syncthreads();  // Q and dO landed (every thread waited for its own copies)
#pragma unroll
    for (int kk = 0; kk < kFr; ++kk) {
      ldmatrix_x4(qf[kk], sQw + kk * 16);
      ldmatrix_x4(df[kk], sdOw + kk * 16);
    }
  }

  const int nkb = (s + kBlockN - 1) / kBlockN;
  for (int kb = 0; kb < nkb; ++kb) {
    const int st = kb & 1;
    const int j0 = kb * kBlockN;
    wait_stage(kb + 1 < nkb, [&] {
      load_rows_async<T, D, kBlockN, kThreads>(sK + (st ^ 1) * kBlockN * kStride, tile.k,
                                               j0 + kBlockN, s, tile.ld);
      load_rows_async<T, D, kBlockN, kThreads>(sV + (st ^ 1) * kBlockN * kStride, tile.v,
                                               j0 + kBlockN, s, tile.ld);
    });
    const T* ks = sK + st * kBlockN * kStride;
    const T* vs = sV + st * kBlockN * kStride;

    float sc[kNT][4], dp[kNT][4];
    warp_gemm_pair_abt<T, D, kBlockN, kStride, kQInRegs, kFr>(sc, dp, qf, df, sQw, sdOw, ks, vs,
                                                              lane);
    if (kDropout) drop_tiles(p, dp, j0, c, t_pair, h);  // Z; the 1/(1-p) below

    // dS = P (dP Z - delta) into sc; keys past the end have P = 0.
    const int valid = s - j0;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int col = nt * 8 + 2 * c;
        const float p0 = col < valid ? fast_exp2(sc[nt][2 * i] * p.scale_log2 - lse2[i]) : 0.0f;
        const float p1 =
            col + 1 < valid ? fast_exp2(sc[nt][2 * i + 1] * p.scale_log2 - lse2[i]) : 0.0f;
        const float z = kDropout ? p.keep_scale : 1.0f;
        sc[nt][2 * i] = p0 * (dp[nt][2 * i] * z - dl[i]);
        sc[nt][2 * i + 1] = p1 * (dp[nt][2 * i + 1] * z - dl[i]);
      }

    mma_scores_b<T, D, kBlockN, kStride>(dq, sc, ks, lane);  // dQ += dS K
    __syncthreads();  // every warp is done with stage st before it is refilled
  }

  store_warp_rows<T, D, kStride>(tile, dq, p.scale, p.scale, sQ, p.dq, q0, s);
}

template <typename T, int D>
cudaError_t launch_bwd_prep_dim(const FmhaParams& p, int64_t rows, cudaStream_t stream) {
  constexpr int kRowsPerBlock = 256 / (D / 8);
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks == 0) return cudaSuccess;
  fmha_bwd_prep_kernel<T, D><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const T*>(p.out), static_cast<const T*>(p.dout), p.delta, p.dq_tiles, rows);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fmha_bwd_prep(const FmhaParams& p, int64_t rows, cudaStream_t stream) {
  return by_head_dim(p.head_dim, [&](auto d) {
    return launch_bwd_prep_dim<T, decltype(d)::value>(p, rows, stream);
  });
}

// Shared memory of the key-block kernel (K, V, two Q / dO stages, lse / delta stages, dS).
template <typename T, int D, int kWarps, int kBlockM, bool kDq>
constexpr size_t bwd_kv_smem_bytes() {
  return (2 * 16 * kWarps + 4 * kBlockM) * static_cast<size_t>(D + 8) * sizeof(T) +
         4 * kBlockM * sizeof(float) +
         (kDq ? static_cast<size_t>(kBlockM) * (16 * kWarps + 8) * sizeof(T) : 0);
}

template <typename T, int D, int kWarps, int kBlockM, bool kKVInRegs, bool kDropout, bool kDq>
cudaError_t launch_bwd_kv(const FmhaParams& p, cudaStream_t stream) {
  return launch_varlen(fmha_bwd_kv_kernel<T, D, kWarps, kBlockM, kKVInRegs, kDropout, kDq>, p,
                       16 * kWarps, kWarps * 32, bwd_kv_smem_bytes<T, D, kWarps, kBlockM, kDq>(),
                       stream);
}

template <typename T, int D, int kDqBlockN, bool kQInRegs, bool kDropout>
cudaError_t launch_bwd_dq(const FmhaParams& p, cudaStream_t stream) {
  constexpr size_t kSmem =
      (2 * kBwdQueriesPerBlock + 4 * kDqBlockN) * static_cast<size_t>(D + 8) * sizeof(T);
  return launch_varlen(fmha_bwd_dq_kernel<T, D, kDqBlockN, kQInRegs, kDropout>, p,
                       kBwdQueriesPerBlock, 128, kSmem, stream);
}

// One head size's configuration: the key-block kernel's warps (16 keys each), queries per
// step and where K / V live; the deterministic dQ kernel's keys per step and where Q / dO live.
template <typename T, int D, int kWarps, int kBlockM, bool kKVInRegs, int kDqBlockN, bool kQInRegs,
          bool kDropout>
cudaError_t launch_bwd_config(const FmhaParams& p, bool deterministic, cudaStream_t stream) {
  if (!deterministic)
    return launch_bwd_kv<T, D, kWarps, kBlockM, kKVInRegs, kDropout, true>(p, stream);
  const cudaError_t e = launch_bwd_kv<T, D, kWarps, kBlockM, kKVInRegs, kDropout, false>(p, stream);
  if (e != cudaSuccess) return e;
  return launch_bwd_dq<T, D, kDqBlockN, kQInRegs, kDropout>(p, stream);
}

template <typename T, bool kDropout>
cudaError_t launch_bwd_dropout(const FmhaParams& p, bool deterministic, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32:
      return launch_bwd_config<T, 32, 8, 64, true, 64, true, kDropout>(p, deterministic, stream);
    case 64:
      return launch_bwd_config<T, 64, 8, 64, true, 64, true, kDropout>(p, deterministic, stream);
    case 128:  // register budget: K / V and Q / dO fragments from shared memory, 32-row steps
      return launch_bwd_config<T, 128, 4, 32, false, 32, false, kDropout>(p, deterministic, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_fmha_bwd(const FmhaParams& p, bool deterministic, cudaStream_t stream) {
  return p.dropout ? launch_bwd_dropout<T, true>(p, deterministic, stream)
                   : launch_bwd_dropout<T, false>(p, deterministic, stream);
}

}  // namespace cuda
}  // namespace paddle_unpad
