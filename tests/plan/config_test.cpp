// The engine config the planner writes: DeepSpeed's keys, read back unchanged, and errors that
// name the key.
#include "plan/config.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "plan/profile.hpp"
#include "zinf/config.hpp"

namespace zinf::plan {
namespace {

PlanConfig sample() {
  PlanConfig c;
  c.setup.stage = 3;
  c.setup.world_size = 8;
  c.setup.ranks_per_machine = 4;
  c.setup.optimizer = OffloadDevice::kNvme;
  c.setup.params = OffloadDevice::kHost;
  c.setup.gradients_on_nvme = true;
  c.setup.sub_group_params = 1 << 24;
  c.setup.buffer_count = 6;
  c.setup.reduce_bucket_params = 67'108'864;
  c.setup.prefetch_bucket_params = 60'397'977;
  c.setup.max_live_params = 1'711'308'800;
  c.setup.persistence_threshold_params = 81'920;
  c.setup.io_block_bytes = 1 << 20;
  c.setup.io_queue_depth = 16;
  c.micro_batch = 2;
  c.grad_accum_steps = 8;
  c.nvme_path = "/local_nvme";
  c.pinned_pool_bytes = pinned_pool_bytes(c.setup);
  return c;
}

TEST(Config, UsesDeepSpeedKeys) {
  const nlohmann::json j = nlohmann::json::parse(config_to_json(sample()));
  const auto& zero = j.at("zero_optimization");
  EXPECT_EQ(zero.at("stage"), 3);
  EXPECT_EQ(zero.at("offload_optimizer").at("device"), "nvme");
  EXPECT_EQ(zero.at("offload_optimizer").at("nvme_path"), "/local_nvme");
  EXPECT_EQ(zero.at("offload_optimizer").at("buffer_count"), 6);
  EXPECT_EQ(zero.at("offload_param").at("device"), "cpu");
  EXPECT_EQ(zero.at("sub_group_size"), 1 << 24);
  EXPECT_EQ(zero.at("reduce_bucket_size"), 67'108'864);
  EXPECT_EQ(zero.at("stage3_prefetch_bucket_size"), 60'397'977);
  EXPECT_EQ(zero.at("stage3_max_live_parameters"), 1'711'308'800);
  EXPECT_EQ(zero.at("stage3_param_persistence_threshold"), 81'920);
  EXPECT_EQ(j.at("train_micro_batch_size_per_gpu"), 2);
  EXPECT_EQ(j.at("gradient_accumulation_steps"), 8);
  EXPECT_EQ(j.at("aio").at("block_size"), 1 << 20);
  EXPECT_EQ(j.at("aio").at("queue_depth"), 16);
  // 6 buffers of 2^24 params x 16 B (master, m, v, spilled gradient).
  EXPECT_EQ(j.at("zinf").at("pinned_pool_bytes"), 6ull * (1 << 24) * 16);
  EXPECT_EQ(j.at("zinf").at("gradients_on_nvme"), true);
  EXPECT_EQ(j.at("zinf").at("world_size"), 8);
}

TEST(Config, RoundTrips) {
  const PlanConfig a = sample();
  auto b = config_from_json(config_to_json(a));
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  EXPECT_EQ(config_to_json(*b), config_to_json(a));
  EXPECT_EQ(b->setup.optimizer, OffloadDevice::kNvme);
  EXPECT_EQ(b->setup.params, OffloadDevice::kHost);
  EXPECT_EQ(b->nvme_path, "/local_nvme");
  EXPECT_EQ(b->pinned_pool_bytes, a.pinned_pool_bytes);
}

TEST(Config, ReadsAHandWrittenDeepSpeedConfig) {
  // DeepSpeed configs write counts as floats (1e9) and leave most keys out.
  const char* text = R"({
    "train_micro_batch_size_per_gpu": 4,
    "zero_optimization": {
      "stage": 2,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "sub_group_size": 1e9,
      "reduce_bucket_size": 5e8
    }
  })";
  auto c = config_from_json(text);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->setup.stage, 2);
  EXPECT_EQ(c->setup.optimizer, OffloadDevice::kHost);
  EXPECT_EQ(c->setup.sub_group_params, 1'000'000'000u);
  EXPECT_EQ(c->setup.reduce_bucket_params, 500'000'000u);
  EXPECT_EQ(c->micro_batch, 4u);
}

// A config that clips by the last applied step's norm (zinf.clip_from_previous_step) lets the pass
// open in the backward; read and written back it must still say so, or the engine would run the
// exact clipping that waits for step(), and the plan read from it would predict that step.
TEST(Config, ClipFromPreviousStepSurvivesARoundTrip) {
  const char* text = R"({
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "zinf": {"clip_from_previous_step": true}
  })";
  auto a = config_from_json(text);
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_FALSE(a->setup.exact_clipping_or_loss_scaling);
  const std::string written = config_to_json(*a);
  const nlohmann::json j = nlohmann::json::parse(written);
  EXPECT_EQ(j.at("gradient_clipping").get<double>(), 1.0);
  EXPECT_EQ(j.at("zinf").at("clip_from_previous_step"), true) << written;
  auto b = config_from_json(written);
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  EXPECT_FALSE(b->setup.exact_clipping_or_loss_scaling) << written;
  EXPECT_EQ(config_to_json(*b), written);

