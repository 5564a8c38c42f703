// Load-balance planner core (framework-free, header-only).
//
// Mirror of paddle_unpad/balance/planner.py::_plan_core_py -- the two must return the
// same plan for the same input; tests/test_balance.py checks this. See the docstring of
// paddle_unpad/balance/planner.py for the algorithm. All arithmetic is exact int64.
#pragma once

#include <algorithm>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

namespace paddle_unpad {
namespace planner {

struct Item {
  int64_t cost;
  int64_t idx;  // flat index == (source rank, source index) order
  bool operator<(const Item& o) const { return cost < o.cost || (cost == o.cost && idx < o.idx); }
};

// counts[R]: samples per source rank; q[N]: integer costs in (rank, index) order;
// targets[R]: samples per destination rank (sum == N); thr < 0: no tolerance stop.
// Writes dest[N] (destination rank of each sample); returns the number of swaps.
inline int64_t plan_core(const int64_t* counts, int64_t R, const int64_t* q, int64_t N,
                         const int64_t* targets, int64_t thr, int64_t max_swaps, int32_t* dest) {
  std::vector<int64_t> starts(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) starts[r + 1] = starts[r] + counts[r];
  if (starts[R] != N) throw std::invalid_argument("plan_core: sum(counts) != N");
  int64_t tsum = 0;
  for (int64_t r = 0; r < R; ++r) tsum += targets[r];
  if (tsum != N) throw std::invalid_argument("plan_core: sum(targets) != N");

  // step 3: identity, surplus -> deficit. Rank r keeps its first min(count, target)
  // samples; the rest, in (rank, index) order, fill the ranks below target in rank order.
  std::vector<std::vector<Item>> lists(R);
  std::vector<int64_t> loads(R, 0);
  int64_t total = 0;
  int64_t pool_r = 0, pool_i = 0;  // next surplus sample: rank pool_r, flat index pool_i
  auto next_surplus = [&]() {
    for (;; ++pool_r) {
      const int64_t first = starts[pool_r] + std::min<int64_t>(counts[pool_r], targets[pool_r]);
      if (pool_i < first) pool_i = first;
      if (pool_i < starts[pool_r + 1]) return pool_i++;
    }
  };
  for (int64_t r = 0; r < R; ++r) {
    auto& lst = lists[r];
    lst.reserve(targets[r] + 1);
    const int64_t keep = std::min<int64_t>(counts[r], targets[r]);
    for (int64_t i = starts[r]; i < starts[r] + keep; ++i) lst.push_back(Item{q[i], i});
    for (int64_t k = keep; k < targets[r]; ++k) {
      const int64_t i = next_surplus();
      lst.push_back(Item{q[i], i});
    }
    for (const Item& it : lst) loads[r] += it.cost;
    std::sort(lst.begin(), lst.end());
    total += loads[r];
  }
  std::set<std::pair<int64_t, int64_t>> order;  // ascending (load, rank)
  for (int64_t r = 0; r < R; ++r) order.emplace(loads[r], r);

  int64_t swaps = 0;
  while (swaps < max_swaps && R > 1) {
    const int64_t top = order.rbegin()->first;
    auto hit = order.lower_bound({top, -1});
    const int64_t H = hit->second;
    const int64_t LH = top;
    if (thr >= 0 && R * LH - total <= thr) break;
    auto& a = lists[H];
    bool done = false;
    for (auto it = order.begin(); it != order.end(); ++it) {
      const int64_t LP = it->first, P = it->second;
      if (P == H) continue;
      const int64_t D = LH - LP;
      if (D < 2) break;
      auto& b = lists[P];
      const int64_t na = (int64_t)a.size(), nb = (int64_t)b.size();
      int64_t i = 0, j = 0, best = -1, bi = -1, bj = -1;
      while (i < na && j < nb) {
        const int64_t d = a[i].cost - b[j].cost;
        if (0 < d && d < D) {
          const int64_t e = (2 * d - D) < 0 ? D - 2 * d : 2 * d - D;
          if (best < 0 || e < best) {
            best = e;
            bi = i;
            bj = j;
            if (e == 0) break;
          }
        }
        if (2 * d < D)
          ++i;
        else
          ++j;
      }
      if (best < 0) continue;
      const Item x = a[bi], y = b[bj];
      a.erase(a.begin() + bi);
      b.erase(b.begin() + bj);
      a.insert(std::upper_bound(a.begin(), a.end(), y), y);
      b.insert(std::upper_bound(b.begin(), b.end(), x), x);
      const int64_t d = x.cost - y.cost;
      order.erase({LH, H});
      order.erase({LP, P});  // `it` is invalid from here on; we leave the loop
      loads[H] = LH - d;
      loads[P] = LP + d;
      order.emplace(loads[H], H);
      order.emplace(loads[P], P);
      ++swaps;
      done = true;
      break;
    }
    if (!done) break;
  }
  for (int64_t r = 0; r < R; ++r)
    for (const Item& it : lists[r]) dest[it.idx] = (int32_t)r;
  return swaps;
}

}  // namespace planner
}  // namespace paddle_unpad
