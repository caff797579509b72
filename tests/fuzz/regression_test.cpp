// Every fuzz target (targets/targets.hpp) run on its seed corpus (corpus/<target>/) and on every
// input a fuzzer ever crashed on (regressions/<target>/), built with the normal compiler in the
// normal build. A crash or a failed check aborts the test binary, which fails the test.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "targets/targets.hpp"

namespace zinf::fuzz {
namespace {

namespace fs = std::filesystem;

struct Target {
  const char* name;
  int (*run)(const std::uint8_t*, std::size_t);
};

constexpr Target kTargets[] = {
    {"config", config},
    {"tcp_wire", tcp_wire},
    {"plan_input", plan_input},
    {"checkpoint_header", checkpoint_header},
    {"checkpoint_manifest", checkpoint_manifest},
};

// Feeds each file of tests/fuzz/<kind>/<target>/ to the target; returns how many.
std::size_t run_files(const Target& target, const std::string& kind) {
  const fs::path dir = fs::path(ZINF_FUZZ_DIR) / kind / target.name;
  if (!fs::is_directory(dir)) return 0;
  std::size_t count = 0;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file() || entry.path().filename() == "README.md") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
    SCOPED_TRACE(entry.path().string());
    EXPECT_EQ(target.run(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()), 0);
    ++count;
  }
  return count;
}

class FuzzInputs : public ::testing::TestWithParam<Target> {};

TEST_P(FuzzInputs, SeedCorpusAndEveryPastCrashRunClean) {
  const std::size_t seeds = run_files(GetParam(), "corpus");
  const std::size_t crashes = run_files(GetParam(), "regressions");
  std::printf("fuzz target %s: %zu seed inputs, %zu past crashes\n", GetParam().name, seeds,
              crashes);
  EXPECT_GT(seeds, 0u) << "no seed corpus under tests/fuzz/corpus/" << GetParam().name;
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzInputs, ::testing::ValuesIn(kTargets),
                         [](const ::testing::TestParamInfo<Target>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace zinf::fuzz
