// LossScaler against DeepSpeed's DynamicLossScaler rules, worked by hand.
#include "zero/loss_scaler.hpp"

#include <gtest/gtest.h>

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
  // good -> 1024 (1 good); overflow -> 512 (run reset); 3 good -> 1024 at the third;
  // one more good -> 1024; two overflows -> 512, 256.
  EXPECT_EQ(seen, (std::vector<double>{1024, 512, 512, 512, 1024, 1024, 512, 256}));
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
