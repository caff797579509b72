// `zinf plan` as a user runs it: JSON keys, the table, the written config, and the exit code and
// message when nothing fits. Runs the zinf binary of the same build (bin/zinf beside tests/);
// skips, saying so, when it has not been built.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli_test_util.hpp"
#include "plan/config.hpp"
#include "plan/model.hpp"
#include "zinf/config.hpp"

namespace zinf::plan {
namespace {

namespace fs = std::filesystem;

struct CliRun {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs `zinf <args>` with a fixed machine profile so nothing is measured.
CliRun run_zinf(const std::string& args) {
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  fs::create_directories(dir);
  // One file per process and call: ctest runs this binary's tests in parallel processes.
  static int calls = 0;
  const std::string err_path =
      dir + "/plan_cli_test-" + std::to_string(::getpid()) + "-" + std::to_string(calls++) + ".err";
  const std::string cmd = zinf_binary() + " " + args + " 2>" + err_path;
  CliRun run;
  run.exit_code = run_command(cmd, &run.out);
  std::ifstream err(err_path);
  std::stringstream text;
  text << err.rdbuf();
  run.err = text.str();
  fs::remove(err_path);
  return run;
}

constexpr const char* kRates =
    " --mem-adam-gbps 50 --nvme-read-gbps 6 --nvme-write-gbps 4 --measure";

class PlanCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (zinf_binary().empty()) GTEST_SKIP() << "bin/zinf is not built: build target zinf_cli";
  }
};

TEST_F(PlanCli, JsonHasFitsBytesPerTierAndTheStepParts) {
  const CliRun r = run_zinf(
      "plan --model llama-2-70b --gpus 4 --gpu-mem 48GB --host-mem 256GB --nvme-capacity 4TB "
      "--seq 4096 --checkpoint-activations --json" +
      std::string(kRates));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("fits"), true);
  for (const char* tier : {"device", "host", "nvme"}) {
    EXPECT_GT(j.at("bytes_per_tier").at(tier).get<double>(), 0) << tier;
  }
  EXPECT_GT(j.at("predicted_step_s").get<double>(), 0);
  for (const char* part : {"forward_backward_s", "optimizer_step_s", "io_alone_s", "update_alone_s",
                           "param_fetch_s", "pipeline_s"}) {
    EXPECT_TRUE(j.at("parts").contains(part)) << part;
  }
  EXPECT_EQ(j.at("no_offload").at("gpus_needed"), 41);
  EXPECT_EQ(j.at("placement").at("offload_optimizer"), "nvme");
}

TEST_F(PlanCli, TableShowsTiersTimeAndTheNoOffloadArithmetic) {
  const CliRun r = run_zinf(
      "plan --model llama-2-70b --gpus 4 --gpu-mem 48GB --host-mem 256GB --nvme-capacity 4TB "
      "--seq 4096 --checkpoint-activations" +
      std::string(kRates));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* text : {"device/GPU", "host/machine", "nvme/machine", "fp32_master",
                           "predicted step", "without offload: 41 GPUs", "ceil("}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << "\n" << r.out;
  }
}

TEST_F(PlanCli, OutWritesAConfigTheParserAccepts) {
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/plan_cli_config.json";
  const CliRun r = run_zinf(
      "plan --model llama-3-8b --gpus 1 --gpu-mem 24GB --host-mem 64GB --nvme-capacity 1TB "
      "--nvme-path /mnt/nvme --checkpoint-activations --out " +
      path + kRates);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  auto config = config_from_json(text.str());
  ASSERT_TRUE(config.is_ok()) << config.status().to_string() << "\n" << text.str();
  // 8B params x 16 B of state do not fit 64 GB of host memory: the optimizer goes to NVMe.
  EXPECT_EQ(config->setup.optimizer, OffloadDevice::kNvme);
  EXPECT_EQ(config->nvme_path, "/mnt/nvme");
  std::remove(path.c_str());
}

// --gradient-clipping and --fp16 change the predicted step (the pass waits for step()), so the
// config --out writes says them as DeepSpeed does: "gradient_clipping" above 0, and "fp16"
// enabled in place of bf16; read back, the plan is the one that was timed.
TEST_F(PlanCli, OutWritesClippingAndFp16) {
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/plan_cli_clip.json";
  const std::string plan =
      "plan --model llama-3-8b --gpus 1 --gpu-mem 24GB --host-mem 64GB --nvme-capacity 1TB "
      "--nvme-path /mnt/nvme --checkpoint-activations --out " +
      path + kRates;
  struct Case {
    const char* flags;
    double clipping;
    bool fp16;
  };
  for (const Case& c :
       {Case{"", 0.0, false}, Case{" --gradient-clipping", 1.0, false}, Case{" --fp16", 0.0, true},
        Case{" --gradient-clipping --fp16", 1.0, true}}) {
    const CliRun r = run_zinf(plan + c.flags);
    ASSERT_EQ(r.exit_code, 0) << c.flags << r.err;
    std::ifstream file(path);
    std::stringstream text;
    text << file.rdbuf();
    const nlohmann::json j = nlohmann::json::parse(text.str());
    EXPECT_EQ(j.at("gradient_clipping").get<double>(), c.clipping) << c.flags;
    EXPECT_EQ(j.at("fp16").at("enabled"), c.fp16) << c.flags;
    EXPECT_EQ(j.at("bf16").at("enabled"), !c.fp16) << c.flags;
    auto config = config_from_json(text.str());
    ASSERT_TRUE(config.is_ok()) << config.status().to_string() << "\n" << text.str();
    EXPECT_EQ(config->setup.exact_clipping_or_loss_scaling, c.clipping > 0 || c.fp16) << c.flags;
    EXPECT_EQ(config->gradient_clipping, c.clipping) << c.flags;
    EXPECT_EQ(config->fp16, c.fp16) << c.flags;
  }
  std::remove(path.c_str());
}