  // Without it the same clipping is exact, and reads back so.
  auto exact = config_from_json(R"({"gradient_clipping": 1.0})");
  ASSERT_TRUE(exact.is_ok()) << exact.status().to_string();
  EXPECT_TRUE(exact->setup.exact_clipping_or_loss_scaling);
  auto exact_back = config_from_json(config_to_json(*exact));
  ASSERT_TRUE(exact_back.is_ok()) << exact_back.status().to_string();
  EXPECT_TRUE(exact_back->setup.exact_clipping_or_loss_scaling);
}

// engine_config() writes the step from gradient_clipping, clip_from_previous_step and fp16; a
// setup timed for another step is a caller's error, caught before a config that runs a different
// step is written.
TEST(Config, SetupDisagreeingWithTheClippingKeysAsserts) {
  // The death tests fork; "threadsafe" re-runs the binary in the child, safe beside any thread
  // an earlier test left running.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // Timed for the exact step, but the keys write a step that overlaps freely.
  PlanConfig c = sample();
  c.setup.exact_clipping_or_loss_scaling = true;
  EXPECT_DEATH(config_to_json(c), "exact_clipping_or_loss_scaling");
  c.gradient_clipping = 1.0;
  c.clip_from_previous_step = true;
  EXPECT_DEATH(config_to_json(c), "exact_clipping_or_loss_scaling");
  c.fp16 = true;
  EXPECT_NE(config_to_json(c).find("\"fp16\""), std::string::npos);

  // The other way: timed for the free step, but the keys clip by the step's own norm.
  PlanConfig d = sample();
  d.setup.exact_clipping_or_loss_scaling = false;
  d.gradient_clipping = 1.0;
  d.clip_from_previous_step = false;
  EXPECT_DEATH(config_to_json(d), "exact_clipping_or_loss_scaling");
  d.clip_from_previous_step = true;
  EXPECT_NE(config_to_json(d).find("\"gradient_clipping\""), std::string::npos);
}

