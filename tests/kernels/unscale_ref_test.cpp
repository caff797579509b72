// The unscale reference against double-precision products (exact for a product of two floats,
// so the expected fp32 result is that product rounded once) and the flag's contract.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "base/random.hpp"
#include "kernels/unscale.h"

namespace zinf::kernels {
namespace {

class UnscaleRef : public ::testing::TestWithParam<std::size_t> {};

TEST_P(UnscaleRef, FiniteGradientsAreScaledAndFlagStaysClear) {
  const std::size_t count = GetParam();
  std::vector<float> grad(count);
  fill_uniform(grad.data(), count, 0x5ca1e + count, -6e4f, 6e4f);
  const std::vector<float> original = grad;
  const float inv_scale = 1.0f / 65536.0f * 3.0f;  // Not a power of two: rounding matters.
  std::int32_t found_inf = 0;
  unscale_grads_ref(grad.data(), count, inv_scale, &found_inf);
  EXPECT_EQ(found_inf, 0);
  for (std::size_t i = 0; i < count; ++i) {
    const float expected =
        static_cast<float>(static_cast<double>(original[i]) * static_cast<double>(inv_scale));
    ASSERT_EQ(grad[i], expected) << "i=" << i;
  }
}

TEST_P(UnscaleRef, AnyInfOrNanSetsTheFlag) {
  const std::size_t count = GetParam();
  if (count == 0) {
    std::int32_t found_inf = 0;
    unscale_grads_ref(nullptr, 0, 0.5f, &found_inf);
    EXPECT_EQ(found_inf, 0) << "an empty gradient has nothing non-finite";
    return;
  }
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (float value : bad) {
    std::vector<float> grad(count);
    fill_uniform(grad.data(), count, 77);
    grad[count - 1] = value;  // The last element: the scalar tail after any vector body.
    std::int32_t found_inf = 0;
    unscale_grads_ref(grad.data(), count, 0.5f, &found_inf);
    EXPECT_EQ(found_inf, 1) << "value " << value;
  }
}

TEST(UnscaleRef, FlagIsNeverCleared) {
  std::vector<float> grad(33);
  fill_uniform(grad.data(), grad.size(), 5);
  std::int32_t found_inf = 1;
  unscale_grads_ref(grad.data(), grad.size(), 0.25f, &found_inf);
  EXPECT_EQ(found_inf, 1);
}

INSTANTIATE_TEST_SUITE_P(AwkwardSizes, UnscaleRef, ::testing::Values(0, 1, 3, 5, 1021, 100003));

}  // namespace
}  // namespace zinf::kernels
