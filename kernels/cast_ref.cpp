// Scalar references of kernels/cast.cu: one element at a time through include/zinf/dtype.hpp.
#include "kernels/cast.h"
#include "zinf/dtype.hpp"

namespace zinf::kernels {

void cast_f32_to_bf16_ref(const float* src, std::uint16_t* dst, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) dst[i] = f32_to_bf16(src[i]);
}

void cast_f32_to_f16_ref(const float* src, std::uint16_t* dst, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) dst[i] = f32_to_f16(src[i]);
}

}  // namespace zinf::kernels
