// `zinf config check FILE` as a user runs it: one line per key with what zinf does with it, and
// exit code 0 when the file is accepted, 1 when a key is refused (and, beside it, the names
// `zinf ckpt export --dtype` takes). Runs the zinf binary of the same
// build (bin/zinf beside tests/); skips, saying so, when it has not been built.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_test_util.hpp"
#include "common/scratch_dir.hpp"

namespace zinf::plan {
namespace {

namespace fs = std::filesystem;

std::string data_file(const char* name) {
  return (fs::path(ZINF_TEST_DATA_DIR) / "ds_configs" / name).string();
}

// The line of `out` that starts with `key` followed by spaces, or "".
std::string line_of(const std::string& out, const std::string& key) {
  std::size_t at = 0;
  while (at < out.size()) {
    const std::size_t end = out.find('\n', at);
    const std::string line = out.substr(at, end == std::string::npos ? end : end - at);
    if (line.rfind(key + " ", 0) == 0) return line;
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return "";
}

class ConfigCheckCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (zinf_binary().empty()) GTEST_SKIP() << "bin/zinf is not built: build target zinf_cli";
  }
};

TEST_F(ConfigCheckCli, AcceptedFileExitsZeroAndSaysWhatEachKeyDoes) {
  std::string out;
  const int code =
      run_command(zinf_binary() + " config check " + data_file("alpaca_lora_zero3.json"), &out);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(line_of(out, "zero_optimization.stage").find("used"), std::string::npos) << out;
  EXPECT_NE(line_of(out, "optimizer.params.lr").find("used"), std::string::npos) << out;
  const std::string pin = line_of(out, "zero_optimization.offload_optimizer.pin_memory");
  EXPECT_NE(pin.find("accepted, no effect in zinf (zinf pins"), std::string::npos) << out;
  const std::string steps = line_of(out, "steps_per_print");
  EXPECT_NE(steps.find("accepted, no effect in zinf ("), std::string::npos) << out;
  EXPECT_NE(line_of(out, "activation_checkpointing.partition_activations").find("no effect"),
            std::string::npos)
      << out;
  EXPECT_NE(line_of(out, "activation_checkpointing.cpu_checkpointing").find("used"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("refused"), std::string::npos) << out;
  EXPECT_NE(out.find("accepted"), std::string::npos) << out;
}

TEST_F(ConfigCheckCli, SchedulerSectionIsUsed) {
  std::string out;
  const int code = run_command(
      zinf_binary() + " config check " + data_file("hf_examples_zero3_offload.json"), &out);
  EXPECT_EQ(code, 0) << out;
  for (const char* key : {"scheduler.type", "scheduler.params.warmup_min_lr",
                          "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps"}) {
    EXPECT_NE(line_of(out, key).find("used"), std::string::npos) << key << "\n" << out;
  }
  EXPECT_EQ(out.find("refused"), std::string::npos) << out;
}

TEST_F(ConfigCheckCli, RefusedFileExitsOneAndSaysWhy) {
  std::string out;
  const int code =
      run_command(zinf_binary() + " config check " + data_file("hf_transformers_zero3.json"), &out);
  EXPECT_EQ(code, 1) << out;
  // reduce_bucket_size 0 is refused (validate()); the scheduler section is used.
  EXPECT_NE(line_of(out, "zero_optimization.reduce_bucket_size")
                .find("refused (0 is below 1 (DeepSpeed then reduces each gradient on its own"),
            std::string::npos)
      << out;
  EXPECT_NE(line_of(out, "scheduler.params.warmup_max_lr").find("used"), std::string::npos) << out;
  // Every other key still gets its line.
  EXPECT_NE(line_of(out, "optimizer.params.betas").find("used"), std::string::npos) << out;
  EXPECT_NE(line_of(out, "zero_optimization.overlap_comm").find("no effect"), std::string::npos)
      << out;
}

TEST_F(ConfigCheckCli, JsonListsEveryKey) {
  std::string out;
  const int code = run_command(
      zinf_binary() + " config check --json " + data_file("megatron_zero3_infinity.json"), &out);
  EXPECT_EQ(code, 1) << out;
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j.at("accepted"), false);
  bool found = false;
  for (const auto& k : j.at("keys")) {
    if (k.at("key") == "zero_optimization.stage3_param_persitance_threshold") {
      EXPECT_EQ(k.at("use"), "refused");
      found = true;
    }
    if (k.at("key") == "aio.block_size") {
      EXPECT_EQ(k.at("use"), "used");
    }
  }
  EXPECT_TRUE(found) << out;
}

// A file every key of which is accepted, but which Engine::open would refuse for want of an
// NVMe directory: a note names the key (the exit code stays 0: a C++ program may give the
// directory through Env::nvme_paths).
TEST_F(ConfigCheckCli, NvmeWithoutAPathIsNoted) {
  const fs::path file =
      fs::temp_directory_path() / ("zinf-check-nvme-" + std::to_string(::getpid()) + ".json");
  std::ofstream(file) << R"({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}})";
  std::string out;
  const int code = run_command(zinf_binary() + " config check " + file.string(), &out);
  std::string json;
  run_command(zinf_binary() + " config check --json " + file.string(), &json);
  fs::remove(file);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("note: zero_optimization.offload_optimizer.nvme_path: empty, and the "
                     "optimizer state is offloaded to nvme"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("note: zero_optimization.offload_param.nvme_path: empty"), std::string::npos)
      << out;
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << json;
  EXPECT_EQ(j.at("notes").size(), 2u) << json;
}

// What a config leaves to zinf where DeepSpeed would do otherwise is said: no optimizer section
// (DeepSpeed takes the program's optimizer), no stage (DeepSpeed's default is ZeRO off), and a
// value read other than at its face (stage 0, as in LLaMA-Factory's ds_z0_config.json).
TEST_F(ConfigCheckCli, WhatTheConfigLeavesToZinfIsNoted) {
  test::ScratchDir scratch("config_check_defaults");
  const std::string no_stage = scratch.path() + "/no_stage.json";
  std::ofstream(no_stage) << R"({"train_micro_batch_size_per_gpu": 4})";
  std::string out;
  EXPECT_EQ(run_command(zinf_binary() + " config check " + no_stage, &out), 0) << out;
  EXPECT_NE(out.find("note: no \"optimizer\" section: the engine runs AdamW with torch's "
                     "defaults (lr 0.001, weight_decay 0.01)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("note: no zero_optimization.stage: zinf runs stage 3 (DeepSpeed's default "
                     "is 0"),
            std::string::npos)
      << out;

  const std::string stage0 = scratch.path() + "/stage0.json";
  std::ofstream(stage0) << R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "zero_optimization": {"stage": 0}, "comms_config": {"verbose": false}})";
  EXPECT_EQ(run_command(zinf_binary() + " config check " + stage0, &out), 0) << out;
  EXPECT_NE(line_of(out, "zero_optimization.stage")
                .find("used (0 (ZeRO off in DeepSpeed) runs "
                      "as stage 1: the same numbers"),
            std::string::npos)
      << out;
  EXPECT_NE(line_of(out, "comms_config").find("no effect"), std::string::npos) << out;
  EXPECT_EQ(out.find("note:"), std::string::npos) << out;

