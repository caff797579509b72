// The planner with frozen parameters (zinf plan --trainable, --lora-rank): the estimate, the time
// model and the no-offload comparison against the per-element costs docs/ENGINE.md gives a
// frozen parameter ("What a frozen parameter costs") and DeepSpeed's, written out here in double
// precision; the parsing of --trainable and the adapters' count of --lora-rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/assert.hpp"
#include "plan/estimate.hpp"
#include "plan/model.hpp"
#include "plan/planner.hpp"
#include "plan/tiers.hpp"
#include "plan/time_model.hpp"

namespace zinf::plan {
namespace {

// Llama-2-7B with 12,345,679 trainable parameters (not a multiple of the world).
ModelShape lora7b() {
  ModelShape m = *find_model_preset("llama-2-7b");
  m.trainable_params = 12'345'679;
  return m;
}

// `ranks` ranks on one machine at stage `stage`; the rest of the setup its defaults.
EngineSetup one_machine(int stage, int ranks) {
  EngineSetup s;
  s.stage = stage;
  s.world_size = ranks;
  s.ranks_per_machine = ranks;
  return s;
}

// Per tier, the bytes a rank saves by freezing: Fr = Pr − ceil(T / N) frozen elements of its
// shard, each without its moments (8 B) on the device and in host memory (on NVMe the swap file
// is preallocated whole), and without its gradient slice (4 B): the host accumulator's zero pages
// no stage writes for a frozen group (it is never reduced), and on the device no slot in the
// device optimizer's packed accumulator. Stage 1 also keeps
// no full-size fp32 gradient copy of a frozen group: 4 B a frozen element of the model, P − T, on
// the device. The device optimizer rounds the frozen half copy from the master with no scratch
// (lib/engine/device_optimizer.cpp, DeviceOps::narrow); with the state in host memory the frozen
// sub-groups cost the four scratch blocks of a half-only master, 14 x 256 Ki = 3,670,016 B, and at
// stage 3 with the shards in host memory the frozen groups are lent the half copy for a shard
// (2 B an element), but the persistent ones (the norms, 32 x 2 x 4096 + 4096 = 266,240, an eighth
// a rank: 33,280) and those beside the one trainable run (--trainable: taken as one), which may
// meet them off a 1024-element cut (Llama-2-7B's hidden 4096 is not a whole number of 1024 x 8):
// at either end the largest group's shard (the embedding, 32000 x 4096 over 8 ranks in slices of
// 128: 16,384,000) and 1023 elements.
std::array<double, kMemoryTierCount> saved_bytes(const ModelShape& m, const EngineSetup& s) {
  const double p = static_cast<double>(param_count(m));
  const double t = static_cast<double>(m.trainable_params);
  const double n = static_cast<double>(s.world_size);
  const double frozen = std::ceil(p / n) - std::ceil(t / n);
  std::array<double, kMemoryTierCount> saved{};
  if (s.optimizer == OffloadDevice::kNone) saved[0] += 12 * frozen;
  if (s.optimizer == OffloadDevice::kHost) saved[1] += 8 * frozen - 3'670'016;
  if (s.optimizer != OffloadDevice::kNone) saved[1] += 4 * frozen;
  if (s.stage == 1) saved[0] += 4 * (p - t);
  if (s.stage == 3 && s.optimizer == OffloadDevice::kHost && s.params == OffloadDevice::kHost) {
    ZINF_ASSERT(s.world_size == 8);
    saved[1] += 2 * (frozen - 33'280 - 2 * (16'384'000 + 1023));
  }
  return saved;
}

TEST(FrozenEstimate, FrozenElementsCostWhatTheEngineCharges) {
  const ModelShape frozen = lora7b();
  ModelShape trainable = frozen;
  trainable.trainable_params = 0;
  const OffloadDevice tiers[] = {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme};
  for (int stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice opt : tiers) {
      for (OffloadDevice params : tiers) {
        if (stage != 3 && params != OffloadDevice::kNone) continue;
        EngineSetup s = one_machine(stage, 8);
        s.optimizer = opt;
        s.params = params;
        s.sub_group_params = 1 << 24;
        s.param_staging_params = 1 << 22;
        const MemoryEstimate a = estimate_memory(trainable, TrainingShape{}, s);
        const MemoryEstimate f = estimate_memory(frozen, TrainingShape{}, s);
        const auto saved = saved_bytes(frozen, s);
        for (int t = 0; t < kMemoryTierCount; ++t) {
          const auto tier = static_cast<MemoryTier>(t);
          EXPECT_EQ(static_cast<double>(a.rank_tier_bytes(tier) - f.rank_tier_bytes(tier)),
                    saved[t])
              << "stage " << stage << ", optimizer " << offload_device_name(opt) << ", params "
              << offload_device_name(params) << ", " << memory_tier_name(tier);
        }
        EXPECT_EQ(f.trainable_params, 12'345'679u);
        EXPECT_EQ(f.trainable_shard_params, (12'345'679u + 7) / 8);
      }
    }
  }
}

// The optimizer pass with the state offloaded: the trainable share's update (30 B an element) and
// NVMe traffic (12 B read and written, and 2 B of new half shard written with the params on
// NVMe). A step does not republish the frozen groups, so nothing of a frozen element moves in the
// pass, not even where the half output streams (params on the device or on NVMe): its master is
// not read for a half copy, its shard not written. The frozen shards are still fetched from NVMe
// in the forward and backward gathers (2 B, twice). Forward and backward: 6 FLOPs a trainable
// parameter and a token, 4 a frozen one; the trainable fp32 gradients' offload at stage 3.
TEST(FrozenTime, OptimizerPassMovesTheTrainableShare) {
  const ModelShape m = lora7b();
  const double p = static_cast<double>(param_count(m));
  const double t = static_cast<double>(m.trainable_params);
  MachineProfile profile;
  profile.mem_adam_gbps = 40;
  profile.nvme_read_gbps = 6;
  profile.nvme_write_gbps = 4;
  profile.h2d_gbps = 20;
  profile.gpu_tflops = 300;
  TrainingShape training;
  training.seq_len = 1024;
  for (OffloadDevice params : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
    EngineSetup s = one_machine(3, 2);
    s.optimizer = OffloadDevice::kNvme;
    s.params = params;
    s.sub_group_params = 1 << 22;
    s.param_staging_params = 1 << 22;
    const double pr = std::ceil(p / 2);
    const double tr = std::ceil(t / 2);
    const bool shards_on_nvme = params == OffloadDevice::kNvme;
    const StepPrediction x = predict_step(m, training, s, profile);
    const std::string where(offload_device_name(params));
    EXPECT_EQ(static_cast<double>(x.adam_memory_bytes), 2 * 30 * tr) << where;
    const double fetched = shards_on_nvme ? 2 * 2 * 2 * pr : 0;  // both ranks, both passes
    EXPECT_EQ(static_cast<double>(x.nvme_read_bytes), 2 * 12 * tr + fetched) << where;
    EXPECT_EQ(static_cast<double>(x.nvme_write_bytes), 2 * (12 + (shards_on_nvme ? 2 : 0)) * tr)
        << where;
    EXPECT_EQ(static_cast<double>(x.sub_groups), std::ceil(tr / (1 << 22))) << where;
    EXPECT_NEAR(x.update_alone_s, 2 * 30 * tr / 40e9, 1e-12) << where;
    // Params on the device: the trainable groups' new half shards go up, 2 B a trainable element.
    // In host memory (stage 3: not streamed) the pass copies them from the store's half array
    // into the host shards after the update: 2 B read and 2 B written a trainable element, both
    // ranks through the machine's memory at 40 GB/s.
    const double home_s = params == OffloadDevice::kNone   ? 2 * tr / 20e9
                          : params == OffloadDevice::kHost ? 2 * 2 * 2 * tr / 40e9
                                                           : 0.0;
    EXPECT_NEAR(x.param_upload_s, home_s, 1e-12) << where;
    EXPECT_NEAR(x.grad_offload_s, 4 * tr / 20e9, 1e-12) << where;  // fp32, as reduced
    const double flops =
        (6 * t + 4 * (p - t) + 12.0 * m.layers * m.hidden * 1024) * 1024;  // one micro-batch
    EXPECT_NEAR(x.compute_s, flops / 300e12, 1e-9) << where;
  }
}

// The new half params that go to their home after the step are the trainable groups' only:
// uploaded from the host optimizer to the device, downloaded from the device optimizer to
// offloaded shards, or written to NVMe beside the host optimizer, 2 B a trainable element, where
// the whole shard (2 B an element) went before. The device optimizer copies each group down and
// then writes it to the drive, waiting for each (DeviceState::publish_step ->
// ParamCoordinator::write_shard_from_device): the two add up for a rank, while the machine's
// ranks share the drive.
TEST(FrozenTime, OnlyTheTrainableShardsAreRepublished) {
  const ModelShape m = lora7b();
  const double p = static_cast<double>(param_count(m));
  const double t = static_cast<double>(m.trainable_params);
  const double pr = std::ceil(p / 4);
  const double tr = std::ceil(t / 4);
  MachineProfile profile;
  profile.mem_adam_gbps = 40;
  profile.gpu_mem_gbps = 2000;
  profile.nvme_read_gbps = 6;
  profile.nvme_write_gbps = 4;
  profile.h2d_gbps = 16;
  struct Case {
    OffloadDevice optimizer, params;
    double upload_s, nvme_write_bytes, nvme_read_bytes;
  };
  const Case cases[] = {
      // Host optimizer, params on the device: 2·Tr up the link.
      {OffloadDevice::kHost, OffloadDevice::kNone, 2 * tr / 16e9, 0, 0},
      // Device optimizer, params in host memory: 2·Tr down the link.
      {OffloadDevice::kNone, OffloadDevice::kHost, 2 * tr / 16e9, 0, 0},
      // Device optimizer, params on NVMe: each rank 2·Tr down the link, then on to the drive,
      // which the four ranks share: max(4·2·Tr at 4 GB/s, 2·Tr at 16 GB/s + 2·Tr at 4 GB/s), the
      // drive's 2·Tr/1 GB/s over one rank's 2·Tr/3.2 GB/s; the gathers still fetch every shard,
      // frozen too, twice.
      {OffloadDevice::kNone, OffloadDevice::kNvme, 4 * 2 * tr / 4e9, 4 * 2 * tr, 4 * 2 * 2 * pr},
      // Host optimizer, params on NVMe: the four ranks write 2·Tr each to the drive.
      {OffloadDevice::kHost, OffloadDevice::kNvme, 4 * 2 * tr / 4e9, 4 * 2 * tr, 4 * 2 * 2 * pr},
  };
  for (const Case& c : cases) {
    EngineSetup s = one_machine(3, 4);
    s.optimizer = c.optimizer;
    s.params = c.params;
    s.param_staging_params = 1 << 22;
    const StepPrediction x = predict_step(m, TrainingShape{}, s, profile);
    const std::string where = std::string("optimizer ") +
                              std::string(offload_device_name(c.optimizer)) + ", params " +
                              std::string(offload_device_name(c.params));
    EXPECT_NEAR(x.param_upload_s, c.upload_s, 1e-12) << where;
    EXPECT_EQ(static_cast<double>(x.nvme_write_bytes), c.nvme_write_bytes) << where;
    EXPECT_EQ(static_cast<double>(x.nvme_read_bytes), c.nvme_read_bytes) << where;
    // None of these streams the half output with the pass (only the optimizer state on NVMe
    // does): the engine writes the half shards after its whole update (run_optimizer(): step(),
    // then write_step() or publish_step()), so the step is the sum.
    EXPECT_NEAR(x.optimizer_step_s, x.pipeline_s + c.upload_s, 1e-12) << where;
  }
  // A link slower than the drive's share (1 GB/s down, 2·Tr/1 GB/s + 2·Tr/4 GB/s = 2·Tr/0.8 GB/s,
  // over the drive's 2·Tr/1 GB/s for the four): one rank's download and writes are the bound.
  profile.h2d_gbps = 1;
  EngineSetup s = one_machine(3, 4);
  s.optimizer = OffloadDevice::kNone;
  s.params = OffloadDevice::kNvme;
  s.param_staging_params = 1 << 22;
  EXPECT_NEAR(predict_step(m, TrainingShape{}, s, profile).param_upload_s,
              2 * tr / 1e9 + 2 * tr / 4e9, 1e-12);
}

// The optimizer on the device skips its frozen runs (lib/engine/device_optimizer.cpp, step():
// their moments are zero and not stored): 30 B of device memory traffic a trainable element, none
// a frozen one.
TEST(FrozenTime, DeviceOptimizerStepsTheTrainableShare) {
  const ModelShape m = lora7b();
  MachineProfile profile;
  profile.mem_adam_gbps = 40;
  profile.gpu_mem_gbps = 2000;
  for (int stage = 1; stage <= 3; ++stage) {
    EngineSetup s = one_machine(stage, 4);
    s.optimizer = OffloadDevice::kNone;
    const double tr = std::ceil(static_cast<double>(m.trainable_params) / 4);
    const StepPrediction x = predict_step(m, TrainingShape{}, s, profile);
    EXPECT_EQ(static_cast<double>(x.adam_memory_bytes), 4 * 30 * tr) << stage;
    EXPECT_NEAR(x.update_alone_s, 30 * tr / 2000e9, 1e-15) << stage;
  }
}

// Activation checkpointing runs the forward once more: 2 FLOPs a parameter and a token, frozen
// or not, and the attention's forward 4·L·h·s, on top of the 6 / 4 of the step without it. With
// nothing frozen that is the whole step's 4/3.
TEST(FrozenTime, CheckpointingAddsOneForward) {
  MachineProfile profile;
  profile.mem_adam_gbps = 40;
  profile.gpu_tflops = 300;
  TrainingShape training;
  training.seq_len = 2048;
  training.micro_batch = 2;
  training.checkpoint_activations = true;
  EngineSetup s = one_machine(3, 2);
  const ModelShape lora = lora7b();
  ModelShape full = lora;
  full.trainable_params = 0;
  const double p = static_cast<double>(param_count(lora));
  const double t = static_cast<double>(lora.trainable_params);
  const double attention = 12.0 * lora.layers * lora.hidden * 2048;
  const double tokens = 2048.0 * 2;
  const double lora_flops =
      (6 * t + 4 * (p - t) + attention) * tokens + (2 * p + attention / 3) * tokens;
  EXPECT_NEAR(predict_step(lora, training, s, profile).compute_s / (lora_flops / 300e12), 1.0,
              1e-12);
  const double full_flops = (6 * p + attention) * tokens * 4 / 3;
  EXPECT_NEAR(predict_step(full, training, s, profile).compute_s / (full_flops / 300e12), 1.0,
              1e-12);
}

// The engine cuts the pass's sub-groups at each run of trainable elements: LoRA's adapters, one
// run an adapted projection, make at least a sub-group each. The frozen gaps between them are
// passed over and read nothing, even where the half output streams, so they are not counted.
TEST(FrozenTime, SubGroupsAreCutAtEachTrainableRun) {
  ModelShape m = *find_model_preset("llama-2-7b");
  ASSERT_TRUE(apply_lora(&m, 16, "q,v").is_ok());
  ASSERT_EQ(m.trainable_runs, 2u * 32);  // q and v in each of 32 layers
  MachineProfile profile;
  profile.mem_adam_gbps = 40;
  profile.nvme_read_gbps = 6;
  profile.nvme_write_gbps = 4;
  for (OffloadDevice params : {OffloadDevice::kNone, OffloadDevice::kHost}) {
    EngineSetup s = one_machine(3, 2);
    s.optimizer = OffloadDevice::kNvme;
    s.params = params;
    s.sub_group_params = 1 << 22;
    const double tr = std::ceil(static_cast<double>(m.trainable_params) / 2);
    const double runs = 32;  // a rank's share of the 64 runs
    const double sub_groups = std::max(std::ceil(tr / (1 << 22)), runs);
    EXPECT_EQ(static_cast<double>(predict_step(m, TrainingShape{}, s, profile).sub_groups),
              sub_groups)
        << offload_device_name(params);
  }
}

// No stage reduces a frozen module. Stages 2-3 reduce-scatter the trainable gradients, in fp32,
// every micro-batch; stage 1 the trainable groups' full copies once a step at step() (a frozen
// group has none), and with the optimizer offloaded the reduced 4·Tr comes down to the host as it
// goes. Stage 3 all-gathers every parameter for each forward and backward, stages 1-2 the
// trainable ones once a step as the step publishes them (no step republishes a frozen group), in
// half precision.
TEST(FrozenTime, ReductionsSkipFrozenModules) {
  const ModelShape m = lora7b();
  const double p = static_cast<double>(param_count(m));
  const double t = static_cast<double>(m.trainable_params);
  MachineProfile profile;
  profile.mem_adam_gbps = 40;
  profile.gpu_link_gbps = 100;
  TrainingShape training;
  training.grad_accum_steps = 4;
  for (int stage = 1; stage <= 3; ++stage) {
    EngineSetup s = one_machine(stage, 4);
    const StepPrediction x = predict_step(m, training, s, profile);
    const double gathered = stage == 3 ? 2 * 2 * p : 0;
    const double reduced = stage == 1 ? 0 : 4 * t;
    EXPECT_NEAR(x.collectives_s, (gathered + reduced) * 0.75 / 100e9, 1e-12) << stage;
    EXPECT_NEAR(x.step_reduce_s, stage == 1 ? 4 * t * 0.75 / 100e9 : 0, 1e-12) << stage;
    EXPECT_NEAR(x.publish_gather_s, stage == 3 ? 0 : 2 * t * 0.75 / 100e9, 1e-12) << stage;
    EXPECT_EQ(static_cast<double>(x.reduce_scatter_bytes), stage == 1 ? 4 * t : 4 * 4 * t) << stage;
    EXPECT_EQ(static_cast<double>(x.all_gather_bytes), stage == 3 ? 4 * gathered : 2 * t) << stage;
  }
  // Stage 1 with the optimizer in host memory and a slow copy to the host: the step's reduction
  // waits for the trainable share of the shard, 4·ceil(T / 4) bytes at 1 GB/s.
  EngineSetup s = one_machine(1, 4);
  s.optimizer = OffloadDevice::kHost;
  profile.h2d_gbps = 1;
  const StepPrediction x = predict_step(m, training, s, profile);
  EXPECT_NEAR(x.step_reduce_s, 4 * std::ceil(t / 4) / 1e9, 1e-12);
}

// DeepSpeed keeps a frozen parameter's bf16 weight only: 18·T + 2·(P − T) bytes of state.
TEST(FrozenPlan, NoOffloadCountsDeepSpeedsFrozenCost) {
  const ModelShape m = lora7b();
  const std::uint64_t p = param_count(m);
  const std::uint64_t t = 12'345'679;
  Budgets budgets;
  budgets.gpu_mem_bytes = 24'000'000'000;
  const NoOffloadComparison c = no_offload_gpus(m, TrainingShape{}, budgets);
  EXPECT_EQ(c.state_bytes, 18 * t + 2 * (p - t));
  const std::uint64_t for_state = c.usable_bytes - c.fixed_bytes;
  EXPECT_EQ(c.gpus_needed, (c.state_bytes + for_state - 1) / for_state);
  EXPECT_NE(c.arithmetic.find("18 B/param x 12.35M trainable + 2 B/param x 6.73B frozen params"),
            std::string::npos)
      << c.arithmetic;
}

// The engine refuses zinf.gradients_on_nvme with a frozen parameter: the planner does not offer
// it, where with every parameter trainable it is the plan (the 70B case of docs/PLAN.md).
TEST(FrozenPlan, GradientsAreNotSpilledWithFrozenParameters) {
  ModelShape m = *find_model_preset("llama-2-70b");
  TrainingShape training;
  training.seq_len = 4096;
  training.checkpoint_activations = true;
  Budgets budgets;
  budgets.gpus = 4;
  budgets.gpu_mem_bytes = 48'000'000'000;
  budgets.host_mem_bytes = 256'000'000'000;
  budgets.nvme_bytes = 4'000'000'000'000;
  MachineProfile profile;
  profile.mem_adam_gbps = 40;
  profile.nvme_read_gbps = 6;
  profile.nvme_write_gbps = 4;
  auto all = make_plan(m, training, budgets, profile);
  ASSERT_TRUE(all.is_ok());
  ASSERT_TRUE(all->fits);
  EXPECT_TRUE(all->best.setup.gradients_on_nvme);
  m.trainable_params = 40'000'000;
  auto lora = make_plan(m, training, budgets, profile);
  ASSERT_TRUE(lora.is_ok());
  ASSERT_TRUE(lora->fits);
  EXPECT_FALSE(lora->best.setup.gradients_on_nvme);
  EXPECT_LT(lora->best.time.step_s, all->best.time.step_s);
}

TEST(Trainable, ParsesCountsAndShares) {
  const std::uint64_t p = 6'738'415'616;
  EXPECT_EQ(parse_trainable("40M", p).value(), 40'000'000u);
  EXPECT_EQ(parse_trainable("1.5B", p).value(), 1'500'000'000u);
  EXPECT_EQ(parse_trainable("350k", p).value(), 350'000u);
  EXPECT_EQ(parse_trainable("123456", p).value(), 123'456u);
  EXPECT_EQ(parse_trainable("0.5%", p).value(), 33'692'078u);  // 33,692,078.08
  EXPECT_EQ(parse_trainable("0.005", p).value(), 33'692'078u);
  EXPECT_EQ(parse_trainable("100%", p).value(), p);
  // The units --params takes (base/size_text.hpp's counts): G is B, decimal unless "iB" says
  // binary, and "MB" as a count is 1e6 as it is for --params.
  EXPECT_EQ(parse_trainable("1.5G", p).value(), 1'500'000'000u);
  EXPECT_EQ(parse_trainable("0.002T", p).value(), 2'000'000'000u);
  EXPECT_EQ(parse_trainable("40MB", p).value(), 40'000'000u);
  EXPECT_EQ(parse_trainable("1GiB", p).value(), 1'073'741'824u);
  EXPECT_EQ(parse_trainable("2k", p).value(), 2'000u);
}

TEST(Trainable, RefusesWithAMessageNamingTheOption) {
  const std::uint64_t p = 6'738'415'616;
  for (const char* text : {"7B", "101%", "-5", "-0.5%", "abc", "", "40X", "40MiX", "0", "0.0%",
                           "1.2.3", "5k%", "%", "1e9", " 40M"}) {
    Result<std::uint64_t> r = parse_trainable(text, p);
    ASSERT_FALSE(r.is_ok()) << text;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find("--trainable"), std::string_view::npos) << text;
  }
  EXPECT_NE(parse_trainable("7B", p).status().message().find("more than the model's 6738415616"),
            std::string_view::npos);
  EXPECT_NE(parse_trainable("-5", p).status().message().find("negative"), std::string_view::npos);
}

TEST(Lora, RankParsesWholeNumbersOnly) {
  EXPECT_EQ(parse_lora_rank("16").value(), 16u);
  for (const char* text : {"-1", "0", "", "8x", "1.5", "99999999999999999999999"}) {
    Result<std::uint64_t> r = parse_lora_rank(text);
    ASSERT_FALSE(r.is_ok()) << text;
    EXPECT_NE(r.status().message().find(std::string("--lora-rank ") + text), std::string::npos)
        << text;
  }
}

// apply_lora()'s adapters on a copy of `m`: their count, or its error.
Result<std::uint64_t> lora_adapter_params(ModelShape m, std::uint64_t rank,
                                          std::string_view targets) {
  ZINF_RETURN_IF_ERROR(apply_lora(&m, rank, targets));
  return m.adapter_params;
}

// apply_lora() adds the adapters to the model's count and trains them alone, one run an adapted
// projection; a refused one leaves the model as it was.
TEST(Lora, AppliedAdaptersTrainAloneInOneRunAProjection) {
  const ModelShape base = *find_model_preset("llama-2-70b");
  ModelShape m = base;
  ASSERT_TRUE(apply_lora(&m, 16, "q,k,v").is_ok());
  const std::uint64_t adapters = 16 * ((8192 + 8192) + 2 * (8192 + 1024)) * 80;
  EXPECT_EQ(m.adapter_params, adapters);
  EXPECT_EQ(trainable_param_count(m), adapters);
  EXPECT_EQ(param_count(m), param_count(base) + adapters);
  EXPECT_EQ(frozen_param_count(m), param_count(base));
  EXPECT_EQ(m.trainable_runs, 3u * 80);
  for (const char* targets : {"q,x", "q,q", ""}) {
    ModelShape refused = base;
    EXPECT_FALSE(apply_lora(&refused, 8, targets).is_ok()) << targets;
    EXPECT_EQ(refused.adapter_params, 0u) << targets;
    EXPECT_EQ(refused.trainable_params, 0u) << targets;
    EXPECT_EQ(refused.trainable_runs, 0u) << targets;
  }
}

// r·(in + out) a projection: Llama-2-70B (h 8192, 8 key/value heads of 128, I 28672, 80 layers).
TEST(Lora, AdapterCountsFromTheShapes) {
  const ModelShape m = *find_model_preset("llama-2-70b");
  const std::uint64_t q = 8192 + 8192, kv = 8192 + 1024, mlp = 8192 + 28672;
  EXPECT_EQ(lora_adapter_params(m, 16, "q,v").value(), 16 * (q + kv) * 80);
  EXPECT_EQ(lora_adapter_params(m, 16, "q,v").value(), 32'768'000u);
  EXPECT_EQ(lora_adapter_params(m, 8, "q,k,v,o,gate,up,down").value(),
            8 * (2 * q + 2 * kv + 3 * mlp) * 80);
  EXPECT_FALSE(lora_adapter_params(m, 0, "q,v").is_ok());
  // An adapter's rank is at most min(in, out) of its projection: 1024 for v (8 heads of 128).
  EXPECT_TRUE(lora_adapter_params(m, 1024, "q,v").is_ok());
  EXPECT_FALSE(lora_adapter_params(m, 1025, "q,v").is_ok());
  EXPECT_TRUE(lora_adapter_params(m, 8192, "q,o").is_ok());
  EXPECT_FALSE(lora_adapter_params(m, 8193, "q,o").is_ok());
  EXPECT_FALSE(lora_adapter_params(m, std::uint64_t{1} << 62, "q").is_ok());
  // The count past 64 bits is refused, not wrapped.
  ModelShape wide = m;
  wide.hidden = std::uint64_t{1} << 40;
  wide.heads = 1;
  wide.kv_heads = 1;
  wide.layers = std::uint64_t{1} << 20;
  Result<std::uint64_t> huge = lora_adapter_params(wide, 1 << 20, "q");
  ASSERT_FALSE(huge.is_ok());
  EXPECT_NE(huge.status().message().find("overflows"), std::string_view::npos);
  EXPECT_FALSE(lora_adapter_params(m, 8, "q,x").is_ok());
  EXPECT_FALSE(lora_adapter_params(m, 8, "q,q").is_ok());
  EXPECT_FALSE(lora_adapter_params(*find_model_preset("gpt2"), 8, "gate").is_ok());
  EXPECT_FALSE(lora_adapter_params(train_lm_model(2, 64, 16, 16), 8, "q").is_ok());
}

}  // namespace
}  // namespace zinf::plan
