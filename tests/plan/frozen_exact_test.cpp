// The estimate of a frozen share with the optimizer state in host memory, with and without the
// frozen values exact in the half dtype (ModelShape::frozen_exact_in_half, zinf plan
// --frozen-exact), against figures worked by hand from what docs/ENGINE.md says the engine keeps
// ("A frozen master its half copy holds exactly is not kept", "A frozen shard the store's half
// copy holds is not copied"): whatever the values, the frozen sub-groups cost the scratch blocks
// of a half-only master, and at stage 3 with offload_param cpu the frozen groups (the persistent
// ones excepted) are lent the half copy for a shard; with the flag a frozen element also keeps no
// fp32 master. Where a trainable run may meet its frozen neighbours off a 1024-element cut, the
// estimate keeps their shards, and with the flag the masters the widened cut holds. With the state
// on the device (offload_optimizer none on a GPU: "What a frozen parameter costs", the device
// optimizer's half-only runs) the flag takes a frozen element's fp32 master off the device and
// nothing else, wherever the runs lie; with the state on NVMe nothing changes.
//
// The model of most tests: 10,000,000 parameters given by count (4 layers, hidden 4096: every
// tensor the estimate assumes, h, V x h, h x h, h x 4h, a whole number of 1024 x 4 elements),
// 1,000,000 of them trainable, on 4 ranks of one machine: a rank's shard Pr = 2,500,000, its
// trainable share Tr = 250,000, its frozen share Fr = 2,250,000.
#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "plan/estimate.hpp"
#include "plan/model.hpp"
#include "plan/tiers.hpp"