  // DeepSpeed's older boolean section is refused with what to write instead; no note then says
  // the config has no stage.
  const std::string boolean = scratch.path() + "/boolean.json";
  std::ofstream(boolean) << R"({"optimizer": {"type": "AdamW"}, "zero_optimization": true})";
  EXPECT_EQ(run_command(zinf_binary() + " config check " + boolean, &out), 1) << out;
  EXPECT_NE(line_of(out, "zero_optimization").find("\"zero_optimization\": {\"stage\": 1}"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("note: no zero_optimization.stage"), std::string::npos) << out;
}

TEST_F(ConfigCheckCli, MissingFileExitsOne) {
  std::string out;
  const int code = run_command(zinf_binary() + " config check /nonexistent/ds.json 2>&1", &out);
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("/nonexistent/ds.json"), std::string::npos) << out;
}

// `zinf config check` prints the key's verdict with the suggestion, and exits 1.
TEST_F(ConfigCheckCli, ConfigCheckSuggestsTheKeyAMisspeltOneIsNear) {
  test::ScratchDir scratch("config_check_cli");
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
TEST_F(ConfigCheckCli, ConfigCheckRefusesAutoBatchSizesWithNothingToDeriveFrom) {
  test::ScratchDir scratch("config_check_cli");
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
TEST_F(ConfigCheckCli, CkptExportTakesF32AsFp32) {
  test::ScratchDir scratch("config_check_cli");
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
}  // namespace zinf::plan
