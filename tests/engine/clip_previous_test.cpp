// zinf.clip_from_previous_step: step t's gradients are clipped by the coefficient of step t-1's
// norm (the first step's own), so the overlapped step's pass can begin during the backward with
// clipping on. How its numbers differ from the exact mode, against the single-process reference
// (tests/engine/engine_test_util.cpp's run_reference, which lags the coefficient the same way):
// the masters equal the lagging reference to 1e-6, they differ from the exact reference by far
// more, and every step's reported coefficient is the one of the previous step's reported norm.
// A checkpoint carries the coefficient, so a resumed run clips its first step as the
// uninterrupted one does.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::Reference;
using engine_test::TrainOptions;

// torch.nn.utils.clip_grad_norm_'s coefficient, in double.
double clip_coef(double norm, double max_norm) {
  return norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
}

struct ClipCase {
  int world;
  int stage;
  OffloadDevice optimizer;
};

class ClipFromPreviousStep : public ::testing::TestWithParam<ClipCase> {};

TEST_P(ClipFromPreviousStep, MastersEqualTheLaggingReferenceNotTheExactOne) {
  const ClipCase c = GetParam();
  engine_test::ScratchDir dir("clip_previous");
  Config config = engine_test::small_config(c.stage, c.optimizer, OffloadDevice::kNone, dir.path());
  config.bf16_enabled = true;
  config.gradient_clipping = 0.05;  // every step of this model clips
  config.clip_from_previous_step = true;
  config.gradient_accumulation_steps = 2;
  const Model model = engine_test::make_model(DType::kBF16, 4100 + c.world * 10 + c.stage);
  TrainOptions options;
  options.steps = 12;
  options.micro_batches = 2;
  options.gathered_tolerance = 1e-5;
  const Reference lagging = engine_test::run_reference(config, model, c.world, options);
  Config exact_config = config;
  exact_config.clip_from_previous_step = false;
  const Reference exact = engine_test::run_reference(exact_config, model, c.world, options);

  engine_test::Ranks ranks = engine_test::make_ranks(c.world);
  std::vector<std::vector<StepReport>> reports(static_cast<std::size_t>(c.world));
  std::vector<std::vector<float>> finals;
  std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        const auto r = static_cast<std::size_t>(rank);
        ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, model, rank, options,
                                                     &lagging.device_per_step, &reports[r]));
        // read_parameters() is collective: every rank reads, rank 0 keeps them.
        for (const engine_test::ParamDef& d : model.params) {
          std::vector<float> out(d.element_count());
          ZINF_RETURN_IF_ERROR(engine.read_parameters(d.name, out.data()));
          if (rank == 0) finals.push_back(std::move(out));
        }
        return Status::ok();
      });
  for (std::size_t r = 0; r < st.size(); ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
  }
  double to_lagging = 0.0, to_exact = 0.0;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    to_lagging = std::max(to_lagging, engine_test::max_rel_diff(finals[p], lagging.master[p]));
    to_exact = std::max(to_exact, engine_test::max_rel_diff(finals[p], exact.master[p]));
  }
  std::printf("largest relative difference: to the lagging reference %.3g, to the exact %.3g\n",
              to_lagging, to_exact);
  EXPECT_LE(to_lagging, 1e-6);
  EXPECT_GT(to_exact, 1e-4);
  const std::vector<StepReport>& rep = reports[0];
  ASSERT_EQ(rep.size(), 12u);
  EXPECT_DOUBLE_EQ(rep[0].clip_coef, clip_coef(rep[0].grad_norm, config.gradient_clipping));
  for (std::size_t t = 1; t < rep.size(); ++t) {
    EXPECT_LT(rep[t].clip_coef, 1.0) << "step " << t + 1;
    EXPECT_DOUBLE_EQ(rep[t].clip_coef, clip_coef(rep[t - 1].grad_norm, config.gradient_clipping))
        << "step " << t + 1;
    // From the second step on the pass began in the backward (state in a store, stage >= 2).
    EXPECT_EQ(rep[t].in_backward, c.optimizer != OffloadDevice::kNone && c.stage >= 2)
        << "step " << t + 1;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ClipFromPreviousStep,
                         ::testing::Values(ClipCase{1, 3, OffloadDevice::kNvme},
                                           ClipCase{2, 2, OffloadDevice::kHost},
                                           ClipCase{3, 1, OffloadDevice::kNone}),
                         [](const auto& info) {
                           const ClipCase& c = info.param;
                           return fmt::format("world{}_stage{}_{}", c.world, c.stage,
                                              c.optimizer == OffloadDevice::kNvme   ? "nvme"
                                              : c.optimizer == OffloadDevice::kHost ? "cpu"
                                                                                    : "none");
                         });

// Saved after step 6 and loaded into a new engine, the run clips step 7 by step 6's coefficient,
// as the uninterrupted run does: the same masters after step 8, bit for bit.
TEST(ClipFromPreviousStepCheckpoint, TheResumedRunClipsItsFirstStepByTheSavedCoefficient) {
  engine_test::ScratchDir dir("clip_previous_ckpt");
  Config config = engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone,
                                            dir.path() + "/swap");
  config.bf16_enabled = true;
  config.gradient_clipping = 0.05;
  config.clip_from_previous_step = true;
  const Model model = engine_test::make_model(DType::kBF16, 4200);
  TrainOptions first;
  first.steps = 6;
  first.check_gathered = false;
  TrainOptions second = first;
  second.first_step = 7;
  second.steps = 8;
  auto masters = [&](Engine& engine, std::vector<std::vector<float>>* out) -> Status {
    for (const engine_test::ParamDef& d : model.params) {
      std::vector<float> v(d.element_count());
      ZINF_RETURN_IF_ERROR(engine.read_parameters(d.name, v.data()));
      out->push_back(std::move(v));
    }
    return Status::ok();
  };
  std::vector<std::vector<float>> whole, resumed;
  std::vector<StepReport> whole_reports, resumed_reports;
  std::vector<Status> st =
      engine_test::with_engines(config, model, 1, [&](int, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, model, 0, first, nullptr, nullptr));
        ZINF_RETURN_IF_ERROR(engine.save_checkpoint(dir.path() + "/ckpt", "six"));
        ZINF_RETURN_IF_ERROR(
            engine_test::train_rank(engine, model, 0, second, nullptr, &whole_reports));
        return masters(engine, &whole);
      });
  ASSERT_TRUE(st[0].is_ok()) << st[0].to_string();
  st = engine_test::with_engines(config, model, 1, [&](int, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(engine.load_checkpoint(dir.path() + "/ckpt", "six"));
    ZINF_RETURN_IF_ERROR(
        engine_test::train_rank(engine, model, 0, second, nullptr, &resumed_reports));
    return masters(engine, &resumed);
  });
  ASSERT_TRUE(st[0].is_ok()) << st[0].to_string();
  ASSERT_EQ(whole_reports.size(), 2u);
  ASSERT_EQ(resumed_reports.size(), 2u);
  EXPECT_EQ(resumed_reports[0].clip_coef, whole_reports[0].clip_coef);
  EXPECT_LT(resumed_reports[0].clip_coef, 1.0);
  EXPECT_EQ(resumed, whole);
}

}  // namespace
}  // namespace zinf