// --no-overlap-step predicts the sequential step; the config --out writes runs it
// (zinf.overlap_step false), and read back it is the plan that was timed.
TEST_F(PlanCli, OutWritesTheSequentialStep) {
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/plan_cli_overlap.json";
  const std::string plan =
      "plan --model llama-3-8b --gpus 1 --gpu-mem 24GB --host-mem 64GB --nvme-capacity 1TB "
      "--nvme-path /mnt/nvme --checkpoint-activations --out " +
      path + kRates;
  for (const auto& [flags, overlap] :
       {std::pair{"", true}, std::pair{" --no-overlap-step", false}}) {
    const CliRun r = run_zinf(plan + flags);
    ASSERT_EQ(r.exit_code, 0) << flags << r.err;
    std::ifstream file(path);
    std::stringstream text;
    text << file.rdbuf();
    const nlohmann::json j = nlohmann::json::parse(text.str());
    EXPECT_EQ(j.at("zinf").at("overlap_step"), overlap) << flags;
    auto config = config_from_json(text.str());
    ASSERT_TRUE(config.is_ok()) << config.status().to_string() << "\n" << text.str();
    EXPECT_EQ(config->setup.overlap_step, overlap) << flags;
  }
  std::remove(path.c_str());
}

TEST_F(PlanCli, NothingFitsExitsTwoNamingTheShortTier) {
  const CliRun r = run_zinf(
      "plan --model llama-2-70b --gpus 4 --gpu-mem 48GB --host-mem 256GB --nvme-capacity 512GB "
      "--seq 4096 --checkpoint-activations" +
      std::string(kRates));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("nothing fits"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("nvme is short by 727.16 GiB"), std::string::npos) << r.err;
}