TEST(Config, ErrorsNameTheKey) {
  struct Case {
    const char* text;
    const char* key;
  };
  const Case cases[] = {
      {R"({"zero_optimization": {"stage": 5}})", "zero_optimization.stage"},
      {R"({"zero_optimization": {"stage": "three"}})", "zero_optimization.stage"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})",
       "zero_optimization.offload_optimizer.device"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})",
       "offload_optimizer.nvme_path"},
      {R"({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})",
       "offload_param"},
      {R"({"zinf": {"gradients_on_nvme": 1}})", "zinf.gradients_on_nvme"},
      {R"({"aio": {"queue_depth": -4}})", "aio.queue_depth"},
      {"[1, 2]", "not a JSON object"},
  };
  for (const Case& c : cases) {
    auto r = config_from_json(c.text);
    ASSERT_FALSE(r.is_ok()) << c.text;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << c.text;
    EXPECT_NE(r.status().message().find(c.key), std::string_view::npos)
        << c.text << " -> " << r.status().to_string();
  }
}

// One schema: the planner's output opens as the engine's config, the engine's writer output reads
// back as the same plan, for every placement the planner can choose.
TEST(Config, PlannerAndEngineRoundTripThroughEachOther) {
  for (int stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
      for (OffloadDevice param :
           {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
        if (stage != 3 && param != OffloadDevice::kNone) continue;
        PlanConfig a = sample();
        a.setup.stage = stage;
        a.setup.optimizer = opt;
        a.setup.params = param;
        a.setup.gradients_on_nvme = opt == OffloadDevice::kNvme && stage > 1;
        a.pinned_pool_bytes = pinned_pool_bytes(a.setup);
        const std::string plan_text = config_to_json(a);
        // The planner's text, read by the engine's parser...
        Result<zinf::Config> engine = zinf::parse_config(plan_text);
        ASSERT_TRUE(engine.is_ok()) << engine.status().to_string() << "\n" << plan_text;
        EXPECT_EQ(engine->zero.stage, stage);
        EXPECT_EQ(engine->zero.sub_group_size, a.setup.sub_group_params);
        EXPECT_EQ(engine->aio_queue_depth, a.setup.io_queue_depth);
        EXPECT_EQ(engine->pinned_pool_bytes, a.pinned_pool_bytes);
        // ... written by the engine's writer, and read by the planner: the same plan.
        const std::string engine_text = zinf::config_to_json(*engine);
        Result<PlanConfig> b = config_from_json(engine_text);
        ASSERT_TRUE(b.is_ok()) << b.status().to_string() << "\n" << engine_text;
        EXPECT_EQ(b->setup.stage, a.setup.stage);
        EXPECT_EQ(b->setup.optimizer, a.setup.optimizer);
        EXPECT_EQ(b->setup.params, a.setup.params);
        EXPECT_EQ(b->setup.world_size, a.setup.world_size);
        EXPECT_EQ(b->setup.ranks_per_machine, a.setup.ranks_per_machine);
        EXPECT_EQ(b->setup.buffer_count, a.setup.buffer_count);
        EXPECT_EQ(b->setup.max_live_params, a.setup.max_live_params);
        EXPECT_EQ(b->setup.device_reserved_bytes, a.setup.device_reserved_bytes);
        EXPECT_EQ(b->micro_batch, a.micro_batch);
        EXPECT_EQ(b->grad_accum_steps, a.grad_accum_steps);
        EXPECT_EQ(b->pinned_pool_bytes, a.pinned_pool_bytes);
        EXPECT_EQ(b->nvme_path,
                  opt == OffloadDevice::kNvme || param == OffloadDevice::kNvme ? a.nvme_path : "");
        EXPECT_EQ(engine_text, plan_text);
      }
    }
  }
}

