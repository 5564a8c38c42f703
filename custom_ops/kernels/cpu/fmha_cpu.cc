// Scheduling and ISA dispatch of the FMHA CPU kernels (the math is in fmha_cpu_impl.h).
#include "kernels/cpu/fmha_cpu.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <vector>

#include "kernels/cpu/cpu_isa.h"
#include "kernels/cpu/thread_pool.h"

namespace paddle_unpad {

PU_DECLARE_PER_ISA(void fwd_item(const FmhaProblem&, const float*, const float*, const float*,
                                 float*, float*, int64_t, int64_t, int64_t, int64_t);
                   void bwd_item(const FmhaProblem&, const float*, const float*, const float*,
                                 const float*, const float*, const float*, float*, float*, float*,
                                 int64_t, int64_t);)

namespace {

// The entry points of one instruction set.
struct Isa {
  const char* name;
  decltype(&sse2::fwd_item) fwd;
  decltype(&sse2::bwd_item) bwd;
};

const Isa& isa() {
#define PU_ISA(isa) {#isa, isa::fwd_item, isa::bwd_item},
  static const Isa by_isa[] = {PU_CPU_ISAS(PU_ISA)};
#undef PU_ISA
  return chosen_isa(by_isa);
}

constexpr int64_t kQueryBlock = 64;  // must match kBr in fmha_cpu_impl.h

std::vector<int64_t> longest_first(const FmhaProblem& p) {
  std::vector<int64_t> order(p.batch);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return p.cu_seqlens[a + 1] - p.cu_seqlens[a] > p.cu_seqlens[b + 1] - p.cu_seqlens[b];
  });
  return order;
}

}  // namespace

const char* fmha_cpu_isa() { return isa().name; }

std::string fmha_cpu_unsupported(const FmhaProblem& p) {
  std::ostringstream why;
  if (p.head_dim < 1 || p.head_dim > kFmhaMaxHeadDim)
    why << "head size (q.shape[2]) " << p.head_dim << " is not supported on CPU: supported are 1.."
        << kFmhaMaxHeadDim;
  else if (p.heads < 1)
    why << "number of heads (q.shape[1]) must be at least 1, got " << p.heads;
  else if (!(p.dropout >= 0.0f && p.dropout < 1.0f))
    why << "dropout must be in [0, 1), got " << p.dropout;
  return why.str();
}

void fmha_fwd_cpu(const FmhaProblem& p, const float* q, const float* k, const float* v, float* out,
                  float* lse) {
  // One item per (sequence, head) amortises packing K and V; long sequences are split
  // into query-block ranges until there are enough items to keep every thread busy.
  struct Item {
    int32_t b, h, qb0, qb1;
  };
  int64_t total_blocks = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    total_blocks += (p.cu_seqlens[b + 1] - p.cu_seqlens[b] + kQueryBlock - 1) / kQueryBlock;
  const int64_t want_items = 8 * static_cast<int64_t>(cpu_num_threads());
  const int64_t blocks_per_item =
      std::max<int64_t>(1, total_blocks * p.heads / std::max<int64_t>(want_items, 1));
  std::vector<Item> items;
  for (int64_t b : longest_first(p)) {
    const int64_t nqb = (p.cu_seqlens[b + 1] - p.cu_seqlens[b] + kQueryBlock - 1) / kQueryBlock;
    for (int64_t qb = 0; qb < nqb; qb += blocks_per_item)
      for (int64_t h = 0; h < p.heads; ++h)
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(qb),
                         static_cast<int32_t>(std::min(nqb, qb + blocks_per_item))});
  }
  const auto fwd = isa().fwd;
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i, int) {
    const Item& it = items[i];
    fwd(p, q, k, v, out, lse, it.b, it.h, it.qb0, it.qb1);
  });
}

void fmha_bwd_cpu(const FmhaProblem& p, const float* q, const float* k, const float* v,
                  const float* out, const float* lse, const float* dout, float* dq, float* dk,
                  float* dv) {
  struct Item {
    int32_t b, h;
  };
  std::vector<Item> items;
  for (int64_t b : longest_first(p)) {
    if (p.cu_seqlens[b + 1] == p.cu_seqlens[b]) continue;
    for (int64_t h = 0; h < p.heads; ++h)
      items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h)});
  }
  const auto bwd = isa().bwd;
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i, int) {
    bwd(p, q, k, v, out, lse, dout, dq, dk, dv, items[i].b, items[i].h);
  });
}

}  // namespace paddle_unpad