TEST_F(PlanCli, StepOnlyTakesBenchStepFlags) {
  const CliRun r =
      run_zinf("plan --step-only --params 1G --tier nvme --sub-group 64MiB --pool 1GiB --json" +
               std::string(kRates));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  for (const char* key :
       {"step_s", "io_alone_s", "update_alone_s", "read_gbps", "write_gbps", "host_bytes"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  // 1e9 params, every piece on NVMe: 16e9 B read at 6 GB/s + 14e9 B written at 4 GB/s.
  EXPECT_DOUBLE_EQ(j.at("io_alone_s").get<double>(), 16.0 / 6.0 + 14.0 / 4.0);
  EXPECT_EQ(j.at("sub_group_params"), 3'727'360);
  EXPECT_EQ(j.at("blocks"), 16);
  EXPECT_DOUBLE_EQ(j.at("update_alone_s").get<double>(), 30e9 / 50e9);
  EXPECT_EQ(j.at("params"), 1'000'000'000);
}

// With exact clipping the pass hides behind the next forward only: a third of the compute, a
// quarter with checkpointing, at most, whatever --overlap-fraction asks. So with fp16 loss scaling,
// whose overflow check also needs every gradient before the step, and with the gradients spilled
// (--grads-tier nvme, the default), whose sub-groups the pass reads whole from step() on.
TEST_F(PlanCli, GradientClippingHidesThePassBehindAThirdOfTheCompute) {
  const std::string step =
      "plan --step-only --params 1G --tier nvme --sub-group 64MiB --pool 1GiB "
      "--compute-s 6 --json" +
      std::string(kRates) + " --grads-tier";
  const auto spilled = [&](const std::string& flags) {
    const CliRun r = run_zinf(step + " nvme" + flags);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out).at("optimizer_hidden_s").get<double>();
  };
  EXPECT_DOUBLE_EQ(spilled(""), 2.0);
  EXPECT_DOUBLE_EQ(spilled(" --overlap-fraction 1"), 2.0);
  EXPECT_DOUBLE_EQ(spilled(" --checkpoint-activations"), 1.5);
  const auto hidden = [&](const std::string& flags) {
    const CliRun r = run_zinf(step + " host" + flags);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    // The optimizer step (about 5.5 s here) is longer than any window below (4 s at most).
    EXPECT_GT(j.at("optimizer_step_s").get<double>(), 4.0);
    return j.at("optimizer_hidden_s").get<double>();
  };
  EXPECT_DOUBLE_EQ(hidden(""), 4.0);                      // 2/3 of 6 s: behind the backward
  EXPECT_DOUBLE_EQ(hidden(" --gradient-clipping"), 2.0);  // 1/3: behind the next forward
  EXPECT_DOUBLE_EQ(hidden(" --fp16"), 2.0);
  EXPECT_DOUBLE_EQ(hidden(" --gradient-clipping --overlap-fraction 0.5"), 2.0);
  EXPECT_DOUBLE_EQ(hidden(" --fp16 --overlap-fraction 0.25"), 1.5);
  EXPECT_DOUBLE_EQ(hidden(" --overlap-fraction 0.5"), 3.0);
  // With checkpointing the forward is a quarter of the compute (it runs twice among four
  // forwards' worth of FLOPs), as a plan with a model counts it.
  EXPECT_DOUBLE_EQ(hidden(" --gradient-clipping --checkpoint-activations"), 1.5);
  EXPECT_DOUBLE_EQ(hidden(" --fp16 --checkpoint-activations --overlap-fraction 1"), 1.5);
  EXPECT_DOUBLE_EQ(hidden(" --checkpoint-activations"), 4.0);
}

// --step-only takes --stage and --offload-param as a plan does: with the optimizer state on NVMe
// the engine's pass streams its half output from the pool (lib/engine/store_state.cpp,
// kStreamed), where the half copy stays in the block (StoreMedium::kBlock) and only the params'
// NVMe home (--offload-param nvme) gets the new half shards, 2 B a param; without placement
// flags the StateStore's own layout (bench step) writes its half copy. At stage 3 with the params
// in host memory the store keeps a host half array (kFromStore): nothing of the half copy goes to
// the drive, and the whole pass runs before any shard is written from it, so the next forward's
// first gather of a module waits for all of it. There the pass hides in the backward only, 2/3
// of the 6 s, even with --overlap-fraction 1, and behind nothing with exact clipping, where
// streamed it hides behind the next forward, 1/3. At stage 1 (the reduce-scatter at step()) and
// with the gradients spilled the pass starts at step(): 1/3 streamed, nothing otherwise.
TEST_F(PlanCli, StepOnlyPassFollowsTheStageAndParamPlacement) {
  const std::string step =
      "plan --step-only --params 1G --tier nvme --sub-group 64MiB --pool 1GiB --compute-s 6 "
      "--json" +
      std::string(kRates);
  struct Case {
    const char* flags;
    bool streams, half_written, grads_spilled;
    double hidden_s, clipped_hidden_s;
  };
  for (const Case& c :
       {Case{" --grads-tier host", true, true, false, 6.0, 2.0},
        Case{" --grads-tier host --stage 3", true, false, false, 6.0, 2.0},
        Case{" --grads-tier host --stage 3 --offload-param none", true, false, false, 6.0, 2.0},
        Case{" --grads-tier host --stage 3 --offload-param nvme", true, true, false, 6.0, 2.0},
        Case{" --grads-tier host --stage 3 --offload-param cpu", false, false, false, 4.0, 0.0},
        Case{" --grads-tier host --offload-param cpu", false, false, false, 4.0, 0.0},
        Case{" --grads-tier host --stage 2", true, false, false, 6.0, 2.0},
        Case{" --grads-tier host --stage 1", true, false, false, 2.0, 2.0},
        Case{" --stage 2", true, false, true, 2.0, 2.0},
        Case{" --stage 3 --offload-param cpu", false, false, true, 0.0, 0.0}}) {
    SCOPED_TRACE(c.flags);
    const CliRun r = run_zinf(step + c.flags + " --overlap-fraction 1");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("half_on_nvme"), c.streams);
    // Reads 12 B a param (master, m, v; +4 for spilled gradients), writes 12 (+2 for the half
    // shards where they go to the drive).
    EXPECT_EQ(j.at("nvme_write_bytes"), c.half_written ? 14'000'000'000u : 12'000'000'000u);
    EXPECT_EQ(j.at("nvme_read_bytes"), c.grads_spilled ? 16'000'000'000u : 12'000'000'000u);
    EXPECT_NEAR(j.at("optimizer_hidden_s").get<double>(),
                std::min(c.hidden_s, j.at("optimizer_step_s").get<double>()), 1e-12);
    const CliRun clipped = run_zinf(step + c.flags + " --gradient-clipping");
    ASSERT_EQ(clipped.exit_code, 0) << clipped.err;
    EXPECT_NEAR(nlohmann::json::parse(clipped.out).at("optimizer_hidden_s").get<double>(),
                c.clipped_hidden_s, 1e-12);
    EXPECT_EQ(j.value("streams_half", !c.streams), c.streams);
  }
  CliRun r = run_zinf(step + " --stage 2 --offload-param cpu");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--offload-param needs --stage 3"), std::string::npos) << r.err;
  r = run_zinf(step + " --stage 3 --offload-param cpu --half-tier nvme");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--half-tier nvme"), std::string::npos) << r.err;
  // Where the pass streams, the engine keeps a half slot in each pool block and writes the new
  // half shards to the params' NVMe home whatever --half-tier says: --half-tier host, which
  // would count neither (12e9 B written where the engine writes 14e9), is refused with placement
  // flags, and --half-tier nvme counts the engine's layout.
  for (const char* flags : {" --grads-tier host --stage 3 --offload-param nvme --half-tier host",
                            " --grads-tier host --stage 2 --half-tier host",
                            " --grads-tier host --stage 3 --half-tier cpu"}) {
    r = run_zinf(step + flags);
    EXPECT_EQ(r.exit_code, 1) << flags;
    EXPECT_NE(r.err.find("--half-tier host"), std::string::npos) << flags << r.err;
  }
  r = run_zinf(step + " --grads-tier host --stage 3 --offload-param nvme --half-tier nvme");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("nvme_write_bytes"), 14'000'000'000u);
  r = run_zinf(step + " --grads-tier host --stage 3 --offload-param cpu --half-tier host");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("nvme_write_bytes"), 12'000'000'000u);
  r = run_zinf(step + " --stage 4");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--stage 4"), std::string::npos) << r.err;
}

// --compute-s is the compute of a whole step, over --grad-accum micro-batches, and the pass
// meets one of them: c of 6 s / 3.
TEST_F(PlanCli, StepOnlyComputeSpansTheMicroBatches) {
  const std::string step =
      "plan --step-only --params 1G --tier nvme --sub-group 64MiB --pool 1GiB "
      "--compute-s 6 --grad-accum 3 --grads-tier host --json" +
      std::string(kRates);
  for (const auto& [flags, hidden] :
       {std::pair{"", 4.0 / 3.0}, std::pair{" --gradient-clipping", 2.0 / 3.0},
        std::pair{" --overlap-fraction 1", 2.0}}) {
    const CliRun r = run_zinf(step + flags);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("micro_batches"), 3) << flags;
    EXPECT_NEAR(j.at("optimizer_hidden_s").get<double>(), hidden, 1e-12) << flags;
    EXPECT_NEAR(j.at("step_s").get<double>(), 6.0 + j.at("optimizer_step_s").get<double>() - hidden,
                1e-9)
        << flags;
  }
  const CliRun zero =
      run_zinf("plan --step-only --params 1G --compute-s 6 --grad-accum 0" + std::string(kRates));
  EXPECT_EQ(zero.exit_code, 1);
  EXPECT_NE(zero.err.find("--grad-accum 0: must be"), std::string::npos) << zero.err;
}

