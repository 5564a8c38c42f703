// Every difference between the supported Paddle versions (2.6.x, 3.x) in the C++ API the
// glue uses, in one place. Differences are detected from the API itself (SFINAE), not
// from version numbers, so a backported or removed method is handled without a table.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "paddle/common/ddim.h"  // Tensor::strides() returns a DDim (both versions have this header)
#include "paddle/extension.h"

namespace paddle_unpad {
namespace compat {
namespace detail {

// Row-major with no gaps; dimensions of size 1 may carry any stride.
template <typename T>
bool strides_are_dense(const T& t) {
  const std::vector<int64_t> dims = t.shape();
  const auto& strides = t.strides();
  if (strides.size() != static_cast<int>(dims.size())) return true;  // no strides recorded: dense
  int64_t expected = 1;
  for (int i = static_cast<int>(dims.size()) - 1; i >= 0; --i) {
    if (dims[i] != 1 && strides[i] != expected) return false;
    expected *= dims[i];
  }
  return true;
}

// Paddle 3.x: Tensor::is_contiguous() / contiguous().
template <typename T>
auto dense(const T& t, int) -> decltype(t.is_contiguous(), t.contiguous()) {
  return t.is_contiguous() ? t : t.contiguous();
}

// Paddle 2.6 has strided views but no Tensor::contiguous(): a copy through a regular
// (non-view) op, whose inputs Paddle makes contiguous and whose output is dense.
template <typename T>
T dense(const T& t, long) {
  return strides_are_dense(t) ? t : paddle::experimental::assign(t);
}

}  // namespace detail

// Strided views (slices, transposes, autograd's grads) are copied once; the kernels
// index rows densely.
inline paddle::Tensor dense(const paddle::Tensor& t) { return detail::dense(t, 0); }

}  // namespace compat
}  // namespace paddle_unpad
