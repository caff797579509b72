// The estimate with the frozen parameters' values exact in the half dtype
// (ModelShape::frozen_exact_in_half, zinf plan --frozen-exact) against figures worked by hand from
// what docs/ENGINE.md says the engine keeps ("A frozen master its half copy holds exactly is not
// kept", "A frozen shard the store's half copy holds is not copied"): with offload_optimizer cpu
// a frozen element keeps its half copy (2 B) and no fp32 master; at stage 3 with offload_param
// cpu its group is lent that half copy for a shard (persistent groups excepted); anywhere else
// nothing changes. Without the flag the estimate is the conservative one, to the byte.
//
// The model throughout: 10,000,000 parameters given by count (4 layers, hidden 256), 1,000,000
// of them trainable, on 4 ranks of one machine: a rank's shard Pr = 2,500,000, its trainable share
// Tr = 250,000, its frozen share Fr = 2,250,000.
#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "plan/estimate.hpp"
#include "plan/model.hpp"

namespace zinf::plan {
namespace {

constexpr MemoryTier kDev = MemoryTier::kDevice;
constexpr MemoryTier kHost = MemoryTier::kHost;
constexpr MemoryTier kNvme = MemoryTier::kNvme;

ModelShape base_model(bool exact) {
  ModelShape m = custom_model(10'000'000, 4, 256);
  m.trainable_params = 1'000'000;
  m.frozen_exact_in_half = exact;
  return m;
}

// 4 ranks at `stage`, optimizer state on `optimizer`, shards on `params`; sub-groups of 2^20, and
// no persistent parameters unless a test sets the threshold.
EngineSetup setup(int stage, OffloadDevice optimizer, OffloadDevice params) {
  EngineSetup s;
  s.stage = stage;
  s.world_size = 4;
  s.ranks_per_machine = 4;
  s.optimizer = optimizer;
  s.params = params;
  s.sub_group_params = 1 << 20;
  s.param_staging_params = 1 << 18;
  s.persistence_threshold_params = 0;
  return s;
}

// The bytes of one kind of state on one tier, for one rank.
struct Expected {
  MemoryUse kind;
  MemoryTier tier;
  std::uint64_t conservative;  // without the flag
  std::uint64_t exact;         // with it
};

void expect_figures(const EngineSetup& s, std::initializer_list<Expected> rows) {
  const MemoryEstimate without = estimate_memory(base_model(false), TrainingShape{}, s);
  const MemoryEstimate with = estimate_memory(base_model(true), TrainingShape{}, s);
  for (const Expected& row : rows) {
    SCOPED_TRACE(std::string(memory_use_name(row.kind)) + " on " +
                 std::string(memory_tier_name(row.tier)));
    EXPECT_EQ(without.bytes(row.kind, row.tier), row.conservative);
    EXPECT_EQ(with.bytes(row.kind, row.tier), row.exact);
  }
  // Nothing else moves: moments and gradients are the trainable share's with or without it.
  for (MemoryUse kind :
       {MemoryUse::kMoments, MemoryUse::kGradients, MemoryUse::kActivations, MemoryUse::kPinnedPool,
        MemoryUse::kGatheredParams, MemoryUse::kCommBuckets, MemoryUse::kReserved}) {
    for (MemoryTier tier : {kDev, kHost, kNvme}) {
      EXPECT_EQ(with.bytes(kind, tier), without.bytes(kind, tier))
          << memory_use_name(kind) << " on " << memory_tier_name(tier);
    }
  }
}

// The four scratch blocks a half-only master goes through: 256 Ki elements each (below the
// sub-group of 2^20 and the shard), three of fp32 and one of halves: 262,144 x 14 = 3,670,016 B.
constexpr std::uint64_t kScratch = 3'670'016;

// Stage 3, state and shards in host memory: a frozen element keeps its half copy alone.
// Conservative: shard 2 x 2,500,000, master 4 x 2,500,000, half copy 2 x 2,500,000 = 8 B an
// element. Exact: the trainable share's shard 2 x 250,000 and master 4 x 250,000 (+ the
// scratch), the half copy of the whole shard 2 x 2,500,000.
TEST(FrozenExact, StageThreeCpuCpuLendsTheHalfCopyAndKeepsNoMaster) {
  expect_figures(setup(3, OffloadDevice::kHost, OffloadDevice::kHost),
                 {{MemoryUse::kHalfParams, kHost, 5'000'000, 500'000},
                  {MemoryUse::kMasterParams, kHost, 10'000'000, 1'000'000 + kScratch},
                  {MemoryUse::kHalfCopy, kHost, 5'000'000, 5'000'000}});
  // Host memory of the rank's engine: 20,000,000 + trainable moments 8 x 250,000 and gradients
  // 4 x 250,000 = 23,000,000 conservative; 6,500,000 + 3,670,016 + 3,000,000 exact: the frozen
  // elements' 6 B each (13,500,000) less the scratch.
  const EngineSetup s = setup(3, OffloadDevice::kHost, OffloadDevice::kHost);
  EXPECT_EQ(estimate_memory(base_model(false), TrainingShape{}, s).engine_bytes(kHost),
            23'000'000u);
  EXPECT_EQ(estimate_memory(base_model(true), TrainingShape{}, s).engine_bytes(kHost), 13'170'016u);
}

// A persistent group is never lent: the persistent parameters (the norms: 4 layers x 2 x 256 +
// 256 = 2,304 of this RMSNorm model, taken as frozen), a quarter of them a rank's, 576, keep their
// shard: 2 x (250,000 + 576) = 501,152 B.
TEST(FrozenExact, PersistentGroupsKeepTheirShard) {
  EngineSetup s = setup(3, OffloadDevice::kHost, OffloadDevice::kHost);
  s.persistence_threshold_params = 100'000;  // DeepSpeed's default, at least the hidden size
  expect_figures(s, {{MemoryUse::kHalfParams, kHost, 5'000'000, 501'152},
                     {MemoryUse::kMasterParams, kHost, 10'000'000, 1'000'000 + kScratch}});
}

// Stages 1 and 2 with the state in host memory: no master of the frozen elements; the half params
// are on the device, every element of the model (2 x 10,000,000), with or without the flag. The
// sub-group of 100,000 elements makes each scratch block a sub-group: 100,000 x 14 = 1,400,000 B.
TEST(FrozenExact, StagesOneAndTwoKeepNoMasterOfTheFrozenElements) {
  for (int stage : {1, 2}) {
    SCOPED_TRACE(stage);
    EngineSetup s = setup(stage, OffloadDevice::kHost, OffloadDevice::kNone);
    s.sub_group_params = 100'000;
    expect_figures(s, {{MemoryUse::kHalfParams, kDev, 20'000'000, 20'000'000},
                       {MemoryUse::kHalfParams, kHost, 0, 0},
                       {MemoryUse::kMasterParams, kHost, 10'000'000, 1'000'000 + 1'400'000},
                       {MemoryUse::kHalfCopy, kHost, 5'000'000, 5'000'000}});
  }
}

// Stage 3 with the state in host memory and the shards on the device or on NVMe: no master of
// the frozen elements; their shards are where they were (nothing is lent off the host).
TEST(FrozenExact, StageThreeShardsOffTheHostAreKept) {
  expect_figures(setup(3, OffloadDevice::kHost, OffloadDevice::kNone),
                 {{MemoryUse::kHalfParams, kDev, 5'000'000, 5'000'000},
                  {MemoryUse::kMasterParams, kHost, 10'000'000, 1'000'000 + kScratch},
                  {MemoryUse::kHalfCopy, kHost, 5'000'000, 5'000'000}});
  expect_figures(setup(3, OffloadDevice::kHost, OffloadDevice::kNvme),
                 {{MemoryUse::kHalfParams, kNvme, 5'000'000, 5'000'000},
                  {MemoryUse::kMasterParams, kHost, 10'000'000, 1'000'000 + kScratch},
                  {MemoryUse::kHalfCopy, kHost, 5'000'000, 5'000'000}});
}

// With the state on NVMe the master stays there (the store's half array, where there is one, is
// the half copy the shards are written from, kept as before), and on the device the device
// optimizer keeps its own: the flag changes nothing, on any tier.
TEST(FrozenExact, StateOnNvmeOrOnTheDeviceIsUnchanged) {
  const OffloadDevice tiers[] = {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme};
  for (OffloadDevice optimizer : {OffloadDevice::kNone, OffloadDevice::kNvme}) {
    for (int stage = 1; stage <= 3; ++stage) {
      for (OffloadDevice params : tiers) {
        if (stage != 3 && params != OffloadDevice::kNone) continue;
        const EngineSetup s = setup(stage, optimizer, params);
        const MemoryEstimate without = estimate_memory(base_model(false), TrainingShape{}, s);
        const MemoryEstimate with = estimate_memory(base_model(true), TrainingShape{}, s);
        EXPECT_EQ(with.rank_bytes, without.rank_bytes)
            << "stage " << stage << ", optimizer " << offload_device_name(optimizer) << ", params "
            << offload_device_name(params);
      }
    }
  }
  // The state on NVMe at stage 3 with the shards in host memory, by hand: the master's
  // 4 x 2,500,000 on NVMe (no checkpoint header page: 10,000,000 B is not a whole number of
  // 4096-byte pages), the shard and the half copy 2 x 2,500,000 each in host memory.
  expect_figures(setup(3, OffloadDevice::kNvme, OffloadDevice::kHost),
                 {{MemoryUse::kMasterParams, kNvme, 10'000'000, 10'000'000},
                  {MemoryUse::kMasterParams, kHost, 0, 0},
                  {MemoryUse::kHalfParams, kHost, 5'000'000, 5'000'000},
                  {MemoryUse::kHalfCopy, kHost, 5'000'000, 5'000'000}});
}

// Nothing frozen: the flag has nothing to count (no scratch either).
TEST(FrozenExact, NothingFrozenIsUnchanged) {
  ModelShape all = base_model(true);
  all.trainable_params = 0;
  ModelShape plain = all;
  plain.frozen_exact_in_half = false;
  const EngineSetup s = setup(3, OffloadDevice::kHost, OffloadDevice::kHost);
  EXPECT_EQ(estimate_memory(all, TrainingShape{}, s).rank_bytes,
            estimate_memory(plain, TrainingShape{}, s).rank_bytes);
  EXPECT_EQ(estimate_memory(all, TrainingShape{}, s).bytes(MemoryUse::kMasterParams, kHost),
            10'000'000u);
}

}  // namespace
}  // namespace zinf::plan
