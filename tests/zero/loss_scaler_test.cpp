// LossScaler against DeepSpeed's ZeRO loss scaling: worked by hand, and against a step-by-step
// transcription of DeepSpeed's DynamicLossScaler.update_scale over seeded random runs of
// overflows, including a scaler resumed from a saved state and one resumed from the state the
// previous zinf rule saved.
#include "zero/loss_scaler.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace zinf {
namespace {

std::vector<double> scales_after(LossScaler& s, const std::vector<bool>& overflows) {
  std::vector<double> seen;
  for (bool overflow : overflows) {
    s.update(overflow);
    seen.push_back(s.scale());
  }
  return seen;
}

TEST(LossScaler, DoublesAtEveryWindowOfGoodSteps) {
  LossScaler s(
      {.dynamic = true, .initial_scale = 1024, .window = 3, .hysteresis = 2, .min_scale = 1});
  // No overflow: doubled at steps 3 and 6, as DeepSpeed's ZeRO optimizers do.
  EXPECT_EQ(scales_after(s, std::vector<bool>(7, false)),
            (std::vector<double>{1024, 1024, 2048, 2048, 2048, 4096, 4096}));
}

TEST(LossScaler, HalvesOnOverflowAndDoublesAfterAWindow) {
  LossScaler s(
      {.dynamic = true, .initial_scale = 1024, .window = 3, .hysteresis = 1, .min_scale = 1});
  // good -> 1024; overflow -> 512; the third good step after it -> 1024, the fourth keeps it;
  // two overflows -> 512, 256.
  EXPECT_EQ(scales_after(s, {false, true, false, false, false, false, true, true}),
            (std::vector<double>{1024, 512, 512, 512, 1024, 1024, 512, 256}));
}

// DeepSpeed's DynamicLossScaler (deepspeed/runtime/fp16/loss_scaler.py), transcribed line by line
// from __init__ (cur_iter = 0, last_overflow_iter = -1, cur_hysteresis = delayed_shift) and
// update_scale, which ZeRO stages 1-3 call once per step whether or not it is skipped
// (stage_1_and_2.py step(), stage3.py _overflow_check_and_loss_scale_update()); scale_factor 2,
// consecutive_hysteresis false (zinf refuses true). Where DeepSpeed raises "Current loss scale
// already at minimum" (raise_error_at_min_scale) this records it in `raises` and goes on as zinf
// does, with the scale at min_scale.
struct DeepSpeedRule {
  double cur_scale;
  std::int64_t scale_window;
  double min_scale;
  int delayed_shift;
  int cur_hysteresis;
  std::int64_t cur_iter = 0;
  std::int64_t last_overflow_iter = -1;
  bool raises = false;
  DeepSpeedRule(double init_scale, std::int64_t window, int hysteresis, double min)
      : cur_scale(init_scale),
        scale_window(window),
        min_scale(min),
        delayed_shift(hysteresis),
        cur_hysteresis(hysteresis) {}
  void update_scale(bool overflow) {
    raises = false;
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        if (cur_scale == min_scale) raises = true;
        cur_scale = std::max(cur_scale / 2.0, min_scale);
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if ((cur_iter - last_overflow_iter) % scale_window == 0) {
        cur_hysteresis = delayed_shift;
        cur_scale *= 2.0;
      }
    }
    cur_iter += 1;
  }
};

// The rule zinf followed before (DeepSpeed's stage-0 FP16_Optimizer timing): the count restarts
// at 1 on a raise, which comes when it passes the window. What it saved is what a checkpoint of
// that version holds.
struct PreviousRule {
  double scale;
  std::int64_t window;
  int hysteresis;
  double min_scale;
  int hysteresis_left;
  std::int64_t good_steps = 0;
  void update(bool overflow) {
    if (overflow) {
      good_steps = 0;
      if (hysteresis_left <= 1) {
        scale = std::max(scale / 2.0, min_scale);
      } else {
        --hysteresis_left;
      }
      return;
    }
    if (++good_steps > window) {
      scale *= 2.0;
      good_steps = 1;
      hysteresis_left = hysteresis;
    }
  }
};