// The table names the step's formula: max(compute, optimizer step) only where the pass may hide
// behind all of the compute (one micro-batch, --overlap-fraction 1, the optimizer state on NVMe);
// with the default 2/3 of one micro-batch it is the sum less the part hidden (S/3 + max(2S/3,
// optimizer step)), and on the host tier, whose update hides behind the backward only, at stage 1
// and with the gradients spilled, whose pass starts at step(), too.
TEST_F(PlanCli, StepOnlyTableNamesTheMaxOnlyBehindTheWholeCompute) {
  const std::string step =
      "plan --step-only --params 1G --sub-group 64MiB --pool 1GiB --compute-s 6" +
      std::string(kRates);
  const std::string max_form = "max(compute, optimizer step): overlapped";
  const std::string part_form = "the part hidden behind one micro-batch's compute";
  for (const auto& [flags, is_max] :
       {std::pair{" --tier nvme --grads-tier host", false},
        std::pair{" --tier nvme --grads-tier host --overlap-fraction 0.5", false},
        std::pair{" --tier nvme --grads-tier host --overlap-fraction 1", true},
        std::pair{" --tier nvme --grads-tier host --grad-accum 2 --overlap-fraction 1", false},
        std::pair{" --tier nvme --grads-tier host --stage 1 --overlap-fraction 1", false},
        std::pair{" --tier nvme --overlap-fraction 1", false},
        std::pair{" --tier host --overlap-fraction 1", false}}) {
    const CliRun r = run_zinf(step + flags);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out.find(max_form) != std::string::npos, is_max) << flags << r.out;
    EXPECT_EQ(r.out.find(part_form) != std::string::npos, !is_max) << flags << r.out;
  }
}

// A plan's --gradient-clipping and --fp16 reach its step: with the optimizer state on NVMe,
// whose pass writes each new half shard as its sub-group completes, the pass hides behind the
// forward's share of the compute, a quarter with checkpointing, where without them it hides
// behind the backward's two thirds and runs on into the next forward. With the optimizer on the
// host the pass writes no shard before its whole update is over, and the next forward's first
// gather of a module with trained parameters waits for the update (OverlappedStep::await_module):
// an update that waits for step() hides behind nothing. The uploads W that follow it are flagged
// group by group as they are queued, so they meet the next forward module by module and hide behind
// it: W = 2·P = 13.48 GB at 1000 GB/s = 13.5 ms, under the forward's 0.298 s (a third of C = 0.894
// s at 100 TFLOP/s), so the host optimizer hides its share of C plus W, W/C = 0.0151 (0.0113 with
// checkpointing's 4/3 C). The params stay on the device (--offload-param none): offloaded, the
// writes and what hides them would differ.
TEST_F(PlanCli, ClippingOrLossScalingHidesThePlansPassBehindTheForward) {
  const std::string plan =
      "plan --model llama-2-7b --gpus 1 --gpu-mem 80GB --host-mem 256GB --nvme-capacity 1TB "
      "--gpu-tflops 100 --stage 3 --offload-param none --h2d-gbps 1000 --json" +
      std::string(kRates);
  const double upload_s =
      2.0 * static_cast<double>(param_count(*find_model_preset("llama-2-7b"))) / 1e12;
  struct Case {
    const char* flags;
    double nvme_share, cpu_share;
  };
  for (const Case& c : {Case{"", 2.0 / 3.0, 2.0 / 3.0}, Case{" --gradient-clipping", 1.0 / 3.0, 0},
                        Case{" --fp16", 1.0 / 3.0, 0},
                        Case{" --gradient-clipping --checkpoint-activations", 0.25, 0}}) {
    for (const auto& [optimizer, share] :
         {std::pair{"nvme", c.nvme_share}, std::pair{"cpu", c.cpu_share}}) {
      const CliRun r = run_zinf(plan + " --offload-optimizer " + optimizer + c.flags);
      ASSERT_EQ(r.exit_code, 0) << optimizer << c.flags << "\n" << r.err;
      const nlohmann::json parts = nlohmann::json::parse(r.out).at("parts");
      const double compute_s = parts.at("compute_s").get<double>();
      ASSERT_GT(parts.at("optimizer_step_s").get<double>(), compute_s);
      // The host optimizer's uploads hide behind the next forward.
      const double hidden_uploads_s = optimizer == std::string("cpu") ? upload_s : 0.0;
      // Streamed and updating in the backward, the pass runs on into the next forward with
      // f = (opt − 2C/3)/opt of the partition left, whose modules the forward's first f waits
      // for: another f of the forward's third hides.
      const double opt_s = parts.at("optimizer_step_s").get<double>();
      const double expected = share == 2.0 / 3.0 && optimizer == std::string("nvme")
                                  ? 2.0 / 3.0 + (opt_s - 2.0 / 3.0 * compute_s) / opt_s / 3.0
                                  : share;
      EXPECT_NEAR((parts.at("optimizer_hidden_s").get<double>() - hidden_uploads_s) / compute_s,
                  expected, 1e-2)
          << optimizer << c.flags;
      if (optimizer == std::string("cpu")) {
        EXPECT_NEAR(parts.at("param_upload_s").get<double>(), upload_s, 1e-9) << c.flags;
      }
    }
  }
}

