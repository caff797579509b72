// StoreState (lib/engine/store_state.cpp) with the state on NVMe: a checkpoint taken in place
// (adopt_checkpoint) after a ranged master update that failed part way. The failed update
// (OptimizerState::update_master_range, as Engine::write_parameters makes it for one group) had
// rounded its new values for the shards (master_loaded) before its write of the master failed;
// the adopted file's master is the one published next, not those values: write_loaded() writes
// every group's shard from the adopted master, and the gathered values are the checkpoint's.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/aligned.hpp"
#include "engine/engine_test_util.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/state_fixture.hpp"
#include "io/fault.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "tier/state_store.hpp"
#include "zero/param_coordinator.hpp"

namespace zinf {
namespace {

using engine_test::seeded;
using engine_test::StateFixture;

TEST(StoreStateAdopt, AFailedRangedWriteLeavesNothingForTheAdoptedCheckpointsPublish) {
  // Two trainable f32 groups, "base" then "lora", in one sub-group: the update of lora's group
  // alone hands the whole range to master_loaded() before the sub-group's write fails.
  StateFixture f(3'000, 2'000, {.offload = OffloadDevice::kNvme, .base_frozen = false});
  f.config_.zero.sub_group_size = 1 << 20;
  engine_test::ScratchDir dir("store-state-adopt");
  Device& device = *f.ranks_.devices[0];

  FaultSpec spec;
  spec.seed = 5;
  spec.eio_rate = 1.0;
  spec.reads = false;
  spec.writes = true;
  auto faults = std::make_shared<FaultInjector>(spec);
  faults->set_enabled(false);
  std::printf("fault seed %llu\n", static_cast<unsigned long long>(spec.seed));
  IoOptions io_options;
  io_options.faults = faults;
  Result<std::unique_ptr<IoEngine>> io = open_engine(io_options);
  ASSERT_TRUE(io.is_ok()) << io.status().to_string();
  Result<StoreLayout> store_layout = StateStore::layout(store_options(f.config_, f.layout_, 0));
  ASSERT_TRUE(store_layout.is_ok()) << store_layout.status().to_string();
  SwapOptions swap_options;
  swap_options.dirs = {dir.path()};
  swap_options.capacity_bytes = store_layout->nvme_bytes + (std::uint64_t{64} << 20);
  swap_options.max_extents = static_cast<std::uint32_t>(store_layout->nvme_extents) + 16;
  Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(**io, swap_options);
  ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();

  const Status attached = f.attach_coordinator();
  ASSERT_TRUE(attached.is_ok()) << attached.to_string();
  StateContext ctx = f.context();
  ctx.io = io->get();
  ctx.swap = swap->get();
  Result<std::unique_ptr<OptimizerState>> opened = open_store_state(ctx);
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  OptimizerState& state = **opened;
  ASSERT_TRUE(state.place_initial().is_ok());

  // The checkpoint: the registered values, linked in place.
  AlignedBuffer header(4096);
  std::memset(header.data(), 0, header.bytes());
  const std::string path = dir.path() + "/rank0.bin";
  std::vector<FileBlockSum> sums;
  Result<bool> linked = state.link_checkpoint(header.data(), path, path, &sums);
  ASSERT_TRUE(linked.is_ok()) << linked.status().to_string();
  ASSERT_TRUE(*linked) << "the store did not link its file";

  // lora's group alone, new values patched in and handed to master_loaded(); the write of the
  // sub-group fails.
  std::uint32_t lora = UINT32_MAX;
  for (std::uint32_t g = 0; g < f.layout_.group_count(); ++g) {
    if (f.layout_.offset(g) > 0) lora = g;
  }
  ASSERT_NE(lora, UINT32_MAX);
  const GroupSpan span = group_run(f.layout_, lora, lora + 1);
  const std::vector<float> fresh = seeded(span.end - span.begin, 99, 2.0f, 3.0f);
  faults->set_enabled(true);
  Status failed = state.update_master_range(
      span.begin, span.end, {}, [&](std::size_t first, std::size_t count, float* out) -> Status {
        std::memcpy(out, fresh.data() + (first - span.begin), count * sizeof(float));
        return state.master_loaded(first, count, out);
      });
  faults->set_enabled(false);
  ASSERT_EQ(failed.code(), Code::kIoError) << failed.to_string();

  // The checkpoint taken in place, then published as a load publishes it.
  ASSERT_TRUE(state.adoptable(sums));
  ASSERT_TRUE(state.adopt_checkpoint(path, path, sums).is_ok());
  Status written = state.write_loaded();
  ASSERT_TRUE(written.is_ok()) << written.to_string();
  ASSERT_TRUE(f.publisher_.publish().is_ok());
  ASSERT_TRUE(device.synchronize(*f.stream_, std::chrono::seconds(30)).is_ok());

  // Every group gathered holds the checkpoint's values (the registered ones), bit for bit.
  for (std::uint32_t g = 0; g < f.layout_.group_count(); ++g) {
    const std::size_t i = g == lora ? 1 : 0;
    const auto* gathered = static_cast<const float*>(f.coordinator_->group_data(g));
    ASSERT_NE(gathered, nullptr) << "group " << g;
    std::vector<float> got(gathered, gathered + f.values_[i].size());
    EXPECT_EQ(got, f.values_[i]) << "group " << g;
  }
}

}  // namespace
}  // namespace zinf
