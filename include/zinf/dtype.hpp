// Element types of tensors and their conversions.
//
// f32 is IEEE-754 binary32; f16 is IEEE-754 binary16; bf16 is bfloat16 (the top 16 bits of a
// binary32). Conversions from f32 round to nearest, ties to even (the IEEE default, and what
// torch's `.to(torch.bfloat16)` / `.half()` do on the CPU); infinities stay infinities; a NaN
// stays a NaN with its sign and as many of its top payload bits as fit, and is made quiet only
// when dropping low payload bits would turn it into an infinity. So every f16 and every bf16 bit
// pattern converts to f32 and back to itself. Widening conversions are exact.
//
// Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace zinf {

enum class DType : std::uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr std::size_t dtype_bytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }
// Whether `dtype` is one of the enumerators (a value cast from an integer may be none).
constexpr bool dtype_valid(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}
// "f32", "f16" or "bf16".
std::string_view dtype_name(DType dtype);
// Parses "f32"/"fp32"/"float32", "f16"/"fp16"/"float16"/"half", "bf16"/"bfloat16".
std::optional<DType> parse_dtype(std::string_view text);

// bf16 <- f32, round to nearest even.
constexpr std::uint16_t f32_to_bf16(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign and top payload bits.
    std::uint16_t out = static_cast<std::uint16_t>(bits >> 16);
    if ((out & 0x007fu) == 0) out |= 0x0040u;  // The kept payload was empty: make it quiet.
    return out;
  }
  // Adding 0x7fff plus the lowest kept bit rounds to nearest with ties to even; a carry out of
  // the mantissa correctly bumps the exponent, up to infinity.
  const std::uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<std::uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

// f32 <- bf16, exact.
constexpr float bf16_to_f32(std::uint16_t value) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(value) << 16);
}

// f16 <- f32, round to nearest even, with f16 subnormals and overflow to infinity.
constexpr std::uint16_t f32_to_f16(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) {
    if (abs == 0x7f800000u) return sign | 0x7c00u;  // Infinity.
    std::uint16_t payload = static_cast<std::uint16_t>((abs >> 13) & 0x03ffu);
    if (payload == 0) payload = 0x0200u;  // Keep it a NaN: set the quiet bit.
    return sign | 0x7c00u | payload;
  }
  // 0x477ff000 is 65520: the smallest f32 that rounds to infinity in f16.
  if (abs >= 0x477ff000u) return sign | 0x7c00u;
  const int exp = static_cast<int>(abs >> 23) - 127;
  if (exp >= -14) {
    // Normal f16: rebias the exponent and round the 23-bit mantissa to 10 bits.
    const std::uint32_t rebased = abs - (112u << 23);  // exponent bias 127 -> 15
    const std::uint32_t lsb = (rebased >> 13) & 1u;
    return sign | static_cast<std::uint16_t>((rebased + 0xfffu + lsb) >> 13);
  }
  if (exp < -25) return sign;  // Below half the smallest subnormal: rounds to zero.
  // Subnormal f16: value = m * 2^-24 with m the integer below 1024. Shift the full 24-bit
  // significand right and round to nearest even on the bits shifted out.
  const std::uint32_t significand = (abs & 0x007fffffu) | 0x00800000u;
  const int shift = -exp - 1;  // 14..24 bits: exp=-15 -> 14 (-1 from 2^-24 unit, 13 mantissa)
  const std::uint32_t kept = significand >> shift;
  const std::uint32_t rest = significand & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  const std::uint32_t rounded = kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
  return sign | static_cast<std::uint16_t>(rounded);
}

// f32 <- f16, exact (subnormals become normal f32 values).
constexpr float f16_to_f32(std::uint16_t value) {
  const std::uint32_t sign = static_cast<std::uint32_t>(value & 0x8000u) << 16;
  const std::uint32_t exp = (value >> 10) & 0x1fu;
  std::uint32_t mantissa = value & 0x03ffu;
  if (exp == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return std::bit_cast<float>(sign);
  // Subnormal: normalise the mantissa.
  std::uint32_t e = 113;  // 127 - 14
  while ((mantissa & 0x0400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  return std::bit_cast<float>(sign | (e << 23) | ((mantissa & 0x03ffu) << 13));
}

// Converts `count` elements; `dst` and `src` must not overlap.
void convert_f32_to_bf16(const float* src, std::uint16_t* dst, std::size_t count);
void convert_f32_to_f16(const float* src, std::uint16_t* dst, std::size_t count);
void convert_bf16_to_f32(const std::uint16_t* src, float* dst, std::size_t count);
void convert_f16_to_f32(const std::uint16_t* src, float* dst, std::size_t count);

}  // namespace zinf
