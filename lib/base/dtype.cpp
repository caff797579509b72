#include "zinf/dtype.hpp"

#include "base/cpu.hpp"
#include "base/dtype_kernel.hpp"

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

namespace dtype_kernel {

void f32_to_bf16_sse2(const float* src, std::uint16_t* dst, std::size_t count) {
  f32_to_bf16_range(src, dst, count);
}

}  // namespace dtype_kernel

namespace {

using ConvertFn = void (*)(const float*, std::uint16_t*, std::size_t);

// The widest loop the CPU runs (dtype_kernel.hpp), chosen once.
ConvertFn pick_f32_to_bf16() {
  if (cpu_features().has_avx512_path()) return &dtype_kernel::f32_to_bf16_avx512;
  if (cpu_features().has_avx2_path()) return &dtype_kernel::f32_to_bf16_avx2;
  return &dtype_kernel::f32_to_bf16_sse2;
}

}  // namespace

void convert_f32_to_bf16(const float* src, std::uint16_t* dst, std::size_t count) {
  static const ConvertFn convert = pick_f32_to_bf16();
  convert(src, dst, count);
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
