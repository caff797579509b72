// The core test of the engine: a five-module model trained 20 steps with AdamW through the
// Engine on world size 1..4 x stage 1..3 x optimizer state none/host/nvme x parameters
// none/host/nvme (stage 3) ends with the fp32 masters of a plain single-process AdamW on whole
// parameters (the reference in engine_test_util.cpp) within 1e-6 relative, the same bits on every
// rank, and every gathered device copy equal to the reference's master rounded to its dtype at
// every step.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::Reference;
using engine_test::TrainOptions;

struct EquivalenceCase {
  int world;
  int stage;
  OffloadDevice optimizer;
  OffloadDevice params;
  DType dtype = DType::kF32;
  int micro_batches = 1;
  double clipping = 0.0;
  // Opaque HostDevices: the engine takes the path of a device that is not host-accessible.
  bool opaque = false;
};

std::string case_name(const EquivalenceCase& c) {
  return fmt::format("w{}_s{}_opt_{}_param_{}_{}_mb{}{}{}", c.world, c.stage,
                     offload_device_name(c.optimizer), offload_device_name(c.params),
                     dtype_name(c.dtype), c.micro_batches, c.clipping > 0 ? "_clip" : "",
                     c.opaque ? "_opaque" : "");
}

// Trains on every rank and compares; returns the reports of rank 0.
void run_case(const EquivalenceCase& c) {
  const std::uint64_t seed =
      1234 + static_cast<std::uint64_t>(c.world) * 10 + static_cast<std::uint64_t>(c.stage);
  std::printf("case %s seed %llu\n", case_name(c).c_str(), static_cast<unsigned long long>(seed));
  engine_test::ScratchDir dir(case_name(c));
  Config config = engine_test::small_config(c.stage, c.optimizer, c.params, dir.path());
  config.gradient_clipping = c.clipping;
  const Model model = engine_test::make_model(c.dtype, seed);
  TrainOptions options;
  options.steps = 20;
  options.micro_batches = c.micro_batches;
  if (c.clipping > 0) options.gathered_tolerance = 1e-5;
  // State on a device that is not host-accessible: the device's Adam (kernels/adam, every
  // operation rounded, where the CPU optimizer fuses multiply-adds), in the reference too.
  options.device_adam = c.opaque && c.optimizer == OffloadDevice::kNone;
  const Reference ref = engine_test::run_reference(config, model, c.world, options);

  engine_test::Ranks ranks =
      engine_test::make_ranks(c.world, std::chrono::seconds(30), /*jitter_max_us=*/0, c.opaque);
  engine_test::RankRuns runs =
      engine_test::train_against_reference(config, ranks, model, options, ref);
  const std::vector<Status>& st = runs.status;
  const auto& finals = runs.finals;
  const auto& reports = runs.reports;
  const auto& counters = runs.counters;
  for (int r = 0; r < c.world; ++r) {
    ASSERT_TRUE(st[static_cast<std::size_t>(r)].is_ok())
        << "rank " << r << ": " << st[static_cast<std::size_t>(r)].to_string();
  }
  // The device's gradient norm is a float (kernels/sq_norm rounds its fp64 sum once), so with
  // clipping its coefficient differs from the reference's double one in the seventh digit.
  const double master_tolerance = options.device_adam && c.clipping > 0 ? 2e-5 : 1e-6;
  double worst = 0.0;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const double d = engine_test::max_rel_diff(finals[0][p], ref.master[p]);
    worst = std::max(worst, d);
    EXPECT_LE(d, master_tolerance) << model.params[p].name;
    for (int r = 1; r < c.world; ++r) {
      EXPECT_EQ(std::memcmp(finals[static_cast<std::size_t>(r)][p].data(), finals[0][p].data(),
                            finals[0][p].size() * 4),
                0)
          << "rank " << r << " differs from rank 0 in " << model.params[p].name;
    }
    // The masters moved: a test that trained nothing would pass the comparison trivially.
    EXPECT_GT(engine_test::max_rel_diff(finals[0][p], model.initial[p]), 1e-3)
        << model.params[p].name;
  }
  std::printf("max relative difference to the reference: %.3g\n", worst);
  ASSERT_EQ(reports[0].size(), 20u);
  EXPECT_EQ(reports[0].back().step, 20);
  EXPECT_FALSE(reports[0].back().skipped);
  EXPECT_EQ(reports[0].back().micro_batches, c.micro_batches);
  for (int r = 1; r < c.world; ++r) {
    EXPECT_EQ(reports[static_cast<std::size_t>(r)].back().grad_norm, reports[0].back().grad_norm);
  }
  if (c.stage == 3) {
    // Once the order is recorded (after step 1) modules are prefetched and found prefetched.
    EXPECT_GT(counters[0].prefetches_issued, 0u);
    EXPECT_GT(counters[0].prefetch_hits, 0u);
    EXPECT_GT(counters[0].persistent_elements, 0u);
    EXPECT_LE(counters[0].live_elements_peak, config.zero.stage3_max_live_parameters);
    EXPECT_EQ(counters[0].live_elements, 0u);
  }
  if (c.clipping > 0) {
    EXPECT_LT(reports[0].back().clip_coef, 1.0);
  }
}

class Equivalence : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(Equivalence, MastersEqualSingleProcessAdamW) { run_case(GetParam()); }

