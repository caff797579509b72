// The squared-norm reference against a long double sum computed here, for each input type.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "base/random.hpp"
#include "kernels/sq_norm.h"
#include "zinf/dtype.hpp"

namespace zinf::kernels {
namespace {

class SqNormRef : public ::testing::TestWithParam<std::size_t> {};

TEST_P(SqNormRef, Fp32MatchesLongDoubleSum) {
  const std::size_t count = GetParam();
  std::vector<float> x(count);
  fill_uniform(x.data(), count, 0x90 + count, -3.0f, 3.0f);
  long double expected = 0;
  for (float v : x) expected += static_cast<long double>(v) * v;
  const float got = sq_norm_ref(x.data(), HalfType::kNone, count);
  EXPECT_NEAR(got, static_cast<double>(expected), 1e-6 * static_cast<double>(expected) + 1e-30);
}

TEST_P(SqNormRef, HalfInputsAreWidenedExactly) {
  const std::size_t count = GetParam();
  std::vector<float> x(count);
  fill_uniform(x.data(), count, 0x91 + count, -100.0f, 100.0f);
  std::vector<std::uint16_t> bf(count), h(count);
  for (std::size_t i = 0; i < count; ++i) {
    bf[i] = f32_to_bf16(x[i]);
    h[i] = f32_to_f16(x[i]);
  }
  long double expected_bf = 0, expected_h = 0;
  for (std::size_t i = 0; i < count; ++i) {
    // Widen independently: bf16 is the top half of an f32; f16 through the compiler's _Float16.
    const std::uint32_t bits = static_cast<std::uint32_t>(bf[i]) << 16;
    float wide;
    std::memcpy(&wide, &bits, 4);
    expected_bf += static_cast<long double>(wide) * wide;
    _Float16 half;
    std::memcpy(&half, &h[i], 2);
    expected_h += static_cast<long double>(static_cast<float>(half)) * static_cast<float>(half);
  }
  EXPECT_NEAR(sq_norm_ref(bf.data(), HalfType::kBf16, count), static_cast<double>(expected_bf),
              1e-6 * static_cast<double>(expected_bf) + 1e-30);
  EXPECT_NEAR(sq_norm_ref(h.data(), HalfType::kF16, count), static_cast<double>(expected_h),
              1e-6 * static_cast<double>(expected_h) + 1e-30);
}

TEST(SqNormRefSpecial, InfAndNanPropagate) {
  std::vector<float> x(17, 1.0f);
  EXPECT_EQ(sq_norm_ref(x.data(), HalfType::kNone, x.size()), 17.0f);
  x[9] = -std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(sq_norm_ref(x.data(), HalfType::kNone, x.size())));
  x[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(sq_norm_ref(x.data(), HalfType::kNone, x.size())));
}

INSTANTIATE_TEST_SUITE_P(AwkwardSizes, SqNormRef, ::testing::Values(0, 1, 9, 1027, 262147));

}  // namespace
}  // namespace zinf::kernels