TEST_F(PlanCli, BadOptionsExitOneWithAMessage) {
  CliRun r = run_zinf("plan --model gpt-17 --gpu-mem 8GB --host-mem 8GB" + std::string(kRates));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--model gpt-17"), std::string::npos) << r.err;
  r = run_zinf("plan --model gpt2 --gpu-mem lots --host-mem 8GB" + std::string(kRates));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--gpu-mem lots"), std::string::npos) << r.err;
}

// A count of 0 is refused naming its option: --params 0 was taken as "not given" and planned the
// shape's own count (0.936e9 for 16 layers of 2048), and a zero --seq, --micro-batch or
// --grad-accum planned a step with no tokens.
TEST_F(PlanCli, ZeroCountsAreRefusedNamingTheOption) {
  const std::string base = "plan --gpus 8 --gpu-mem 80GB --host-mem 512GB" + std::string(kRates);
  for (const char* flag : {"--params", "--seq", "--micro-batch", "--grad-accum"}) {
    const std::string model = std::string(flag) == "--params"
                                  ? " --layers 16 --hidden 2048"
                                  : " --params 1G --layers 16 --hidden 2048";
    const CliRun r = run_zinf(base + model + " " + flag + " 0");
    EXPECT_EQ(r.exit_code, 1) << flag << "\n" << r.out;
    EXPECT_NE(r.err.find(std::string(flag) + " 0: must be"), std::string::npos)
        << flag << ": " << r.err;
  }
}

// A plan with nothing offloaded predicts a step of milliseconds when the GPUs' compute and
// collectives are not modelled; the output says what the figure leaves out.
TEST_F(PlanCli, TheStepSaysWhatItLeavesOut) {
  const std::string plan =
      "plan --params 1G --layers 16 --hidden 2048 --gpus 8 --gpu-mem 80GB --host-mem 512GB" +
      std::string(kRates);
  CliRun r = run_zinf(plan);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("note:    the predicted step leaves out the GPUs' compute and collectives: "
                       "pass --gpu-tflops and --gpu-link-gbps"),
            std::string::npos)
      << r.out;
  r = run_zinf(plan + " --gpu-tflops 300");
  EXPECT_NE(r.out.find("leaves out the GPUs' collectives: pass --gpu-link-gbps"), std::string::npos)
      << r.out;
  r = run_zinf(plan + " --gpu-tflops 300 --gpu-link-gbps 100");
  EXPECT_EQ(r.out.find("leaves out"), std::string::npos) << r.out;
}

// "--params 7B" is 7e9 parameters (it was 7); a count more than 4 times off what the shape
// holds as a transformer is noted (1M for 80 layers of hidden 8192, a typo for a 70B model).
TEST_F(PlanCli, ParamsInBillionsAndACountFarFromTheShapeIsNoted) {
  const std::string budgets = " --gpus 8 --gpu-mem 80GB --host-mem 512GB" + std::string(kRates);
  CliRun r = run_zinf("plan --params 7B --layers 32 --hidden 4096" + budgets);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("custom: 7.00B params"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("far from"), std::string::npos) << r.out;
  r = run_zinf("plan --params 1M --layers 80 --hidden 8192" + budgets);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("note:    --params 1M is far from the 6.5e+10 parameters that 80 layers "
                       "of hidden 8192 (vocab 32000) hold as a transformer"),
            std::string::npos)
      << r.out;
}

