// Resharding on load: a checkpoint saved at (world size, stage, optimizer placement) loads into
// another (world size, stage, placement), the masters and moments re-sliced by parameter name,
// and training goes on. Each pair saves after 3 steps at world N, loads at world M and trains
// steps 4-13; the masters must equal, to 1e-6 relative, the single-process reference that steps
// 1-3 with N ranks' gradients and 4-13 with M ranks' (what an uninterrupted run at the new world
// size started from the same state computes). A load that just kept the state it had (or read it
// by byte offset) is far off.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::TrainOptions;

struct Side {
  int world;
  int stage;
  OffloadDevice optimizer;
};
struct ReshardCase {
  Side saved, loaded;
};

std::string side_name(const Side& s) {
  return fmt::format("w{}_s{}_{}", s.world, s.stage, offload_device_name(s.optimizer));
}

constexpr int kSavedSteps = 3;
constexpr int kLastStep = 13;

class ReshardTest : public ::testing::TestWithParam<ReshardCase> {};

TEST_P(ReshardTest, ResumedAtAnotherWorldStageAndPlacementMatchesTheReference) {
  const ReshardCase& c = GetParam();
  engine_test::ScratchDir scratch("ckpt-reshard-" + side_name(c.saved) + "-" + side_name(c.loaded));
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 77);
  const auto config_of = [&](const Side& s, const std::string& nvme) {
    Config config = engine_test::small_config(s.stage, s.optimizer, OffloadDevice::kNone, nvme);
    // Another sub-group size on each side, so the layouts differ even at the same world size.
    config.zero.sub_group_size = &s == &c.saved ? 700 : 500;
    return config;
  };
  {
    const Config config = config_of(c.saved, scratch.path() + "/nvme-saved");
    engine_test::Ranks ranks = engine_test::make_ranks(c.saved.world);
    const std::vector<Status> st = engine_test::run_ranks(c.saved.world, [&](int rank) -> Status {
      Env env;
      env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
      env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
      TrainOptions options;
      options.steps = kSavedSteps;
      options.check_gathered = false;
      ZINF_RETURN_IF_ERROR(
          engine_test::train_rank(*engine, model, rank, options, nullptr, nullptr));
      return engine->save_checkpoint(dir);
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << "save: " << s.to_string();
  }
  std::vector<std::vector<float>> masters(model.params.size());
  {
    const Config config = config_of(c.loaded, scratch.path() + "/nvme-loaded");
    engine_test::Ranks ranks = engine_test::make_ranks(c.loaded.world);
    const std::vector<Status> st = engine_test::run_ranks(c.loaded.world, [&](int rank) -> Status {
      Env env;
      env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
      env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
      ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
      ZINF_RETURN_IF_ERROR(engine->load_checkpoint(dir));
      TrainOptions options;
      options.first_step = kSavedSteps + 1;
      options.steps = kLastStep;
      options.check_gathered = false;
      std::vector<StepReport> reports;
      ZINF_RETURN_IF_ERROR(
          engine_test::train_rank(*engine, model, rank, options, nullptr, &reports));
      if (reports.empty() || reports.front().step != kSavedSteps + 1) {
        return Status::internal("the first step after the load is not step 4");
      }
      for (std::size_t p = 0; p < model.params.size(); ++p) {
        std::vector<float> values(model.params[p].element_count());
        ZINF_RETURN_IF_ERROR(engine->read_parameters(model.params[p].name, values.data()));
        if (rank == 0) masters[p] = std::move(values);
      }
      return Status::ok();
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << "load and train: " << s.to_string();
  }
  TrainOptions ref_options;
  ref_options.steps = kLastStep;
  ref_options.resharded_from_step = kSavedSteps + 1;
  ref_options.resharded_world = c.loaded.world;
  const engine_test::Reference ref =
      engine_test::run_reference(config_of(c.loaded, ""), model, c.saved.world, ref_options);
  double worst = 0;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const double d = engine_test::max_rel_diff(masters[p], ref.master[p]);
    worst = std::max(worst, d);
    EXPECT_LE(d, 1e-6) << model.params[p].name;
  }
  std::printf("%s -> %s: max relative difference to the reference %.3g\n",
              side_name(c.saved).c_str(), side_name(c.loaded).c_str(), worst);
}

std::vector<ReshardCase> cases() {
  using D = OffloadDevice;
  return {
      {{4, 3, D::kNvme}, {1, 1, D::kNone}},  // 4 -> 1, stage 3 -> 1
      {{1, 1, D::kNone}, {4, 3, D::kNvme}},  // 1 -> 4, stage 1 -> 3
      {{3, 3, D::kHost}, {2, 2, D::kNvme}},  // 3 -> 2, stage 3 -> 2
      {{2, 1, D::kHost}, {2, 3, D::kNone}},  // stage 1 -> 3 at the same world size
      {{2, 2, D::kNvme}, {4, 1, D::kHost}}, {{4, 2, D::kNone}, {2, 3, D::kHost}},
      {{1, 3, D::kNvme}, {2, 1, D::kNvme}}, {{2, 3, D::kNone}, {1, 2, D::kHost}},
      {{4, 1, D::kHost}, {4, 3, D::kNvme}}, {{1, 2, D::kHost}, {1, 3, D::kNone}},
      {{2, 2, D::kHost}, {3, 3, D::kNone}}, {{4, 3, D::kHost}, {2, 3, D::kNvme}},
      {{3, 1, D::kNone}, {4, 2, D::kHost}}, {{1, 1, D::kNvme}, {2, 2, D::kHost}},
  };
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, ReshardTest, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<ReshardCase>& info) {
                           return side_name(info.param.saved) + "_to_" +
                                  side_name(info.param.loaded);
                         });

}  // namespace
}  // namespace zinf
