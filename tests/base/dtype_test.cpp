// DType conversions: exhaustive round trips for every half pattern, and f32 -> half rounding
// against two independent references: an exact rounding computed in double precision from the
// definition of round-to-nearest-even, and (for f16) the compiler's own _Float16 conversion.
#include "zinf/dtype.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "base/cpu.hpp"
#include "base/dtype_kernel.hpp"
#include "base/random.hpp"

namespace zinf {
namespace {

bool is_nan16(std::uint16_t h, int exp_bits) {
  const int mant_bits = 15 - exp_bits;
  const std::uint16_t exp_mask = static_cast<std::uint16_t>(((1u << exp_bits) - 1) << mant_bits);
  return (h & exp_mask) == exp_mask && (h & ((1u << mant_bits) - 1)) != 0;
}

// Value of a finite half pattern with `exp_bits` exponent bits, computed from the definition.
double half_value(std::uint16_t h, int exp_bits) {
  const int mant_bits = 15 - exp_bits;
  const int bias = (1 << (exp_bits - 1)) - 1;
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> mant_bits) & ((1 << exp_bits) - 1);
  const int mant = h & ((1 << mant_bits) - 1);
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), 1 - bias - mant_bits);
  return sign * std::ldexp(static_cast<double>(mant + (1 << mant_bits)), exp - bias - mant_bits);
}

// Reference rounding of x to the half format by brute reasoning on doubles: find the two
// neighbouring representable values and pick the nearer, ties to the even pattern. Overflow is
// decided by the IEEE rule: round as if the exponent range were unbounded, and a result above
// the largest finite value becomes infinity.
std::uint16_t reference_round(float x, int exp_bits) {
  const int mant_bits = 15 - exp_bits;
  const std::uint16_t inf = static_cast<std::uint16_t>(((1u << exp_bits) - 1) << mant_bits);
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isinf(x)) return sign | inf;
  const double a = std::fabs(static_cast<double>(x));
  // Largest finite pattern and the "next" value beyond it (one ulp above max).
  const std::uint16_t max_finite = static_cast<std::uint16_t>(inf - 1);
  const double max_value = half_value(max_finite, exp_bits);
  const double beyond = max_value + (max_value - half_value(max_finite - 1, exp_bits));
  if (a >= beyond) return sign | inf;
  if (a > max_value) {
    // Between max and the unbounded next value: the tie goes to the even one, which is the
    // unbounded value (max_finite has an odd mantissa), so it becomes infinity.
    const double mid = 0.5 * (max_value + beyond);
    return (a < mid) ? (sign | max_finite) : (sign | inf);
  }
  // Binary search the largest pattern whose value is <= a.
  std::uint16_t lo = 0, hi = max_finite;
  while (lo < hi) {
    const std::uint16_t mid = static_cast<std::uint16_t>((lo + hi + 1) / 2);
    if (half_value(mid, exp_bits) <= a)
      lo = mid;
    else
      hi = static_cast<std::uint16_t>(mid - 1);
  }
  if (half_value(lo, exp_bits) == a) return sign | lo;
  const std::uint16_t up = static_cast<std::uint16_t>(lo + 1);
  const double d_lo = a - half_value(lo, exp_bits);
  const double d_up = half_value(up, exp_bits) - a;
  if (d_lo < d_up) return sign | lo;
  if (d_up < d_lo) return sign | up;
  return sign | ((lo & 1) ? up : lo);
}

TEST(DType, EveryBf16PatternRoundTrips) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float f = bf16_to_f32(bits);
    ASSERT_EQ(f32_to_bf16(f), bits) << "bf16 0x" << std::hex << h;
    if ((bits & 0x7f80u) == 0x7f80u) {
      if (bits & 0x7fu)
        ASSERT_TRUE(std::isnan(f));
      else
        ASSERT_TRUE(std::isinf(f));
    } else {
      ASSERT_EQ(static_cast<double>(f), half_value(bits, 8)) << std::hex << h;
    }
  }
}

