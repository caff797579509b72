// narrow() (see narrow.hpp).
#include "engine/narrow.hpp"

#include <cstdint>
#include <cstring>

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

}  // namespace zinf
