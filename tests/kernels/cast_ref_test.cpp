// The cast references against an independent rounding: the two neighbouring 16-bit values of
// each input are found from the bit pattern and the nearer one picked in double precision (ties
// to the even pattern); f16 is also checked against the compiler's _Float16 conversion.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "base/random.hpp"
#include "kernels/cast.h"
#include "zinf/dtype.hpp"

namespace zinf::kernels {
namespace {

// Inputs that exercise rounding: random values over the whole exponent range, ties, values
// next to the format limits, subnormals, signed zeros, infinities and NaNs with payloads.
std::vector<float> awkward_inputs(std::size_t count, std::uint64_t seed) {
  std::vector<float> out(count);
  SplitMix64 rng(seed);
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            -1.5f,
                            65504.0f,
                            65519.99f,
                            65520.0f,
                            -65536.0f,
                            5.96046448e-08f,  // smallest f16 subnormal
                            2.98023224e-08f,  // half of it: ties to zero
                            6.1035156e-05f,   // smallest f16 normal
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::bit_cast<float>(0x7fc00001u),
                            std::bit_cast<float>(0xff800001u),   // signalling NaN, low payload
                            std::bit_cast<float>(0x3f808000u),   // bf16 tie, even below
                            std::bit_cast<float>(0x3f818000u)};  // bf16 tie, odd below
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint64_t r = rng.next();
    if (i < std::size(specials)) {
      out[i] = specials[i];
    } else if (r % 4 == 0) {
      out[i] = std::bit_cast<float>(static_cast<std::uint32_t>(r >> 32));  // any pattern
    } else if (r % 4 == 1) {
      // Exact f16/bf16 ties: a representable value plus half an ulp.
      out[i] = std::bit_cast<float>((static_cast<std::uint32_t>(r >> 32) & 0xffff8000u) | 0x8000u);
    } else {
      out[i] = static_cast<float>(
          std::ldexp(rng.uniform() * 2.0 - 1.0, static_cast<int>((r >> 8) % 48) - 30));
    }
  }
  return out;
}

// Independent bf16 rounding: bf16 values are f32 patterns with the low 16 bits clear.
std::uint16_t bf16_by_distance(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t down = bits & 0xffff0000u;
  const std::uint32_t up = down + 0x10000u;  // Next pattern away from zero (may be infinity).
  const double d_down = std::fabs(static_cast<double>(x) - std::bit_cast<float>(down));
  const double up_value = (up & 0x7fffffffu) >= 0x7f800000u
                              ? std::ldexp(std::copysign(1.0, x), 128)  // unbounded next value
                              : static_cast<double>(std::bit_cast<float>(up));
  const double d_up = std::fabs(up_value - static_cast<double>(x));
  if (d_down < d_up) return static_cast<std::uint16_t>(down >> 16);
  if (d_up < d_down) return static_cast<std::uint16_t>(up >> 16);
  return static_cast<std::uint16_t>(((down >> 16) & 1u) ? up >> 16 : down >> 16);
}

void expect_nan_kept(float x, std::uint16_t h, int mant_bits) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint16_t exp_mask = static_cast<std::uint16_t>(0x7fffu & ~((1u << mant_bits) - 1u));
  ASSERT_EQ(h & exp_mask, exp_mask) << std::hex << bits;
  ASSERT_NE(h & ((1u << mant_bits) - 1u), 0u) << "NaN became infinity: " << std::hex << bits;
  ASSERT_EQ(h >> 15, bits >> 31) << "NaN lost its sign";
  const std::uint32_t top = (bits & 0x7fffffu) >> (23 - mant_bits);
  if (top != 0) {
    ASSERT_EQ(h & ((1u << mant_bits) - 1u), top) << "payload not kept";
  }
}

class CastRef : public ::testing::TestWithParam<std::size_t> {};

TEST_P(CastRef, Bf16MatchesRoundingByDistance) {
  const std::size_t count = GetParam();
  const std::vector<float> in = awkward_inputs(count, 0xb16 + count);
  std::vector<std::uint16_t> out(count, 0xdead);
  cast_f32_to_bf16_ref(in.data(), out.data(), count);
  for (std::size_t i = 0; i < count; ++i) {
    if (std::isnan(in[i])) {
      expect_nan_kept(in[i], out[i], 7);
    } else {
      ASSERT_EQ(out[i], bf16_by_distance(in[i]))
          << "i=" << i << " x=" << in[i] << " bits=" << std::hex
          << std::bit_cast<std::uint32_t>(in[i]);
    }
  }
}

TEST_P(CastRef, F16MatchesCompilerConversion) {
  const std::size_t count = GetParam();
  const std::vector<float> in = awkward_inputs(count, 0xf16 + count);
  std::vector<std::uint16_t> out(count, 0xdead);
  cast_f32_to_f16_ref(in.data(), out.data(), count);
  for (std::size_t i = 0; i < count; ++i) {
    if (std::isnan(in[i])) {
      expect_nan_kept(in[i], out[i], 10);
    } else {
      const auto expected = std::bit_cast<std::uint16_t>(static_cast<_Float16>(in[i]));
      ASSERT_EQ(out[i], expected) << "i=" << i << " x=" << in[i];
    }
  }
}

// Sizes that are not multiples of the kernels' vector widths (4 and 8).
INSTANTIATE_TEST_SUITE_P(AwkwardSizes, CastRef, ::testing::Values(0, 1, 7, 19, 1023, 65537));

}  // namespace
}  // namespace zinf::kernels