namespace zinf::plan {
namespace {

ModelShape base_model(bool exact) {
  ModelShape m = custom_model(10'000'000, 4, 4096);
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

// Stage 3, state and shards in host memory: a frozen group is lent the half copy for a shard,
// with or without the flag, and with it a frozen element keeps its half copy alone. Without:
// the trainable share's shard 2 x 250,000, the master 4 x 2,500,000 (+ the scratch), the half
// copy 2 x 2,500,000: 6 B a frozen element. With: the master 4 x 250,000 (+ the scratch).
TEST(FrozenExact, StageThreeCpuCpuLendsTheHalfCopyAndKeepsNoMaster) {
  expect_figures(setup(3, OffloadDevice::kHost, OffloadDevice::kHost),
                 {{MemoryUse::kHalfParams, kHost, 500'000, 500'000},
                  {MemoryUse::kMasterParams, kHost, 10'000'000 + kScratch, 1'000'000 + kScratch},
                  {MemoryUse::kHalfCopy, kHost, 5'000'000, 5'000'000}});
  // Host memory of the rank's engine: the trainable moments 8 x 250,000 and gradients
  // 4 x 250,000 besides: 500,000 + 13,670,016 + 5,000,000 + 3,000,000 = 22,170,016 without the
  // flag, 9,000,000 less with it (the frozen masters, 4 x 2,250,000).
  const EngineSetup s = setup(3, OffloadDevice::kHost, OffloadDevice::kHost);
  EXPECT_EQ(estimate_memory(base_model(false), TrainingShape{}, s).engine_bytes(kHost),
            22'170'016u);
  EXPECT_EQ(estimate_memory(base_model(true), TrainingShape{}, s).engine_bytes(kHost), 13'170'016u);
}

// A persistent group is never lent: the persistent parameters (the norms: 4 layers x 2 x 4096 +
// 4096 = 36,864 of this RMSNorm model, taken as frozen), a quarter of them a rank's, 9,216, keep
// their shard: 2 x (250,000 + 9,216) = 518,432 B, with or without the flag.
TEST(FrozenExact, PersistentGroupsKeepTheirShard) {
  EngineSetup s = setup(3, OffloadDevice::kHost, OffloadDevice::kHost);
  s.persistence_threshold_params = 100'000;  // DeepSpeed's default, at least the hidden size
  expect_figures(s,
                 {{MemoryUse::kHalfParams, kHost, 518'432, 518'432},
                  {MemoryUse::kMasterParams, kHost, 10'000'000 + kScratch, 1'000'000 + kScratch}});
}

// Stages 1 and 2 with the state in host memory: no master of the frozen elements with the flag;
// the half params are on the device, every element of the model (2 x 10,000,000), with or without
// it. The sub-group of 100,000 elements makes each scratch block a sub-group: 100,000 x 14 =
// 1,400,000 B, with or without the flag.
TEST(FrozenExact, StagesOneAndTwoKeepNoMasterOfTheFrozenElements) {
  for (int stage : {1, 2}) {
    SCOPED_TRACE(stage);
    EngineSetup s = setup(stage, OffloadDevice::kHost, OffloadDevice::kNone);
    s.sub_group_params = 100'000;
    expect_figures(
        s, {{MemoryUse::kHalfParams, kDev, 20'000'000, 20'000'000},
            {MemoryUse::kHalfParams, kHost, 0, 0},
            {MemoryUse::kMasterParams, kHost, 10'000'000 + 1'400'000, 1'000'000 + 1'400'000},
            {MemoryUse::kHalfCopy, kHost, 5'000'000, 5'000'000}});
  }
}

// Stage 3 with the state in host memory and the shards on the device or on NVMe: no master of
// the frozen elements with the flag; their shards are where they were (nothing is lent off the
// host).
TEST(FrozenExact, StageThreeShardsOffTheHostAreKept) {
  expect_figures(setup(3, OffloadDevice::kHost, OffloadDevice::kNone),
                 {{MemoryUse::kHalfParams, kDev, 5'000'000, 5'000'000},
                  {MemoryUse::kMasterParams, kHost, 10'000'000 + kScratch, 1'000'000 + kScratch},
                  {MemoryUse::kHalfCopy, kHost, 5'000'000, 5'000'000}});
  expect_figures(setup(3, OffloadDevice::kHost, OffloadDevice::kNvme),
                 {{MemoryUse::kHalfParams, kNvme, 5'000'000, 5'000'000},
                  {MemoryUse::kMasterParams, kHost, 10'000'000 + kScratch, 1'000'000 + kScratch},
                  {MemoryUse::kHalfCopy, kHost, 5'000'000, 5'000'000}});
}

// With the state on NVMe the master stays there (the store's half array, where there is one, is
// the half copy the shards are written from, kept as before): the flag changes nothing, on any
// tier.
TEST(FrozenExact, StateOnNvmeIsUnchanged) {
  for (int stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice params :
         {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
      if (stage != 3 && params != OffloadDevice::kNone) continue;
      const EngineSetup s = setup(stage, OffloadDevice::kNvme, params);
      const MemoryEstimate without = estimate_memory(base_model(false), TrainingShape{}, s);
      const MemoryEstimate with = estimate_memory(base_model(true), TrainingShape{}, s);
      EXPECT_EQ(with.rank_bytes, without.rank_bytes)
          << "stage " << stage << ", params " << offload_device_name(params);
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

// The state on the device (offload_optimizer none): without the flag the device optimizer keeps
// every element's master, 4 x 2,500,000 = 10,000,000 B; with it the trainable share's alone,
// 4 x 250,000 = 1,000,000 B (a frozen element's half copy is its master). The half copy, the
// device optimizer's, is 2 x 2,500,000 either way, and the host gains nothing (no scratch blocks:
// a read widens the half copy in the buffer it is read into; the estimate leaves out, as the
// engine's MemoryReport does, the host block of at most 2 MiB a write is narrowed through). The
// half params are where the stage and offload_param put them: every element of the model at stages
// 1-2 (2 x 10,000,000), the shard at stage 3 (2 x 2,500,000, lent from nothing: the half copy is on
// the device).
TEST(FrozenExact, StateOnTheDeviceKeepsNoMasterOfTheFrozenElements) {
  struct Case {
    int stage;
    OffloadDevice params;
    MemoryTier half_tier;
    std::uint64_t half_bytes;
  };
  for (const Case& c : {Case{1, OffloadDevice::kNone, kDev, 20'000'000},
                        Case{2, OffloadDevice::kNone, kDev, 20'000'000},
                        Case{3, OffloadDevice::kNone, kDev, 5'000'000},
                        Case{3, OffloadDevice::kHost, kHost, 5'000'000},
                        Case{3, OffloadDevice::kNvme, kNvme, 5'000'000}}) {
    SCOPED_TRACE(std::to_string(c.stage) + ", params " +
                 std::string(offload_device_name(c.params)));
    expect_figures(setup(c.stage, OffloadDevice::kNone, c.params),
                   {{MemoryUse::kHalfParams, c.half_tier, c.half_bytes, c.half_bytes},
                    {MemoryUse::kMasterParams, kDev, 10'000'000, 1'000'000},
                    {MemoryUse::kMasterParams, kHost, 0, 0},
                    {MemoryUse::kHalfCopy, kDev, 5'000'000, 5'000'000}});
  }
  // The device's engine bytes at stage 2: the half params 20,000,000, the master, the trainable
  // moments 8 x 250,000 and gradients 4 x 250,000, the half copy 5,000,000: 38,000,000 without the
  // flag, 29,000,000 with it, 9,000,000 = 4 B x the frozen share 2,250,000 less.
  const EngineSetup s = setup(2, OffloadDevice::kNone, OffloadDevice::kNone);
  const MemoryEstimate without = estimate_memory(base_model(false), TrainingShape{}, s);
  const MemoryEstimate with = estimate_memory(base_model(true), TrainingShape{}, s);
  EXPECT_EQ(without.engine_bytes(kDev), 38'000'000u);
  EXPECT_EQ(with.engine_bytes(kDev), 29'000'000u);
  EXPECT_EQ(without.rank_tier_bytes(kDev) - with.rank_tier_bytes(kDev), 9'000'000u);
  EXPECT_EQ(with.rank_tier_bytes(kHost), without.rank_tier_bytes(kHost));
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

// A Llama-shaped model small enough to work by hand: vocab 1024, hidden 1024, MLP 4096 (gated),
// 2 layers of 8 heads, untied head, LoRA of rank 8 on q: per layer 4 x 1024^2 of attention,
// 3 x 1024 x 4096 of MLP, 2 x 1024 of norms, 16,779,264; with the embeddings 2 x 1024^2, the final
// norm 1024 and the adapters 2 x 8 x 2048 = 32,768: 35,689,472 parameters, 2 trainable runs.
ModelShape small_lora(bool exact) {
  ModelShape m = *find_model_preset("llama-2-7b");
  m.vocab = 1024;
  m.hidden = 1024;
  m.intermediate = 4096;
  m.layers = 2;
  m.heads = 8;
  m.kv_heads = 8;
  EXPECT_TRUE(apply_lora(&m, 8, "q").is_ok());
  m.frozen_exact_in_half = exact;
  return m;
}

// small_lora's setup: one machine of `ranks` ranks at stage 3 with the optimizer state and the
// shards on `where`, every group in one sub-group, and the norms (under 100,000 elements)
// persistent.
EngineSetup small_lora_setup(std::uint64_t ranks, OffloadDevice where) {
  EngineSetup s = setup(3, where, where);
  s.world_size = ranks;
  s.ranks_per_machine = ranks;
  s.sub_group_params = 1'000'000'000;
  s.persistence_threshold_params = 100'000;
  return s;
}

// On one rank every tensor (1024, 1024^2, 1024 x 4096, the adapters' 8 x 1024 and 8 x 4096) is a
// whole number of 1024 elements, so every run begins and ends on a cut and every frozen group
// but the persistent ones (the norms, 2 x 2 x 1024 + 1024 = 5,120) is lent: 2 x (32,768 +
// 5,120) = 75,776 B of shard; with the flag 4 x 32,768 = 131,072 B of master and the scratch.
TEST(FrozenExact, RunsOnTheCutsLendEveryFrozenGroup) {
  EXPECT_TRUE(trainable_runs_on_cuts(small_lora(false), 1));
  const EngineSetup s = small_lora_setup(1, OffloadDevice::kHost);
  for (bool exact : {false, true}) {
    SCOPED_TRACE(exact ? "exact" : "any values");
    const MemoryEstimate e = estimate_memory(small_lora(exact), TrainingShape{}, s);
    EXPECT_EQ(e.bytes(MemoryUse::kHalfParams, kHost), 75'776u);
    EXPECT_EQ(e.bytes(MemoryUse::kMasterParams, kHost),
              (exact ? 131'072u : 4u * 35'689'472) + kScratch);
  }
}

// On 3 ranks a group's shard is padded to 128 elements, not 1024 (1024 is not a whole number of
// 3 x 1024: a q projection's shard is ceil(1024^2 / 384) x 128 = 349,568, 384 past a cut), so a
// run may meet its frozen neighbours off a cut: each of the 2 runs keeps, at either end, the
// largest frozen group's shard (the MLP's 1024 x 4096: ceil(4,194,304 / 384) x 128 = 1,398,144)
// and 1023 elements: 2 x 2 x 1,399,167 = 5,596,668 elements beside Tr = ceil(32,768 / 3) =
// 10,923 and the persistent norms' shard ceil(5,120 / 3) = 1,707: 2 x 5,609,298 = 11,218,596 B
// of shard. With the flag the widened cuts keep their 2 x 1023 frozen masters a run:
// 4 x (10,923 + 4,092) = 60,060 B; without it the whole shard's, Pr = ceil(35,689,472 / 3) =
// 11,896,491: 47,585,964 B.
TEST(FrozenExact, RunsOffTheCutsKeepTheirNeighboursShards) {
  EXPECT_FALSE(trainable_runs_on_cuts(small_lora(false), 3));
  EXPECT_EQ(largest_frozen_group_shard_params(small_lora(false), 3), 1'398'144u);
  const EngineSetup s = small_lora_setup(3, OffloadDevice::kHost);
  for (bool exact : {false, true}) {
    SCOPED_TRACE(exact ? "exact" : "any values");
    const MemoryEstimate e = estimate_memory(small_lora(exact), TrainingShape{}, s);
    EXPECT_EQ(e.shard_params, 11'896'491u);
    EXPECT_EQ(e.bytes(MemoryUse::kHalfParams, kHost), 11'218'596u);
    EXPECT_EQ(e.bytes(MemoryUse::kMasterParams, kHost), (exact ? 60'060u : 47'585'964u) + kScratch);
  }
  // The kept shards never pass the whole shard's: with 2,000 runs the estimate is 2 x Pr.
  ModelShape many = small_lora(false);
  many.trainable_runs = 2'000;
  EXPECT_EQ(estimate_memory(many, TrainingShape{}, s).bytes(MemoryUse::kHalfParams, kHost),
            2u * 11'896'491);
}

// The device optimizer's runs are the parameters' own pieces, not sub-groups widened to 1024
// elements: on 3 ranks, where the host estimate keeps the masters of 2 x 1023 frozen elements a
// run off the cuts (above), the device keeps none of a frozen element. With the flag the
// trainable share's, 4 x 10,923 = 43,692 B; without it the shard's, 4 x 11,896,491 = 47,585,964
// B. Nothing is lent: the shard stays whole, 2 x 11,896,491 = 23,792,982 B, beside the half copy
// as large.
TEST(FrozenExact, StateOnTheDeviceKeepsNoMasterBesideRunsOffTheCuts) {
  const EngineSetup s = small_lora_setup(3, OffloadDevice::kNone);
  for (bool exact : {false, true}) {
    SCOPED_TRACE(exact ? "exact" : "any values");
    const MemoryEstimate e = estimate_memory(small_lora(exact), TrainingShape{}, s);
    EXPECT_EQ(e.bytes(MemoryUse::kMasterParams, kDev), exact ? 43'692u : 47'585'964u);
    EXPECT_EQ(e.bytes(MemoryUse::kMasterParams, kHost), 0u);
    EXPECT_EQ(e.bytes(MemoryUse::kHalfParams, kDev), 23'792'982u);
    EXPECT_EQ(e.bytes(MemoryUse::kHalfCopy, kDev), 23'792'982u);
  }
}

// Llama-2-7B with LoRA of rank 16 on q and v (PEFT's default), the state on one 80 GB GPU at
// stage 2, seq 4096 with checkpointing. By hand: P = 6,738,415,616 + 32 x (16 x 8192 + 16 x 8192)
// = 6,746,804,224, T = 8,388,608, on one rank Pr = P, Tr = T. The device holds the half params
// 2 x P = 13,493,608,448, the master, the moments 8 x T = 67,108,864, the gradients 4 x T =
// 33,554,432, the half copy 2 x P = 13,493,608,448, the activations 32 x 2 x 4096 x 4096 (the
// checkpoints) + 34 x 4096 x 4096 (one layer) + 6 x 4096 x 32,000 (the logits) = 2,430,599,168,
// two reducer buckets of 2^24 fp32 = 134,217,728 and the reserved 2^30 = 1,073,741,824:
// 30,726,438,912 B besides the master. The master is 4 x P = 26,987,216,896 without the flag
// (57,713,655,808 B, 53.75 GiB), 4 x T = 33,554,432 with it (30,759,993,344 B, 28.65 GiB): 4 B less
// each of the 6,738,415,616 frozen elements, 26,953,662,464 B. The engine's share (what its
// MemoryReport counts) is 54,075,097,088 B and 27,121,434,624 B. Both fit the 80 GB less the 10%
// headroom (72e9 B); on a 40 GB GPU (36e9 B) only the second (PlanCli's FrozenExact tests).
TEST(FrozenExact, Llama7bLoraOnOneGpuKeepsNoFrozenMaster) {
  ModelShape m = *find_model_preset("llama-2-7b");
  ASSERT_TRUE(apply_lora(&m, 16, "q,v").is_ok());
  ASSERT_EQ(param_count(m), 6'746'804'224u);
  ASSERT_EQ(trainable_param_count(m), 8'388'608u);
  TrainingShape t;
  t.seq_len = 4096;
  t.checkpoint_activations = true;
  EngineSetup s;
  s.stage = 2;
  s.optimizer = OffloadDevice::kNone;
  s.param_staging_params = std::uint64_t{1} << 24;
  const MemoryEstimate without = estimate_memory(m, t, s);
  m.frozen_exact_in_half = true;
  const MemoryEstimate with = estimate_memory(m, t, s);
  EXPECT_EQ(without.bytes(MemoryUse::kMasterParams, kDev), 26'987'216'896u);
  EXPECT_EQ(with.bytes(MemoryUse::kMasterParams, kDev), 33'554'432u);
  EXPECT_EQ(without.rank_tier_bytes(kDev), 57'713'655'808u);
  EXPECT_EQ(with.rank_tier_bytes(kDev), 30'759'993'344u);
  EXPECT_EQ(without.engine_bytes(kDev), 54'075'097'088u);
  EXPECT_EQ(with.engine_bytes(kDev), 27'121'434'624u);
  // The host holds the reducer's pinned buckets alone either way.
  EXPECT_EQ(with.rank_tier_bytes(kHost), 134'217'728u);
  EXPECT_EQ(without.rank_tier_bytes(kHost), 134'217'728u);
}

// Llama-2-70B with LoRA of rank 16 on q and v: every tensor a whole number of 1024 elements, so
// on one rank the runs meet the cuts; on 3 the q projection's shard, ceil(8192^2 / 384) x 128 =
// 22,369,664 elements, is 384 past one.
TEST(FrozenExact, Llama70bRunsMeetTheCutsOnOneRankOnly) {
  ModelShape m = *find_model_preset("llama-2-70b");
  ASSERT_TRUE(apply_lora(&m, 16, "q,v").is_ok());
  EXPECT_TRUE(trainable_runs_on_cuts(m, 1));
  EXPECT_FALSE(trainable_runs_on_cuts(m, 3));
}

}  // namespace
}  // namespace zinf::plan
