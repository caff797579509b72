// What a user typed, as the zinf command reads it: a misspelt key in `zinf config check FILE`. Runs
// the zinf binary of the same build (bin/zinf beside tests/); skips, saying so, when it has not
// been built.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "common/scratch_dir.hpp"
#include "plan/cli_test_util.hpp"

namespace zinf {
namespace {

using plan::run_command;
using plan::zinf_binary;

class ConfigCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (zinf_binary().empty()) GTEST_SKIP() << "bin/zinf is not built: build target zinf_cli";
  }
};

// `zinf config check` prints the key's verdict with the suggestion, and exits 1.
TEST_F(ConfigCli, ConfigCheckSuggestsTheKeyAMisspeltOneIsNear) {
  test::ScratchDir scratch("config_cli");
  const std::string path = scratch.path() + "/ds.json";
  std::ofstream(path) << R"({"train_batch_size": 8,
    "zero_optimization": {"stage": 3, "stage3_param_persitance_threshold": 1e5}})";
  std::string out;
  const int code = run_command(zinf_binary() + " config check '" + path + "'", &out);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("zero_optimization.stage3_param_persitance_threshold  refused (unknown key "
                     "(did you mean \"stage3_param_persistence_threshold\"?))"),
            std::string::npos)
      << out;
}

}  // namespace
}  // namespace zinf
