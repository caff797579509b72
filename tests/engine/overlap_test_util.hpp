// The overlapped step (zinf.overlap_step) against the sequential one: the same training run
// twice, each rank's values gathered by every forward pass, its step reports and its final
// masters recorded, for the tests to compare bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "zinf/config.hpp"
#include "zinf/engine.hpp"

namespace zinf::overlap_test {

struct OverlapCase {
  int world = 1;
  int stage = 3;
  OffloadDevice optimizer = OffloadDevice::kNvme;
  OffloadDevice params = OffloadDevice::kNone;
  bool clip = false;
  DType dtype = DType::kBF16;  // kF16: fp16 dynamic loss scaling, with a step skipped on overflow
  // No forward pass and no gathers: each step only reduces every module's gradients (computed
  // from the initial values, so they need no gather), in reverse module order right after the
  // previous step() returned, so the reductions meet the pass while it still reads the last
  // groups' gradients.
  bool backward_only = false;
  // With clip: zinf.clip_from_previous_step (both runs).
  bool clip_previous = false;
};

std::string case_name(const OverlapCase& c);

// Whether the case's overlapped steps begin their pass during the backward: no clipping (or the
// previous step's clipping coefficient), no loss scaling (bf16), stage 2 or 3 (the gradients are
// always in host memory here).
inline bool updates_in_backward(const OverlapCase& c) {
  return (!c.clip || c.clip_previous) && c.dtype == DType::kBF16 && c.stage >= 2;
}
// StepReport::in_backward of step `step` (from 1) of an overlapped run of the case: the previous
// step's clipping coefficient needs a previous step.
inline bool in_backward_at(const OverlapCase& c, std::int64_t step) {
  return updates_in_backward(c) && (step > 1 || !c.clip_previous);
}
// StepReport::read_ahead: the other steps at stages 2 and 3 open their pass during the backward
// too, but it only reads ahead until step() (also on a step skipped on overflow).
inline bool read_ahead_at(const OverlapCase& c, std::int64_t step) {
  return c.stage >= 2 && !in_backward_at(c, step);
}

struct OverlapRun {
  // [rank][step - 1]: every value the forward passes of the step gathered, in module order.
  std::vector<std::vector<std::vector<float>>> forward;
  std::vector<std::vector<StepReport>> reports;          // [rank][step - 1]
  std::vector<std::vector<std::vector<float>>> masters;  // [rank][parameter]: read_parameters()
};

// Trains engine_test::make_model(c.dtype, seed) for `steps` steps of 2 micro-batches on c.world
// LocalComm ranks, with zinf.overlap_step = `overlap`. The forward pass gathers each module in
// order right after the previous step() (nothing waits for the step in between), the backward
// gathers them in reverse and hands gradients computed from the values it gathered. With kF16
// the gradients carry the loss scale, and rank 0 hands an inf at step `inf_step` (0: never).
Result<OverlapRun> run_case(const OverlapCase& c, bool overlap, int steps, int inf_step,
                            std::uint64_t seed, const std::string& nvme_dir);

// The first difference between two runs ("" when they are the same bits), in words.
std::string first_difference(const OverlapRun& a, const OverlapRun& b);

}  // namespace zinf::overlap_test
