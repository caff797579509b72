// Issue 8: "bytes predicted per tier match what the engine actually allocates within 5%, in a
// test that opens the engine with the planned config". For every placement the planner can
// choose, the plan (forced to that placement) is written as JSON by config_to_json(), parsed by
// the engine's own parse_config(), and opened on 4 ranks (run_local: HostDevice + LocalComm; an
// opaque HostDevice with the optimizer on the device, so that the engine takes a GPU's path, the
// device optimizer of lib/engine/device_state.cpp, which the planner costs); rank 0's
// MemoryReport after finalize() is compared with the estimate's engine-owned bytes per tier.
// Placements with the optimizer on NVMe at stages 2-3 run both with and without
// zinf.gradients_on_nvme. The two agree to the byte (the issue asked for 5%), which the test
// requires, so a change to what the engine allocates must come with the estimator's. The
// collectives a step moves are checked the same way, against the engine's counters.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "plan/config.hpp"
#include "plan/estimate.hpp"
#include "plan/model.hpp"
#include "plan/planner.hpp"
#include "plan/time_model.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/engine.hpp"
#include "zinf/run_local.hpp"

namespace zinf::plan {
namespace {

namespace fs = std::filesystem;

constexpr int kWorld = 4;
constexpr int kModules = 8;
constexpr std::int64_t kSide = 256;  // one 256 x 256 bf16 weight a module

// The model the engine is given, as the planner sees it: 8 layers of 65,536 parameters, and a
// vocabulary and MLP width that make the largest tensor one such layer.
ModelShape planner_model() {
  ModelShape m = custom_model(kModules * kSide * kSide, kModules, kSide);
  m.vocab = kSide;
  m.intermediate = kSide;
  return m;
}

struct Placement {
  int stage;
  OffloadDevice optimizer;
  OffloadDevice params;
  bool gradients_on_nvme = false;
};

TEST(EngineMatch, PlannedBytesPerTierAreWhatTheEngineAllocates) {
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string root = std::string(tmp != nullptr ? tmp : "/tmp") + "/plan_engine_match";
  fs::create_directories(root);
  const ModelShape model = planner_model();
  std::vector<float> initial(static_cast<std::size_t>(kSide * kSide));
  for (std::size_t i = 0; i < initial.size(); ++i) {
    initial[i] = 0.25f + static_cast<float>(i % 97) / 128.0f;  // any finite values
  }
  Budgets budgets;
  budgets.gpus = kWorld;
  budgets.gpu_mem_bytes = 8'000'000'000;
  budgets.host_mem_bytes = 8'000'000'000;
  budgets.nvme_bytes = 100'000'000'000;
  MachineProfile profile;
  profile.mem_adam_gbps = 20;
  profile.nvme_read_gbps = 2;
  profile.nvme_write_gbps = 1;

  const OffloadDevice tiers[] = {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme};
  std::vector<Placement> placements;
  for (int stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice opt : tiers) {
      for (OffloadDevice params : tiers) {
        if (stage != 3 && params != OffloadDevice::kNone) continue;
        placements.push_back({stage, opt, params});
        if (opt == OffloadDevice::kNvme && stage >= 2)
          placements.push_back({stage, opt, params, true});
      }
    }
  }
  std::printf("stage optimizer params spill tier    predicted     engine\n");
  for (const Placement& pl : placements) {
    PlanConstraints forced;
    forced.stage = pl.stage;
    forced.optimizer = pl.optimizer;
    forced.params = pl.params;
    forced.sub_group_params = 16384;
    forced.buffer_count = 3;
    auto plan = make_plan(model, TrainingShape{}, budgets, profile, forced);
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    ASSERT_TRUE(plan->fits);
    EngineSetup setup = plan->best.setup;
    setup.gradients_on_nvme = pl.gradients_on_nvme;
    setup.gradient_spill_buffers = 3;
    setup.param_buffer_count = 2;
    const MemoryEstimate estimate = estimate_memory(model, TrainingShape{}, setup);

    const std::string dir =
        fmt::format("{}/s{}_{}_{}{}", root, pl.stage, offload_device_name(pl.optimizer),
                    offload_device_name(pl.params), pl.gradients_on_nvme ? "_spill" : "");
    fs::create_directories(dir);
    PlanConfig plan_config;
    plan_config.setup = setup;
    plan_config.nvme_path = dir;
    plan_config.pinned_pool_bytes = pinned_pool_bytes(setup);
    Result<Config> config = parse_config(config_to_json(plan_config));
    ASSERT_TRUE(config.is_ok()) << config.status().to_string() << "\n"
                                << config_to_json(plan_config);

    LocalRunOptions options;
    options.device.opaque = pl.optimizer == OffloadDevice::kNone;
    std::vector<MemoryReport> memory(kWorld);
    const Status status = run_local(
        kWorld, *config,
        [&](Engine& engine, int rank) -> Status {
          for (int m = 0; m < kModules; ++m) {
            const std::string module = fmt::format("layer{}", m);
            ZINF_RETURN_IF_ERROR(engine.register_parameter(
                {module + ".w", module, {kSide, kSide}, DType::kBF16, initial.data()}));
          }
          ZINF_RETURN_IF_ERROR(engine.finalize());
          memory[static_cast<std::size_t>(rank)] = engine.memory();
          return Status::ok();
        },
        options);
    ASSERT_TRUE(status.is_ok()) << status.to_string();

    const MemoryReport& got = memory[0];
    const std::uint64_t engine_bytes[kMemoryTierCount] = {got.device_bytes, got.host_bytes,
                                                          got.nvme_bytes};
    for (int t = 0; t < kMemoryTierCount; ++t) {
      const MemoryTier tier = static_cast<MemoryTier>(t);
      const double predicted = static_cast<double>(estimate.engine_bytes(tier));
      const double actual = static_cast<double>(engine_bytes[t]);
      std::printf("%5d %9s %6s %5s  %-6s %10.0f %10.0f\n", pl.stage,
                  std::string(offload_device_name(pl.optimizer)).c_str(),
                  std::string(offload_device_name(pl.params)).c_str(),
                  pl.gradients_on_nvme ? "yes" : "no", std::string(memory_tier_name(tier)).c_str(),
                  predicted, actual);
      // To the byte: the estimator follows the engine's allocations, pages and pools included.
      EXPECT_EQ(predicted, actual)
          << "stage " << pl.stage << ", optimizer " << offload_device_name(pl.optimizer)
          << ", params " << offload_device_name(pl.params)
          << (pl.gradients_on_nvme ? ", gradients on nvme" : "") << ", " << memory_tier_name(tier)
          << ": predicted " << predicted << " B, the engine allocated " << actual;
    }
    std::error_code ignored;
    fs::remove_all(dir, ignored);
  }
}

// The collectives of a step, predicted (predict_step()'s reduce_scatter_bytes and
// all_gather_bytes) against the engine's own counters over one step of 4 micro-batches on 4
// ranks, at each stage with the optimizer state in host memory and the first layer frozen: stage
// 1 adds each micro-batch's gradients into the trainable layers' full copies and reduce-scatters
// the sums once, at step() (the frozen layer has no full copy and is not reduced); stages 2-3
// reduce-scatter every micro-batch's trainable ones; stages 1-2 all-gather the new trainable
// params once a step, stage 3 every module for each forward and each backward.
TEST(EngineMatch, PredictedCollectiveBytesPerStepAreTheEngineCounters) {
  constexpr int kMicroBatches = 4;
  // The first layer frozen: it is gathered as any other but never reduced, at any stage, and a
  // step does not republish it, so stages 1-2 all-gather the 7 trainable layers after a step.
  constexpr int kFrozenModules = 1;
  ModelShape model = planner_model();
  model.trainable_params = (kModules - kFrozenModules) * kSide * kSide;
  model.trainable_runs = 1;
  TrainingShape training;
  training.grad_accum_steps = kMicroBatches;
  Budgets budgets;
  budgets.gpus = kWorld;
  budgets.gpu_mem_bytes = 8'000'000'000;
  budgets.host_mem_bytes = 8'000'000'000;
  MachineProfile profile;
  profile.mem_adam_gbps = 20;

  // Seeded values and gradients: module m's weight from seed 9100 + m, micro-batch k's gradient
  // of it from 9200 + 16·k + m (the same on every rank: the counters do not depend on them).
  const std::size_t elements = static_cast<std::size_t>(kSide * kSide);
  std::vector<std::vector<float>> values(kModules, std::vector<float>(elements));
  std::vector<std::vector<std::vector<std::uint16_t>>> grads(
      kMicroBatches,
      std::vector<std::vector<std::uint16_t>>(kModules, std::vector<std::uint16_t>(elements)));
  std::vector<float> g(elements);
  for (int m = 0; m < kModules; ++m) {
    fill_uniform(values[m].data(), elements, 9100 + m, -1.0f, 1.0f);
    for (int k = 0; k < kMicroBatches; ++k) {
      fill_uniform(g.data(), elements, 9200 + 16 * k + m, -0.1f, 0.1f);
      convert_f32_to_bf16(g.data(), grads[k][m].data(), elements);
    }
  }

  std::printf("stage  reduce-scatter predicted / engine   all-gather predicted / engine\n");
  for (int stage = 1; stage <= 3; ++stage) {
    PlanConstraints forced;
    forced.stage = stage;
    forced.optimizer = OffloadDevice::kHost;
    forced.params = OffloadDevice::kNone;
    auto plan = make_plan(model, training, budgets, profile, forced);
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    ASSERT_TRUE(plan->fits);
    const EngineSetup setup = plan->best.setup;
    const StepPrediction predicted = predict_step(model, training, setup, profile);
    PlanConfig plan_config;
    plan_config.setup = setup;
    plan_config.grad_accum_steps = kMicroBatches;
    plan_config.pinned_pool_bytes = pinned_pool_bytes(setup);
    Result<Config> config = parse_config(config_to_json(plan_config));
    ASSERT_TRUE(config.is_ok()) << config.status().to_string();
    ASSERT_EQ(config->gradient_accumulation_steps, static_cast<std::size_t>(kMicroBatches));

    std::vector<EngineCounters> before(kWorld), after(kWorld);
    const Status status = run_local(kWorld, *config, [&](Engine& engine, int r) -> Status {
      const auto rank = static_cast<std::size_t>(r);
      std::vector<std::string> names;
      for (int m = 0; m < kModules; ++m) {
        const std::string module = fmt::format("layer{}", m);
        names.push_back(module + ".w");
        ParameterSpec spec{names.back(), module, {kSide, kSide}, DType::kBF16, values[m].data()};
        spec.trainable = m >= kFrozenModules;
        ZINF_RETURN_IF_ERROR(engine.register_parameter(spec));
      }
      ZINF_RETURN_IF_ERROR(engine.finalize());
      // Two steps, counted from the end of the first to the end of the second: one step's
      // reductions and one publish of new params, wherever the overlapped step puts it (the
      // pass that publishes step 1's params may end in step 2's first forward).
      for (int step = 1; step <= 2; ++step) {
        for (int k = 0; k < kMicroBatches; ++k) {
          for (int m = 0; m < kModules; ++m) {  // the forward
            const std::string module = fmt::format("layer{}", m);
            ZINF_RETURN_IF_ERROR(engine.gather(module));
            ZINF_RETURN_IF_ERROR(engine.release(module));
          }
          // The backward, the frozen layer's too (gathered for its input's gradient, which a
          // layer above a trainable one needs): only the trainable modules reduce.
          for (int m = kModules - 1; m >= 0; --m) {
            const std::string module = fmt::format("layer{}", m);
            ZINF_RETURN_IF_ERROR(engine.gather(module));
            if (m >= kFrozenModules) {
              const GradientRef ref{names[m], grads[k][m].data(), elements, DType::kBF16};
              ZINF_RETURN_IF_ERROR(engine.reduce_gradients(module, {&ref, 1}));
            }
            ZINF_RETURN_IF_ERROR(engine.release(module));
          }
        }
        ZINF_ASSIGN_OR_RETURN(StepReport report, engine.step());
        if (report.skipped) return Status::internal("a step was skipped");
        if (report.micro_batches != kMicroBatches) {
          return Status::internal(fmt::format("{} micro-batches", report.micro_batches));
        }
        if (step == 1) before[rank] = engine.counters();
      }
      after[rank] = engine.counters();
      return Status::ok();
    });
    ASSERT_TRUE(status.is_ok()) << status.to_string();

    for (int r = 0; r < kWorld; ++r) {
      const auto rank = static_cast<std::size_t>(r);
      const std::uint64_t reduced =
          after[rank].reduce_scatter_bytes - before[rank].reduce_scatter_bytes;
      const std::uint64_t gathered = after[rank].all_gather_bytes - before[rank].all_gather_bytes;
      if (r == 0) {
        std::printf("%5d  %14llu / %-14llu   %10llu / %llu\n", stage,
                    static_cast<unsigned long long>(predicted.reduce_scatter_bytes),
                    static_cast<unsigned long long>(reduced),
                    static_cast<unsigned long long>(predicted.all_gather_bytes),
                    static_cast<unsigned long long>(gathered));
      }
      EXPECT_EQ(predicted.reduce_scatter_bytes, reduced) << "stage " << stage << ", rank " << r;
      EXPECT_EQ(predicted.all_gather_bytes, gathered) << "stage " << stage << ", rank " << r;
    }
  }
}

}  // namespace
}  // namespace zinf::plan