// Unknown and mis-cased keys, and keys zinf refuses, fail the planner's reader with exactly the
// engine's message.
TEST(Config, PlannerAndEngineRefuseKeysWithTheSameMessage) {
  const char* cases[] = {
      R"({"zero_optimization": {"stage": 3, "bogus_knob": 1}})",
      R"({"Zero_Optimization": {"stage": 3}})",
      R"({"zero_optimization": {"Stage": 3}})",
      R"({"zero_optimization": {"offload_optimizer": {"device": "GPU"}}})",
      R"({"zero_optimization": {"offload_optimizer": {"device": "device"}}})",
      R"({"zero_optimization": {"offload_param": {"Device": "cpu"}}})",
      R"({"zinf": {"worldsize": 4}})",
      R"({"aio": {"BLOCK_SIZE": 1048576}})",
      R"({"scheduler": {"type": "LRRangeTest"}})",
      R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_LR": 1e-3}}})",
      R"({"optimizer": {"type": "SGD"}})",
  };
  for (const char* text : cases) {
    Result<zinf::Config> engine = zinf::parse_config(text);
    Result<PlanConfig> plan = config_from_json(text);
    ASSERT_FALSE(engine.is_ok()) << text;
    ASSERT_FALSE(plan.is_ok()) << text;
    EXPECT_EQ(plan.status().code(), Code::kInvalidArgument) << text;
    EXPECT_EQ(plan.status().message(), engine.status().message()) << text;
  }
}

TEST(Config, WriteConfigWritesTheFileOrNamesThePath) {
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  const std::string path = dir + "/plan_config_test.json";
  ASSERT_TRUE(write_config(sample(), path).is_ok());
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  EXPECT_EQ(text.str(), config_to_json(sample()));
  std::remove(path.c_str());
  const Status bad = write_config(sample(), dir + "/no/such/dir/config.json");
  EXPECT_FALSE(bad.is_ok());
  EXPECT_NE(bad.message().find("no/such/dir"), std::string_view::npos) << bad.to_string();
}

TEST(Profile, ReadsProbeOutputAndIoTuneResults) {
  // `zinf probe --json` output with an io tune sweep added.
  const char* text = R"({"cpu_cores": 16, "mem_triad_gbps": 80.5, "mem_adam_pattern_gbps": 61.25,
    "io": {"results": [
      {"block_bytes": 131072, "queue_depth": 8, "read_gbps": 2.5, "write_gbps": 1.5},
      {"block_bytes": 1048576, "queue_depth": 32, "read_gbps": 6.5, "write_gbps": 3.25},
      {"block_bytes": 4194304, "queue_depth": 64, "read_gbps": 7.0, "write_gbps": 3.0}]}})";
  MachineProfile p;
  ASSERT_TRUE(parse_machine_profile(text, "file x.json", 1 << 20, 32, &p).is_ok());
  EXPECT_DOUBLE_EQ(p.mem_adam_gbps, 61.25);
  EXPECT_EQ(p.cpu_cores, 16);
  // The entry at the engine's block size and depth.
  EXPECT_DOUBLE_EQ(p.nvme_read_gbps, 6.5);
  EXPECT_DOUBLE_EQ(p.nvme_write_gbps, 3.25);
  EXPECT_EQ(p.nvme_source, "file x.json");
  // No matching entry: the best read and the best write.
  MachineProfile q;
  ASSERT_TRUE(parse_machine_profile(text, "f", 65536, 4, &q).is_ok());
  EXPECT_DOUBLE_EQ(q.nvme_read_gbps, 7.0);
  EXPECT_DOUBLE_EQ(q.nvme_write_gbps, 3.25);
}

