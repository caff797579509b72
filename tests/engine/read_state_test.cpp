// Engine::read_optimizer_state: a parameter's optimizer moment, whole, on every rank, after
// training, against the single-process reference's moments (the same bits, as the masters are),
// at every stage, with the state in host memory and on NVMe; and its refusals.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;

struct Case {
  int world;
  int stage;
  OffloadDevice optimizer;
};

class ReadOptimizerState : public ::testing::TestWithParam<Case> {};

TEST_P(ReadOptimizerState, GivesEveryRankTheReferenceMoments) {
  const Case c = GetParam();
  engine_test::ScratchDir dir(
      fmt::format("read_state_w{}_s{}_{}", c.world, c.stage, offload_device_name(c.optimizer)));
  const Model model = engine_test::make_model(DType::kF32, 91);
  const Config config =
      engine_test::small_config(c.stage, c.optimizer, OffloadDevice::kNone, dir.path());
  engine_test::TrainOptions options;
  options.steps = 4;
  const engine_test::Reference ref = engine_test::run_reference(config, model, c.world, options);
  engine_test::Ranks ranks = engine_test::make_ranks(c.world);
  const std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        engine_test::TrainOptions rank_options = options;
        rank_options.device = ranks.devices[static_cast<std::size_t>(rank)].get();
        ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, model, rank, rank_options,
                                                     &ref.device_per_step, nullptr));
        for (std::size_t p = 0; p < model.params.size(); ++p) {
          const std::string& name = model.params[p].name;
          for (const char* state : {"exp_avg", "exp_avg_sq"}) {
            const std::vector<float>& want =
                std::string_view(state) == "exp_avg" ? ref.exp_avg[p] : ref.exp_avg_sq[p];
            std::vector<float> got(want.size(), -1.0f);
            ZINF_RETURN_IF_ERROR(engine.read_optimizer_state(name, state, got.data()));
            if (std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) != 0) {
              return Status::internal(fmt::format("{} of '{}': max rel diff {}", state, name,
                                                  engine_test::max_rel_diff(got, want)));
            }
          }
        }
        // Refused alike on every rank, before any collective: the engine stays usable.
        std::vector<float> out(model.params[0].element_count());
        Status bad = engine.read_optimizer_state("no.such.parameter", "exp_avg", out.data());
        if (bad.code() != Code::kNotFound) return Status::internal("unknown: " + bad.to_string());
        bad = engine.read_optimizer_state(model.params[0].name, "momentum_buffer", out.data());
        if (bad.code() != Code::kInvalidArgument ||
            bad.message().find("\"exp_avg\", \"exp_avg_sq\"") == std::string::npos) {
          return Status::internal("unkept state: " + bad.to_string());
        }
        std::vector<float> master(out.size());
        return engine.read_parameters(model.params[0].name, master.data());
      });
  for (std::size_t r = 0; r < st.size(); ++r)
    EXPECT_TRUE(st[r].is_ok()) << r << ": " << st[r].to_string();
}

INSTANTIATE_TEST_SUITE_P(Cases, ReadOptimizerState,
                         ::testing::Values(Case{1, 1, OffloadDevice::kHost},
                                           Case{2, 1, OffloadDevice::kNvme},
                                           Case{2, 2, OffloadDevice::kHost},
                                           Case{2, 3, OffloadDevice::kHost},
                                           Case{2, 3, OffloadDevice::kNvme}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return fmt::format("w{}_s{}_{}", info.param.world, info.param.stage,
                                              offload_device_name(info.param.optimizer));
                         });

}  // namespace
}  // namespace zinf
