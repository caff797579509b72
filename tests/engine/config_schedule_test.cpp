// The config's `scheduler` section drives the engine: an engine opened from a config with a
// WarmupLR or WarmupDecayLR section runs each step at DeepSpeed's learning rate, written out here
// in double from deepspeed/runtime/lr_schedules.py (as tests/engine/schedule_test.cpp does for
// LrSchedule alone). DeepSpeed sets the lr of last_batch_iteration -1 when it builds the scheduler
// and steps it after each applied optimizer step, so the k-th step (k = 1, 2, ...) runs at the
// iteration n = k - 2.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine_test_util.hpp"
#include "zinf/config.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

constexpr std::size_t kElements = 256;

// One rank, optimizer state on the host (stage 3), two parameters of seeded random values.
struct OneRank {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  std::unique_ptr<Engine> engine;
  std::vector<float> init = std::vector<float>(kElements);

  Status open(const Config& config) {
    Env env;
    env.device = ranks.devices[0].get();
    env.comm = ranks.comms[0].get();
    ZINF_ASSIGN_OR_RETURN(engine, Engine::open(config, env));
    std::uint64_t x = 0x9e3779b97f4a7c15ull;  // seed, printed by the failing assertion's trace
    for (float& v : init) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      v = static_cast<float>(static_cast<double>(x >> 11) / 9007199254740992.0 - 0.5);
    }
    ParameterSpec spec;
    spec.name = "w";
    spec.module = "layer";
    spec.shape = {kElements};
    spec.dtype = DType::kF32;
    spec.initial_values = init.data();
    ZINF_RETURN_IF_ERROR(engine->register_parameter(spec));
    return engine->finalize();
  }

  // One micro-batch with gradient g[i] = init[i] + shift (not zero, different per element).
  Status reduce(float shift) {
    std::vector<float> grad(kElements);
    for (std::size_t i = 0; i < kElements; ++i) grad[i] = init[i] + shift;
    ZINF_RETURN_IF_ERROR(engine->gather("layer"));
    const GradientRef refs[] = {{"w", grad.data(), kElements, DType::kF32}};
    ZINF_RETURN_IF_ERROR(engine->reduce_gradients("layer", refs));
    return engine->release("layer");
  }

  // One step of one micro-batch with shift 0.25.
  Status step() {
    ZINF_RETURN_IF_ERROR(reduce(0.25f));
    return engine->step().status();
  }
};

struct ScheduleCase {
  const char* scheduler;
  std::function<double(std::int64_t n)> deepspeed_lr;  // DeepSpeed's get_lr() at iteration n
  // Iterations 0, 1, the end of warm-up, the middle and the end, with their lr worked out by hand.
  std::vector<std::pair<std::int64_t, double>> named;
  std::int64_t last_iteration;
};

