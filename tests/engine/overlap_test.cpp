// The overlapped step (zinf.overlap_step, on by default) gives the same bits as the sequential
// one: every value each forward pass gathers, every step's norm, clipping, loss scale and skip,
// and the final masters, over world 1 and 4, stages 1-3, the optimizer state in host memory and
// on NVMe (and, at stage 3, the parameter shards in host memory and on NVMe), with and without
// clipping, bf16 and fp16 with dynamic loss scaling and a step skipped on overflow; and the same
// for a backward that reduces while the pass still reads gradients (OverlapBackward). Without
// clipping and loss scaling at stages 2 and 3 the pass begins during the backward and updates
// each part as its gradients are final (StepReport::in_backward, checked in every such case);
// with them it begins there too but only reads ahead until step() decides the step, and a step
// skipped on overflow calls it off (StepReport::read_ahead, checked likewise).
// overlap_slow_test.cpp runs both matrices for 200 steps (OVERLAP_STEPS, OVERLAP_SUITE,
// OVERLAP_BACKWARD_SUITE).
#include <gtest/gtest.h>

#include <cstdio>

#include "engine_test_util.hpp"
#include "overlap_test_util.hpp"

namespace zinf {
namespace {

using overlap_test::OverlapCase;
using overlap_test::OverlapRun;

std::vector<OverlapCase> overlap_matrix() {
  std::vector<OverlapCase> cases;
  for (int world : {1, 4}) {
    for (int stage : {1, 2, 3}) {
      for (OffloadDevice opt : {OffloadDevice::kHost, OffloadDevice::kNvme}) {
        for (bool clip : {false, true}) {
          for (DType dtype : {DType::kBF16, DType::kF16}) {
            cases.push_back({world, stage, opt, OffloadDevice::kNone, clip, dtype});
          }
        }
      }
    }
    // Clipping by the previous step's coefficient (zinf.clip_from_previous_step, in both runs):
    // the pass begins during the backward as without clipping.
    for (int stage : {2, 3}) {
      for (OffloadDevice opt : {OffloadDevice::kHost, OffloadDevice::kNvme}) {
        cases.push_back({world, stage, opt, OffloadDevice::kNone, true, DType::kBF16,
                         /*backward_only=*/false, /*clip_previous=*/true});
      }
    }
    // Stage 3 with the parameter shards off the device: the pass writes them in host memory or
    // to NVMe while the next forward reads the ones already written.
    for (OffloadDevice params : {OffloadDevice::kHost, OffloadDevice::kNvme}) {
      for (bool clip : {false, true}) {
        cases.push_back({world, 3, OffloadDevice::kNvme, params, clip, DType::kBF16});
      }
    }
  }
  return cases;
}

#ifndef OVERLAP_STEPS
#define OVERLAP_STEPS 10
#define OVERLAP_SUITE OverlapStep
#define OVERLAP_BACKWARD_SUITE OverlapBackward
#endif

class OVERLAP_SUITE : public ::testing::TestWithParam<OverlapCase> {};

TEST_P(OVERLAP_SUITE, SameBitsAsTheSequentialStep) {
  const OverlapCase c = GetParam();
  const int steps = OVERLAP_STEPS;
  const int inf_step = c.dtype == DType::kF16 ? 4 : 0;
  const std::uint64_t seed = 1700 + static_cast<std::uint64_t>(c.world * 10 + c.stage);
  std::printf("seed %llu, %d steps\n", static_cast<unsigned long long>(seed), steps);
  engine_test::ScratchDir dir("overlap_" + overlap_test::case_name(c));
  Result<OverlapRun> sequential =
      overlap_test::run_case(c, /*overlap=*/false, steps, inf_step, seed, dir.path());
  ASSERT_TRUE(sequential.is_ok()) << sequential.status().to_string();
  Result<OverlapRun> overlapped =
      overlap_test::run_case(c, /*overlap=*/true, steps, inf_step, seed, dir.path());
  ASSERT_TRUE(overlapped.is_ok()) << overlapped.status().to_string();
  for (std::size_t r = 0; r < overlapped->reports.size(); ++r) {
    for (const StepReport& rep : overlapped->reports[r]) {
      ASSERT_TRUE(rep.overlapped) << "rank " << r << " step " << rep.step;
      // From the first step on (gradient_accumulation_steps is 2: declared). A skipped step
      // reports the step count before it: its position in the run is what counts.
      const auto step = static_cast<std::int64_t>(&rep - overlapped->reports[r].data()) + 1;
      ASSERT_EQ(rep.in_backward, overlap_test::in_backward_at(c, step))
          << "rank " << r << " step " << step;
      ASSERT_EQ(rep.read_ahead, overlap_test::read_ahead_at(c, step))
          << "rank " << r << " step " << step;
    }
    for (const StepReport& rep : sequential->reports[r]) {
      ASSERT_FALSE(rep.overlapped);
      ASSERT_FALSE(rep.in_backward);
      ASSERT_FALSE(rep.read_ahead);
    }
  }
  if (inf_step > 0) {
    // The overflow was seen: the run has a skipped step (the same one in both, checked below).
    EXPECT_TRUE(sequential->reports[0][inf_step - 1].skipped);
  }
  EXPECT_EQ(overlap_test::first_difference(*sequential, *overlapped), "");
}

INSTANTIATE_TEST_SUITE_P(Matrix, OVERLAP_SUITE, ::testing::ValuesIn(overlap_matrix()),
                         [](const auto& info) { return overlap_test::case_name(info.param); });

// The backward of step t+1 beside pass t: reduce_gradients() into a group waits only until the
// pass has read that group's gradients, then zeroes them. Each step here reduces right after the
// previous step() returned, last module first (the pass reads it last), so a reduction that did
// not wait would add into gradients the pass has yet to read, or zero them.
std::vector<OverlapCase> backward_cases() {
  std::vector<OverlapCase> cases;
  for (int world : {1, 4}) {
    for (int stage : {1, 2, 3}) {
      for (OffloadDevice opt : {OffloadDevice::kHost, OffloadDevice::kNvme}) {
        for (bool clip : {false, true}) {
          cases.push_back({world, stage, opt, OffloadDevice::kNone, clip, DType::kBF16,
                           /*backward_only=*/true});
        }
      }
    }
  }
  return cases;
}

class OVERLAP_BACKWARD_SUITE : public ::testing::TestWithParam<OverlapCase> {};

TEST_P(OVERLAP_BACKWARD_SUITE, SameBitsAsTheSequentialStep) {
  const OverlapCase c = GetParam();
  const int steps = OVERLAP_STEPS;
  const std::uint64_t seed = 1800 + static_cast<std::uint64_t>(c.world * 10 + c.stage);
  std::printf("seed %llu, %d steps\n", static_cast<unsigned long long>(seed), steps);
  engine_test::ScratchDir dir("overlap_" + overlap_test::case_name(c));
  Result<OverlapRun> sequential =
      overlap_test::run_case(c, /*overlap=*/false, steps, 0, seed, dir.path());
  ASSERT_TRUE(sequential.is_ok()) << sequential.status().to_string();
  Result<OverlapRun> overlapped =
      overlap_test::run_case(c, /*overlap=*/true, steps, 0, seed, dir.path());
  ASSERT_TRUE(overlapped.is_ok()) << overlapped.status().to_string();
  for (const StepReport& rep : overlapped->reports[0]) {
    ASSERT_TRUE(rep.overlapped);
    ASSERT_EQ(rep.in_backward, overlap_test::in_backward_at(c, rep.step)) << "step " << rep.step;
    ASSERT_EQ(rep.read_ahead, overlap_test::read_ahead_at(c, rep.step)) << "step " << rep.step;
  }
  EXPECT_EQ(overlap_test::first_difference(*sequential, *overlapped), "");
}

INSTANTIATE_TEST_SUITE_P(Matrix, OVERLAP_BACKWARD_SUITE, ::testing::ValuesIn(backward_cases()),
                         [](const auto& info) { return overlap_test::case_name(info.param); });

}  // namespace
}  // namespace zinf
