// A small CPU emulation of the CUDA execution model, enough to run the kernels of
// custom_ops/kernels/cuda on a machine without a GPU (tests/test_cuda_emulated*.py):
//   - a launch runs its blocks one after another (first to last, or last to first); a
//     block's threads are fibers (own
//     stacks) on the calling OS thread, switched only at barriers and warp collectives,
//     so a block of 256 threads costs no OS threads and reruns interleave identically;
//   - __shared__ is `static` (one block is alive at a time, so it is the block's memory);
//     dynamic shared memory (`extern __shared__ T name[]`, rewritten by the build into
//     emu::dynamic_smem()) is filled with 0xff bytes before every block, a NaN in fp16,
//     bf16 and fp32, so reading what no thread wrote shows up in the results;
//   - __syncthreads() is a barrier of the block, __syncwarp() of the warp (a thread that
//     left the kernel no longer counts); warp collectives (__shfl_xor_sync and the
//     tensor-core instructions of emu_isa.h) exchange through a per-warp area between
//     warp barriers;
//   - a block whose threads all wait at barriers nobody else can reach (a barrier in
//     divergent code) fails the launch instead of hanging, as do the checks of emu_isa.h
//     and the race checks of the asynchronous copies (Granule, below);
//     cudaGetLastError() then returns cudaErrorLaunchFailure and cudaGetErrorString() why.
// Kernel launches `k<<<grid, block, smem, stream>>>(args)` are rewritten by the build
// (tests/cuda_emu/emu_build.py) into emu::launch(k, grid, block, smem, stream, args).
// Device math runs as host math. It checks indexing, chunking, reductions, fragment
// layouts, pipelines and dropout layouts, not GPU timing, precision or real concurrency.
#pragma once
// Fibers switch with _setjmp/_longjmp between stacks, which the fortified longjmp refuses.
#undef _FORTIFY_SOURCE
#define PU_CUDA_EMULATION 1  // cuda_common.cuh: emulated instructions, not PTX
#define PU_COUNT_PHILOX_CALL() (++emu::counters.philox)  // kernels/common/philox.h
#define __shared__ static
#define __launch_bounds__(...)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace emu {

constexpr size_t kStackBytes = 256 * 1024;
constexpr unsigned kWarp = 32;

struct Barrier {
  unsigned expected = 0, arrived = 0;
  uint64_t gen = 0;
};

// What one lane hands to a warp collective.
struct Deposit {
  uint32_t w[6];
  const void* ptr;
  float f;
  uint64_t stamp;  // the depositing lane's count of warp collectives, this one included
};

// What the emulation knows of one 16-byte granule of dynamic shared memory, to find
// cross-warp races of the asynchronous copies: a copy must have landed (its thread's
// wait_group) before a __syncthreads that precedes any other warp's read, and must not be
// issued in the same barrier interval in which another warp reads the granule.
struct Granule {
  int pending = 0;          // copies issued into it and not yet landed
  int writer_warp = -1;     // warp of the latest copy into it
  uint64_t landed = 0;      // barrier interval (+1) in which that copy landed, 0 = never
  uint64_t read_epoch = 0;  // barrier interval (+1) of the latest reads
  uint32_t readers = 0;     // warps that read it in that interval (bit per warp)
};

struct PendingCopy {
  void* dst;
  const void* src;
  bool valid;
  uint64_t group;
};

struct Thread {
  ucontext_t ctx;  // only to start the fiber on its stack
  jmp_buf jb;      // where it continues
  bool started = false;
  void* stack = nullptr;
  dim3 tid;
  unsigned linear = 0;
  unsigned parity = 0;  // which of the warp's two exchange areas the next collective uses
  uint64_t collectives = 0;
  bool done = false;
  const char* waits_at = nullptr;
  std::vector<PendingCopy> copies;  // cp.async issued and not yet waited for
  uint64_t open_group = 0;          // cp.async group that the next commit closes
};

struct Block {
  unsigned n = 0;
  std::vector<Thread> threads;
  Barrier all;
  std::vector<Barrier> warps;
  std::vector<Deposit> exchange;  // [warp][2][32]
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  std::vector<Granule> granules;  // [smem_bytes / 16]
  uint64_t progress = 0;
  std::function<void()> body;
  jmp_buf sched;
};