std::vector<EquivalenceCase> matrix() {
  std::vector<EquivalenceCase> cases;
  const OffloadDevice tiers[] = {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme};
  for (int world = 1; world <= 4; ++world) {
    for (int stage = 1; stage <= 3; ++stage) {
      for (OffloadDevice opt : tiers) {
        for (OffloadDevice param : tiers) {
          if (stage != 3 && param != OffloadDevice::kNone) continue;
          EquivalenceCase c{world, stage, opt, param};
          // Two micro-batches on odd world sizes, so accumulation runs in every stage.
          c.micro_batches = world % 2 == 1 ? 2 : 1;
          cases.push_back(c);
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, Equivalence, ::testing::ValuesIn(matrix()),
                         [](const ::testing::TestParamInfo<EquivalenceCase>& info) {
                           return case_name(info.param);
                         });

// Half-precision device copies: bf16 and f16 parameters with fp32 masters, and clipping by the
// global norm.
INSTANTIATE_TEST_SUITE_P(
    Mixed, Equivalence,
    ::testing::Values(
        EquivalenceCase{2, 3, OffloadDevice::kNvme, OffloadDevice::kHost, DType::kBF16, 1},
        EquivalenceCase{3, 2, OffloadDevice::kHost, OffloadDevice::kNone, DType::kBF16, 2},
        EquivalenceCase{2, 1, OffloadDevice::kNone, OffloadDevice::kNone, DType::kF16, 1},
        EquivalenceCase{4, 3, OffloadDevice::kNone, OffloadDevice::kNvme, DType::kF16, 1},
        EquivalenceCase{3, 3, OffloadDevice::kHost, OffloadDevice::kNone, DType::kF32, 1, 0.5},
        EquivalenceCase{2, 1, OffloadDevice::kNvme, OffloadDevice::kNone, DType::kF32, 2, 0.5}),
    [](const ::testing::TestParamInfo<EquivalenceCase>& info) { return case_name(info.param); });

// On opaque HostDevices (not host-accessible; host code that dereferences device memory faults)
// the engine moves everything by copies, device ops and collectives, as on a GPU. Every stage and
// placement, 1 to 4 ranks, micro-batches, half dtypes and clipping: with the optimizer state in
// host memory or on NVMe (the ZeRO-Infinity case) the same bits as the reference; with it on the
// device (DeviceOptimizer, the kernels' references here) within 1e-6 relative.
std::vector<EquivalenceCase> opaque_cases() {
  std::vector<EquivalenceCase> cases;
  const OffloadDevice tiers[] = {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme};
  for (int stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice opt : tiers) {
      for (OffloadDevice param : tiers) {
        if (stage != 3 && param != OffloadDevice::kNone) continue;
        EquivalenceCase c{2, stage, opt, param};
        c.opaque = true;
        cases.push_back(c);
      }
    }
  }
  for (EquivalenceCase c :
       {EquivalenceCase{1, 1, OffloadDevice::kHost, OffloadDevice::kNone, DType::kF32, 2},
        EquivalenceCase{3, 1, OffloadDevice::kNvme, OffloadDevice::kNone, DType::kBF16, 2},
        EquivalenceCase{3, 2, OffloadDevice::kHost, OffloadDevice::kNone, DType::kF16, 2},
        EquivalenceCase{4, 3, OffloadDevice::kNvme, OffloadDevice::kNvme, DType::kBF16, 1},
        EquivalenceCase{3, 3, OffloadDevice::kHost, OffloadDevice::kHost, DType::kF32, 2, 0.5},
        EquivalenceCase{3, 2, OffloadDevice::kNone, OffloadDevice::kNone, DType::kBF16, 2},
        EquivalenceCase{2, 3, OffloadDevice::kNone, OffloadDevice::kNvme, DType::kF16, 1},
        EquivalenceCase{3, 1, OffloadDevice::kNone, OffloadDevice::kNone, DType::kF32, 2, 0.5}}) {
    c.opaque = true;
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Opaque, Equivalence, ::testing::ValuesIn(opaque_cases()),
                         [](const ::testing::TestParamInfo<EquivalenceCase>& info) {
                           return case_name(info.param);
                         });

// offload_optimizer "none" on a device that is not host-accessible steps Adam and AdamW with bias
// correction only (the kernels/adam step); anything else is refused at open(), naming the key and
// the device.
TEST(EquivalenceOpaque, AnOptimizerTheDeviceCannotStepIsRefusedNamingTheKey) {
  engine_test::Ranks ranks =
      engine_test::make_ranks(1, std::chrono::seconds(30), /*jitter_max_us=*/0, /*opaque=*/true);
  Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
  config.optimizer.kind = OptimizerKind::kLion;
  Env env;
  env.device = ranks.devices[0].get();
  env.comm = ranks.comms[0].get();
  Result<std::unique_ptr<Engine>> engine = Engine::open(config, env);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_EQ(engine.status().code(), Code::kUnsupported);
  EXPECT_NE(engine.status().message().find("optimizer.type"), std::string_view::npos)
      << engine.status().to_string();
  EXPECT_NE(engine.status().message().find("host:0"), std::string_view::npos);
  config.optimizer.kind = OptimizerKind::kAdamW;
  config.optimizer.bias_correction = false;
  engine = Engine::open(config, env);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_EQ(engine.status().code(), Code::kUnsupported);
  EXPECT_NE(engine.status().message().find("optimizer.params.bias_correction"),
            std::string_view::npos)
      << engine.status().to_string();
  config.optimizer.bias_correction = true;
  EXPECT_TRUE(Engine::open(config, env).is_ok());
}

}  // namespace
}  // namespace zinf
