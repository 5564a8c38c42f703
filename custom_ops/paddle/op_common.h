// Helpers shared by the Paddle glue of every operator (checks and messages).
#pragma once
#include <sstream>
#include <string>
#include <vector>

#include "paddle/extension.h"
#include "paddle_compat.h"  // same folder

namespace paddle_unpad {
namespace glue {

using paddle::DataType;
using paddle::Tensor;

inline std::string place_name(const paddle::Tensor& t) {
  return t.is_cpu() ? "CPU" : (t.is_gpu() ? "GPU" : "other");
}

using compat::dense;

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

}  // namespace glue
}  // namespace paddle_unpad
