#include "kernels/common/runtime_settings.h"

namespace paddle_unpad {

RuntimeSettings& runtime_settings() {
  static RuntimeSettings s;
  return s;
}

}  // namespace paddle_unpad