TEST(DType, EveryF16PatternRoundTrips) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float f = f16_to_f32(bits);
    ASSERT_EQ(f32_to_f16(f), bits) << "f16 0x" << std::hex << h;
    if ((bits & 0x7c00u) == 0x7c00u) {
      if (bits & 0x3ffu)
        ASSERT_TRUE(std::isnan(f));
      else
        ASSERT_TRUE(std::isinf(f));
    } else {
      ASSERT_EQ(static_cast<double>(f), half_value(bits, 5)) << std::hex << h;
    }
  }
}

std::vector<float> edge_values() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          65504.0f,
                          65519.99f,
                          65520.0f,
                          65536.0f,
                          -65520.0f,
                          1e-8f,
                          5.960464477539063e-08f /* 2^-24 */,
                          2.9802322387695312e-08f /* 2^-25: tie to zero */,
                          4.470348358154297e-08f /* 1.5 * 2^-25 */,
                          6.103515625e-05f /* smallest normal f16 */,
                          6.097555160522461e-05f /* largest subnormal f16 */,
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          3.3895313892515355e+38f /* bf16 max */};
  // Exact ties for both formats: x = a + half-ulp with a representable.
  for (float base : {1.0f, 1.5f, 3.0f, 1024.0f, 0.125f, -7.0f}) {
    const std::uint32_t b = std::bit_cast<std::uint32_t>(base);
    v.push_back(std::bit_cast<float>(b | 0x8000u));   // bf16 tie, even below
    v.push_back(std::bit_cast<float>(b | 0x18000u));  // bf16 tie, odd below
    v.push_back(std::bit_cast<float>(b | 0x1000u));   // f16 tie, even below
    v.push_back(std::bit_cast<float>(b | 0x3000u));   // f16 tie, odd below
  }
  return v;
}

TEST(DType, F32ToHalfMatchesReferenceOnEdges) {
  for (float x : edge_values()) {
    EXPECT_EQ(f32_to_bf16(x), reference_round(x, 8)) << "x=" << x;
    EXPECT_EQ(f32_to_f16(x), reference_round(x, 5)) << "x=" << x;
  }
}

TEST(DType, F32ToHalfMatchesReferenceOnRandomValues) {
  SplitMix64 rng(0xd7e5);
  for (int i = 0; i < 200000; ++i) {
    // Random bit patterns cover every exponent; keep them finite and non-NaN here.
    const auto bits = static_cast<std::uint32_t>(rng.next());
    const float x = std::bit_cast<float>(bits);
    if (std::isnan(x)) continue;
    ASSERT_EQ(f32_to_bf16(x), reference_round(x, 8)) << "bits=0x" << std::hex << bits;
    ASSERT_EQ(f32_to_f16(x), reference_round(x, 5)) << "bits=0x" << std::hex << bits;
  }
  // Values concentrated in the f16 range, where rounding of subnormals matters.
  for (int i = 0; i < 200000; ++i) {
    const float x = std::ldexp(static_cast<float>(rng.uniform()) * 2 - 1,
                               static_cast<int>(rng.next() % 48) - 30);
    ASSERT_EQ(f32_to_f16(x), reference_round(x, 5)) << "x=" << x;
    ASSERT_EQ(f32_to_bf16(x), reference_round(x, 8)) << "x=" << x;
  }
}

#if defined(__FLT16_MAX__)
TEST(DType, F32ToF16MatchesCompilerFloat16) {
  SplitMix64 rng(0xf16);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(rng.next()));
    if (std::isnan(x)) continue;
    const _Float16 h = static_cast<_Float16>(x);
    ASSERT_EQ(f32_to_f16(x), std::bit_cast<std::uint16_t>(h)) << "x=" << x;
  }
}
#endif

