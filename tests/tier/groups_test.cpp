// Parameter groups through the OptimizerPipeline: sub-groups carry the pieces of the groups'
// ranges they hold, so the tiered step (on NVMe, in host memory) equals, bit for bit, one
// in-memory optimizer_step over the whole partition with the same ranges, whatever the
// sub-group size; set_group_params() changes the groups' hyper-parameters between steps.
#include <gtest/gtest.h>

#include <vector>

#include "base/random.hpp"
#include "tier/optimizer_pipeline.hpp"
#include "tier_test_util.hpp"

namespace zinf {
namespace {

using tier_test::Reference;
using tier_test::Rig;
using tier_test::RigOptions;

// Runs alternating between a long "weight" in group 0 and a short "bias" in group 1 or 2.
std::vector<OptimizerRange> transformer_like_ranges(std::size_t count, std::uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<OptimizerRange> ranges;
  std::size_t begin = 0;
  std::uint32_t small = 1;
  while (begin < count) {
    ranges.push_back({begin, 0});
    begin += 500 + rng.next() % 3000;
    if (begin >= count) break;
    ranges.push_back({begin, small});
    small = small == 1 ? 2 : 1;
    begin += 1 + rng.next() % 200;
  }
  return ranges;
}

std::vector<OptimizerParams> three_groups(double lr) {
  OptimizerParams decayed;
  decayed.kind = OptimizerKind::kAdamW;
  decayed.lr = lr;
  decayed.weight_decay = 0.1;
  OptimizerParams no_decay = decayed;
  no_decay.weight_decay = 0.0;
  OptimizerParams scaled = decayed;
  scaled.lr = lr * 0.25;
  scaled.weight_decay = 0.0;
  return {decayed, no_decay, scaled};
}

void reference_step(Reference& ref, const RigOptions& so, std::span<const OptimizerParams> groups,
                    std::span<const OptimizerRange> ranges, std::int64_t t) {
  OptimizerSpan span;
  span.params = ref.params.data();
  span.exp_avg = ref.exp_avg.data();
  span.exp_avg_sq = ref.exp_avg_sq.data();
  span.grads = ref.grads.data();
  span.grad_dtype = so.store.grad_dtype;
  span.params_half = so.store.with_half ? ref.half.data() : nullptr;
  span.half_dtype = so.store.half_dtype;
  span.count = ref.count;
  StepOptions options;
  options.step = t;
  options.threads = 1;
  options.tile_elements = 3000;
  ASSERT_TRUE(optimizer_step(groups, ranges, span, options).is_ok());
}

void run_groups(std::size_t sub_group_params, StoreMedium tier) {
  const std::size_t count = 40'000 + 333;
  const std::uint64_t seed = 0x9a0 + sub_group_params;
  RigOptions so;
  so.store.param_count = count;
  so.store.sub_group_params = sub_group_params;
  so.store.optimizer = OptimizerKind::kAdamW;
  so.store.tiers = {tier, tier, tier, tier, tier};
  so.pipeline.optimizer = three_groups(1e-2)[0];
  so.pipeline.groups = three_groups(1e-2);
  so.pipeline.ranges = transformer_like_ranges(count, seed);
  so.pipeline.threads = 2;
  Rig s;
  Reference ref;
  const Status opened = tier_test::open_loaded_rig("groups", so, seed, 0, &s, &ref);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  for (std::int64_t t = 1; t <= 3; ++t) {
    // A schedule: every group's lr changes each step.
    const std::vector<OptimizerParams> groups = three_groups(1e-2 / static_cast<double>(t));
    ASSERT_TRUE(s.pipeline->set_group_params(groups).is_ok());
    ref.make_grads(DType::kF32, seed * 7 + static_cast<std::uint64_t>(t));
    ASSERT_TRUE(tier_test::load_grads(*s.store, ref).is_ok());
    Result<StepStats> stats = s.pipeline->step({.step = t});
    ASSERT_TRUE(stats.is_ok()) << stats.status().to_string();
    reference_step(ref, so, groups, so.pipeline.ranges, t);
    ASSERT_EQ(tier_test::compare_all(*s.store, ref), "")
        << "step " << t << ", sub-groups of " << sub_group_params;
  }
  // The groups' count is fixed at open().
  EXPECT_EQ(s.pipeline->set_group_params(std::vector<OptimizerParams>(2)).code(),
            Code::kInvalidArgument);
}

TEST(OptimizerPipelineGroups, NvmeEqualsOneInMemoryStepOverTheRanges) {
  for (std::size_t sub : {std::size_t{4096}, std::size_t{10007}, std::size_t{40'333}}) {
    run_groups(sub, StoreMedium::kNvme);
  }
}

TEST(OptimizerPipelineGroups, HostTier) { run_groups(7000, StoreMedium::kHost); }

TEST(OptimizerPipelineGroups, BadRangesAreRefusedAtOpen) {
  RigOptions so;
  so.store.param_count = 1000;
  so.store.sub_group_params = 300;
  so.pipeline.optimizer = three_groups(1e-2)[0];
  so.pipeline.groups = three_groups(1e-2);
  for (const std::vector<OptimizerRange>& bad :
       {std::vector<OptimizerRange>{}, std::vector<OptimizerRange>{{10, 0}},
        std::vector<OptimizerRange>{{0, 0}, {5, 3}},
        std::vector<OptimizerRange>{{0, 0}, {500, 1}, {400, 0}},
        std::vector<OptimizerRange>{{0, 0}, {1000, 1}}}) {
    so.pipeline.ranges = bad;
    Rig s;
    Reference ref;
    const Status opened = tier_test::open_loaded_rig("groups_bad", so, 5, 0, &s, &ref);
    EXPECT_EQ(opened.code(), Code::kInvalidArgument) << opened.to_string();
  }
  so.pipeline.ranges = {{0, 0}};
  so.pipeline.groups[1].kind = OptimizerKind::kLion;
  Rig s;
  Reference ref;
  EXPECT_EQ(tier_test::open_loaded_rig("groups_kind", so, 5, 0, &s, &ref).code(),
            Code::kInvalidArgument);
}

}  // namespace
}  // namespace zinf
