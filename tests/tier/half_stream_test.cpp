// The half-precision output on the block tier: each sub-group's new bf16/f16 parameters are
// handed to PipelineOptions::half_done from the pool block, in sub-group order, and equal bit for
// bit the same optimizer run over the whole partition in memory; the store keeps no half copy.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "tier/optimizer_pipeline.hpp"
#include "tier_test_util.hpp"

namespace zinf {
namespace {

using tier_test::Reference;
using tier_test::Rig;
using tier_test::RigOptions;

// What half_done saw in one step: the sub-groups in call order, and the half values they carried
// placed at their partition offsets. Sized before the steps so the callback does not allocate.
struct Received {
  std::vector<std::size_t> order;
  std::vector<std::uint16_t> half;
};

void run_streamed(std::size_t count, std::size_t sub_group,
                  std::array<StoreMedium, kPieceCount> tiers, DType half_dtype, int steps) {
  const std::uint64_t seed = 0x5a1f + count + sub_group;
  std::printf("half stream: %zu params, sub-groups of %zu, %s, seed %llu\n", count, sub_group,
              std::string(store_medium_name(tiers[0])).c_str(),
              static_cast<unsigned long long>(seed));
  RigOptions so;
  so.store.param_count = count;
  so.store.sub_group_params = sub_group;
  so.store.half_dtype = half_dtype;
  so.store.tiers = tiers;
  so.pool_blocks = 3;
  so.pipeline.optimizer.kind = OptimizerKind::kAdamW;
  so.pipeline.optimizer.lr = 1e-2;
  so.pipeline.optimizer.weight_decay = 0.05;
  so.pipeline.threads = 2;
  Received got;
  got.order.reserve(count);
  got.half.resize(count);
  StateStore* store = nullptr;
  so.pipeline.half_done = [&](std::size_t i, const std::byte* half) {
    got.order.push_back(i);
    std::memcpy(got.half.data() + store->sub_group_first(i), half, store->sub_group_size(i) * 2);
    return Status::ok();
  };
  Rig s;
  Reference ref;
  Status opened = tier_test::open_loaded_rig("half_stream", so, seed, 0, &s, &ref);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  store = s.store.get();
  ASSERT_TRUE(store->streams_half());
  // The block holds the half slot beside the NVMe pieces; nothing is kept of it.
  EXPECT_EQ(store->residency(Piece::kParamsHalf, 0), Residency::kAbsent);
  std::vector<std::byte> page(4096);
  EXPECT_EQ(store->read_piece(Piece::kParamsHalf, 0, page.data()).code(),
            Code::kFailedPrecondition);
  for (int t = 1; t <= steps; ++t) {
    ref.make_grads(so.store.grad_dtype, seed * 31 + t);
    ASSERT_TRUE(tier_test::load_grads(*store, ref).is_ok());
    got.order.clear();
    std::fill(got.half.begin(), got.half.end(), std::uint16_t{0x7fc1});  // a NaN no step makes
    const float grad_scale = 1.0f / static_cast<float>(t + 1);
    Result<StepStats> stats = s.pipeline->step({.step = t, .grad_scale = grad_scale});
    ASSERT_TRUE(stats.is_ok()) << stats.status().to_string();
    ref.step(so.pipeline.optimizer, so.store, t, grad_scale);
    ASSERT_EQ(got.order.size(), store->sub_group_count()) << "step " << t;
    for (std::size_t i = 0; i < got.order.size(); ++i) EXPECT_EQ(got.order[i], i);
    ASSERT_EQ(std::memcmp(got.half.data(), ref.half.data(), count * 2), 0) << "step " << t;
    EXPECT_EQ(tier_test::compare_all(*store, ref), "") << "step " << t;
  }
}

TEST(HalfStream, NvmeStateHandsEachSubGroupsHalfOutputInOrder) {
  // A short last sub-group; bf16 and f16.
  run_streamed(50'000, 4096,
               {StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kHost,
                StoreMedium::kBlock},
               DType::kBF16, 3);
  run_streamed(30'001, 7000,
               {StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme,
                StoreMedium::kBlock},
               DType::kF16, 2);
}

TEST(HalfStream, OnlyGradientsOnNvmeAndAllHost) {
  // Nothing written back: the half output is handed over before the block goes back.
  run_streamed(40'000, 9000,
               {StoreMedium::kHost, StoreMedium::kHost, StoreMedium::kHost, StoreMedium::kNvme,
                StoreMedium::kBlock},
               DType::kBF16, 2);
  // Everything on the host: the host-only step runs in one block for the half slot.
  run_streamed(40'000, 9000,
               {StoreMedium::kHost, StoreMedium::kHost, StoreMedium::kHost, StoreMedium::kHost,
                StoreMedium::kBlock},
               DType::kBF16, 2);
}

TEST(HalfStream, AnErrorFromHalfDoneFailsTheStepAndIsSticky) {
  RigOptions so;
  so.store.param_count = 20'000;
  so.store.sub_group_params = 4096;
  so.store.tiers = {StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kHost,
                    StoreMedium::kBlock};
  so.pipeline.optimizer.kind = OptimizerKind::kAdamW;
  std::size_t calls = 0;
  so.pipeline.half_done = [&](std::size_t i, const std::byte*) {
    ++calls;
    return i == 2 ? Status::io_error("shard write failed") : Status::ok();
  };
  Rig s;
  Reference ref;
  Status opened = tier_test::open_loaded_rig("half_stream_error", so, 77, 78, &s, &ref);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  Result<StepStats> stats = s.pipeline->step({.step = 1});
  ASSERT_FALSE(stats.is_ok());
  EXPECT_EQ(stats.status().code(), Code::kIoError);
  EXPECT_NE(stats.status().message().find("sub-group 2: handing over the half output"),
            std::string::npos)
      << stats.status().to_string();
  EXPECT_EQ(calls, 3u);  // none after the failure
  EXPECT_EQ(s.pipeline->step({.step = 1}).status().to_string(), stats.status().to_string());
  // Every sub-group is exactly old or new (the failure is not an I/O failure).
  for (std::size_t i = 0; i < s.store->sub_group_count(); ++i) {
    EXPECT_NE(s.store->version(i, 1), Version::kTorn) << "sg " << i;
  }
}

TEST(HalfStream, OpenRefusesABlockHalfWithoutHalfDone) {
  RigOptions so;
  so.store.param_count = 8192;
  so.store.sub_group_params = 4096;
  so.store.tiers = {StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kHost,
                    StoreMedium::kBlock};
  Rig s;
  Status opened = tier_test::open_rig("half_stream_refused", so, &s);
  EXPECT_EQ(opened.code(), Code::kInvalidArgument);
  EXPECT_NE(opened.message().find("half_done"), std::string::npos) << opened.to_string();
  // Only the half piece may be on the block tier.
  StateStoreOptions bad = so.store;
  bad.tiers[static_cast<std::size_t>(Piece::kExpAvg)] = StoreMedium::kBlock;
  EXPECT_EQ(StateStore::layout(bad).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace zinf