// A small train_lm model on a 1 GB GPU: the header gives its count readably, the shortfall
// names the 1 GiB runtime reserve (not the activations, 1 MiB), and --device-reserved lowers the
// reserve, which --out's config then carries as zinf.device_reserved_bytes.
TEST_F(PlanCli, ShortDeviceNamesTheReserveAndDeviceReservedSetsIt) {
  const std::string plan =
      "plan --arch train_lm --layers 4 --hidden 48 --context 16 --embed 16 --seq 256 "
      "--micro-batch 2 --checkpoint-activations --gpu-mem 1GB --host-mem 4GB" +
      std::string(kRates);
  CliRun r = run_zinf(plan);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.out.find("model     train_lm: 103.7k params, 4 layers, hidden 48"), std::string::npos)
      << r.out;
  EXPECT_NE(r.err.find("device is short by 0.16 GiB"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the runtime reserve takes 1.00 GiB of it (zinf.device_reserved_bytes, "
                       "zinf plan --device-reserved"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("activations take"), std::string::npos) << r.err;

  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string path =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/plan_cli_device_reserved.json";
  r = run_zinf(plan + " --device-reserved 256MiB --json --out " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("bytes_per_state_per_rank").at("reserved").at("device"), 256u << 20);
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  Result<Config> config = parse_config(text.str());
  ASSERT_TRUE(config.is_ok()) << config.status().to_string() << "\n" << text.str();
  EXPECT_EQ(config->device_reserved_bytes, 256u << 20);
  std::remove(path.c_str());

  r = run_zinf(plan + " --device-reserved lots");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--device-reserved lots: not a size"), std::string::npos) << r.err;
}

// --params sizes the state alone: its help says --layers and --hidden are needed with it, and
// the error without them names --params and what is missing.
TEST_F(PlanCli, ParamsSaysItNeedsLayersAndHidden) {
  CliRun r = run_zinf("plan --help");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::size_t at = r.out.find("  --params ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
  EXPECT_NE(line.find("needs --layers and --hidden"), std::string::npos) << line;
  r = run_zinf("plan --params 1B --gpu-mem 80GB --host-mem 512GB" + std::string(kRates));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("zinf: --params 1B needs --layers L and --hidden H too", 0), 0u) << r.err;
}

// A missing budget or rate is named alone, not with the one that was given.
TEST_F(PlanCli, AMissingBudgetOrRateIsNamed) {
  CliRun r = run_zinf("plan --model gpt2 --gpu-mem 80GB" + std::string(kRates));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("zinf: --host-mem:", 0), 0u) << r.err;
  r = run_zinf("plan --model gpt2 --host-mem 80GB" + std::string(kRates));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("zinf: --gpu-mem:", 0), 0u) << r.err;
  // One NVMe rate without the other was dropped silently (then measured, or "no NVMe rates").
  r = run_zinf(
      "plan --model gpt2 --gpu-mem 80GB --host-mem 80GB --nvme-capacity 1TB --measure "
      "--mem-adam-gbps 50 --nvme-read-gbps 6");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("zinf: --nvme-read-gbps 6 needs --nvme-write-gbps", 0), 0u) << r.err;
}

// --offload-activations plans the checkpoints in host memory; the config it writes puts them
// there (activation_checkpointing.cpu_checkpointing) with an arena that holds them all
// (zinf.activation_host_bytes): the engine's default 1 GiB arena is short for 2 GiB of
// checkpoints, and the engine then fails the save that does not fit.
TEST_F(PlanCli, OffloadedActivationsAreWrittenIntoTheConfig) {
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string path =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/plan_cli_offload_activations.json";
  const std::string plan =
      "plan --model llama-2-7b --gpus 1 --gpu-mem 80GB --host-mem 512GB --seq 8192 "
      "--checkpoint-activations --offload-activations --json --out " +
      path + kRates;
  const CliRun r = run_zinf(plan);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  // 32 layers x 8192 tokens x 4096 x 2 B: each layer's input, in bf16.
  const std::uint64_t checkpoints = 32ull * 8192 * 4096 * 2;
  EXPECT_EQ(j.at("bytes_per_state_per_rank").at("activations").at("host"), checkpoints);
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  Result<Config> config = parse_config(text.str());
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  EXPECT_TRUE(config->activations.cpu_checkpointing);
  EXPECT_GE(config->activations.host_bytes, checkpoints);
  EXPECT_LE(config->activations.host_bytes, checkpoints + (std::uint64_t{1} << 20));
  auto round_trip = config_from_json(text.str());
  ASSERT_TRUE(round_trip.is_ok()) << round_trip.status().to_string();
  EXPECT_EQ(round_trip->activation_host_bytes, config->activations.host_bytes);
  std::remove(path.c_str());

  // Without the offload the checkpoints stay on the device, as the engine's default keeps them.
  const CliRun on_device = run_zinf(
      "plan --model llama-2-7b --gpus 1 --gpu-mem 80GB --host-mem 512GB --seq 8192 "
      "--checkpoint-activations --json --out " +
      path + kRates);
  ASSERT_EQ(on_device.exit_code, 0) << on_device.err;
  std::ifstream file2(path);
  std::stringstream text2;
  text2 << file2.rdbuf();
  config = parse_config(text2.str());
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  EXPECT_FALSE(config->activations.cpu_checkpointing);
  std::remove(path.c_str());
}

// --trainable over the model's count, negative, zero or not a number: exit 1, naming the option.
TEST_F(PlanCli, TrainableOutOfRangeExitsOneNamingTheOption) {
  const std::string base =
      "plan --model llama-2-7b --gpu-mem 80GB --host-mem 256GB" + std::string(kRates);
  for (const char* value : {"8B", "100.5%", "-5", "abc", "0", "12x"}) {
    const CliRun r = run_zinf(base + " --trainable " + value);
    EXPECT_EQ(r.exit_code, 1) << value << "\n" << r.out;
    EXPECT_NE(r.err.find(std::string("--trainable ") + value), std::string::npos) << r.err;
  }
  CliRun r = run_zinf(base + " --trainable 1% --lora-rank 8");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--trainable and --lora-rank"), std::string::npos) << r.err;
  r = run_zinf(base + " --lora-rank 0");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--lora-rank 0"), std::string::npos) << r.err;
}