inline thread_local Block* block = nullptr;
inline thread_local Thread* self = nullptr;
inline thread_local dim3 bid, block_dim, grid_dim;
inline thread_local std::string error;  // first failure of the current launch, "" if none

// What the kernels executed since the last reset (emu_counters() in runtime_stubs.cpp): warp
// tensor-core instructions (mma.sync m16n8k16, one per warp), Philox calls (one per thread
// call) and atomic additions (one per thread call) -- counted as the code runs, so they do
// not depend on how the compiler would unroll or schedule it.
struct Counters {
  uint64_t mma = 0, philox = 0, atomics = 0;
};
inline Counters counters;

// Run a launch's blocks last to first (emu_set_block_order): a GPU gives no order, so a
// result must not depend on the one the emulation happens to use.
inline bool reverse_block_order = false;
inline thread_local std::string reported;  // what cudaGetErrorString() hands out

// A switch costs a _setjmp and a _longjmp (no signal-mask system call as in swapcontext).
__attribute__((noinline)) inline void yield() {
  if (_setjmp(self->jb) == 0) _longjmp(block->sched, 1);
}

__attribute__((noinline)) inline void resume(Block& b, Thread& t) {
  if (_setjmp(b.sched) == 0) {
    if (!t.started) {
      t.started = true;
      setcontext(&t.ctx);
    }
    _longjmp(t.jb, 1);
  }
}

// Stops the calling thread for good and fails the launch with `why`.
[[noreturn]] inline void fail(const std::string& why) {
  if (error.empty()) {
    char where[160];
    std::snprintf(where, sizeof where, " (block %u,%u,%u thread %u,%u,%u)", bid.x, bid.y, bid.z,
                  self->tid.x, self->tid.y, self->tid.z);
    error = why + where;
  }
  self->done = true;
  _longjmp(block->sched, 1);  // never resumed
}

inline void arrive_and_wait(Barrier& b, const char* what) {
  const uint64_t gen = b.gen;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.gen;
    ++block->progress;
    return;
  }
  self->waits_at = what;
  while (b.gen == gen) yield();
  self->waits_at = nullptr;
  ++block->progress;
}

inline void arrive_and_drop(Barrier& b) {
  --b.expected;
  if (b.expected > 0 && b.arrived == b.expected) {
    b.arrived = 0;
    ++b.gen;
  }
}

inline unsigned lane() { return self->linear % kWarp; }

// Hands `mine` to the warp and returns the warp's 32 deposits. Two areas alternate, so one
// barrier suffices: a lane writes an area again only after the barrier of the collective
// in between, which every lane passes only after it finished reading this one.
inline const Deposit* warp_exchange(const Deposit& mine, const char* what) {
  const unsigned w = self->linear / kWarp;
  Deposit* area = &block->exchange[(2 * w + self->parity) * kWarp];
  self->parity ^= 1u;
  area[lane()] = mine;
  area[lane()].stamp = ++self->collectives;
  arrive_and_wait(block->warps[w], what);
  return area;
}

// Tensor-core instructions need every lane of the warp (.sync.aligned).
inline void require_full_warp(const char* what) {
  if (block->warps[self->linear / kWarp].expected != kWarp)
    fail(std::string(what) + " executed by a warp without all 32 lanes");
}

// After the exchange: every lane deposited for this very collective (a lane that left the
// kernel while the others waited completes the barrier without depositing).
inline void require_all_deposits(const Deposit* all, const char* what) {
  for (unsigned l = 0; l < kWarp; ++l)
    if (all[l].stamp != self->collectives)
      fail(std::string(what) + " executed by a warp without all 32 lanes");
}

// The 16 bytes at p must lie inside the block's dynamic shared memory, 16-byte aligned.
inline void require_smem16(const void* p, const char* what) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < block->smem || c + 16 > block->smem + block->smem_bytes ||
      (reinterpret_cast<uintptr_t>(c) & 15u) != 0u) {
    char buf[200];
    std::snprintf(buf, sizeof buf,
                  "%s: shared address %+lld (of %zu bytes) out of bounds or not 16-byte aligned",
                  what, static_cast<long long>(c - block->smem), block->smem_bytes);
    fail(buf);
  }
}

