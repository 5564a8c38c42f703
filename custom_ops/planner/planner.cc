// pybind11 module paddle_unpad.balance._planner: the C++ core of
// paddle_unpad.balance.plan(). Built by setup.py (see custom_ops/README.md); the
// pure-Python fallback in paddle_unpad/balance/planner.py gives the identical plan.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <vector>

#include "planner_core.h"

namespace py = pybind11;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

py::array_t<int32_t> plan_core(I64Array counts, I64Array q, I64Array targets, int64_t thr,
                               int64_t max_swaps) {
  if (counts.ndim() != 1 || q.ndim() != 1 || targets.ndim() != 1)
    throw std::invalid_argument("plan_core: counts, q and targets must be 1-D");
  const int64_t R = counts.shape(0), N = q.shape(0);
  if (targets.shape(0) != R) throw std::invalid_argument("plan_core: len(targets) != len(counts)");
  if (R < 1) throw std::invalid_argument("plan_core: need at least one rank");
  py::array_t<int32_t> dest(N);
  const int64_t* c = counts.data();
  const int64_t* qq = q.data();
  const int64_t* t = targets.data();
  for (int64_t r = 0; r < R; ++r)
    if (c[r] < 0 || t[r] < 0) throw std::invalid_argument("plan_core: negative count");
  int32_t* d = dest.mutable_data();
  {
    py::gil_scoped_release release;
    paddle_unpad::planner::plan_core(c, R, qq, N, t, thr, max_swaps, d);
  }
  return dest;
}

// Same planning, but returns the plan as Python objects: list over destination ranks of
// lists of (source_rank, source_index) tuples, each sorted by (source rank, index).
py::list plan_lists(I64Array counts, I64Array q, I64Array targets, int64_t thr, int64_t max_swaps) {
  py::array_t<int32_t> dest_arr = plan_core(counts, q, targets, thr, max_swaps);
  const int64_t R = counts.shape(0), N = q.shape(0);
  const int64_t* c = counts.data();
  const int32_t* dest = dest_arr.data();
  // counting sort by destination, stable in (source rank, index) order
  std::vector<int64_t> fill(R + 1, 0);
  for (int64_t i = 0; i < N; ++i) ++fill[dest[i] + 1];
  std::vector<py::list> out;
  out.reserve(R);
  for (int64_t r = 0; r < R; ++r) out.emplace_back(fill[r + 1]);
  std::vector<int64_t> pos(R, 0);
  int64_t maxc = 0;
  for (int64_t r = 0; r < R; ++r) maxc = std::max(maxc, c[r]);
  // small-int caches: every tuple shares these objects
  std::vector<py::int_> rank_obj, idx_obj;
  rank_obj.reserve(R);
  idx_obj.reserve(maxc);
  for (int64_t r = 0; r < R; ++r) rank_obj.emplace_back(r);
  for (int64_t k = 0; k < maxc; ++k) idx_obj.emplace_back(k);
  int64_t i = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t k = 0; k < c[r]; ++k, ++i) {
      const int32_t d = dest[i];
      PyObject* t = PyTuple_New(2);
      if (!t) throw py::error_already_set();
      PyObject* a = rank_obj[r].ptr();
      PyObject* b = idx_obj[k].ptr();
      Py_INCREF(a);
      Py_INCREF(b);
      PyTuple_SET_ITEM(t, 0, a);
      PyTuple_SET_ITEM(t, 1, b);
      PyList_SET_ITEM(out[d].ptr(), pos[d]++, t);  // steals t
    }
  }
  py::list res(R);
  for (int64_t r = 0; r < R; ++r) PyList_SET_ITEM(res.ptr(), r, out[r].release().ptr());
  return res;
}

}  // namespace

PYBIND11_MODULE(_planner, m) {
  m.doc() = "C++ core of paddle_unpad.balance.plan (see planner_core.h)";
  m.def("plan_core", &plan_core, py::arg("counts"), py::arg("q"), py::arg("targets"),
        py::arg("thr"), py::arg("max_swaps"),
        "Destination rank (int32) of every sample in (source rank, index) order. "
        "Releases the GIL while planning.");
  m.def("plan_lists", &plan_lists, py::arg("counts"), py::arg("q"), py::arg("targets"),
        py::arg("thr"), py::arg("max_swaps"),
        "The plan as a list over destination ranks of lists of (source_rank, source_index). "
        "Releases the GIL while planning.");
}
