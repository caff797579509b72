// LossScaler against DeepSpeed's DynamicLossScaler rules: worked by hand, and against the rule
// itself over random runs of overflows.
#include "zero/loss_scaler.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace zinf {
namespace {

TEST(LossScaler, HalvesOnOverflowAndDoublesAfterAWindow) {
  LossScaler s(
      {.dynamic = true, .initial_scale = 1024, .window = 3, .hysteresis = 1, .min_scale = 1});
  std::vector<double> seen;
  for (bool overflow : {false, true, false, false, false, false, true, true}) {
    s.update(overflow);
    seen.push_back(s.scale());
  }
  // good -> 1024 (1 good); overflow -> 512 (run reset); 3 good -> 512; the fourth good step,
  // after a whole window of them, -> 1024; two overflows -> 512, 256.
  EXPECT_EQ(seen, (std::vector<double>{1024, 512, 512, 512, 512, 1024, 512, 256}));
}

// DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py), kept by
// its own counters: the iteration, the last overflow's iteration, the hysteresis left. Not
// consecutive_hysteresis (zinf refuses it); no error at min_scale (the engine reports that one,
// from LossScaler::at_floor()).
struct DeepSpeedRule {
  double scale;
  std::int64_t window;
  int delayed_shift;
  double min_scale;
  std::int64_t iter = 0;
  std::int64_t last_overflow = -1;
  int hysteresis;
  DeepSpeedRule(double s, std::int64_t w, int h, double m)
      : scale(s), window(w), delayed_shift(h), min_scale(m), hysteresis(h) {}
  void update(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || hysteresis == 1) {
        scale = std::max(scale / 2.0, min_scale);
      } else {
        --hysteresis;
      }
      last_overflow = iter;
    } else {
      const std::int64_t stable = iter - last_overflow - 1;
      if (stable > 0 && stable % window == 0) {
        hysteresis = delayed_shift;
        scale *= 2.0;
      }
    }
    ++iter;
  }
};

TEST(LossScaler, FollowsDeepSpeedsRuleOverRandomRuns) {
  std::mt19937_64 rng(20261204);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t window = 1 + static_cast<std::int64_t>(rng() % 6);
    const int hysteresis = 1 + static_cast<int>(rng() % 3);
    const double p_overflow = 0.05 + 0.4 * static_cast<double>(rng() % 1000) / 1000.0;
    LossScaler ours({.dynamic = true,
                     .initial_scale = 65536,
                     .window = window,
                     .hysteresis = hysteresis,
                     .min_scale = 1});
    DeepSpeedRule ref(65536, window, hysteresis, 1);
    std::bernoulli_distribution overflow(p_overflow);
    for (int step = 0; step < 300; ++step) {
      const bool o = overflow(rng);
      ours.update(o);
      ref.update(o);
      ASSERT_EQ(ours.scale(), ref.scale) << "trial " << trial << " step " << step << " window "
                                         << window << " hysteresis " << hysteresis;
      ASSERT_EQ(ours.hysteresis_left(), ref.hysteresis) << "trial " << trial << " step " << step;
    }
  }
}

TEST(LossScaler, HysteresisToleratesOverflowsBeforeLowering) {
  LossScaler s(
      {.dynamic = true, .initial_scale = 64, .window = 100, .hysteresis = 3, .min_scale = 1});
  s.update(true);
  EXPECT_EQ(s.scale(), 64);
  s.update(true);
  EXPECT_EQ(s.scale(), 64);
  s.update(true);
  EXPECT_EQ(s.scale(), 32);
  s.update(true);  // hysteresis is used up until a window of good steps restores it
  EXPECT_EQ(s.scale(), 16);
}

TEST(LossScaler, NeverBelowMinAndStaticNeverMoves) {
  LossScaler s(
      {.dynamic = true, .initial_scale = 4, .window = 10, .hysteresis = 1, .min_scale = 2});
  for (int i = 0; i < 5; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 2);
  LossScaler fixed(
      {.dynamic = false, .initial_scale = 128, .window = 1, .hysteresis = 1, .min_scale = 1});
  fixed.update(true);
  fixed.update(false);
  fixed.update(false);
  EXPECT_EQ(fixed.scale(), 128);
}

}  // namespace
}  // namespace zinf