// Numbers a double cannot hold (a count of 400 digits, a share that underflows) are refused
// naming --trainable, not a crash (std::stod threw std::out_of_range: exit 134).
TEST_F(PlanCli, TrainableBeyondADoubleExitsOne) {
  const std::string base =
      "plan --model llama-2-7b --gpu-mem 80GB --host-mem 256GB" + std::string(kRates);
  const std::string huge(400, '9');
  CliRun r = run_zinf(base + " --trainable " + huge);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("more than the model's"), std::string::npos) << r.err;
  const std::string tiny = "0." + std::string(400, '0') + "1%";
  r = run_zinf(base + " --trainable " + tiny);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("no parameter would train"), std::string::npos) << r.err;
}

// --lora-rank negative, past 64 bits, not a number or above the adapted projections' width, and
// the options that would be ignored (--lora-targets alone; --trainable, --lora-rank with
// --step-only): exit 1, naming the options.
TEST_F(PlanCli, LoraOptionsOutOfRangeExitOneNamingTheOption) {
  const std::string base =
      "plan --model llama-2-70b --gpu-mem 80GB --host-mem 256GB --nvme-capacity 2TB" +
      std::string(kRates);
  const struct {
    const char* args;
    const char* message;
  } cases[] = {
      {" --lora-rank -1", "--lora-rank -1: must not be negative"},
      {" --lora-rank 99999999999999999999999", "--lora-rank 99999999999999999999999: more than"},
      {" --lora-rank 8x", "--lora-rank 8x: not a whole number"},
      // v's outputs are 8 key/value heads of 128: 1024.
      {" --lora-rank 1025", "--lora-rank 1025: more than 1024"},
      {" --lora-rank 99999999999999", "--lora-rank 99999999999999: more than 1024"},
      {" --lora-rank 8193 --lora-targets q", "--lora-rank 8193: more than 8192"},
      {" --lora-targets q,k", "--lora-targets q,k: needs --lora-rank"},
  };
  for (const auto& c : cases) {
    const CliRun r = run_zinf(base + c.args);
    EXPECT_EQ(r.exit_code, 1) << c.args << "\n" << r.out;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << c.args << ": " << r.err;
  }
  CliRun r = run_zinf(base + " --lora-rank 1024 --json");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* option : {" --trainable 1%", " --lora-rank 8", " --lora-targets q"}) {
    r = run_zinf(std::string("plan --step-only --params 1G --tier host --mem-adam-gbps 50") +
                 option);
    EXPECT_EQ(r.exit_code, 1) << option << "\n" << r.out;
    EXPECT_NE(r.err.find("do not apply to --step-only"), std::string::npos) << option << r.err;
  }
}

