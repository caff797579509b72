// narrow(), widen() and the exactness check (see narrow.hpp).
#include "engine/narrow.hpp"

#include <cstdint>
#include <cstring>

#include "base/assert.hpp"

namespace zinf {

void narrow(const float* src, std::size_t count, DType dtype, void* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * sizeof(float));
      break;
    case DType::kBF16:
      convert_f32_to_bf16(src, static_cast<std::uint16_t*>(dst), count);
      break;
    case DType::kF16:
      convert_f32_to_f16(src, static_cast<std::uint16_t*>(dst), count);
      break;
  }
}

void widen(const void* src, std::size_t count, DType dtype, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * sizeof(float));
      break;
    case DType::kBF16:
      convert_bf16_to_f32(static_cast<const std::uint16_t*>(src), dst, count);
      break;
    case DType::kF16:
      convert_f16_to_f32(static_cast<const std::uint16_t*>(src), dst, count);
      break;
  }
}

std::size_t narrow_checked(DType dtype, const float* values, std::size_t count, std::uint16_t* half,
                           float* wide) {
  ZINF_ASSERT(dtype != DType::kF32);
  narrow(values, count, dtype, half);
  widen(half, count, dtype, wide);
  // One comparison of the whole block where every element is held (a frozen base loaded from the
  // half dtype), and the element only in a block that differs.
  if (std::memcmp(wide, values, count * sizeof(float)) == 0) return count;
  std::size_t i = 0;
  while (i < count && std::memcmp(wide + i, values + i, sizeof(float)) == 0) ++i;
  return i;
}

}  // namespace zinf
