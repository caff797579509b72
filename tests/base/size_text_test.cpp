// Sizes and counts as the command line writes them: every unit of the table in
// base/size_text.hpp, as a size and as a count, against the multiples written out; and what is
// refused.
#include "base/size_text.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

namespace zinf {
namespace {

TEST(SizeText, EveryUnitAsASizeAndAsACount) {
  struct Case {
    const char* text;
    double size;   // decimal false
    double count;  // decimal true
  };
  const double ki = 1024.0, mi = ki * ki, gi = mi * ki, ti = gi * ki;
  const Case cases[] = {
      {"3", 3, 3},
      {"3b", 3, 3e9},
      {"3B", 3, 3e9},
      {"3k", 3 * ki, 3e3},
      {"3K", 3 * ki, 3e3},
      {"3m", 3 * mi, 3e6},
      {"3M", 3 * mi, 3e6},
      {"3g", 3 * gi, 3e9},
      {"3G", 3 * gi, 3e9},
      {"3t", 3 * ti, 3e12},
      {"3T", 3 * ti, 3e12},
      {"3kb", 3e3, 3e3},
      {"3KB", 3e3, 3e3},
      {"3mb", 3e6, 3e6},
      {"3MB", 3e6, 3e6},
      {"3gb", 3e9, 3e9},
      {"3GB", 3e9, 3e9},
      {"3tb", 3e12, 3e12},
      {"3TB", 3e12, 3e12},
      {"3kib", 3 * ki, 3 * ki},
      {"3KiB", 3 * ki, 3 * ki},
      {"3mib", 3 * mi, 3 * mi},
      {"3MiB", 3 * mi, 3 * mi},
      {"3gib", 3 * gi, 3 * gi},
      {"3GiB", 3 * gi, 3 * gi},
      {"3tib", 3 * ti, 3 * ti},
      {"3TiB", 3 * ti, 3 * ti},
      {"1.5G", 1.5 * gi, 1.5e9},
      {".5k", 512, 500},
      {"2.", 2, 2},
      {"0.25MiB", 0.25 * mi, 0.25 * mi},
  };
  for (const Case& c : cases) {
    const std::optional<double> size = parse_scaled(c.text, /*decimal=*/false);
    const std::optional<double> count = parse_scaled(c.text, /*decimal=*/true);
    ASSERT_TRUE(size.has_value()) << c.text;
    ASSERT_TRUE(count.has_value()) << c.text;
    EXPECT_EQ(*size, c.size) << c.text;
    EXPECT_EQ(*count, c.count) << c.text;
    std::uint64_t bytes = 0;
    ASSERT_TRUE(parse_size(c.text, &bytes)) << c.text;
    EXPECT_EQ(static_cast<double>(bytes), c.size) << c.text;
  }
}

TEST(SizeText, RefusesAnythingElseAndLeavesTheOutputAlone) {
  for (const char* text : {"", ".", "k", "-1", "+1", " 1", "1 ", "1 k", "1.2.3", "1e9", "1x", "1kk",
                           "1kibb", "1ib", "1p", "1%", "0x10", "1,5"}) {
    EXPECT_FALSE(parse_scaled(text, false).has_value()) << text;
    EXPECT_FALSE(parse_scaled(text, true).has_value()) << text;
    std::uint64_t out = 7;
    EXPECT_FALSE(parse_size(text, &out)) << text;
    EXPECT_EQ(out, 7u) << text;
  }
}

// Digits past a double's range are infinite (more than anything), a fraction below its smallest
// value 0; whole numbers round to the nearest and stop below 2^64.
TEST(SizeText, ExtremesAndRounding) {
  const std::string huge(400, '9');
  EXPECT_EQ(*parse_scaled(huge, true), HUGE_VAL);
  std::uint64_t out = 7;
  EXPECT_FALSE(parse_size(huge, &out, true));
  EXPECT_EQ(*parse_scaled("0." + std::string(400, '0') + "1", true), 0.0);
  ASSERT_TRUE(parse_size("2.5", &out));
  EXPECT_EQ(out, 3u);
  ASSERT_TRUE(parse_size("2.49", &out));
  EXPECT_EQ(out, 2u);
  ASSERT_TRUE(parse_size("16777215T", &out));
  EXPECT_EQ(out, std::uint64_t{16777215} << 40);
  EXPECT_FALSE(parse_size("16777216T", &out));  // 2^64
  EXPECT_FALSE(parse_size("18446744073709551616", &out));
}

}  // namespace
}  // namespace zinf