TEST(DType, NanStaysNanWithSign) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  // A NaN whose payload lives only in the low bits must not become infinity.
  const float low_payload = std::bit_cast<float>(0x7f800001u);
  const float neg_low = std::bit_cast<float>(0xff800001u);
  for (float x : {qnan, -qnan, low_payload, neg_low}) {
    EXPECT_TRUE(is_nan16(f32_to_bf16(x), 8)) << std::hex << std::bit_cast<std::uint32_t>(x);
    EXPECT_TRUE(is_nan16(f32_to_f16(x), 5)) << std::hex << std::bit_cast<std::uint32_t>(x);
    EXPECT_EQ(f32_to_bf16(x) >> 15, std::bit_cast<std::uint32_t>(x) >> 31);
    EXPECT_EQ(f32_to_f16(x) >> 15, std::bit_cast<std::uint32_t>(x) >> 31);
  }
}

TEST(DType, NamesAndSizes) {
  EXPECT_EQ(dtype_bytes(DType::kF32), 4u);
  EXPECT_EQ(dtype_bytes(DType::kBF16), 2u);
  EXPECT_EQ(dtype_name(DType::kF16), "f16");
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("fp32"), DType::kF32);
  EXPECT_FALSE(parse_dtype("int8").has_value());
}

TEST(DType, BulkConversionsMatchScalar) {
  std::vector<float> src(1001);
  fill_uniform(src.data(), src.size(), 7, -70000.0f, 70000.0f);
  std::vector<std::uint16_t> half(src.size());
  std::vector<float> back(src.size());
  convert_f32_to_f16(src.data(), half.data(), src.size());
  convert_f16_to_f32(half.data(), back.data(), src.size());
  for (std::size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(half[i], f32_to_f16(src[i]));
    ASSERT_EQ(back[i], f16_to_f32(half[i]));
  }
  convert_f32_to_bf16(src.data(), half.data(), src.size());
  convert_bf16_to_f32(half.data(), back.data(), src.size());
  for (std::size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(half[i], f32_to_bf16(src[i]));
    ASSERT_EQ(back[i], bf16_to_f32(half[i]));
  }
}

// convert_f32_to_bf16() runs the widest of three compiled loops (dtype_kernel.hpp); each one this
// CPU can run must give f32_to_bf16()'s bits for every kind of input: random bit patterns (NaNs
// with any payload, infinities, subnormals, every exponent), the edge values, and lengths and
// starts that are not multiples of a vector, so the loops' tails and unaligned heads run too.
TEST(DType, EveryBf16LoopMatchesScalar) {
  using Loop = void (*)(const float*, std::uint16_t*, std::size_t);
  std::vector<std::pair<const char*, Loop>> loops = {{"sse2", &dtype_kernel::f32_to_bf16_sse2},
                                                     {"public", &convert_f32_to_bf16}};
  if (cpu_features().has_avx2_path()) loops.push_back({"avx2", &dtype_kernel::f32_to_bf16_avx2});
  if (cpu_features().has_avx512_path()) {
    loops.push_back({"avx512", &dtype_kernel::f32_to_bf16_avx512});
  }
  SplitMix64 rng(0xbf16);
  std::vector<float> src(100003);
  for (float& x : src) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng.next()));
  const std::vector<float> edges = edge_values();
  std::copy(edges.begin(), edges.end(), src.begin() + 17);
  // NaNs whose top payload bits are empty (the quiet bit must be set) and full.
  for (std::uint32_t bits : {0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7fffffffu, 0xffbf0000u}) {
    src.push_back(std::bit_cast<float>(bits));
  }
  for (const auto& [name, loop] : loops) {
    for (std::size_t start : {std::size_t{0}, std::size_t{1}, std::size_t{13}}) {
      for (std::size_t count :
           {std::size_t{0}, std::size_t{1}, std::size_t{31}, std::size_t{67}, src.size() - start}) {
        std::vector<std::uint16_t> out(count + 2, 0xabcd);
        loop(src.data() + start, out.data() + 1, count);
        ASSERT_EQ(out.front(), 0xabcd) << name;
        ASSERT_EQ(out.back(), 0xabcd) << name << ": wrote past the end";
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_EQ(out[i + 1], f32_to_bf16(src[start + i]))
              << name << " bits=0x" << std::hex << std::bit_cast<std::uint32_t>(src[start + i]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace zinf
