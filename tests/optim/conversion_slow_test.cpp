// Exhaustive: every one of the 2^32 f32 bit patterns through each SIMD path's bf16 and f16
// conversion, against f32_to_bf16 / f32_to_f16. (The default tests cover every high half with
// chosen low halves; this closes the gap.) About 50 s of CPU time a path. A path this CPU cannot
// run is reported as skipped, with the reason, never passed.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <atomic>
#include <bit>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "optim/optim_util.hpp"

namespace zinf::optim_test {
namespace {

class HalfConversionExhaustive : public ::testing::TestWithParam<const char*> {};

TEST_P(HalfConversionExhaustive, EveryF32Pattern) {
  std::string why_not;
  const std::optional<Path> path = find_path(GetParam(), &why_not);
  if (!path) {
    GTEST_SKIP() << GetParam() << " path not tested: " << why_not;
  }
  constexpr std::uint64_t kChunk = 1 << 16;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    std::atomic<std::uint64_t> mismatches{0};
    std::atomic<std::uint64_t> converted{0};
    std::atomic<std::uint32_t> first_bad{0};
    tbb::parallel_for(tbb::blocked_range<std::uint64_t>(0, (std::uint64_t{1} << 32) / kChunk),
                      [&](const tbb::blocked_range<std::uint64_t>& range) {
                        std::vector<float> in(kChunk);
                        std::vector<std::uint16_t> out(kChunk);
                        for (std::uint64_t c = range.begin(); c != range.end(); ++c) {
                          for (std::uint64_t i = 0; i < kChunk; ++i) {
                            in[i] =
                                std::bit_cast<float>(static_cast<std::uint32_t>(c * kChunk + i));
                          }
                          path->table->convert(in.data(), out.data(), dtype, 0, kChunk);
                          for (std::uint64_t i = 0; i < kChunk; ++i) {
                            if (out[i] != round_half(in[i], dtype)) {
                              if (mismatches.fetch_add(1) == 0) {
                                first_bad = std::bit_cast<std::uint32_t>(in[i]);
                              }
                            }
                          }
                          converted += kChunk;
                        }
                      });
    EXPECT_EQ(converted.load(), std::uint64_t{1} << 32);
    EXPECT_EQ(mismatches.load(), 0u) << fmt::format("{} {}: first mismatch at f32 bits {:#010x}",
                                                    path->name, dtype_name(dtype),
                                                    first_bad.load());
  }
}

// The scalar path is the reference itself.
INSTANTIATE_TEST_SUITE_P(Paths, HalfConversionExhaustive,
                         ::testing::Values("avx2", "avx512-intbf16", "avx512-bf16"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace zinf::optim_test
