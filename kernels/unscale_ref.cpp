// Scalar reference of kernels/unscale.cu.
#include <cmath>

#include "kernels/unscale.h"

namespace zinf::kernels {

void unscale_grads_ref(float* grad, std::size_t count, float inv_scale, std::int32_t* found_inf) {
  for (std::size_t i = 0; i < count; ++i) {
    if (!std::isfinite(grad[i])) *found_inf = 1;
    grad[i] = grad[i] * inv_scale;
  }
}

}  // namespace zinf::kernels
