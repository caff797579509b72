// The windows the optimizer pass hides in, where the half output does not stream (the optimizer
// state in host memory): the update U only in the backward of the pass's micro-batch, and only
// where the pass updates there; the writes W (and stage 1-2's all-gather G) in the next forward.
// --step-only counts the same as a plan with a model.
#include <gtest/gtest.h>

#include "plan/model.hpp"
#include "plan/time_model.hpp"

namespace zinf::plan {
namespace {

// --step-only --tier host, 1e9 parameters, the update at 20 GB/s: U = 30·1e9 / 20e9 = 1.5 s, the
// optimizer step. Around it 6 s of compute in one micro-batch, c = 2/3. With exact clipping or
// loss scaling the pass updates only after step(), and the next forward's first gather waits for
// the whole update: nothing hides, step = 6 + 1.5 = 7.5 s (where a cap at the forward's share
// would hide min(1.5, 6/3) = 1.5 s, step 6 s). Without them U hides behind c·6 = 4 s: all of it,
// step 6 s.
TEST(TimeModelWindow, StepOnlyHostTierUpdateHidesNowhereWithExactClipping) {
  StepOnlySpec spec;
  spec.params = 1'000'000'000;
  spec.tier = OffloadDevice::kHost;
  spec.grads_on_nvme = false;
  spec.half_on_nvme = false;
  spec.compute_s = 6.0;
  MachineProfile p;
  p.mem_adam_gbps = 20;
  for (const bool checkpoint : {false, true}) {
    spec.checkpoint_activations = checkpoint;
    spec.exact_clipping_or_loss_scaling = true;
    StepPrediction t = predict_optimizer_step(spec, p);
    EXPECT_NEAR(t.optimizer_step_s, 1.5, 1e-12);
    EXPECT_NEAR(t.optimizer_hidden_s, 0.0, 1e-12) << checkpoint;
    EXPECT_NEAR(t.step_s, 7.5, 1e-12) << checkpoint;
    spec.exact_clipping_or_loss_scaling = false;
    t = predict_optimizer_step(spec, p);
    EXPECT_NEAR(t.optimizer_hidden_s, 1.5, 1e-12) << checkpoint;
    EXPECT_NEAR(t.step_s, 6.0, 1e-12) << checkpoint;
  }
}

}  // namespace
}  // namespace zinf::plan
