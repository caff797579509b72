// Parameter groups through the OptimizerPipeline: sub-groups carry the pieces of the groups'
// ranges they hold, so the tiered step (on NVMe, in host memory) equals, bit for bit, one
// in-memory optimizer_step over the whole partition with the same ranges, whatever the
// sub-group size; set_group_params() changes the groups' hyper-parameters between steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/aligned.hpp"
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

void run_groups(std::size_t sub_group_params, StoreMedium tier,
                std::vector<std::size_t> cuts = {}) {
  const std::size_t count = 40'000 + 333;
  const std::uint64_t seed = 0x9a0 + sub_group_params;
  RigOptions so;
  so.store.param_count = count;
  so.store.sub_group_params = sub_group_params;
  so.store.cuts = std::move(cuts);
  so.store.optimizer = OptimizerKind::kAdamW;
  so.store.tiers = {tier, tier, tier, tier, tier};
  if (!so.store.cuts.empty())
    so.store.tiers[static_cast<std::size_t>(Piece::kGrads)] = StoreMedium::kHost;
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

// Sub-groups also cut at given elements (shorter ones, some of one element), on both tiers.
TEST(OptimizerPipelineGroups, SubGroupsCutAtGivenElements) {
  run_groups(4096, StoreMedium::kNvme, {5000, 5001, 17'000, 40'000});
  run_groups(7000, StoreMedium::kHost, {1, 7001, 30'000});
}

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

// Frozen sub-groups (PipelineOptions::frozen_sub_groups): sub-groups 2-4 and 7 of 8 step in a
// group of learning rate and weight decay 0 on zero gradients. While their moments are not zero
// (they decay) every step updates them as the in-memory reference does; once a full update left
// them zero, later steps pass over them (no read, no update, no write: the bytes moved are the
// other sub-groups', plus the frozen master when the half output streams; on NVMe the zero
// moments are released, not written) and the state stays
// the reference's, bit for bit, the half output included. A moment written into one of them
// makes the step update it again; its other moment, released and still zero, is neither read nor
// written back (it stays released, in a full step as in an io-only one). Gated, descending steps
// pass over them the same way. With `kept` (PipelineOptions::frozen_half_kept for every frozen
// sub-group) the caller keeps the half copy of those passed over: nothing of them is read, not
// even the master, and half_done gets a null pointer for each in its place (the half copy it
// kept from the last full update is still the reference's).
void run_frozen(StoreMedium tier, bool streamed, bool gated, bool kept = false) {
  constexpr std::size_t kSub = 1000, kCount = 8 * kSub;
  const std::vector<bool>& frozen = tier_test::kFrozenSubGroups;
  const std::uint64_t seed = 0xf20 + static_cast<std::uint64_t>(tier) * 2 + (streamed ? 1 : 0);
  RigOptions so = tier_test::frozen_rig_options(
      kSub,
      {tier, tier, tier, StoreMedium::kHost, streamed ? StoreMedium::kBlock : StoreMedium::kHost},
      /*threads=*/2);
  // The streamed half output, collected as half_done hands it over, and the sub-groups handed
  // over in this step (null: kept).
  std::vector<std::uint16_t> streamed_half(kCount);
  std::vector<int> handed, handed_null;
  handed.reserve(64);
  handed_null.reserve(64);
  so.pipeline.half_done = [&](std::size_t i, const std::byte* half) {
    handed.push_back(static_cast<int>(i));
    if (half == nullptr) {
      handed_null.push_back(static_cast<int>(i));
      return Status::ok();
    }
    std::memcpy(streamed_half.data() + i * kSub, half, kSub * 2);
    return Status::ok();
  };
  if (kept) so.pipeline.frozen_half_kept = frozen;
  Rig s;
  Reference ref;
  const Status opened = tier_test::open_loaded_rig("frozen", so, seed, 0, &s, &ref);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  std::vector<float> zeros(kSub, 0.0f);
  AlignedBuffer block(kSub * 4 + 4096);
  // Zero moments in the store and the reference for sub-group i.
  auto zero_moments = [&](std::size_t i) {
    std::memset(block.data(), 0, block.bytes());
    for (Piece piece : {Piece::kExpAvg, Piece::kExpAvgSq}) {
      ASSERT_TRUE(s.store->write_piece(piece, i, block.data()).is_ok());
    }
    std::fill_n(ref.exp_avg.begin() + static_cast<std::ptrdiff_t>(i * kSub), kSub, 0.0f);
    std::fill_n(ref.exp_avg_sq.begin() + static_cast<std::ptrdiff_t>(i * kSub), kSub, 0.0f);
  };
  // A gate that always says yes, for the gated, descending steps.
  const GradsReady ready = [](void*, std::size_t) { return 1; };
  for (std::int64_t t = 1; t <= 6; ++t) {
    if (t == 2) {
      for (std::size_t i = 0; i < frozen.size(); ++i) {
        if (frozen[i]) zero_moments(i);
      }
    }
    if (t == 5) {
      // A moment written into sub-group 3: no longer settled.
      std::vector<float> m(kSub);
      fill_uniform(m.data(), kSub, seed + 9, -0.1f, 0.1f);
      std::memcpy(block.data(), m.data(), kSub * 4);
      ASSERT_TRUE(s.store->write_piece(Piece::kExpAvg, 3, block.data()).is_ok());
      std::copy(m.begin(), m.end(), ref.exp_avg.begin() + 3 * kSub);
    }
    ref.make_grads(DType::kF32, seed * 7 + static_cast<std::uint64_t>(t));
    auto* g = reinterpret_cast<float*>(ref.grads.data());
    for (std::size_t i = 0; i < frozen.size(); ++i) {
      if (frozen[i]) std::fill_n(g + i * kSub, kSub, 0.0f);
    }
    ASSERT_TRUE(tier_test::load_grads(*s.store, ref).is_ok());
    StepArgs args{.step = t};
    if (gated) {
      args.descending = true;
      args.ready = ready;
    }
    handed.clear();
    handed_null.clear();
    Result<StepStats> stats = s.pipeline->step(args);
    ASSERT_TRUE(stats.is_ok()) << stats.status().to_string();
    reference_step(ref, so, so.pipeline.groups, so.pipeline.ranges, t);
    // Step 1: the moments decay (random at load); step 2: zeroed by write_piece, the update
    // checks them; steps 3-4 pass over all four; step 5 updates sub-group 3 again.
    const std::size_t passed = t <= 2 ? 0 : t == 5 ? 3 : t == 6 ? 3 : 4;
    EXPECT_EQ(stats->sub_groups_passed, passed) << "step " << t;
    if (tier == StoreMedium::kNvme) {
      // Master and moments of each sub-group updated; the master alone of those passed over
      // when the half output streams. Moments an update leaves zero in a frozen sub-group are
      // not written but released (StateStore::release_piece): step 2's four; and a released
      // moment that stays zero is neither read nor written: sub-group 3's exp_avg_sq at steps 5
      // and 6 (its exp_avg written non-zero makes the step update it again, and write that one;
      // writing the zero exp_avg_sq would fill its hole with new disk blocks).
      const std::uint64_t updated = (8 - passed) * kSub * 12;
      const std::uint64_t released = t == 2 ? 4 * kSub * 8 : 0;
      const std::uint64_t unread = t >= 5 ? kSub * 4 : 0;
      EXPECT_EQ(stats->read_bytes, updated - unread + (streamed && !kept ? passed * kSub * 4 : 0))
          << "step " << t;
      EXPECT_EQ(stats->write_bytes, updated - released - unread) << "step " << t;
      for (std::size_t i = 0; i < frozen.size(); ++i) {
        EXPECT_EQ(s.store->residency(Piece::kExpAvgSq, i) == Residency::kZero, frozen[i] && t >= 2)
            << "sub-group " << i << " step " << t;
        EXPECT_EQ(s.store->residency(Piece::kExpAvg, i) == Residency::kZero,
                  frozen[i] && t >= 2 && !(t >= 5 && i == 3))
            << "sub-group " << i << " step " << t;
      }
    }
    ASSERT_EQ(tier_test::compare_all(*s.store, ref), "") << "step " << t;
    if (streamed) {
      EXPECT_EQ(std::memcmp(streamed_half.data(), ref.half.data(), kCount * 2), 0) << "step " << t;
      // Every sub-group handed over once, in the step's order; null for those passed over and
      // kept.
      EXPECT_EQ(handed.size(), frozen.size()) << "step " << t;
      for (std::size_t k = 0; k < handed.size(); ++k) {
        const std::size_t want = gated ? frozen.size() - 1 - k : k;
        EXPECT_EQ(handed[k], static_cast<int>(want)) << "step " << t;
      }
      EXPECT_EQ(handed_null.size(), kept ? passed : 0) << "step " << t;
      for (int i : handed_null) {
        EXPECT_TRUE(frozen[static_cast<std::size_t>(i)] &&
                    s.store->settled(static_cast<std::size_t>(i)))
            << i;
      }
    }
    for (std::size_t i = 0; i < frozen.size(); ++i) {
      EXPECT_EQ(s.store->stored_step(i), t) << "sub-group " << i;
      // Settled after a full update that left the moments zero; sub-group 3 never again, its
      // written exp_avg decays but stays non-zero.
      const bool settled = frozen[i] && t >= 2 && !(t >= 5 && i == 3);
      EXPECT_EQ(s.store->settled(i), settled) << "sub-group " << i << " step " << t;
    }
  }
  if (tier != StoreMedium::kNvme) return;
  // An io-only step writes back what it read: the released moments, read as zeros without I/O,
  // are not written either (sub-group 3's exp_avg_sq stays released), and nothing changes.
  Result<StepStats> io = s.pipeline->step({.step = 7, .mode = StepMode::kIoOnly});
  ASSERT_TRUE(io.is_ok()) << io.status().to_string();
  EXPECT_EQ(io->sub_groups_passed, 3u);
  EXPECT_EQ(io->write_bytes, 5 * kSub * 12 - kSub * 4);
  for (std::size_t i = 0; i < frozen.size(); ++i) {
    EXPECT_EQ(s.store->residency(Piece::kExpAvgSq, i) == Residency::kZero, frozen[i])
        << "sub-group " << i;
    EXPECT_EQ(s.store->stored_step(i), 6) << "sub-group " << i;
  }
  EXPECT_EQ(tier_test::compare_all(*s.store, ref), "");
}

TEST(OptimizerPipelineGroups, FrozenSubGroupsOnNvmeArePassedOverOnceTheirMomentsAreZero) {
  run_frozen(StoreMedium::kNvme, /*streamed=*/false, /*gated=*/false);
}
TEST(OptimizerPipelineGroups, FrozenSubGroupsOnNvmeStreamingTheHalfOutput) {
  run_frozen(StoreMedium::kNvme, /*streamed=*/true, /*gated=*/false);
}
TEST(OptimizerPipelineGroups, FrozenSubGroupsOnNvmeGatedDescending) {
  run_frozen(StoreMedium::kNvme, /*streamed=*/true, /*gated=*/true);
}
TEST(OptimizerPipelineGroups, FrozenSubGroupsOnNvmeWithTheirHalfCopyKeptReadNothing) {
  run_frozen(StoreMedium::kNvme, /*streamed=*/true, /*gated=*/false, /*kept=*/true);
  run_frozen(StoreMedium::kNvme, /*streamed=*/true, /*gated=*/true, /*kept=*/true);
}
TEST(OptimizerPipelineGroups, FrozenSubGroupsOnTheHostTier) {
  run_frozen(StoreMedium::kHost, /*streamed=*/false, /*gated=*/false);
  run_frozen(StoreMedium::kHost, /*streamed=*/false, /*gated=*/true);
}

TEST(OptimizerPipelineGroups, FrozenFlagsOfAnotherCountAreRefused) {
  RigOptions so;
  so.store.param_count = 1000;
  so.store.sub_group_params = 300;
  so.pipeline.optimizer = three_groups(1e-2)[0];
  so.pipeline.frozen_sub_groups = {true, false};
  Rig s;
  Reference ref;
  const Status opened = tier_test::open_loaded_rig("frozen_bad", so, 5, 0, &s, &ref);
  EXPECT_EQ(opened.code(), Code::kInvalidArgument) << opened.to_string();
  EXPECT_NE(opened.message().find("2 frozen_sub_groups flags for a store of 4 sub-groups"),
            std::string::npos)
      << opened.to_string();
}

}  // namespace
}  // namespace zinf
