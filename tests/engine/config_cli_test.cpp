// What a user typed, as the zinf command reads it: a misspelt key in `zinf config check FILE` and
// the names `zinf ckpt export --dtype` takes. Runs the zinf binary of the same build (bin/zinf
// beside tests/); skips, saying so, when it has not been built.
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

// Both batch sizes "auto" and nothing else giving the micro-batch size: `zinf config check`
// refuses each of the two with the reason, keeps the other keys' verdicts, and exits 1.
TEST_F(ConfigCli, ConfigCheckRefusesAutoBatchSizesWithNothingToDeriveFrom) {
  test::ScratchDir scratch("config_cli");
  const std::string path = scratch.path() + "/ds.json";
  std::ofstream(path) << R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})";
  std::string out;
  const int code = run_command(zinf_binary() + " config check '" + path + "'", &out);
  EXPECT_EQ(code, 1) << out;
  const std::string why =
      "refused (\"auto\" is a placeholder that the Hugging Face Trainer fills in before "
      "DeepSpeed reads the config, and with neither train_batch_size nor "
      "train_micro_batch_size_per_gpu written nothing gives the micro-batch size: write the value "
      "of one of them (DeepSpeed refuses a config with neither))";
  EXPECT_NE(out.find("train_batch_size                " + why), std::string::npos) << out;
  EXPECT_NE(out.find("train_micro_batch_size_per_gpu  " + why), std::string::npos) << out;
  EXPECT_NE(out.find("optimizer.params.lr             used"), std::string::npos) << out;
  EXPECT_NE(out.find(": refused (2 of 4 keys refused)"), std::string::npos) << out;
}

// --dtype takes f32, DType's own name, as fp32: both get as far as reading the checkpoint (there
// is none here) and fail the same way; a name that is neither is refused listing the names.
TEST_F(ConfigCli, CkptExportTakesF32AsFp32) {
  test::ScratchDir scratch("config_cli");
  const std::string base = zinf_binary() + " ckpt export '" + scratch.path() + "' --out '" +
                           scratch.path() + "/out.safetensors' 2>&1 --dtype ";
  std::string fp32, f32, f16;
  EXPECT_EQ(run_command(base + "fp32", &fp32), 1) << fp32;
  EXPECT_EQ(run_command(base + "f32", &f32), 1) << f32;
  EXPECT_NE(fp32.find("no checkpoint in"), std::string::npos) << fp32;
  EXPECT_EQ(f32, fp32);
  EXPECT_NE(run_command(base + "f16", &f16), 0) << f16;
  EXPECT_NE(f16.find("--dtype: f16 not in {fp32,f32,bf16}"), std::string::npos) << f16;
}

}  // namespace
}  // namespace zinf