inline unsigned char* dynamic_smem() { return block->smem; }

// Barrier interval of the running thread (+1, so 0 means never): every running thread has
// passed exactly block->all.gen __syncthreads.
inline uint64_t epoch() { return block->all.gen + 1; }
inline unsigned warp_id() { return self->linear / kWarp; }
inline Granule& granule(const void* p) {
  return block
      ->granules[static_cast<size_t>(static_cast<const unsigned char*>(p) - block->smem) / 16];
}

// Warp-level reads (ldmatrix) of 16 bytes at p (checked in bounds and aligned).
inline void note_smem_read(const void* p, const char* what) {
  Granule& g = granule(p);
  const unsigned w = warp_id();
  if (g.writer_warp >= 0 && static_cast<unsigned>(g.writer_warp) != w &&
      (g.pending > 0 || g.landed >= epoch())) {
    char buf[240];
    std::snprintf(
        buf, sizeof buf,
        "race: %s of warp %u reads shared offset %lld that a cp.async of warp %d fills with no "
        "wait_group + __syncthreads in between",
        what, w, static_cast<long long>(static_cast<const unsigned char*>(p) - block->smem),
        g.writer_warp);
    fail(buf);
  }
  if (g.read_epoch != epoch()) {
    g.read_epoch = epoch();
    g.readers = 0;
  }
  g.readers |= 1u << (w % 32);
}

inline void note_copy_issue(void* dst) {
  Granule& g = granule(dst);
  const unsigned w = warp_id();
  if (g.read_epoch == epoch() && (g.readers & ~(1u << (w % 32))) != 0u) {
    char buf[240];
    std::snprintf(buf, sizeof buf,
                  "race: cp.async of warp %u overwrites shared offset %lld that another warp reads "
                  "in the same "
                  "__syncthreads interval",
                  w, static_cast<long long>(static_cast<unsigned char*>(dst) - block->smem));
    fail(buf);
  }
  ++g.pending;
  g.writer_warp = static_cast<int>(w);
}

inline void note_copy_landed(void* dst) {
  Granule& g = granule(dst);
  --g.pending;
  g.landed = epoch();
}

inline std::vector<void*>& stack_pool() {
  static thread_local std::vector<void*> pool;
  return pool;
}

inline void* stack_for(unsigned t) {
  std::vector<void*>& pool = stack_pool();
  while (pool.size() <= t) {
    void* s = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s == MAP_FAILED) {
      std::perror("emu: stack");
      std::abort();
    }
    mprotect(s, 4096, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
    pool.push_back(s);
  }
  return pool[t];
}

inline void finish_thread() {
  Thread* t = self;
  t->copies.clear();
  arrive_and_drop(block->all);
  arrive_and_drop(block->warps[t->linear / kWarp]);
  t->done = true;
  ++block->progress;
}

inline void thread_entry() {
  block->body();
  finish_thread();
  _longjmp(block->sched, 1);
}

inline bool run_block(Block& b, dim3 threads) {
  for (unsigned t = 0; t < b.n; ++t) {
    Thread& th = b.threads[t];
    th.linear = t;
    th.tid = dim3(t % threads.x, (t / threads.x) % threads.y, t / (threads.x * threads.y));
    th.parity = 0;
    th.collectives = 0;
    th.done = false;
    th.started = false;
    th.waits_at = nullptr;
    th.copies.clear();
    th.open_group = 0;
    th.stack = stack_for(t);
    getcontext(&th.ctx);
    th.ctx.uc_stack.ss_sp = th.stack;
    th.ctx.uc_stack.ss_size = kStackBytes;
    th.ctx.uc_link = nullptr;
    makecontext(&th.ctx, thread_entry, 0);
  }
  b.all = Barrier{b.n, 0, 0};
  for (unsigned w = 0; w < b.warps.size(); ++w)
    b.warps[w] = Barrier{std::min(kWarp, b.n - kWarp * w), 0, 0};
  for (;;) {
    const uint64_t before = b.progress;
    bool alive = false;
    for (Thread& th : b.threads) {
      if (th.done) continue;
      alive = true;
      self = &th;
      resume(b, th);
      if (!error.empty()) return false;
    }
    if (!alive) return true;
    if (b.progress == before) {
      unsigned at_block = 0, at_warp = 0;
      for (const Thread& th : b.threads)
        if (!th.done)
          (th.waits_at && std::strcmp(th.waits_at, "__syncthreads") == 0 ? at_block : at_warp) += 1;
      char buf[200];
      std::snprintf(
          buf, sizeof buf,
          "deadlock: %u threads wait at __syncthreads and %u at warp barriers/collectives that "
          "the other threads never reach (block %u,%u,%u)",
          at_block, at_warp, bid.x, bid.y, bid.z);
      error = buf;
      return false;
    }
  }
}