TEST(ConfigSchedule, EngineFromConfigRunsDeepSpeedsCurve) {
  const double lo = 1e-4, hi = 2e-3;
  const ScheduleCase cases[] = {
      // WarmupLR, log warm-up over W = 8: lo + (hi - lo) * log(n + 1) / log(8), then hi.
      {R"({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3,
           "warmup_num_steps": 8}})",
       [&](std::int64_t n) {
         if (n < 0) return lo;
         if (n < 8) return lo + (hi - lo) * std::log(n + 1.0) / std::log(8.0);
         return hi;
       },
       {{0, 1e-4},
        {1, 1e-4 + 1.9e-3 / 3.0},  // log 2 / log 8 = 1/3
        {7, 2e-3},                 // log 8 / log 8
        {3, 1e-4 + 1.9e-3 * 2.0 / 3.0},
        {12, 2e-3}},
       12},
      // WarmupDecayLR, linear warm-up over W = 6 from 0 to 1e-3, then linear decay to 0 at
      // T = 20: 1e-3 * n / 6, then 1e-3 * (20 - n) / (20 - 6), never below 0.
      {R"({"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_min_lr": 0,
           "warmup_max_lr": 1e-3, "warmup_num_steps": 6, "warmup_type": "linear"}})",
       [](std::int64_t n) {
         if (n < 0) return 0.0;
         if (n < 6) return 1e-3 * static_cast<double>(n) / 6.0;
         return std::max(0.0, 1e-3 * (20.0 - static_cast<double>(n)) / 14.0);
       },
       {{0, 0.0}, {1, 1e-3 / 6.0}, {6, 1e-3}, {13, 0.5e-3}, {20, 0.0}},
       21},
  };
  for (const ScheduleCase& c : cases) {
    SCOPED_TRACE(c.scheduler);
    Result<Config> config = parse_config(fmt::format(
        R"({{"optimizer": {{"type": "AdamW", "params": {{"lr": 5e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {{"device": "cpu"}}}},
            "scheduler": {}}})",
        c.scheduler));
    ASSERT_TRUE(config.is_ok()) << config.status().to_string();
    OneRank r;
    ASSERT_TRUE(r.open(*config).is_ok());
    EXPECT_EQ(r.engine->config().scheduler.kind, config->scheduler.kind);
    std::vector<double> lr_at;  // lr_at[n + 1]: the rate the step at iteration n runs with
    for (std::int64_t n = -1; n <= c.last_iteration; ++n) {
      lr_at.push_back(r.engine->learning_rate());
      const Status s = r.step();
      ASSERT_TRUE(s.is_ok()) << s.to_string();
    }
    for (std::int64_t n = -1; n <= c.last_iteration; ++n) {
      EXPECT_NEAR(lr_at[static_cast<std::size_t>(n + 1)], c.deepspeed_lr(n),
                  1e-15 * c.deepspeed_lr(n) + 1e-300)
          << "iteration " << n;
    }
    for (const auto& [n, want] : c.named) {
      EXPECT_NEAR(lr_at[static_cast<std::size_t>(n + 1)], want, 1e-15) << "iteration " << n;
    }
  }
}

