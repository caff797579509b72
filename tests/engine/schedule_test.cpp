// Learning-rate schedules against DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py),
// written out here in double for each checked iteration: 0, 1, the end of warm-up, the middle and
// the end of the schedule; and the parser's refusals, each naming the key.
#include "zinf/schedule.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>
#include <string>

#include "engine/schedule.hpp"

namespace zinf {
namespace {

using json = nlohmann::ordered_json;

LrSchedule make(const char* section_json, double base_lr) {
  ScheduleConfig config;
  const Status parsed = parse_scheduler_section(json::parse(section_json), &config);
  EXPECT_TRUE(parsed.is_ok()) << parsed.to_string();
  Result<LrSchedule> s = LrSchedule::create(config, base_lr);
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return s.is_ok() ? *s : LrSchedule();
}

// Relative 1e-14: the schedule and the formulas here are both double, in slightly different
// orders of operations.
void expect_lr(const LrSchedule& s, std::int64_t n, double expected) {
  EXPECT_NEAR(s.lr_at(n), expected, 1e-14 * std::fabs(expected) + 1e-300)
      << schedule_name(s.kind()) << " at last_batch_iteration " << n;
}

TEST(Schedule, WarmupLRLog) {
  const LrSchedule s = make(
      R"({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4,
          "warmup_num_steps": 100}})",
      1e-3);
  const double lo = 1e-5, hi = 3e-4;
  expect_lr(s, -1, lo);  // what the first optimizer step runs with
  expect_lr(s, 0, lo + (hi - lo) * std::log(1.0) / std::log(100.0));
  expect_lr(s, 1, lo + (hi - lo) * std::log(2.0) / std::log(100.0));
  expect_lr(s, 50, lo + (hi - lo) * std::log(51.0) / std::log(100.0));
  expect_lr(s, 98, lo + (hi - lo) * std::log(99.0) / std::log(100.0));
  expect_lr(s, 99, hi);  // warm-up ends: log(100) / log(100)
  expect_lr(s, 100, hi);
  expect_lr(s, 100000, hi);
  EXPECT_FALSE(s.betas_at(5).set);
}

TEST(Schedule, WarmupLRLinearDefaultsToTheOptimizersLr) {
  const LrSchedule s = make(
      R"({"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}})", 2e-3);
  expect_lr(s, -1, 0.0);
  expect_lr(s, 0, 0.0);
  expect_lr(s, 1, 2e-3 * 1.0 / 10.0);
  expect_lr(s, 5, 2e-3 * 5.0 / 10.0);
  expect_lr(s, 9, 2e-3 * 9.0 / 10.0);
  expect_lr(s, 10, 2e-3);
  expect_lr(s, 1000, 2e-3);
}

TEST(Schedule, WarmupLRUsesAtLeastTwoWarmupSteps) {
  const LrSchedule s = make(
      R"({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 1,
          "warmup_type": "linear"}})",
      1e-3);
  expect_lr(s, 1, 0.1 * 1.0 / 2.0);  // max(2, 1) = 2 warm-up steps
  expect_lr(s, 2, 0.1);
}

TEST(Schedule, WarmupDecayLR) {
  const LrSchedule s = make(
      R"({"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_min_lr": 0,
          "warmup_max_lr": 6e-4, "warmup_num_steps": 50, "warmup_type": "linear"}})",
      1e-3);
  const double hi = 6e-4;
  expect_lr(s, -1, 0.0);
  expect_lr(s, 0, 0.0);
  expect_lr(s, 1, hi * 1.0 / 50.0);
  expect_lr(s, 49, hi * 49.0 / 50.0);
  // Decay: gamma = (T - n) / (T - W).
  expect_lr(s, 50, hi * (1000.0 - 50.0) / (1000.0 - 50.0));
  expect_lr(s, 525, hi * (1000.0 - 525.0) / 950.0);
  expect_lr(s, 999, hi * 1.0 / 950.0);
  expect_lr(s, 1000, 0.0);
  expect_lr(s, 1500, 0.0);
}

TEST(Schedule, WarmupDecayLRDefaultMaxIsDeepSpeeds) {
  // WarmupDecayLR's warmup_max_lr defaults to 0.001, whatever the optimizer's lr.
  const LrSchedule s =
      make(R"({"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_num_steps": 4}})",
           0.5);
  expect_lr(s, 3, 0.001 * std::log(4.0) / std::log(4.0));
  expect_lr(s, 2, 0.001 * std::log(3.0) / std::log(4.0));
  expect_lr(s, 12, 0.001 * (20.0 - 12.0) / 16.0);
}

