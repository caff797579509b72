// Engine::read_optimizer_state: a parameter's optimizer moment, whole, on every rank, after
// training, against the single-process reference's moments (the same bits, as the masters are),
// at every stage, with the state in host memory and on NVMe; its refusals; and what a failure on
// one rank does to the others.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "io/fault.hpp"

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

// A read that fails on one rank (an I/O error reading its NVMe state, or a null `out`) fails every
// rank in the same call (the others with kAborted naming it), not in the all-gather after their
// collective timeout; and it leaves no rank's engine failed: once the fault is gone, every rank
// reads again and they agree.
TEST(ReadOptimizerStateErrors, AFailureOnOneRankFailsEveryRankAndStaysNoFailure) {
  constexpr int kWorld = 2;
  engine_test::ScratchDir dir("read_state_errors");
  const Model model = engine_test::make_model(DType::kF32, 93);
  Config config =
      engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
  config.collective_timeout_ms = 5000;
  engine_test::TrainOptions options;
  options.steps = 2;
  options.check_gathered = false;
  engine_test::Ranks ranks = engine_test::make_ranks(kWorld, std::chrono::seconds(5));
  const std::string& name = model.params[0].name;
  const std::size_t count = model.params[0].element_count();
  std::vector<Status> failed_read(kWorld), null_out(kWorld);
  std::vector<std::vector<float>> again(kWorld, std::vector<float>(count));
  const std::vector<Status> st = engine_test::run_ranks(kWorld, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    FaultSpec spec;
    spec.eio_rate = 1.0;
    spec.writes = false;
    auto faults = std::make_shared<FaultInjector>(spec);
    faults->set_enabled(false);
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          engine_test::open_rank(ranks, rank, config, faults));
    engine_test::TrainOptions rank_options = options;
    rank_options.device = ranks.devices[r].get();
    ZINF_RETURN_IF_ERROR(
        engine_test::train_rank(*engine, model, rank, rank_options, nullptr, nullptr));
    std::vector<float> out(count);
    // The last step's pass done (it may still run behind the call): the faults meet this read.
    ZINF_RETURN_IF_ERROR(engine->read_parameters(name, out.data()));
    faults->set_enabled(rank == 0);
    failed_read[r] = engine->read_optimizer_state(name, "exp_avg_sq", out.data());
    faults->set_enabled(false);
    null_out[r] = engine->read_optimizer_state(name, "exp_avg", rank == 1 ? nullptr : out.data());
    return engine->read_optimizer_state(name, "exp_avg_sq", again[r].data());
  });
  for (std::size_t r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
  }
  EXPECT_EQ(failed_read[0].code(), Code::kIoError) << failed_read[0].to_string();
  EXPECT_EQ(failed_read[1].code(), Code::kAborted) << failed_read[1].to_string();
  EXPECT_THAT(failed_read[1].message(), ::testing::HasSubstr("rank 0 failed (io_error)"));
  EXPECT_EQ(null_out[1].code(), Code::kInvalidArgument) << null_out[1].to_string();
  EXPECT_EQ(null_out[0].code(), Code::kAborted) << null_out[0].to_string();
  EXPECT_THAT(null_out[0].message(), ::testing::HasSubstr("rank 1 failed (invalid_argument)"));
  EXPECT_EQ(std::memcmp(again[0].data(), again[1].data(), count * sizeof(float)), 0);
}

}  // namespace
}  // namespace zinf
