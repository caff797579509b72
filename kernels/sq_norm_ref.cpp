// Scalar reference of kernels/sq_norm.cu.
#include "kernels/sq_norm.h"
#include "zinf/dtype.hpp"

namespace zinf::kernels {

float sq_norm_ref(const void* x, HalfType type, std::size_t count) {
  double sum = 0.0;
  for (std::size_t i = 0; i < count; ++i) {
    double v = 0.0;
    switch (type) {
      case HalfType::kBf16:
        v = bf16_to_f32(static_cast<const std::uint16_t*>(x)[i]);
        break;
      case HalfType::kF16:
        v = f16_to_f32(static_cast<const std::uint16_t*>(x)[i]);
        break;
      case HalfType::kNone:
        v = static_cast<const float*>(x)[i];
        break;
    }
    sum += v * v;
  }
  return static_cast<float>(sum);
}

}  // namespace zinf::kernels
