// The planner's bytes against what the pipelined step's store really allocates: a plan's
// placement opened as a StateStore + SwapSpace + PinnedPool (the parts the engine will open from
// the config), and bench step's layout (--step-only) against the store's.
// Until the ZeRO engine exists this is the check that predicted bytes per tier are real.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "device/pinned_pool.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "plan/estimate.hpp"
#include "plan/model.hpp"
#include "plan/planner.hpp"
#include "plan/time_model.hpp"
#include "tier/state_store.hpp"

namespace zinf::plan {
namespace {

namespace fs = std::filesystem;

// What the engine would open for one rank's optimizer state.
struct Opened {
  std::string dir;
  std::unique_ptr<IoEngine> engine;
  std::unique_ptr<SwapSpace> swap;
  std::unique_ptr<StateStore> store;
  std::unique_ptr<PinnedPool> pool;
  ~Opened() {
    pool.reset();
    store.reset();
    swap.reset();
    engine.reset();
    std::error_code ignored;
    if (!dir.empty()) fs::remove_all(dir, ignored);
  }
};

// Opens the store for `params` parameters in sub-groups of `sub_group_params`, with master and
// moments on NVMe, gradients and the half copy where flagged, and a pool of `blocks` blocks of
// the store's block size. Swap capacity is generous: the test reads back what was used.
Status open_store(const std::string& name, std::uint64_t params, std::uint64_t sub_group_params,
                  bool grads_on_nvme, zinf::StoreMedium half_tier, std::uint64_t blocks,
                  Opened* o) {
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  o->dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/plan_store_match_" + name;
  fs::create_directories(o->dir);
  IoOptions io;
  io.queue_depth = 8;
  ZINF_ASSIGN_OR_RETURN(o->engine, open_engine(io));
  SwapOptions swap;
  swap.dirs = {o->dir};
  swap.capacity_bytes = 20 * params + (std::uint64_t{64} << 20);
  ZINF_ASSIGN_OR_RETURN(o->swap, SwapSpace::open(*o->engine, swap));
  StateStoreOptions so;
  so.param_count = params;
  so.sub_group_params = sub_group_params;
  so.optimizer = OptimizerKind::kAdamW;
  so.grad_dtype = DType::kF32;
  so.with_half = true;
  so.half_dtype = DType::kBF16;
  so.tiers = {zinf::StoreMedium::kNvme, zinf::StoreMedium::kNvme, zinf::StoreMedium::kNvme,
              grads_on_nvme ? zinf::StoreMedium::kNvme : zinf::StoreMedium::kHost, half_tier};
  ZINF_ASSIGN_OR_RETURN(o->store, StateStore::open(so, o->swap.get()));
  PinnedPoolOptions pool;
  pool.block_bytes = (o->store->block_bytes() + 4095) / 4096 * 4096;
  pool.block_count = blocks;
  pool.huge_pages = HugePages::kNone;
  ZINF_ASSIGN_OR_RETURN(o->pool, PinnedPool::create(pool));
  ZINF_RETURN_IF_ERROR(o->pool->register_with(*o->engine));
  // What OptimizerPipeline::open() checks: a block holds a sub-group's NVMe pieces, and there
  // are at least two blocks.
  if (o->pool->block_bytes() < o->store->block_bytes() || o->pool->block_count() < 2) {
    return Status::invalid_argument("the pool does not fit the store");
  }
  return Status::ok();
}

double relative_error(double predicted, double actual) {
  return std::abs(predicted - actual) / actual;
}

TEST(StoreMatch, PlannedNvmeAndPoolBytesAreWhatTheStoreAllocates) {
  // A 24M-parameter model on one GPU with the optimizer forced to NVMe; the planner picks the
  // sub-group size, buffer count and whether gradients spill.
  const ModelShape model = custom_model(24'000'000, 4, 512);
  Budgets budgets;
  budgets.gpus = 1;
  budgets.gpu_mem_bytes = 8'000'000'000;
  budgets.host_mem_bytes = 8'000'000'000;
  budgets.nvme_bytes = 100'000'000'000;
  MachineProfile profile;
  profile.mem_adam_gbps = 20;
  profile.nvme_read_gbps = 2;
  profile.nvme_write_gbps = 1;
  for (bool spill : {false, true}) {
    PlanConstraints constraints;
    constraints.optimizer = OffloadDevice::kNvme;
    constraints.stage = 3;  // gradients spill at stages 2-3 only
    auto plan = make_plan(model, TrainingShape{}, budgets, profile, constraints);
    ASSERT_TRUE(plan.is_ok() && plan->fits);
    EngineSetup setup = plan->best.setup;
    setup.gradients_on_nvme = spill;  // check both ways the planner may place gradients
    const MemoryEstimate e = estimate_memory(model, TrainingShape{}, setup);

    Opened o;
    const Status s =
        open_store(spill ? "spill" : "host_grads", e.shard_params, setup.sub_group_params, spill,
                   // As the engine places it: a slot in the blocks when it streams.
                   streams_half(setup) ? zinf::StoreMedium::kBlock : zinf::StoreMedium::kHost,
                   setup.buffer_count, &o);
    if (s.code() == Code::kUnsupported) GTEST_SKIP() << s.to_string();
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    const double nvme_predicted = static_cast<double>(e.rank_tier_bytes(MemoryTier::kNvme));
    const double nvme_allocated = static_cast<double>(o.swap->used_bytes());
    EXPECT_LT(relative_error(nvme_predicted, nvme_allocated), 0.05)
        << "spill " << spill << ": predicted " << nvme_predicted << " B on NVMe, swap holds "
        << nvme_allocated;
    const double pool_predicted =
        static_cast<double>(e.bytes(MemoryUse::kPinnedPool, MemoryTier::kHost));
    const double pool_allocated = static_cast<double>(o.pool->bytes());
    EXPECT_LT(relative_error(pool_predicted, pool_allocated), 0.05)
        << "spill " << spill << ": predicted pool " << pool_predicted << " B, allocated "
        << pool_allocated;
    EXPECT_EQ(o.store->sub_group_params(), setup.sub_group_params);
    std::printf("plan vs store (gradients %s): nvme %.0f vs %.0f B, pool %.0f vs %.0f B\n",
                spill ? "on nvme" : "on host", nvme_predicted, nvme_allocated, pool_predicted,
                pool_allocated);
  }
}

TEST(StoreMatch, StepOnlyLayoutIsTheStoresLayout) {
  // --sub-group 4MiB over 3M params, every piece on NVMe and then state only.
  for (bool all_on_nvme : {true, false}) {
    StepOnlySpec spec;
    spec.params = 3'000'000;
    spec.sub_group_bytes = 4u << 20;
    spec.pool_bytes = 64u << 20;
    spec.grads_on_nvme = all_on_nvme;
    spec.half_on_nvme = all_on_nvme;
    const StepOnlyLayout l = step_only_layout(spec);
    Opened o;
    const Status s = open_store(
        all_on_nvme ? "all" : "state", spec.params, l.sub_group_params, spec.grads_on_nvme,
        spec.half_on_nvme ? zinf::StoreMedium::kNvme : zinf::StoreMedium::kHost, l.blocks, &o);
    if (s.code() == Code::kUnsupported) GTEST_SKIP() << s.to_string();
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    // The store's own sizing from sub_group_bytes must agree with ours.
    StateStoreOptions by_bytes = o.store->options();
    by_bytes.sub_group_params = 0;
    by_bytes.sub_group_bytes = spec.sub_group_bytes;
    by_bytes.tiers.fill(zinf::StoreMedium::kHost);  // sizing counts every piece whatever its tier
    auto store2 = StateStore::open(by_bytes, nullptr);
    ASSERT_TRUE(store2.is_ok()) << store2.status().to_string();
    EXPECT_EQ((*store2)->sub_group_params(), l.sub_group_params);
    EXPECT_EQ(o.store->sub_group_count(), l.sub_groups);
    EXPECT_EQ(o.store->block_bytes(), l.block_bytes);
    const double predicted_nvme =
        static_cast<double>(spec.params) * static_cast<double>(12 + (all_on_nvme ? 6 : 0));
    EXPECT_LT(relative_error(predicted_nvme, static_cast<double>(o.swap->used_bytes())), 0.05)
        << predicted_nvme << " vs " << o.swap->used_bytes();
  }
}

}  // namespace
}  // namespace zinf::plan
