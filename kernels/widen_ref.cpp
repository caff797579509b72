// Scalar reference of kernels/widen.cu: one element at a time through include/zinf/dtype.hpp.
#include "kernels/widen.h"
#include "zinf/dtype.hpp"

namespace zinf::kernels {
namespace {

template <typename Widen>
void widen_each(float* dst, std::size_t count, bool accumulate, Widen widen) {
  if (accumulate) {
    for (std::size_t i = 0; i < count; ++i) dst[i] += widen(i);
  } else {
    for (std::size_t i = 0; i < count; ++i) dst[i] = widen(i);
  }
}

}  // namespace

void widen_to_f32_ref(const void* src, HalfType src_type, float* dst, std::size_t count,
                      bool accumulate) {
  switch (src_type) {
    case HalfType::kNone: {
      const auto* s = static_cast<const float*>(src);
      widen_each(dst, count, accumulate, [s](std::size_t i) { return s[i]; });
      break;
    }
    case HalfType::kBf16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      widen_each(dst, count, accumulate, [s](std::size_t i) { return bf16_to_f32(s[i]); });
      break;
    }
    case HalfType::kF16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      widen_each(dst, count, accumulate, [s](std::size_t i) { return f16_to_f32(s[i]); });
      break;
    }
  }
}

}  // namespace zinf::kernels