// One random run's settings: windows 1-5, hysteresis 1-3, and a start on, above or below the
// floor, with overflows drawn at a rate of the trial's own, in bursts or alone.
struct Trial {
  std::int64_t window;
  int hysteresis;
  double min_scale;
  double initial_scale;
  double p_overflow;
  double p_repeat;  // the chance that an overflow follows an overflow
};

Trial draw_trial(std::mt19937_64& rng) {
  const double mins[] = {1.0, 0.25, 3.0};
  Trial t;
  t.window = 1 + static_cast<std::int64_t>(rng() % 5);
  t.hysteresis = 1 + static_cast<int>(rng() % 3);
  t.min_scale = mins[rng() % 3];
  t.initial_scale = std::ldexp(1.0, static_cast<int>(rng() % 8) - 2);  // 1/4 .. 32
  t.p_overflow = 0.05 + 0.5 * static_cast<double>(rng() % 1000) / 1000.0;
  t.p_repeat = static_cast<double>(rng() % 1000) / 1000.0;
  return t;
}

std::vector<bool> draw_overflows(std::mt19937_64& rng, const Trial& t, int steps) {
  std::vector<bool> out;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int i = 0; i < steps; ++i) {
    const bool after_overflow = !out.empty() && out.back();
    out.push_back(u(rng) < (after_overflow ? t.p_repeat : t.p_overflow));
  }
  return out;
}

LossScaler make_scaler(const Trial& t) {
  return LossScaler({.dynamic = true,
                     .initial_scale = t.initial_scale,
                     .window = t.window,
                     .hysteresis = t.hysteresis,
                     .min_scale = t.min_scale});
}

TEST(LossScaler, FollowsDeepSpeedsRuleOverRandomRuns) {
  const std::uint64_t seed = 20261205;
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 400; ++trial) {
    const Trial t = draw_trial(rng);
    const std::vector<bool> overflows = draw_overflows(rng, t, 200);
    LossScaler ours = make_scaler(t);
    DeepSpeedRule ref(t.initial_scale, t.window, t.hysteresis, t.min_scale);
    for (std::size_t step = 0; step < overflows.size(); ++step) {
      const bool stuck = overflows[step] && ours.at_floor();
      ours.update(overflows[step]);
      ref.update_scale(overflows[step]);
      ASSERT_EQ(ours.scale(), ref.cur_scale)
          << "seed " << seed << " trial " << trial << " step " << step + 1 << " window " << t.window
          << " hysteresis " << t.hysteresis << " min " << t.min_scale;
      ASSERT_EQ(ours.hysteresis_left(), ref.cur_hysteresis)
          << "seed " << seed << " trial " << trial << " step " << step + 1;
      ASSERT_EQ(stuck, ref.raises) << "seed " << seed << " trial " << trial << " step " << step + 1;
      ASSERT_EQ(ours.good_steps(), ref.cur_iter - ref.last_overflow_iter - 1)
          << "seed " << seed << " trial " << trial << " step " << step + 1;
    }
  }
}

// A scaler put back from its accessors at any step goes on exactly as the one that was saved.
TEST(LossScaler, ARestoredScalerContinuesAsTheSavedOne) {
  const std::uint64_t seed = 77031;
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const Trial t = draw_trial(rng);
    const std::vector<bool> overflows = draw_overflows(rng, t, 120);
    const std::size_t save_at = rng() % overflows.size();
    LossScaler whole = make_scaler(t);
    DeepSpeedRule ref(t.initial_scale, t.window, t.hysteresis, t.min_scale);
    for (std::size_t step = 0; step < save_at; ++step) {
      whole.update(overflows[step]);
      ref.update_scale(overflows[step]);
    }
    LossScaler resumed = make_scaler(t);
    resumed.restore(whole.scale(), whole.good_steps(), whole.hysteresis_left());
    for (std::size_t step = save_at; step < overflows.size(); ++step) {
      whole.update(overflows[step]);
      resumed.update(overflows[step]);
      ref.update_scale(overflows[step]);
      ASSERT_EQ(resumed.scale(), ref.cur_scale)
          << "seed " << seed << " trial " << trial << " saved after " << save_at << " step "
          << step + 1;
      ASSERT_EQ(resumed.hysteresis_left(), ref.cur_hysteresis)
          << "seed " << seed << " trial " << trial << " step " << step + 1;
      ASSERT_EQ(resumed.good_steps(), whole.good_steps())
          << "seed " << seed << " trial " << trial << " step " << step + 1;
    }
  }
}

