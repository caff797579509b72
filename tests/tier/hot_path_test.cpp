// The step allocates nothing after warm-up: every buffer, in-flight record and ticket is sized
// at open(). Global operator new is replaced in this test binary to count allocations made by
// any thread while the counter is armed.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <vector>

#include "common/counting_new.hpp"
#include "tier_test_util.hpp"

using zinf::test::g_allocations;
using zinf::test::g_count_allocations;

namespace zinf {
namespace {

void steps_allocate_nothing(bool stream_half, bool frozen = false) {
  // The counter counts: one allocation while armed is seen.
  g_allocations.store(0);
  g_count_allocations.store(true);
  auto* probe = new std::uint64_t(42);
  g_count_allocations.store(false);
  EXPECT_EQ(g_allocations.load(), 1u);
  delete probe;
  tier_test::RigOptions so;
  so.store.param_count = 60'000;
  so.store.sub_group_params = 7000;  // a short last sub-group too
  so.store.grad_dtype = DType::kBF16;
  so.pool_blocks = 3;
  so.pipeline.threads = 2;
  std::size_t handed = 0;
  if (stream_half) {
    // The half output handed over from the blocks (what the engine streams into its shards).
    so.store.tiers[static_cast<std::size_t>(Piece::kParamsHalf)] = StoreMedium::kBlock;
    so.pipeline.half_done = [&](std::size_t, const std::byte*) {
      ++handed;
      return Status::ok();
    };
  }
  // Frozen: four of the nine sub-groups are passed over (settled from the start, as the engine
  // marks its frozen sub-groups after loading zero moments).
  const std::vector<bool> frozen_flags = {false, true,  true, false, true,
                                          false, false, true, false};
  if (frozen) so.pipeline.frozen_sub_groups = frozen_flags;
  tier_test::Rig s;
  tier_test::Reference ref;
  Status opened = tier_test::open_loaded_rig("hot", so, 77, 78, &s, &ref);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  if (frozen) {
    ASSERT_EQ(s.store->sub_group_count(), frozen_flags.size());
    for (std::size_t i = 0; i < frozen_flags.size(); ++i) {
      s.store->set_settled(i, frozen_flags[i]);
    }
  }
  ASSERT_TRUE(s.pipeline->step({.step = 1}).is_ok());  // warm-up: threads, arenas, caches
  for (std::int64_t t = 2; t <= 4; ++t) {
    g_allocations.store(0);
    g_count_allocations.store(true);
    Result<StepStats> stats = s.pipeline->step({.step = t});
    g_count_allocations.store(false);
    ASSERT_TRUE(stats.is_ok()) << stats.status().to_string();
    EXPECT_EQ(stats->sub_groups_passed, frozen ? 4u : 0u) << "step " << t;
    std::printf("step %lld: %llu allocations\n", static_cast<long long>(t),
                static_cast<unsigned long long>(g_allocations.load()));
    EXPECT_EQ(g_allocations.load(), 0u) << "step " << t;
  }
  if (stream_half) {
    EXPECT_EQ(handed, 4u * s.store->sub_group_count());  // every sub-group of the 4 steps
  }
}

TEST(OptimizerPipelineHotPath, StepAllocatesNothingAfterWarmUp) { steps_allocate_nothing(false); }

TEST(OptimizerPipelineHotPath, StreamingTheHalfOutputAllocatesNothing) {
  steps_allocate_nothing(true);
}

TEST(OptimizerPipelineHotPath, PassingOverFrozenSubGroupsAllocatesNothing) {
  steps_allocate_nothing(false, /*frozen=*/true);
  steps_allocate_nothing(true, /*frozen=*/true);
}

}  // namespace
}  // namespace zinf
