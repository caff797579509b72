// The tiered optimizer step with its swap space striped over two directories: the same state, bit
// for bit, as over one directory and as the in-memory run, with the engine's default request
// bound; a pipeline whose swap ops could hold more engine requests than the engine takes is
// refused at open, naming the config keys that bound them.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "tier/optimizer_pipeline.hpp"
#include "tier_test_util.hpp"

namespace zinf {
namespace {

using tier_test::Reference;
using tier_test::Rig;
using tier_test::RigOptions;

// An aio block of 64 KiB at depth 32, 6M parameters in sub-groups of 2M, 4 pool blocks: every
// sub-group's reads in flight at once, 8 MiB a piece.
RigOptions striped_step_options(std::size_t dir_count) {
  RigOptions so;
  so.store.param_count = 6 << 20;
  so.store.sub_group_params = 2 << 20;
  so.store.grad_dtype = DType::kBF16;
  so.store.optimizer = OptimizerKind::kAdamW;
  so.pool_blocks = 4;
  so.io_block_bytes = 64 << 10;
  so.io_queue_depth = 32;
  so.swap_dir_count = dir_count;
  so.pipeline.optimizer.kind = OptimizerKind::kAdamW;
  so.pipeline.optimizer.lr = 1e-2;
  so.pipeline.optimizer.weight_decay = 0.05;
  so.pipeline.threads = 2;
  return so;
}

TEST(PipelineDirs, TwoStepsOverTwoDirectoriesEqualOneDirectoryAndTheInMemoryRun) {
  const std::uint64_t seed = 0xd125;
  for (std::size_t dirs : {1u, 2u}) {
    std::printf("striped step over %zu dirs: seed %llu\n", dirs,
                static_cast<unsigned long long>(seed));
    const RigOptions so = striped_step_options(dirs);
    Rig s;
    Reference ref;
    Status opened = tier_test::open_loaded_rig(fmt::format("dirs{}", dirs), so, seed, 0, &s, &ref);
    ASSERT_TRUE(opened.is_ok()) << opened.to_string();
    ASSERT_EQ(s.swap->options().dirs.size(), dirs);
    for (std::int64_t t = 1; t <= 2; ++t) {
      ref.make_grads(so.store.grad_dtype, seed + 100 + static_cast<std::uint64_t>(t));
      ASSERT_TRUE(tier_test::load_grads(*s.store, ref).is_ok());
      Result<StepStats> stats = s.pipeline->step({.step = t, .grad_scale = 1.0f});
      ASSERT_TRUE(stats.is_ok()) << dirs << " dirs, step " << t << ": "
                                 << stats.status().to_string();
      EXPECT_EQ(stats->sub_groups, 3u);
      ref.step(so.pipeline.optimizer, so.store, t, 1.0f);
      // Both runs equal the same reference, so they equal each other bit for bit.
      EXPECT_EQ(tier_test::compare_all(*s.store, ref), "") << dirs << " dirs, step " << t;
    }
  }
}

// 4 blocks x 4 ops x 8 requests (8 MiB ops over 2 directories, rounds of 16 blocks each) is 128
// requests, above an engine bound of 100: refused at open, naming the keys that lower it and
// saying max_requests is no key of the config, where the step used to fail part-way with
// resource_exhausted. What the message advises works: at aio.queue_depth 64 a request moves 32
// blocks of a directory's share, an op takes 4 requests, and 64 fit the same bound.
TEST(PipelineDirs, MoreRequestsThanTheEngineTakesIsRefusedAtOpen) {
  RigOptions so = striped_step_options(2);
  so.io_max_requests = 100;
  Rig s;
  Status opened = tier_test::open_rig("dirs-bound", so, &s);
  ASSERT_EQ(opened.code(), Code::kInvalidArgument) << opened.to_string();
  for (const char* key :
       {"16 swap ops", "up to 8 I/O requests", "max_requests 100", "max_requests at 1024",
        "no config key sets it", "aio.queue_depth 32", "raise aio.queue_depth", "aio.block_size",
        "sub_group_size", "buffer_count"}) {
    EXPECT_NE(opened.message().find(key), std::string::npos) << key << ": " << opened.to_string();
  }
  so.io_max_requests = 128;
  Rig fits;
  opened = tier_test::open_rig("dirs-fits", so, &fits);
  EXPECT_TRUE(opened.is_ok()) << opened.to_string();

  so.io_max_requests = 100;
  so.io_queue_depth = 64;
  Rig deeper;
  opened = tier_test::open_rig("dirs-deeper", so, &deeper);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  EXPECT_EQ(deeper.swap->op_requests(8 << 20), 4u);
}

}  // namespace
}  // namespace zinf
