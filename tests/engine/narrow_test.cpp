// narrow_checked() (lib/engine/narrow.hpp), which decides whether a frozen master may be kept as
// its half copy alone, against a reference worked element by element with dtype.hpp's scalar
// conversions: on seeded values a half dtype holds (each rounded to it first), with special values
// and with one element it does not hold at a known place, it returns that element (or the count)
// and leaves every element narrowed, as narrow() rounds it.
#include "engine/narrow.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "engine/engine_test_util.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using engine_test::seeded;

std::uint16_t narrow_one(DType dtype, float x) {
  return dtype == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x);
}
float widen_one(DType dtype, std::uint16_t h) {
  return dtype == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// The reference: the first element whose scalar round trip changes its bits, or the count.
std::size_t first_inexact_ref(DType dtype, const std::vector<float>& values) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float back = widen_one(dtype, narrow_one(dtype, values[i]));
    if (std::bit_cast<std::uint32_t>(back) != std::bit_cast<std::uint32_t>(values[i])) return i;
  }
  return values.size();
}

// `count` seeded values in [-2, 2) rounded to `dtype`, with -0, both infinities and a NaN whose
// payload lies in the bits both half dtypes keep (0x7fc10000) among them.
std::vector<float> held(DType dtype, std::size_t count, std::uint64_t seed) {
  std::vector<float> v = seeded(count, seed, -2.0f, 2.0f);
  for (float& x : v) x = widen_one(dtype, narrow_one(dtype, x));
  v[7] = -0.0f;
  v[100] = std::numeric_limits<float>::infinity();
  v[101] = -std::numeric_limits<float>::infinity();
  v[102] = std::bit_cast<float>(0x7fc10000u);
  return v;
}

// Checks narrow_checked() over `values` against the reference, and the halves it leaves.
void expect_matches_reference(DType dtype, const std::vector<float>& values, std::size_t want) {
  ASSERT_EQ(first_inexact_ref(dtype, values), want) << "the reference disagrees with the test";
  std::vector<std::uint16_t> half(values.size());
  std::vector<float> wide(values.size());
  EXPECT_EQ(narrow_checked(dtype, values.data(), values.size(), half.data(), wide.data()), want);
  for (std::size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(half[i], narrow_one(dtype, values[i])) << "element " << i;
  }
}

class NarrowChecked : public ::testing::TestWithParam<DType> {};

TEST_P(NarrowChecked, ValuesTheDtypeHoldsGiveTheCount) {
  const DType dtype = GetParam();
  expect_matches_reference(dtype, held(dtype, 10'000, 8701), 10'000);
}

TEST_P(NarrowChecked, GivesTheFirstElementTheDtypeDoesNotHold) {
  const DType dtype = GetParam();
  for (const std::size_t at : {std::size_t{0}, std::size_t{5003}, std::size_t{9999}}) {
    std::vector<float> v = held(dtype, 10'000, 8702);
    v[at] = std::nextafter(v[at], 4.0f);  // one fp32 step off a value the dtype holds
    if (at != 9999) v[9999] = std::nextafter(v[9999], 4.0f);  // a later one does not count
    expect_matches_reference(dtype, v, at);
  }
}

// A quiet NaN whose payload only fp32 keeps (0x7fc00001): narrowed, it widens to another NaN,
// which is not the value written.
TEST_P(NarrowChecked, ANaNWhosePayloadTheDtypeDropsIsNotHeld) {
  const DType dtype = GetParam();
  std::vector<float> v = held(dtype, 10'000, 8703);
  v[777] = std::bit_cast<float>(0x7fc00001u);
  expect_matches_reference(dtype, v, 777);
}

INSTANTIATE_TEST_SUITE_P(HalfDtypes, NarrowChecked, ::testing::Values(DType::kBF16, DType::kF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return info.param == DType::kBF16 ? "bf16" : "f16";
                         });

}  // namespace
}  // namespace zinf
