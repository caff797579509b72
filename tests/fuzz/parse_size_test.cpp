// cli::parse_size (`zinf plan --params`, `zinf bench`'s sizes) at the edge of 64 bits: the
// plan_input fuzz target found that a size past 2^64 was converted to an integer (undefined
// behaviour; on x86-64 a wrong count that `zinf plan` went on with). Such sizes are refused.
#include <gtest/gtest.h>

#include <cstddef>

#include "zinf/command.hpp"

namespace zinf::cli {
namespace {

TEST(ParseSize, SizesOf2To64OrMoreAreRefused) {
  std::size_t bytes = 7;
  EXPECT_FALSE(parse_size("1222222222222222222222222222", &bytes, /*decimal=*/true));
  EXPECT_FALSE(parse_size("18446744073709551616", &bytes));  // 2^64 bytes
  EXPECT_FALSE(parse_size("16777216T", &bytes));             // 2^24 TiB = 2^64
  EXPECT_FALSE(parse_size("20000000000G", &bytes, /*decimal=*/true));
  EXPECT_EQ(bytes, 7u) << "a refused size must leave the output alone";
  // Just below: 1.8e19 bytes (the digits are summed in double, so only near), and 2^24 TiB
  // less one TiB exactly.
  ASSERT_TRUE(parse_size("18000000000000000000", &bytes));
  EXPECT_NEAR(static_cast<double>(bytes), 1.8e19, 1e5);
  ASSERT_TRUE(parse_size("16777215T", &bytes));
  EXPECT_EQ(bytes, 16777215ull << 40);
  ASSERT_TRUE(parse_size("1.5GiB", &bytes));
  EXPECT_EQ(bytes, 1610612736u);
}

// A count of parameters written as model names write it: "7B" is 7e9 (it was 7), as in
// train_lm --params 1B; for a size, B stays bytes.
TEST(ParseSize, BIsABillionForACountAndBytesForASize) {
  std::size_t n = 0;
  ASSERT_TRUE(parse_size("7B", &n, /*decimal=*/true));
  EXPECT_EQ(n, 7000000000u);
  ASSERT_TRUE(parse_size("1.5b", &n, /*decimal=*/true));
  EXPECT_EQ(n, 1500000000u);
  ASSERT_TRUE(parse_size("7B", &n));
  EXPECT_EQ(n, 7u);
}

}  // namespace
}  // namespace zinf::cli
