#include "zinf/dtype.hpp"

namespace zinf {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "unknown";
}

std::optional<DType> parse_dtype(std::string_view text) {
  if (text == "f32" || text == "fp32" || text == "float32" || text == "float") return DType::kF32;
  if (text == "f16" || text == "fp16" || text == "float16" || text == "half") return DType::kF16;
  if (text == "bf16" || text == "bfloat16") return DType::kBF16;
  return std::nullopt;
}

void convert_f32_to_bf16(const float* src, std::uint16_t* dst, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) dst[i] = f32_to_bf16(src[i]);
}
void convert_f32_to_f16(const float* src, std::uint16_t* dst, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) dst[i] = f32_to_f16(src[i]);
}
void convert_bf16_to_f32(const std::uint16_t* src, float* dst, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) dst[i] = bf16_to_f32(src[i]);
}
void convert_f16_to_f32(const std::uint16_t* src, float* dst, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) dst[i] = f16_to_f32(src[i]);
}

}  // namespace zinf