// A state saved by the previous rule (its scale, its count, its hysteresis left) goes on as
// DeepSpeed's rule would from that scale and hysteresis with the run's own overflows: that count
// and the good steps since the last overflow differ by a multiple of the window.
TEST(LossScaler, AStateSavedByThePreviousRuleResumesOnDeepSpeedsSchedule) {
  const std::uint64_t seed = 5150;
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const Trial t = draw_trial(rng);
    const std::vector<bool> overflows = draw_overflows(rng, t, 120);
    const std::size_t save_at = rng() % overflows.size();
    PreviousRule previous{.scale = t.initial_scale,
                          .window = t.window,
                          .hysteresis = t.hysteresis,
                          .min_scale = t.min_scale,
                          .hysteresis_left = t.hysteresis};
    DeepSpeedRule ref(t.initial_scale, t.window, t.hysteresis, t.min_scale);
    for (std::size_t step = 0; step < save_at; ++step) {
      previous.update(overflows[step]);
      ref.update_scale(overflows[step]);
    }
    LossScaler resumed = make_scaler(t);
    resumed.restore(previous.scale, previous.good_steps, previous.hysteresis_left);
    ref.cur_scale = previous.scale;
    ref.cur_hysteresis = previous.hysteresis_left;
    for (std::size_t step = save_at; step < overflows.size(); ++step) {
      resumed.update(overflows[step]);
      ref.update_scale(overflows[step]);
      ASSERT_EQ(resumed.scale(), ref.cur_scale)
          << "seed " << seed << " trial " << trial << " saved after " << save_at << " step "
          << step + 1 << " window " << t.window;
      ASSERT_EQ(resumed.hysteresis_left(), ref.cur_hysteresis)
          << "seed " << seed << " trial " << trial << " step " << step + 1;
    }
  }
}

TEST(LossScaler, HysteresisToleratesOverflowsBeforeLowering) {
  LossScaler s(
      {.dynamic = true, .initial_scale = 64, .window = 100, .hysteresis = 3, .min_scale = 1});
  // The third overflow lowers the scale; the hysteresis is used up until a raise refills it.
  EXPECT_EQ(scales_after(s, {true, true, true, true}), (std::vector<double>{64, 64, 32, 16}));
  // Good steps between overflows do not refill it either: only a raise does.
  LossScaler t(
      {.dynamic = true, .initial_scale = 64, .window = 3, .hysteresis = 2, .min_scale = 1});
  EXPECT_EQ(scales_after(t, {true, false, false, true, false, false, false, true, true}),
            (std::vector<double>{64, 64, 64, 32, 32, 32, 64, 64, 32}));
}

TEST(LossScaler, NeverBelowMinAndStaticNeverMoves) {
  LossScaler s(
      {.dynamic = true, .initial_scale = 4, .window = 10, .hysteresis = 1, .min_scale = 2});
  EXPECT_FALSE(s.at_floor());
  s.update(true);
  EXPECT_EQ(s.scale(), 2);
  EXPECT_TRUE(s.at_floor());
  for (int i = 0; i < 4; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 2);
  // A start below min_scale is not at the floor: DeepSpeed lifts the scale to min_scale there.
  LossScaler below(
      {.dynamic = true, .initial_scale = 1, .window = 10, .hysteresis = 1, .min_scale = 2});
  EXPECT_FALSE(below.at_floor());
  below.update(true);
  EXPECT_EQ(below.scale(), 2);
  LossScaler fixed(
      {.dynamic = false, .initial_scale = 128, .window = 1, .hysteresis = 1, .min_scale = 1});
  fixed.update(true);
  fixed.update(false);
  fixed.update(false);
  EXPECT_EQ(fixed.scale(), 128);
  EXPECT_FALSE(fixed.at_floor());
}

}  // namespace
}  // namespace zinf
