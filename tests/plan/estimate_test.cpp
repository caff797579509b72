// The estimator against the arithmetic of the ZeRO paper (Rajbhandari et al. 2020: half params,
// gradients and 12 bytes of optimizer state a parameter, divided by N where partitioned; zinf's
// engine accumulates gradients in fp32, so 4 bytes where the paper has 2) and of Korthikanti et
// al. 2022 for activations, written out independently here.
#include "plan/estimate.hpp"

#include <gtest/gtest.h>

#include <cstdint>

#include "plan/model.hpp"
#include "plan/tiers.hpp"

namespace zinf::plan {
namespace {

ModelShape llama7b() { return *find_model_preset("llama-2-7b"); }

TEST(Estimate, StagesPartitionAsTheEngineDoes) {
  const ModelShape m = llama7b();
  const std::uint64_t p = param_count(m);
  const std::uint64_t n = 8;
  const std::uint64_t pr = (p + n - 1) / n;
  TrainingShape t;
  for (int stage = 1; stage <= 3; ++stage) {
    EngineSetup s;
    s.stage = stage;
    s.world_size = n;
    s.ranks_per_machine = n;
    const MemoryEstimate e = estimate_memory(m, t, s);
    // Stage 1: only optimizer state partitioned. Stage 2: + gradients. Stage 3: + params.
    EXPECT_EQ(e.bytes(MemoryUse::kHalfParams, kDev), stage == 3 ? 2 * pr : 2 * p) << stage;
    // fp32 accumulators of the shard; stage 1 also holds the full fp32 gradients.
    EXPECT_EQ(e.bytes(MemoryUse::kGradients, kDev), stage == 1 ? 4 * p + 4 * pr : 4 * pr) << stage;
    EXPECT_EQ(e.bytes(MemoryUse::kMasterParams, kDev), 4 * pr);
    EXPECT_EQ(e.bytes(MemoryUse::kMoments, kDev), 8 * pr);
    // The device optimizer (lib/engine/device_state.cpp, a GPU's path) keeps its half copy of
    // the shard on the device and frees the host's publish buffer once the values are placed:
    // the host holds nothing.
    EXPECT_EQ(e.bytes(MemoryUse::kHalfCopy, kDev), 2 * pr);
    // On the host only the reducer's two pinned buffers of a chunk (comm buckets, below).
    EXPECT_EQ(e.rank_tier_bytes(kHost), e.bytes(MemoryUse::kCommBuckets, kHost));
    EXPECT_EQ(e.rank_tier_bytes(kNvme), 0u);
    EXPECT_EQ(e.bytes(MemoryUse::kGatheredParams, kDev) > 0, stage == 3);
  }
}

// The estimate counts the reducer's buffers by the rule lib/zero/grad_reducer.cpp allocates them
// by: chunk = reduce_bucket / N elements (capped at the largest group's shard), two fp32 buckets of
// N chunks, two receive buffers of a chunk with more than one rank, and two pinned host buffers of
// a chunk on a GPU. The expected bytes are that rule worked by hand, not a reducer's allocation
// (FrozenMatch.LoraEstimateIsWhatTheEngineMakesResident compares stage 1's buckets with one).
TEST(Estimate, CommBucketsAreCountedAsTheReducerAllocates) {
  const ModelShape m = llama7b();
  TrainingShape t;
  struct Case {
    std::uint64_t ranks, bucket_params, staging_params, device_bytes, host_bytes;
  };
  // 8 ranks, 2^24-element buckets: chunk 2^21; 2·4·2^21·8 + 2·4·2^21 = 150,994,944 on the
  // device, 2·4·2^21 = 16,777,216 on the host. One rank: no receive buffers, 2·4·2^24 and
  // 2·4·2^24. A bucket over 3 ranks of 10^6: chunk 333,333. A chunk capped by a 100,000-element
  // shard: 2·4·100,000·4 + 2·4·100,000 and 2·4·100,000.
  for (const Case c :
       {Case{8, 1 << 24, 0, 150'994'944, 16'777'216}, Case{1, 1 << 24, 0, 134'217'728, 134'217'728},
        Case{3, 1'000'000, 0, 8 * 333'333 * 3 + 8 * 333'333, 8 * 333'333},
        Case{4, 1 << 24, 100'000, 3'200'000 + 800'000, 800'000}}) {
    for (int stage = 1; stage <= 3; ++stage) {
      EngineSetup s;
      s.stage = stage;
      s.world_size = c.ranks;
      s.ranks_per_machine = c.ranks;
      s.reduce_bucket_params = c.bucket_params;
      s.param_staging_params = c.staging_params;
      const MemoryEstimate e = estimate_memory(m, t, s);
      EXPECT_EQ(e.bytes(MemoryUse::kCommBuckets, kDev), c.device_bytes) << c.ranks << " " << stage;
      EXPECT_EQ(e.bytes(MemoryUse::kCommBuckets, kHost), c.host_bytes) << c.ranks << " " << stage;
    }
  }
}

TEST(Estimate, OffloadMovesStateAndGradientsToTheirTiers) {
  const ModelShape m = llama7b();
  const std::uint64_t p = param_count(m);
  const std::uint64_t pr = (p + 3) / 4;
  TrainingShape t;
  EngineSetup s;
  s.stage = 3;
  s.world_size = 4;
  s.ranks_per_machine = 2;  // two machines of two GPUs
  s.optimizer = OffloadDevice::kNvme;
  s.params = OffloadDevice::kHost;
  s.gradients_on_nvme = true;
  s.sub_group_params = 1 << 24;
  s.buffer_count = 4;
  const MemoryEstimate e = estimate_memory(m, t, s);
  EXPECT_EQ(e.bytes(MemoryUse::kHalfParams, kHost), 2 * pr);
  // The master, and the store's 4096-byte checkpoint header page (4 * pr is whole pages).
  EXPECT_EQ(e.bytes(MemoryUse::kMasterParams, kNvme), 4 * pr + 4096);
  EXPECT_EQ(e.bytes(MemoryUse::kMoments, kNvme), 8 * pr);
  EXPECT_EQ(e.bytes(MemoryUse::kGradients, kNvme), 4 * pr);
  // On the host only the spill buffers: gradient_spill_buffers (4) sub-groups of 4 B a parameter.
  EXPECT_EQ(e.bytes(MemoryUse::kGradients, kHost), 4u * (1u << 24) * 4u);
  // The CPU optimizer's half-precision output, on the host beside the state it came from.
  EXPECT_EQ(e.bytes(MemoryUse::kHalfCopy, kHost), 2 * pr);
  // A buffer holds master, m, v and the spilled gradient of one sub-group: 16 B a parameter.
  EXPECT_EQ(e.bytes(MemoryUse::kPinnedPool, kHost), 4u * (1u << 24) * 16u);
  EXPECT_EQ(e.rank_tier_bytes(kNvme), 16 * pr + 4096);
  // Per machine: two ranks' worth.
  EXPECT_EQ(e.machine_tier_bytes(kNvme), 2 * (16 * pr + 4096));
  EXPECT_EQ(e.machine_tier_bytes(kHost), 2 * e.rank_tier_bytes(kHost));
  // Every kind sums to its tier total.
  for (MemoryTier tier : {kDev, kHost, kNvme}) {
    std::uint64_t sum = 0;
    for (int k = 0; k < kMemoryUseCount; ++k) sum += e.bytes(static_cast<MemoryUse>(k), tier);
    EXPECT_EQ(sum, e.rank_tier_bytes(tier));
  }
}

TEST(Estimate, ActivationsFollowKorthikanti) {
  const ModelShape m = llama7b();  // h 4096, a 32, L 32, V 32000
  TrainingShape t;
  t.seq_len = 4096;
  t.micro_batch = 2;
  t.flash_attention = false;
  const double s = 4096, b = 2, h = 4096, a = 32, layers = 32, v = 32000;
  const double one_layer = s * b * h * (34 + 5 * a * s / h);
  const double logits = 6 * s * b * v;
  EXPECT_DOUBLE_EQ(static_cast<double>(activation_bytes(m, t)), layers * one_layer + logits);
  t.checkpoint_activations = true;
  EXPECT_DOUBLE_EQ(static_cast<double>(activation_bytes(m, t)),
                   layers * 2 * s * b * h + one_layer + logits);
  t.flash_attention = true;
  EXPECT_DOUBLE_EQ(static_cast<double>(activation_bytes(m, t)),
                   layers * 2 * s * b * h + s * b * h * 34 + logits);
}

TEST(Estimate, ValidateNamesTheBadKey) {
  EngineSetup s;
  s.stage = 4;
  Status st = validate_setup(s);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("zero_optimization.stage"), std::string_view::npos);
  s.stage = 2;
  s.params = OffloadDevice::kHost;
  st = validate_setup(s);
  EXPECT_NE(st.message().find("offload_param"), std::string_view::npos) << st.to_string();
  s.params = OffloadDevice::kNone;
  s.gradients_on_nvme = true;
  EXPECT_NE(validate_setup(s).message().find("gradients_on_nvme"), std::string_view::npos);
  s.gradients_on_nvme = false;
  s.world_size = 6;
  s.ranks_per_machine = 4;
  EXPECT_NE(validate_setup(s).message().find("world_size"), std::string_view::npos);
  s.world_size = 8;
  s.optimizer = OffloadDevice::kNvme;
  s.buffer_count = 1;
  EXPECT_NE(validate_setup(s).message().find("buffer_count"), std::string_view::npos);
  s.buffer_count = 2;
  EXPECT_TRUE(validate_setup(s).is_ok());
}

TEST(Estimate, OffloadNamesRoundTripInDeepSpeedsSpelling) {
  for (OffloadDevice o : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
    OffloadDevice back = OffloadDevice::kNone;
    ASSERT_TRUE(parse_offload_device(offload_device_name(o), &back));
    EXPECT_EQ(back, o);
  }
  // One vocabulary with the engine: DeepSpeed's values, case-sensitive.
  OffloadDevice o = OffloadDevice::kNone;
  EXPECT_FALSE(parse_offload_device("HOST", &o));
  EXPECT_FALSE(parse_offload_device("CPU", &o));
  EXPECT_FALSE(parse_offload_device("gpu", &o));
  EXPECT_FALSE(parse_offload_device("disk", &o));
  EXPECT_EQ(memory_tier(OffloadDevice::kHost), MemoryTier::kHost);
  EXPECT_EQ(memory_tier(OffloadDevice::kNone), MemoryTier::kDevice);
}

}  // namespace
}  // namespace zinf::plan
