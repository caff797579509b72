// The widen reference against independent definitions: every one of the 65536 bf16 patterns is
// the f32 with those top 16 bits; every f16 pattern converts as the compiler's _Float16 does
// (NaNs stay NaNs with their sign); with accumulate each result is dst + x computed exactly in
// double and rounded once to f32 (the sum of two floats is exact in double), on sizes that are
// not multiples of the kernel's vector width.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "base/random.hpp"
#include "kernels/widen.h"

namespace zinf::kernels {
namespace {

std::vector<std::uint16_t> every_pattern() {
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  return all;
}

TEST(WidenRef, EveryBf16PatternIsTheF32WithThoseTopBits) {
  const std::vector<std::uint16_t> in = every_pattern();
  std::vector<float> out(in.size(), 1.0f);
  widen_to_f32_ref(in.data(), HalfType::kBf16, out.data(), in.size(), /*accumulate=*/false);
  for (std::size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i]), std::uint32_t{in[i]} << 16) << "i=" << i;
  }
}

TEST(WidenRef, EveryF16PatternMatchesCompilerConversion) {
  const std::vector<std::uint16_t> in = every_pattern();
  std::vector<float> out(in.size(), 1.0f);
  widen_to_f32_ref(in.data(), HalfType::kF16, out.data(), in.size(), /*accumulate=*/false);
  for (std::size_t i = 0; i < in.size(); ++i) {
    const float expected = static_cast<float>(std::bit_cast<_Float16>(in[i]));
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(out[i])) << "i=" << i;
      ASSERT_EQ(std::signbit(out[i]), std::signbit(expected)) << "i=" << i;
    } else {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i]), std::bit_cast<std::uint32_t>(expected))
          << "i=" << i;
    }
  }
}

class WidenRef : public ::testing::TestWithParam<std::size_t> {};

TEST_P(WidenRef, AccumulateAddsOnceRoundedAndCopyOverwrites) {
  const std::size_t count = GetParam();
  std::vector<float> base(count), src32(count);
  fill_uniform(base.data(), count, 0xacc + count, -3.0f, 3.0f);
  fill_uniform(src32.data(), count, 0x5c + count, -1e-2f, 1e-2f);
  std::vector<std::uint16_t> src16(count);
  SplitMix64 rng(0x16 + count);
  for (std::uint16_t& h : src16) {
    // Finite random halves in either format: clear the top exponent bit (no inf/NaN).
    h = static_cast<std::uint16_t>(rng.next() & 0xbfffu);
  }
  for (HalfType type : {HalfType::kNone, HalfType::kBf16, HalfType::kF16}) {
    const void* src = type == HalfType::kNone ? static_cast<const void*>(src32.data())
                                              : static_cast<const void*>(src16.data());
    std::vector<float> widened(count, std::nanf(""));
    widen_to_f32_ref(src, type, widened.data(), count, /*accumulate=*/false);
    std::vector<float> sum = base;
    widen_to_f32_ref(src, type, sum.data(), count, /*accumulate=*/true);
    for (std::size_t i = 0; i < count; ++i) {
      float x = src32[i];
      if (type == HalfType::kBf16) x = std::bit_cast<float>(std::uint32_t{src16[i]} << 16);
      if (type == HalfType::kF16) x = static_cast<float>(std::bit_cast<_Float16>(src16[i]));
      ASSERT_EQ(std::bit_cast<std::uint32_t>(widened[i]), std::bit_cast<std::uint32_t>(x))
          << "type " << static_cast<int>(type) << " i=" << i;
      const float expected =
          static_cast<float>(static_cast<double>(base[i]) + static_cast<double>(x));
      ASSERT_EQ(std::bit_cast<std::uint32_t>(sum[i]), std::bit_cast<std::uint32_t>(expected))
          << "type " << static_cast<int>(type) << " i=" << i;
    }
  }
}

// Sizes that are not multiples of the kernel's vector width (4).
INSTANTIATE_TEST_SUITE_P(AwkwardSizes, WidenRef, ::testing::Values(0, 1, 7, 19, 1023, 65537));

}  // namespace
}  // namespace zinf::kernels