// The 70B LoRA case of docs/PLAN.md: one 80 GB GPU, 256 GB host, 2 TB NVMe. Every parameter
// trainable needs the gradients spilled to NVMe; with the base frozen (rank 16 on q and v) the
// trainable share's gradients and moments are all the optimizer keeps beyond the masters, and the
// step is the trainable share's. The output says how much trains; without the option the JSON
// has no such keys.
TEST_F(PlanCli, LoraPlanShowsTheTrainableShare) {
  const std::string base =
      "plan --model llama-2-70b --gpus 1 --gpu-mem 80GB --host-mem 256GB --nvme-capacity 2TB "
      "--seq 4096 --checkpoint-activations --gpu-tflops 400 --gpu-link-gbps 100" +
      std::string(kRates);
  CliRun r = run_zinf(base + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json all = nlohmann::json::parse(r.out);
  EXPECT_FALSE(all.at("model").contains("trainable_params"));
  EXPECT_EQ(all.at("placement").at("gradients_on_nvme"), true);
  r = run_zinf(base + " --lora-rank 16 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json lora = nlohmann::json::parse(r.out);
  EXPECT_EQ(lora.at("model").at("trainable_params"), 32'768'000);
  EXPECT_EQ(lora.at("model").at("params"), 68'976'648'192 + 32'768'000);
  EXPECT_EQ(lora.at("model").at("lora").at("targets"), "q,v");
  EXPECT_EQ(lora.at("placement").at("gradients_on_nvme"), false);
  // Moments and gradients of the adapters only: 8 + 4 bytes of 32,768,000 parameters (the
  // moments' swap-file room stays: it is preallocated whole at open).
  EXPECT_EQ(lora.at("bytes_per_state_per_rank").at("gradients").at("host"), 4 * 32'768'000);
  EXPECT_LT(lora.at("predicted_step_s").get<double>(), all.at("predicted_step_s").get<double>());
  r = run_zinf(base + " --lora-rank 16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("trainable 32.77M params (0.0475% of the model), 68.98B frozen: LoRA rank "
                       "16 adapters on q,v in each of 80 layers"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("18 B/param x 32.77M trainable + 2 B/param x 68.98B frozen params"),
            std::string::npos)
      << r.out;
}

// The 70B LoRA case of docs/PLAN.md without NVMe: counted as any values the base is short of host
// memory; with --frozen-exact (a bf16 base) it fits at stage 3 with state and shards in host
// memory, where a frozen element keeps its half copy alone. By hand, P = 68,976,648,192 +
// 32,768,000 adapters, T = 32,768,000 on 1 rank: the shard, lent from the half copy whatever the
// values but the adapters' and the persistent norms' (80 x 2 x 8192 + 8192 = 1,318,912),
// 2 x 34,086,912 = 68,173,824 B with or without the flag; the master, four scratch blocks of
// 256 Ki elements (three fp32, one bf16: 3,670,016 B) and the adapters' 4 x 32,768,000 with the
// flag, 134,742,016 B, every element's 4 x P without, 276,041,334,784 B; the half copy every
// element's, 2 x P = 138,018,832,384 B.
TEST_F(PlanCli, FrozenExactCountsTheHalfCopyAlone) {
  const std::string base =
      "plan --model llama-2-70b --gpus 1 --gpu-mem 80GB --host-mem 256GB --seq 4096 "
      "--checkpoint-activations --gpu-tflops 400 --gpu-link-gbps 100 --lora-rank 16" +
      std::string(kRates);
  CliRun r = run_zinf(base + " --json");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  const nlohmann::json closest = nlohmann::json::parse(r.out).at("bytes_per_state_per_rank");
  EXPECT_EQ(closest.at("half_params").at("host"), 68'173'824);
  EXPECT_EQ(closest.at("fp32_master").at("host"), 276'041'334'784);
  r = run_zinf(base + " --json --frozen-exact");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json plan = nlohmann::json::parse(r.out);
  EXPECT_EQ(plan.at("model").at("frozen_exact_in_half"), true);
  EXPECT_EQ(plan.at("placement").at("stage"), 3);
  EXPECT_EQ(plan.at("placement").at("offload_optimizer"), "cpu");
  EXPECT_EQ(plan.at("placement").at("offload_param"), "cpu");
  const nlohmann::json& bytes = plan.at("bytes_per_state_per_rank");
  EXPECT_EQ(bytes.at("half_params").at("host"), 68'173'824);
  EXPECT_EQ(bytes.at("fp32_master").at("host"), 134'742'016);
  EXPECT_EQ(bytes.at("half_copy").at("host"), 138'018'832'384);
  r = run_zinf(base + " --frozen-exact");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("68.98B frozen: LoRA rank 16 adapters on q,v in each of 80 layers (frozen "
                       "values exact in the half dtype)"),
            std::string::npos)
      << r.out;
}

// A Llama-2-7B LoRA (rank 16 on q,v) on one 40 GB GPU, 64 GB of host memory: counted as any
// values the plan is what it was, stage 2 with the state in host memory (the master 4 x P plus the
// scratch blocks there), and the state cannot go on the device (exit 2 with offload_optimizer
// none: the device is short). With --frozen-exact the device optimizer keeps no master of a frozen
// element, and the planner puts the state on the GPU at stage 1. By hand, P = 6,746,804,224, T =
// 8,388,608: the half params and the half copy 2 x P = 13,493,608,448 each, the master 4 x T =
// 33,554,432, the moments 8 x T = 67,108,864, the gradients 4 x T packed and stage 1's full-size
// 4 x T, 67,108,864, the activations 2,430,599,168 (seq 4096, checkpointing: 2.26 GiB), the
// reducer's buckets 134,217,728 and the reserved 1,073,741,824: 30,793,547,776 B of the 36e9
// usable; the host holds the reducer's pinned buckets alone.
TEST_F(PlanCli, FrozenExactPutsTheStateOfA7bLoraOnTheGpu) {
  const std::string base =
      "plan --model llama-2-7b --lora-rank 16 --gpus 1 --gpu-mem 40GB --host-mem 64GB --seq 4096 "
      "--checkpoint-activations --json" +
      std::string(kRates);
  CliRun r = run_zinf(base);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json plan = nlohmann::json::parse(r.out);
  EXPECT_EQ(plan.at("placement").at("stage"), 2);
  EXPECT_EQ(plan.at("placement").at("offload_optimizer"), "cpu");
  EXPECT_EQ(plan.at("bytes_per_state_per_rank").at("fp32_master").at("host"),
            4 * 6'746'804'224 + 3'670'016);
  r = run_zinf(base + " --offload-optimizer none");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("shortfall").at(0).at("tier"), "device");
  r = run_zinf(base + " --frozen-exact");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  plan = nlohmann::json::parse(r.out);
  EXPECT_EQ(plan.at("placement").at("stage"), 1);
  EXPECT_EQ(plan.at("placement").at("offload_optimizer"), "none");
  const nlohmann::json& bytes = plan.at("bytes_per_state_per_rank");
  EXPECT_EQ(bytes.at("fp32_master").at("device"), 33'554'432);
  EXPECT_EQ(bytes.at("fp32_master").at("host"), 0);
  EXPECT_EQ(bytes.at("half_copy").at("device"), 13'493'608'448);
  EXPECT_EQ(plan.at("bytes_per_tier").at("device"), 30'793'547'776);
  EXPECT_EQ(plan.at("bytes_per_tier").at("host"), 134'217'728);
}

// --frozen-exact without anything frozen, or with --step-only (which steps every parameter): exit
// 1, naming the option. Without it nothing of the output says so (the JSON's key is false).
TEST_F(PlanCli, FrozenExactNeedsFrozenParameters) {
  const std::string base =
      "plan --model llama-2-7b --gpu-mem 80GB --host-mem 256GB" + std::string(kRates);
  CliRun r = run_zinf(base + " --frozen-exact");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.err.find("--frozen-exact: needs --trainable or --lora-rank"), std::string::npos)
      << r.err;
  r = run_zinf("plan --step-only --params 1G --tier host --mem-adam-gbps 50 --frozen-exact");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.err.find("do not apply to --step-only"), std::string::npos) << r.err;
  r = run_zinf(base + " --trainable 1% --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("model").at("frozen_exact_in_half"), false);
  r = run_zinf(base + " --trainable 1%");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("exact in the half dtype"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace zinf::plan