TEST(Profile, ReadsWhatZinfIoTuneSaves) {
  // The shape of ~/.cache/zinf/io-tune.json: every point, and the best per op.
  const char* text = R"({"path": "/nvme", "engine": "uring", "seconds_per_point": 0.3,
    "points": [
      {"op": "read", "block_bytes": 1048576, "queue_depth": 16, "rings": 1, "gbps": 5.5},
      {"op": "read", "block_bytes": 1048576, "queue_depth": 32, "rings": 2, "gbps": 6.25},
      {"op": "write", "block_bytes": 1048576, "queue_depth": 32, "rings": 1, "gbps": 2.5},
      {"op": "write", "block_bytes": 1048576, "queue_depth": 32, "rings": 2, "gbps": 2.75},
      {"op": "write", "block_bytes": 4194304, "queue_depth": 8, "rings": 1, "gbps": 3.5}],
    "best": {
      "read": {"op": "read", "block_bytes": 1048576, "queue_depth": 32, "rings": 2, "gbps": 6.25},
      "write": {"op": "write", "block_bytes": 4194304, "queue_depth": 8, "rings": 1, "gbps": 3.5}}})";
  MachineProfile p;
  ASSERT_TRUE(parse_machine_profile(text, "file t.json", 1 << 20, 32, &p).is_ok());
  // The read's best point sets block and depth; the write rate is the best at that point.
  EXPECT_DOUBLE_EQ(p.nvme_read_gbps, 6.25);
  EXPECT_DOUBLE_EQ(p.nvme_write_gbps, 2.75);
  EXPECT_EQ(p.nvme_block_bytes, 1u << 20);
  EXPECT_EQ(p.nvme_queue_depth, 32u);
  EXPECT_NE(p.nvme_source.find("io tune"), std::string::npos);
  const Status bad =
      parse_machine_profile(R"({"best": {"read": {"gbps": 1}}})", "file t.json", 1 << 20, 32, &p);
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_NE(bad.message().find("t.json"), std::string_view::npos) << bad.to_string();
}

TEST(Profile, SaveKeepsOtherKeysAndReadsBack) {
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string path =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/plan_profile_save/sub/machine.json";
  std::filesystem::remove_all(std::filesystem::path(path).parent_path().parent_path());
  MachineProfile p;
  p.mem_adam_gbps = 23.5;
  p.nvme_read_gbps = 3.25;
  p.nvme_write_gbps = 5.5;
  p.nvme_duplex_gbps = 4.75;
  p.cpu_cores = 2;
  ASSERT_TRUE(save_machine_profile(path, p).is_ok());
  // Another tool's key survives a second save.
  {
    std::ifstream in(path);
    nlohmann::json j = nlohmann::json::parse(in);
    j["mem_triad_gbps"] = 11.0;
    std::ofstream(path) << j.dump();
  }
  p.mem_adam_gbps = 24.5;
  ASSERT_TRUE(save_machine_profile(path, p).is_ok());
  MachineProfile back;
  ASSERT_TRUE(load_machine_profile(path, 1 << 20, 32, &back).is_ok());
  EXPECT_DOUBLE_EQ(back.mem_adam_gbps, 24.5);
  EXPECT_DOUBLE_EQ(back.nvme_read_gbps, 3.25);
  EXPECT_DOUBLE_EQ(back.nvme_write_gbps, 5.5);
  EXPECT_DOUBLE_EQ(back.nvme_duplex_gbps, 4.75);
  EXPECT_EQ(back.cpu_cores, 2);
  std::ifstream in(path);
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(in).at("mem_triad_gbps").get<double>(), 11.0);
}

TEST(Profile, KeepsWhatTheFileLacksAndNamesBadKeys) {
  MachineProfile p;
  p.h2d_gbps = 24;
  ASSERT_TRUE(
      parse_machine_profile(R"({"nvme_read_gbps": 3, "nvme_write_gbps": 2})", "f", 1 << 20, 32, &p)
          .is_ok());
  EXPECT_DOUBLE_EQ(p.nvme_read_gbps, 3);
  EXPECT_DOUBLE_EQ(p.h2d_gbps, 24);
  EXPECT_DOUBLE_EQ(p.mem_adam_gbps, 0);
  const Status bad =
      parse_machine_profile(R"({"mem_adam_pattern_gbps": "fast"})", "f", 1 << 20, 32, &p);
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_NE(bad.message().find("mem_adam_pattern_gbps"), std::string_view::npos);
  EXPECT_EQ(load_machine_profile("/nonexistent/zinf/machine.json", 1 << 20, 32, &p).code(),
            Code::kNotFound);
}

}  // namespace
}  // namespace zinf::plan