template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, dim3 threads, size_t smem_bytes, cudaStream_t, Args... args) {
  if (!error.empty()) return;  // an earlier launch failed; the error is still pending
  block_dim = threads;
  grid_dim = grid;
  Block b;
  b.n = threads.x * threads.y * threads.z;
  b.threads.resize(b.n);
  b.warps.resize((b.n + kWarp - 1) / kWarp);
  b.exchange.assign(b.warps.size() * 2 * kWarp, Deposit{});
  std::vector<unsigned char> smem(smem_bytes + 16);
  b.smem = smem.data() + ((16 - reinterpret_cast<uintptr_t>(smem.data()) % 16) % 16);
  b.smem_bytes = smem_bytes;
  b.body = [&] { kernel(args...); };
  Block* outer_block = block;
  Thread* outer_self = self;
  block = &b;
  const unsigned long long blocks = 1ull * grid.x * grid.y * grid.z;
  for (unsigned long long n = 0; n < blocks; ++n) {
    const unsigned long long i = reverse_block_order ? blocks - 1 - n : n;
    bid = dim3(static_cast<unsigned>(i % grid.x), static_cast<unsigned>(i / grid.x % grid.y),
               static_cast<unsigned>(i / grid.x / grid.y));
    std::memset(b.smem, 0xff, smem_bytes);
    b.granules.assign(smem_bytes / 16, Granule{});
    if (!run_block(b, threads)) {
      block = outer_block;
      self = outer_self;
      return;
    }
  }
  block = outer_block;
  self = outer_self;
}

// cudaGetLastError(): the pending launch failure, cleared once read.
inline cudaError_t take_error() {
  if (error.empty()) return cudaSuccess;
  reported = error;
  error.clear();
  return cudaErrorLaunchFailure;
}

}  // namespace emu

// The runtime's template overload exists only for nvcc.
template <class Kernel>
inline cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}

#define threadIdx (emu::self->tid)
#define blockIdx (emu::bid)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::arrive_and_wait(emu::block->all, "__syncthreads"); }

inline void __syncwarp(unsigned = 0xffffffffu) {
  emu::arrive_and_wait(emu::block->warps[emu::self->linear / emu::kWarp], "__syncwarp");
}

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  emu::Deposit mine{};
  mine.f = v;
  const emu::Deposit* all = emu::warp_exchange(mine, "__shfl_xor_sync");
  return all[emu::lane() ^ static_cast<unsigned>(lane_mask)].f;
}

// Blocks run one at a time, so an atomic is a plain read-modify-write here, and a fence
// orders nothing that is not already in order.
inline float atomicAdd(float* address, float v) {
  ++emu::counters.atomics;
  const float old = *address;
  *address = old + v;
  return old;
}

inline int atomicAdd(int* address, int v) {
  const int old = *address;
  *address = old + v;
  return old;
}

inline void __threadfence() {}

inline float2 __ldcg(const float2* p) { return *p; }

inline int __shfl_sync(unsigned, int v, int src_lane) {
  emu::Deposit mine{};
  mine.w[0] = static_cast<uint32_t>(v);
  const emu::Deposit* all = emu::warp_exchange(mine, "__shfl_sync");
  return static_cast<int>(all[static_cast<unsigned>(src_lane) % emu::kWarp].w[0]);
}

using std::max;
using std::min;