TEST(Schedule, WarmupCosineLR) {
  const LrSchedule s = make(
      R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 1100, "warmup_min_ratio": 0.1,
          "warmup_num_steps": 100, "cos_min_ratio": 0.01}})",
      4e-4);
  const double base = 4e-4;
  auto warm = [&](double n) { return base * (0.1 + std::log(n + 1.0) / std::log(100.0) * 0.9); };
  auto cosine = [&](double n) {
    const double p = std::min(1.0, (n - 100.0 + 1.0) / 1000.0);
    return base * (0.01 + 0.99 * (1.0 + std::cos(std::numbers::pi * p)) / 2.0);
  };
  expect_lr(s, -1, 0.0);  // DeepSpeed's first optimizer step runs at lr 0
  expect_lr(s, 0, base * 0.1);
  expect_lr(s, 1, warm(1));
  expect_lr(s, 99, warm(99));
  expect_lr(s, 100, cosine(100));
  expect_lr(s, 599, base * (0.01 + 0.99 * 0.5));  // the middle: p = 1/2
  expect_lr(s, 1099, base * 0.01);                // the end: p = 1
  expect_lr(s, 5000, base * 0.01);
}

TEST(Schedule, OneCycleLrAndMomentum) {
  const LrSchedule s = make(
      R"({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
          "cycle_first_step_size": 100, "cycle_second_step_size": 300,
          "decay_lr_rate": 0.5, "decay_step_size": 10, "cycle_min_mom": 0.85,
          "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}})",
      1e-3);
  const double lo = 1e-4, hi = 1e-3;
  // Iteration n is batch b = n + 1 of a cycle of 400: up over 100, down over 300.
  expect_lr(s, -1, lo);
  expect_lr(s, 0, lo + (hi - lo) * 1.0 / 100.0);
  expect_lr(s, 1, lo + (hi - lo) * 2.0 / 100.0);
  expect_lr(s, 99, hi);                                         // the peak, b = 100
  expect_lr(s, 249, lo + (hi - lo) * (400.0 - 250.0) / 300.0);  // the way down
  expect_lr(s, 398, lo + (hi - lo) * 1.0 / 300.0);
  expect_lr(s, 399, lo);  // the cycle's end
  // Decay after the cycle: lo / (1 + rate * (n - 400 + 1) / decay_step_size).
  expect_lr(s, 400, lo / (1.0 + 0.5 * (1.0 / 10.0)));
  expect_lr(s, 419, lo / (1.0 + 0.5 * (20.0 / 10.0)));

  EXPECT_TRUE(s.betas_at(-1).set);
  EXPECT_DOUBLE_EQ(s.betas_at(-1).beta1, 0.85);
  EXPECT_DOUBLE_EQ(s.betas_at(-1).beta2, 0.99);
  EXPECT_NEAR(s.betas_at(0).beta1, 0.95 - 0.1 * 1.0 / 100.0, 1e-15);
  EXPECT_NEAR(s.betas_at(99).beta1, 0.85, 1e-15);
  EXPECT_NEAR(s.betas_at(249).beta1, 0.95 - 0.1 * 150.0 / 300.0, 1e-15);
  EXPECT_NEAR(s.betas_at(419).beta1, 0.95 * (1.0 + 0.01 * 20.0 / 10.0), 1e-15);
  EXPECT_DOUBLE_EQ(s.betas_at(419).beta2, 0.99);
}

TEST(Schedule, OneCycleStairs) {
  const LrSchedule s = make(
      R"({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1,
          "cycle_first_step_size": 10, "cycle_first_stair_count": 5, "cycle_momentum": false}})",
      1e-3);
  // Up over 10 batches in 5 stairs of 2: floor(b * 5 / 10) / 5; down likewise from 20.
  expect_lr(s, 0, 0.0);        // b = 1
  expect_lr(s, 1, 1.0 / 5.0);  // b = 2
  expect_lr(s, 2, 1.0 / 5.0);  // b = 3
  expect_lr(s, 9, 1.0);        // b = 10, the peak
  expect_lr(s, 12, std::floor((20.0 - 13.0) * 5.0 / 10.0) / 5.0);
  expect_lr(s, 19, 0.0);
  EXPECT_FALSE(s.betas_at(3).set);
}

TEST(Schedule, StepAndRestoreContinueTheCurve) {
  LrSchedule a = make(
      R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 60, "warmup_num_steps": 20}})",
      1e-3);
  for (int i = 0; i < 7; ++i) a.step();
  EXPECT_EQ(a.last_batch_iteration(), 6);
  LrSchedule b = make(
      R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 60, "warmup_num_steps": 20}})",
      1e-3);
  ASSERT_TRUE(b.set_last_batch_iteration(a.last_batch_iteration()).is_ok());
  for (int i = 0; i < 30; ++i) {
    EXPECT_EQ(a.lr(), b.lr()) << i;
    a.step();
    b.step();
  }
  EXPECT_FALSE(b.set_last_batch_iteration(-2).is_ok());
}

