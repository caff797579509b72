// The planner: the 70B-on-4x48GB case, the no-offload GPU count, shortfall messages, and that
// the chosen placement is the fastest of those that fit.
#include "plan/planner.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "plan/estimate.hpp"
#include "plan/model.hpp"

namespace zinf::plan {
namespace {

MachineProfile machine() {
  MachineProfile p;
  p.mem_adam_gbps = 50;
  p.nvme_read_gbps = 6;
  p.nvme_write_gbps = 4;
  return p;
}

TrainingShape seq4096_checkpointed() {
  TrainingShape t;
  t.seq_len = 4096;
  t.micro_batch = 1;
  t.checkpoint_activations = true;
  return t;
}

Budgets four_48gb_gpus(std::uint64_t nvme_bytes) {
  Budgets b;
  b.gpus = 4;
  b.gpu_mem_bytes = 48'000'000'000;
  b.host_mem_bytes = 256'000'000'000;
  b.nvme_bytes = nvme_bytes;
  return b;
}

TEST(Planner, Llama70bFitsOnFour48GbGpusWith256GbHostAndNvme) {
  const ModelShape m = *find_model_preset("llama-2-70b");
  auto plan = make_plan(m, seq4096_checkpointed(), four_48gb_gpus(4'000'000'000'000), machine());
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  ASSERT_TRUE(plan->fits) << shortfall_message(*plan);
  const Candidate& c = plan->best;
  EXPECT_EQ(c.setup.stage, 3);
  // 12 B/param of optimizer state cannot be in 4·48 GB of GPUs nor in 256 GB of host memory.
  EXPECT_EQ(c.setup.optimizer, OffloadDevice::kNvme);
  for (const TierUse& u : c.use)
    EXPECT_LE(u.need_bytes, u.usable_bytes) << memory_tier_name(u.tier);
  // Every byte of model state is somewhere: half params 2, fp32 gradients 4, master and moments
  // 12 bytes a parameter, over the machine's four ranks.
  const std::uint64_t p = param_count(m);
  std::uint64_t state = 0;
  for (MemoryUse k : {MemoryUse::kHalfParams, MemoryUse::kGradients, MemoryUse::kMasterParams,
                      MemoryUse::kMoments}) {
    for (MemoryTier t : {MemoryTier::kDevice, MemoryTier::kHost, MemoryTier::kNvme})
      state += c.memory.bytes(k, t) * 4;
  }
  // With gradients on NVMe the host also holds the spill buffers, working space beside them.
  if (c.setup.gradients_on_nvme)
    state -= c.memory.bytes(MemoryUse::kGradients, MemoryTier::kHost) * 4;
  EXPECT_GE(state, 18 * p);
  // Only the rounding of ceil(P / 4), and each rank's 4096-byte checkpoint header page.
  EXPECT_LT(state, 18 * p + 18 * 4 + 4 * 4096);
  EXPECT_GT(c.time.step_s, 0);
  EXPECT_GE(c.time.optimizer_step_s, c.time.io_alone_s);
}

TEST(Planner, NoOffloadGpuCountWithItsArithmetic) {
  const ModelShape m = *find_model_preset("llama-2-70b");
  const TrainingShape t = seq4096_checkpointed();
  const Budgets b = four_48gb_gpus(4'000'000'000'000);
  const NoOffloadComparison n = no_offload_gpus(m, t, b);
  // Worked by hand for Llama-2-70B (P = 68,976,648,192), s = 4096, b = 1, checkpointing:
  //   activations  80·2·4096·8192 + 34·4096·8192 + 6·4096·32000        =  7,295,991,808
  //   gathered     2·(2·855,654,400 + 60,397,977) + 2·(80·2·8192 + 8192) =  3,546,051,378
  //   buckets      2·4·8192² (two fp32 buckets, one rank)               =    536,870,912
  //   reserved     2^30                                                 =  1,073,741,824
  //   fixed                                                             = 12,452,655,922
  //   usable 0.9·48e9 = 43,200,000,000; for state 30,747,344,078
  //   18·P (2 half + 4 fp32 gradient + 12 optimizer) = 1,241,579,667,456;
  //   / 30,747,344,078 = 40.38 -> 41 GPUs
  EXPECT_EQ(n.activation_bytes, 7'295'991'808u);
  EXPECT_EQ(n.gathered_bytes, 3'546'051'378u);
  EXPECT_EQ(n.fixed_bytes, 12'452'655'922u);
  EXPECT_EQ(n.state_bytes, 1'241'579'667'456u);
  EXPECT_EQ(n.gpus_needed, 41u);
  EXPECT_NE(n.arithmetic.find("= 41 GPUs"), std::string::npos) << n.arithmetic;
  EXPECT_NE(n.arithmetic.find("18 B/param"), std::string::npos) << n.arithmetic;
  // zinf's engine needs 2 B a parameter more than DeepSpeed's count: its device optimizer keeps
  // its own half copy of the shard, which the shards are written from
  // (lib/engine/device_optimizer.cpp). So the estimator's ZeRO-3 without offload needs the
  // fixed bytes + 20·ceil(P / N), its buckets at N ranks (chunk = floor(8192² / N), two buckets
  // of N chunks and two receive buffers of one: 8·chunk·(N + 1)): at 41 GPUs (chunk 1,636,801)
  // 12,452,655,922 − 536,870,912 + 549,965,136 + 20·1,682,357,273 = 46,112,895,606, above the
  // usable 43.2e9; it fits 45 GPUs' device memory, not 44.
  {
    EngineSetup s;
    s.stage = 3;
    s.world_size = 41;
    s.ranks_per_machine = 1;
    size_buckets(m, &s);
    Budgets one = b;
    one.gpus = 41;
    EXPECT_EQ(evaluate(m, t, s, one, machine()).use[0].need_bytes, 46'112'895'606u);
  }
  for (std::uint64_t gpus : {44u, 45u}) {
    EngineSetup s;
    s.stage = 3;
    s.world_size = gpus;
    s.ranks_per_machine = 1;
    size_buckets(m, &s);
    Budgets one = b;
    one.gpus = gpus;
    const Candidate c = evaluate(m, t, s, one, machine());
    EXPECT_EQ(c.use[0].fits(), gpus == 45u) << gpus << " GPUs need " << c.use[0].need_bytes;
  }
}

TEST(Planner, ShortNvmeIsNamedWithTheShortfall) {
  const ModelShape m = *find_model_preset("llama-2-70b");
  const Budgets b = four_48gb_gpus(512'000'000'000);
  auto plan = make_plan(m, seq4096_checkpointed(), b, machine());
  ASSERT_TRUE(plan.is_ok());
  ASSERT_FALSE(plan->fits);
  // Host (230.4 GB usable) holds the CPU optimizer's half copy (2·P, 138 GB) but not the half
  // params beside it nor the fp32 gradients (276 GB), so both go to NVMe with master, m, v:
  // 2 + 4 + 12 = 18·P.
  const std::uint64_t p = param_count(m);
  const Shortfall* nvme = nullptr;
  for (const Shortfall& f : plan->shortfalls) {
    if (f.tier == MemoryTier::kNvme) nvme = &f;
  }
  ASSERT_NE(nvme, nullptr) << shortfall_message(*plan);
  // And the store's 4096-byte checkpoint header page on each of the 4 ranks.
  EXPECT_EQ(nvme->need_bytes, 18 * p + 4 * 4096);
  EXPECT_EQ(nvme->usable_bytes, 460'800'000'000u);
  EXPECT_EQ(nvme->shortfall_bytes(), 18 * p + 4 * 4096 - 460'800'000'000u);
  const std::string message = shortfall_message(*plan);
  EXPECT_NE(message.find("nvme is short by 727.16 GiB"), std::string::npos) << message;
}

TEST(Planner, WithoutGradientSpillThe70bCaseIsShortOfHostMemory) {
  // The engine keeps gradients in host memory today: 4 bytes a parameter, 276 GB for 69e9
  // parameters, more than 256 GB less headroom whatever else moves to NVMe.
  const ModelShape m = *find_model_preset("llama-2-70b");
  PlanConstraints no_spill;
  no_spill.allow_gradient_spill = false;
  auto plan =
      make_plan(m, seq4096_checkpointed(), four_48gb_gpus(4'000'000'000'000), machine(), no_spill);
  ASSERT_TRUE(plan.is_ok());
  ASSERT_FALSE(plan->fits);
  ASSERT_FALSE(plan->shortfalls.empty());
  const Shortfall& host = plan->shortfalls.front();
  EXPECT_EQ(host.tier, MemoryTier::kHost) << shortfall_message(*plan);
  // The least host any placement needs: fp32 gradients 4·P, with params and optimizer state on
  // NVMe, plus the smallest pool (4 ranks x 3 buffers x 2^22 x 14 B: master, m, v and the
  // streamed half output's slot). The half output streams into the shards through one buffer
  // of a layer's shard a rank, not a 2·P copy. Each rank's reducer has two pinned buffers of a
  // chunk (8192² / 4 fp32 elements) that the reduced chunks come back through.
  const std::uint64_t p = param_count(m);
  // With params on NVMe, 5 staging blocks of one shard of a layer (855,654,400 / 4 params).
  const std::uint64_t pool = std::uint64_t{4} * 3 * (1 << 22) * 14;
  const std::uint64_t staging = std::uint64_t{4} * 5 * 2 * (855'654'400 / 4);
  const std::uint64_t half_stage = std::uint64_t{4} * 2 * (855'654'400 / 4);
  const std::uint64_t receive = std::uint64_t{4} * 2 * 4 * (8192 * 8192 / 4);
  EXPECT_EQ(host.need_bytes, 4 * p + pool + staging + half_stage + receive)
      << shortfall_message(*plan);
}

TEST(Planner, ShortDeviceBlamesActivationsWhenEveryPlacementIsShort) {
  const ModelShape m = *find_model_preset("llama-2-70b");
  TrainingShape t;  // seq 2048, no checkpointing: 43 GiB of activations per GPU
  auto plan = make_plan(m, t, four_48gb_gpus(4'000'000'000'000), machine());
  ASSERT_TRUE(plan.is_ok());
  ASSERT_FALSE(plan->fits);
  ASSERT_EQ(plan->shortfalls.size(), 1u) << shortfall_message(*plan);
  const Shortfall& f = plan->shortfalls[0];
  EXPECT_EQ(f.tier, MemoryTier::kDevice);
  EXPECT_TRUE(f.every_placement);
  // The least a GPU can hold: everything offloaded, so the fixed part alone, counted for one
  // rank by no_offload_gpus: 4 ranks add the reducer's two receive buffers of a chunk
  // (8192² / 4 fp32 elements).
  EXPECT_EQ(f.need_bytes,
            no_offload_gpus(m, t, four_48gb_gpus(0)).fixed_bytes + 2 * 4 * (8192 * 8192 / 4));
  const std::string message = shortfall_message(*plan);
  EXPECT_NE(message.find("device is short by"), std::string::npos) << message;
  EXPECT_NE(message.find("every placement"), std::string::npos) << message;
  EXPECT_NE(message.find("activations take 42.87 GiB of it"), std::string::npos) << message;
  EXPECT_NE(message.find("--checkpoint-activations"), std::string::npos) << message;
  // The 1 GiB reserve is neither the larger part nor enough to close the gap.
  EXPECT_EQ(message.find("reserve"), std::string::npos) << message;
}

// A small model (train_lm's 103.7k parameters) on a 1 GB GPU: the 1 GiB runtime reserve, not the
// 1 MiB of activations, is what no placement fits, and the message says so; a smaller reserve
// (zinf.device_reserved_bytes) fits, in the plan and in the no-offload count.
TEST(Planner, ShortDeviceNamesTheReserveWhenItIsTheCause) {
  const ModelShape m = train_lm_model(4, 48, 16, 16);
  TrainingShape t;
  t.seq_len = 256;
  t.micro_batch = 2;
  t.checkpoint_activations = true;
  Budgets b;
  b.gpus = 1;
  b.gpu_mem_bytes = 1'000'000'000;
  b.host_mem_bytes = 4'000'000'000;
  auto plan = make_plan(m, t, b, machine());
  ASSERT_TRUE(plan.is_ok());
  ASSERT_FALSE(plan->fits);
  ASSERT_EQ(plan->shortfalls.size(), 1u) << shortfall_message(*plan);
  EXPECT_TRUE(plan->shortfalls[0].every_placement);
  const std::string message = shortfall_message(*plan);
  EXPECT_NE(message.find("device is short by 0.16 GiB"), std::string::npos) << message;
  EXPECT_NE(message.find("the runtime reserve takes 1.00 GiB of it (zinf.device_reserved_bytes"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("activations take"), std::string::npos) << message;
  EXPECT_EQ(plan->no_offload.gpus_needed, 0u);
  EXPECT_NE(plan->no_offload.arithmetic.find("the runtime reserve takes 1.00 GiB"),
            std::string::npos)
      << plan->no_offload.arithmetic;
  EXPECT_EQ(plan->no_offload.arithmetic.find("activation checkpointing"), std::string::npos)
      << plan->no_offload.arithmetic;

  PlanConstraints small_reserve;
  small_reserve.device_reserved_bytes = std::uint64_t{256} << 20;
  auto fits = make_plan(m, t, b, machine(), small_reserve);
  ASSERT_TRUE(fits.is_ok());
  ASSERT_TRUE(fits->fits) << shortfall_message(*fits);
  EXPECT_EQ(fits->best.setup.device_reserved_bytes, std::uint64_t{256} << 20);
  EXPECT_EQ(fits->best.memory.bytes(MemoryUse::kReserved, MemoryTier::kDevice),
            std::uint64_t{256} << 20);
  EXPECT_EQ(fits->no_offload.reserved_bytes, std::uint64_t{256} << 20);
  EXPECT_EQ(fits->no_offload.gpus_needed, 1u);
}

TEST(Planner, SmallModelStaysOnTheGpus) {
  // GPT-2 124M fits one 24 GB GPU whole: offloading could only slow it down.
  const ModelShape m = *find_model_preset("gpt2");
  Budgets b;
  b.gpus = 1;
  b.gpu_mem_bytes = 24'000'000'000;
  b.host_mem_bytes = 64'000'000'000;
  b.nvme_bytes = 1'000'000'000'000;
  auto plan = make_plan(m, TrainingShape{}, b, machine());
  ASSERT_TRUE(plan.is_ok());
  ASSERT_TRUE(plan->fits);
  EXPECT_EQ(plan->best.setup.optimizer, OffloadDevice::kNone);
  EXPECT_EQ(plan->best.setup.params, OffloadDevice::kNone);
  EXPECT_EQ(plan->best.setup.stage, 1);
  EXPECT_EQ(plan->no_offload.gpus_needed, 1u);
}

TEST(Planner, ChosenPlanIsTheFastestThatFits) {
  // Llama-2-7B on one 24 GB GPU: the state (16 B/param = 108 GB) must leave the GPU; with
  // 256 GB of host memory the host is faster than NVMe.
  const ModelShape m = *find_model_preset("llama-2-7b");
  Budgets b;
  b.gpus = 1;
  b.gpu_mem_bytes = 24'000'000'000;
  b.host_mem_bytes = 256'000'000'000;
  b.nvme_bytes = 2'000'000'000'000;
  TrainingShape t;
  t.checkpoint_activations = true;
  auto plan = make_plan(m, t, b, machine());
  ASSERT_TRUE(plan.is_ok());
  ASSERT_TRUE(plan->fits);
  EXPECT_EQ(plan->best.setup.optimizer, OffloadDevice::kHost);
  // Forcing NVMe gives a slower plan.
  PlanConstraints nvme;
  nvme.optimizer = OffloadDevice::kNvme;
  auto slower = make_plan(m, t, b, machine(), nvme);
  ASSERT_TRUE(slower.is_ok());
  ASSERT_TRUE(slower->fits);
  EXPECT_GT(slower->best.time.step_s, plan->best.time.step_s);
  EXPECT_GT(plan->candidates_fitting, 1u);
}

TEST(Planner, RejectsBudgetsThatMakeNoSense) {
  const ModelShape m = *find_model_preset("gpt2");
  Budgets b;
  b.gpus = 0;
  b.gpu_mem_bytes = 1;
  EXPECT_EQ(make_plan(m, {}, b, machine()).status().code(), Code::kInvalidArgument);
  b.gpus = 6;
  b.gpus_per_machine = 4;
  auto r = make_plan(m, {}, b, machine());
  EXPECT_NE(r.status().message().find("--gpus-per-machine"), std::string_view::npos);
  b.gpus = 4;
  PlanConstraints c;
  c.optimizer = OffloadDevice::kNvme;
  b.nvme_bytes = 0;
  EXPECT_EQ(make_plan(m, {}, b, machine(), c).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace zinf::plan
