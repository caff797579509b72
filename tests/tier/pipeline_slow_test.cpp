// Larger runs of the pipelined step (label `slow`, outside the default run): realistic sub-group
// sizes over millions of parameters, against the in-memory optimizer, bit for bit.
#include <gtest/gtest.h>

#include <cstdio>

#include "tier_test_util.hpp"

namespace zinf {
namespace {

TEST(OptimizerPipelineSlow, MillionsOfParamsInMiBSubGroupsEqualTheInMemoryRun) {
  const std::uint64_t seed = 0x51a4;
  std::printf("slow equality: seed %llu\n", static_cast<unsigned long long>(seed));
  for (std::size_t sub_group_bytes : {std::size_t{4} << 20, std::size_t{16} << 20}) {
    tier_test::RigOptions so;
    so.store.param_count = 12'345'679;
    so.store.sub_group_bytes = sub_group_bytes;  // 18 bytes a parameter: does not divide
    so.io_block_bytes = 1 << 20;
    so.pool_blocks = 6;
    so.pipeline.optimizer.lr = 1e-3;
    tier_test::Rig s;
    tier_test::Reference ref;
    Status opened = tier_test::open_loaded_rig("slow", so, seed, 0, &s, &ref);
    ASSERT_TRUE(opened.is_ok()) << opened.to_string();
    for (std::int64_t t = 1; t <= 3; ++t) {
      ref.make_grads(DType::kF32, seed + static_cast<std::uint64_t>(t));
      ASSERT_TRUE(tier_test::load_grads(*s.store, ref).is_ok());
      Result<StepStats> stats = s.pipeline->step({.step = t});
      ASSERT_TRUE(stats.is_ok()) << stats.status().to_string();
      ref.step(so.pipeline.optimizer, so.store, t, 1.0f);
    }
    ASSERT_EQ(tier_test::compare_all(*s.store, ref), "");
  }
}

}  // namespace
}  // namespace zinf