// OneCycle's momentum after the cycle grows by decay_mom_rate (DeepSpeed's formula), past 1 after
// enough iterations, which the config cannot tell: here cycle_max_mom 0.9 x (1 + 0.05 x 3) = 1.035
// at iteration 6, the 8th step's. That step is refused before anything changes, naming the key, the
// iteration and the value, not sticky: with a schedule whose momentum stays below 1 it goes on,
// here with a second micro-batch of another gradient reduced first, and the step is the 8th with
// both micro-batches averaged: the same bits as a run that reduced the two and stepped once under
// the new schedule. With the count declared the pass would open in the backward with those betas
// (overlap on); it opens for neither micro-batch.
TEST(ConfigSchedule, OneCycleMomentumPastOneRefusesTheStepNamingTheKeyAndANewScheduleGoesOn) {
  for (const char* overlap : {"true", "false"}) {
    SCOPED_TRACE(fmt::format("zinf.overlap_step {}", overlap));
    const std::string cycle =
        R"("type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
           "cycle_first_step_size": 2, "decay_step_size": 1, "decay_mom_rate": )";
    auto config_with = [&](const char* decay_mom_rate, const char* overlap_step) {
      return parse_config(fmt::format(
          R"({{"optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
              "gradient_accumulation_steps": 1,
              "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {{"device": "cpu"}}}},
              "zinf": {{"overlap_step": {}}},
              "scheduler": {{{}{}}}}}}})",
          overlap_step, cycle, decay_mom_rate));
    };
    Result<Config> config = config_with("0.05", overlap);
    ASSERT_TRUE(config.is_ok()) << config.status().to_string();
    OneRank r;
    ASSERT_TRUE(r.open(*config).is_ok());
    for (int k = 1; k <= 7; ++k) ASSERT_TRUE(r.step().is_ok()) << "step " << k;
    std::vector<float> before(kElements), after(kElements);
    ASSERT_TRUE(r.engine->read_parameters("w", before.data()).is_ok());
    const Status refused = r.step();
    EXPECT_EQ(refused.code(), Code::kInvalidArgument) << refused.to_string();
    for (const char* part : {"step 8", "scheduler.params.decay_mom_rate", "iteration 6", "1.035"}) {
      EXPECT_NE(refused.message().find(part), std::string::npos)
          << part << ": " << refused.message();
    }
    ASSERT_TRUE(r.engine->read_parameters("w", after.data()).is_ok());
    EXPECT_EQ(after, before);

    Result<Config> steady = config_with("0", overlap);
    ASSERT_TRUE(steady.is_ok()) << steady.status().to_string();
    ASSERT_TRUE(r.engine->set_lr_schedule(steady->scheduler).is_ok());
    ASSERT_TRUE(r.reduce(0.75f).is_ok());
    Result<StepReport> applied = r.engine->step();
    ASSERT_TRUE(applied.is_ok()) << applied.status().to_string();
    EXPECT_EQ(applied->step, 8);
    EXPECT_EQ(applied->micro_batches, 2);
    EXPECT_EQ(r.engine->betas().first, 0.9);
    ASSERT_TRUE(r.engine->read_parameters("w", after.data()).is_ok());
    EXPECT_NE(after, before);

    // Sequential: with the count declared 1 an overlapped pass would open at the first of the two
    // micro-batches (the same bits either way).
    Result<Config> sequential = config_with("0.05", "false");
    ASSERT_TRUE(sequential.is_ok()) << sequential.status().to_string();
    OneRank reference;
    ASSERT_TRUE(reference.open(*sequential).is_ok());
    for (int k = 1; k <= 7; ++k) ASSERT_TRUE(reference.step().is_ok()) << "step " << k;
    ASSERT_TRUE(reference.engine->set_lr_schedule(steady->scheduler).is_ok());
    ASSERT_TRUE(reference.reduce(0.25f).is_ok());
    ASSERT_TRUE(reference.reduce(0.75f).is_ok());
    ASSERT_TRUE(reference.engine->step().is_ok());
    std::vector<float> expected(kElements);
    ASSERT_TRUE(reference.engine->read_parameters("w", expected.data()).is_ok());
    EXPECT_EQ(after, expected);
  }
}

// The scheduled rate is the one the update uses: WarmupDecayLR from warmup_min_lr 0 runs the
// first step at lr 0, so the parameters stay exactly where they were (decoupled decay is
// lr * weight_decay, also 0); without the section the same step moves them.
TEST(ConfigSchedule, FirstStepOfAWarmupFromZeroLeavesTheParameters) {
  for (bool with_scheduler : {true, false}) {
    SCOPED_TRACE(with_scheduler ? "with scheduler" : "without scheduler");
    Result<Config> config = parse_config(fmt::format(
        R"({{"optimizer": {{"type": "AdamW", "params": {{"lr": 5e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {{"device": "cpu"}}}}{}}})",
        with_scheduler ? R"(, "scheduler": {"type": "WarmupDecayLR", "params": {
                         "total_num_steps": 20, "warmup_num_steps": 6}})"
                       : ""));
    ASSERT_TRUE(config.is_ok()) << config.status().to_string();
    OneRank r;
    ASSERT_TRUE(r.open(*config).is_ok());
    ASSERT_TRUE(r.step().is_ok());
    std::vector<float> after(kElements);
    ASSERT_TRUE(r.engine->read_parameters("w", after.data()).is_ok());
    std::size_t moved = 0;
    for (std::size_t i = 0; i < kElements; ++i) moved += after[i] != r.init[i] ? 1 : 0;
    EXPECT_EQ(moved, with_scheduler ? 0u : kElements);
  }
}

