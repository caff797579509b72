// Checkpoints and steps of an engine whose NVMe state and checkpoints live on a small ext4 on a
// loop device (tests/common/loop_mount.hpp) that fills up and then turns read-only: each save
// fails with a Status naming the file and the cause, leaves no checkpoint that would load half
// written, and the checkpoint saved before still loads (its checksums verified) with the same
// master values. Skips, naming the reason, where the machine cannot mount a loop filesystem.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "common/loop_mount.hpp"
#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::TrainOptions;
using test_common::LoopMount;

// Every parameter's fp32 master, in registration order.
TEST(LoopFilesystem, SavesOnAFullThenReadOnlyDiskFailNamingTheFileAndTheLastCheckpointLoads) {
  LoopMount mount("engine", 96);
  if (!mount.ok()) GTEST_SKIP() << mount.reason();
  const Model model = engine_test::make_model(DType::kF32, 2604);
  const std::string root = mount.path();
  Config config = engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, root);
  // The filesystem turns read-only right after a step(): the sequential step, whose writes have
  // all landed by then (overlapped, the pass may still be writing, and fails there first).
  config.overlap_step = false;
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Env env;
  env.device = ranks.devices[0].get();
  env.comm = ranks.comms[0].get();
  Result<std::unique_ptr<Engine>> opened = Engine::open(config, env);
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  Engine& engine = **opened;
  TrainOptions options;
  options.steps = 2;
  Status trained = engine_test::train_rank(engine, model, 0, options, nullptr, nullptr);
  ASSERT_TRUE(trained.is_ok()) << trained.to_string();
  ASSERT_TRUE(engine.save_checkpoint(root + "/a").is_ok());
  Result<std::vector<std::vector<float>>> saved = engine_test::read_masters(engine, model);
  ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();

  // A full disk: the save fails naming the file and ENOSPC; nothing under b/ would load. (The
  // directories exist already, so that the saves fail writing their files, not at mkdir.)
  std::filesystem::create_directories(root + "/b");
  std::filesystem::create_directories(root + "/c");
  std::printf("filled %s with %llu bytes\n", root.c_str(),
              static_cast<unsigned long long>(mount.fill()));
  const Status full = engine.save_checkpoint(root + "/b");
  std::printf("save on a full disk: %s\n", full.to_string().c_str());
  EXPECT_EQ(full.code(), Code::kNoSpace) << full.to_string();
  EXPECT_NE(full.message().find(root + "/b/"), std::string::npos) << full.to_string();
  EXPECT_FALSE(std::filesystem::exists(root + "/b/manifest.json"));
  // The optimizer's swap space was preallocated: training goes on.
  options.first_step = 3;
  options.steps = 3;
  const Status step3 = engine_test::train_rank(engine, model, 0, options, nullptr, nullptr);
  std::printf("step on a full disk: %s\n", step3.to_string().c_str());
  EXPECT_TRUE(step3.is_ok()) << step3.to_string();

  // Read-only: the save fails naming the file and EROFS, and so does the next step's write.
  ASSERT_TRUE(mount.turn_read_only()) << "no trigger_fs_error on " << mount.device();
  const Status ro = engine.save_checkpoint(root + "/c");
  std::printf("save on a read-only filesystem: %s\n", ro.to_string().c_str());
  EXPECT_EQ(ro.sys_code(), EROFS) << ro.to_string();
  EXPECT_NE(ro.message().find(root + "/c"), std::string::npos) << ro.to_string();
  options.first_step = 4;
  options.steps = 4;
  const Status step4 = engine_test::train_rank(engine, model, 0, options, nullptr, nullptr);
  std::printf("step on a read-only filesystem: %s\n", step4.to_string().c_str());
  EXPECT_EQ(step4.sys_code(), EROFS) << step4.to_string();
  EXPECT_NE(step4.message().find(root), std::string::npos) << step4.to_string();

  // The checkpoint saved before the faults loads, from the read-only disk, into a new engine
  // (optimizer state in host memory), checksums verified, with the master values it held.
  engine_test::Ranks fresh_ranks = engine_test::make_ranks(1);
  Env fresh_env;
  fresh_env.device = fresh_ranks.devices[0].get();
  fresh_env.comm = fresh_ranks.comms[0].get();
  const Config host_config =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, "");
  Result<std::unique_ptr<Engine>> fresh = Engine::open(host_config, fresh_env);
  ASSERT_TRUE(fresh.is_ok()) << fresh.status().to_string();
  ASSERT_TRUE(engine_test::register_model(**fresh, model).is_ok());
  ASSERT_TRUE((*fresh)->finalize().is_ok());
  const Status loaded = (*fresh)->load_checkpoint(root + "/a");
  ASSERT_TRUE(loaded.is_ok()) << loaded.to_string();
  Result<std::vector<std::vector<float>>> back = engine_test::read_masters(**fresh, model);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    EXPECT_EQ(std::memcmp((*back)[p].data(), (*saved)[p].data(), (*saved)[p].size() * 4), 0)
        << model.params[p].name;
  }
}

}  // namespace
}  // namespace zinf