TEST(Schedule, LastBatchIterationParamStartsMidway) {
  const LrSchedule s = make(
      R"({"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 100,
          "last_batch_iteration": 41}})",
      1e-3);
  EXPECT_EQ(s.last_batch_iteration(), 41);
  EXPECT_NEAR(s.lr(), 1e-3 * std::log(42.0) / std::log(100.0), 1e-18);
}

Status parse_only(const char* text) {
  ScheduleConfig config;
  return parse_scheduler_section(json::parse(text), &config);
}

Status create_only(const char* text) {
  ScheduleConfig config;
  ZINF_RETURN_IF_ERROR(parse_scheduler_section(json::parse(text), &config));
  return LrSchedule::create(config, 1e-3).status();
}

// After its cycle OneCycle's momentum is cycle_max_mom x (1 + decay_mom_rate x d /
// decay_step_size), d the iterations past the cycle counted from 1: with 0.9 and 0.05, 0.99 at d =
// 2 and 1.035 at d = 3, which Adam cannot take as beta1.
TEST(Schedule, OneCycleMomentumPastOneIsRefusedAtItsIterationNamingTheKey) {
  const LrSchedule s = make(
      R"({"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
          "cycle_first_step_size": 2, "decay_step_size": 1, "decay_mom_rate": 0.05}})",
      1e-3);
  for (std::int64_t n = -1; n <= 5; ++n) EXPECT_TRUE(s.check_at(n).is_ok()) << n;
  EXPECT_NEAR(s.betas_at(5).beta1, 0.9 * 1.1, 1e-15);
  const Status refused = s.check_at(6);
  EXPECT_EQ(refused.code(), Code::kInvalidArgument);
  for (const char* part : {"scheduler.params.decay_mom_rate", "iteration 6", "1.035"}) {
    EXPECT_NE(refused.message().find(part), std::string::npos) << part << ": " << refused.message();
  }
}

TEST(Schedule, RefusesNamingTheKey) {
  Status s = parse_only(R"({"type": "LRRangeTest", "params": {}})");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("scheduler.type"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("LRRangeTest"), std::string::npos) << s.message();

  s = parse_only(R"({"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_steps": 5}})");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("scheduler.params.warmup_steps"), std::string::npos) << s.message();

  // A key of another type is unknown to this one.
  s = parse_only(R"({"type": "WarmupLR", "params": {"total_num_steps": 5}})");
  EXPECT_NE(s.message().find("scheduler.params.total_num_steps"), std::string::npos) << s.message();

  s = parse_only(R"({"type": "WarmupLR", "parms": {}})");
  EXPECT_NE(s.message().find("scheduler.parms"), std::string::npos) << s.message();

  s = parse_only(R"({"type": "WarmupLR", "params": {"warmup_type": "cosine"}})");
  EXPECT_NE(s.message().find("scheduler.params.warmup_type"), std::string::npos) << s.message();

  s = parse_only(R"({"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}})");
  EXPECT_NE(s.message().find("scheduler.params.warmup_num_steps"), std::string::npos)
      << s.message();

  s = create_only(R"({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}})");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("scheduler.params.total_num_steps"), std::string::npos) << s.message();

  s = create_only(R"({"type": "WarmupLR", "params": {"warmup_num_steps": 0}})");
  EXPECT_NE(s.message().find("scheduler.params.warmup_num_steps"), std::string::npos)
      << s.message();

  s = create_only(R"({"type": "OneCycle", "params": {"cycle_max_lr": 1e-3}})");
  EXPECT_NE(s.message().find("scheduler.params.cycle_min_lr"), std::string::npos) << s.message();

  s = create_only(
      R"({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e-3,
          "cycle_max_mom": 1.5}})");
  EXPECT_NE(s.message().find("scheduler.params.cycle_max_mom"), std::string::npos) << s.message();

  s = create_only(
      R"({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e-3,
          "decay_lr_rate": -0.5}})");
  EXPECT_NE(s.message().find("scheduler.params.decay_lr_rate"), std::string::npos) << s.message();

  // A float written whole number is read as DeepSpeed configs often write counts.
  EXPECT_TRUE(
      create_only(R"({"type": "WarmupDecayLR", "params": {"total_num_steps": 1e4}})").is_ok());
}

}  // namespace
}  // namespace zinf