// A schedule started midway (last_batch_iteration L >= 0, as a job resuming by its config
// writes it): DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle set the
// optimizer's lr (OneCycle also its betas) when they are built only where L is -1
// (deepspeed/runtime/lr_schedules.py), so the first step runs with the optimizer's own lr and
// betas, and the scheduler's step() after it sets iteration L + 1 for the second step. The
// rates below are worked from DeepSpeed's formulas; the first step's update is checked against
// AdamW's at the optimizer's lr.
TEST(ConfigSchedule, StartedMidwayTheFirstStepRunsWithTheOptimizersOwnLrAndBetas) {
  constexpr double kLr = 5e-3, kBeta1 = 0.9, kBeta2 = 0.999, kDecay = 0.01;
  const struct {
    const char* scheduler;
    double lr2, lr3;                   // the rates of steps 2 and 3: iterations L + 1, L + 2
    double beta1_2, beta1_3, beta2_2;  // their betas (OneCycle's cycled momentum, 0.99)
  } cases[] = {
      // OneCycle from L = 5, S1 = S2 = 10: b = n + 1, x = b / 20, rising half while x <= 0.5 with
      // scale = x / 0.5; at n = 6, scale 0.7: lr = 1e-4 + 9e-4 * 0.7 = 7.3e-4, momentum
      // 0.95 - 0.1 * 0.7 = 0.88; at n = 7, scale 0.8: lr 8.2e-4, momentum 0.87.
      {R"({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
           "cycle_first_step_size": 10, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
           "last_batch_iteration": 5}})",
       1e-4 + 9e-4 * 0.7, 1e-4 + 9e-4 * 0.8, 0.95 - 0.1 * 0.7, 0.95 - 0.1 * 0.8, 0.99},
      // WarmupDecayLR from L = 500, past a warm-up of 100 with T = 1000: gamma =
      // (T - n) / (T - 100); lr = 1e-3 * 499 / 900 at n = 501, 1e-3 * 498 / 900 at n = 502. Its
      // betas are the optimizer's throughout.
      {R"({"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_min_lr": 0,
           "warmup_max_lr": 1e-3, "warmup_num_steps": 100, "warmup_type": "linear",
           "last_batch_iteration": 500}})",
       1e-3 * 499.0 / 900.0, 1e-3 * 498.0 / 900.0, kBeta1, kBeta1, kBeta2},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.scheduler);
    Result<Config> config = parse_config(fmt::format(
        R"({{"optimizer": {{"type": "AdamW", "params": {{"lr": 5e-3, "betas": [0.9, 0.999],
                                                      "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {{"device": "cpu"}}}},
            "scheduler": {}}})",
        c.scheduler));
    ASSERT_TRUE(config.is_ok()) << config.status().to_string();
    OneRank r;
    ASSERT_TRUE(r.open(*config).is_ok());
    EXPECT_DOUBLE_EQ(r.engine->learning_rate(), kLr);
    EXPECT_DOUBLE_EQ(r.engine->betas().first, kBeta1);
    EXPECT_DOUBLE_EQ(r.engine->betas().second, kBeta2);
    ASSERT_TRUE(r.step().is_ok());
    // AdamW's first step (bias-corrected, so the betas drop out): w - lr * (g / (|g| + eps) +
    // weight_decay * w), at the optimizer's lr; at the schedule's lr_at(L) it would differ by
    // several times 1e-4 per element.
    std::vector<float> after(kElements);
    ASSERT_TRUE(r.engine->read_parameters("w", after.data()).is_ok());
    for (std::size_t i = 0; i < kElements; ++i) {
      const double w = r.init[i];
      const double g = static_cast<double>(r.init[i] + 0.25f);
      const double want = w - kLr * (g / (std::fabs(g) + 1e-8) + kDecay * w);
      ASSERT_NEAR(after[i], want, 1e-6) << "element " << i;
    }
    EXPECT_NEAR(r.engine->learning_rate(), c.lr2, 1e-15);
    EXPECT_NEAR(r.engine->betas().first, c.beta1_2, 1e-15);
    EXPECT_NEAR(r.engine->betas().second, c.beta2_2, 1e-15);
    ASSERT_TRUE(r.step().is_ok());
    EXPECT_NEAR(r.engine->learning_rate(), c.lr3, 1e-15);
    EXPECT_NEAR(r.engine->betas().first, c.beta1_3, 1e-15);
  }
}

}  // namespace
}  // namespace zinf
