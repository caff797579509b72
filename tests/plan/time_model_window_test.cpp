// The windows the optimizer pass hides in. Where the half output does not stream (the optimizer
// state in host memory): the update U only in the backward of the pass's micro-batch, and only
// where the pass updates there; the writes W (and stage 1-2's all-gather G) in the next forward.
// --step-only counts the same as a plan with a model. Where it streams and the pass updates in
// the backward: the backward's share of c, then on into the next forward, module by module.
#include <gtest/gtest.h>

#include "plan/model.hpp"
#include "plan/time_model.hpp"

namespace zinf::plan {
namespace {

// --step-only --tier host, 1e9 parameters, the update at 20 GB/s: U = 30·1e9 / 20e9 = 1.5 s, the
// optimizer step. Around it 6 s of compute in one micro-batch, c = 2/3. With exact clipping or
// loss scaling the pass updates only after step(), and the next forward's first gather of a
// module with trained parameters waits for the whole update: nothing hides, step = 6 + 1.5 = 7.5 s
// (where a cap at the forward's share would hide min(1.5, 6/3) = 1.5 s, step 6 s). Without them U
// hides behind c·6 = 4 s: all of it, step 6 s.
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

// --step-only --tier host, 4e9 parameters at 20 GB/s: U = 30·4e9 / 20e9 = 6 s; 6 s of compute in
// one micro-batch, c = 1. U waits for nothing but hides only in the backward: 2/3 of the
// micro-batch (1 − 1/3 the forward), 4 s; 3/4 with checkpointing (the forward 2/8), 4.5 s. So
// step = 6 + 6 − 4 = 8 s, and 7.5 s with checkpointing (where the whole micro-batch would hide
// all 6 s, step 6 s). On the NVMe tier the pass streams its writes and the engine lets it run on
// into the next forward: c·mb stays the window there. With the default 64 MiB sub-groups of
// 1820·2048 = 3,727,360 parameters (18 B each), 1074 of them, and a 1 GiB pool of 16 blocks, at
// 1000 GB/s each way the drive reads 16·4e9 = 64 GB in 0.064 s and writes 14·4e9 = 56 GB in
// 0.056 s; each sub-group's update, 6/1074 s, is the longest stage, so the pass takes
// 1073·6/1074 + (6 + 0.12)/1074 = 6.000112 s, of which c·6 = 6 s hides (not the backward's 4 s,
// 4.5 s with checkpointing): step = 6 + 6.000112 − 6 = 6.000112 s.
TEST(TimeModelWindow, StepOnlyHostTierUpdateHidesInTheBackwardOnly) {
  StepOnlySpec spec;
  spec.params = 4'000'000'000;
  spec.tier = OffloadDevice::kHost;
  spec.grads_on_nvme = false;
  spec.half_on_nvme = false;
  spec.compute_s = 6.0;
  spec.overlap_fraction = 1.0;
  MachineProfile p;
  p.mem_adam_gbps = 20;
  spec.checkpoint_activations = false;
  StepPrediction t = predict_optimizer_step(spec, p);
  EXPECT_NEAR(t.optimizer_step_s, 6.0, 1e-12);
  EXPECT_NEAR(t.optimizer_hidden_s, 4.0, 1e-12);
  EXPECT_NEAR(t.step_s, 8.0, 1e-12);
  spec.checkpoint_activations = true;
  t = predict_optimizer_step(spec, p);
  EXPECT_NEAR(t.optimizer_hidden_s, 4.5, 1e-12);
  EXPECT_NEAR(t.step_s, 7.5, 1e-12);

  spec.tier = OffloadDevice::kNvme;
  spec.grads_on_nvme = true;
  spec.half_on_nvme = true;
  p.nvme_read_gbps = 1000;
  p.nvme_write_gbps = 1000;
  const double pass_s = (1073.0 * 6.0 + 6.0 + 0.064 + 0.056) / 1074.0;
  for (const bool checkpoint : {false, true}) {
    spec.checkpoint_activations = checkpoint;
    t = predict_optimizer_step(spec, p);
    EXPECT_EQ(t.sub_groups, 1074u) << checkpoint;
    EXPECT_NEAR(t.optimizer_step_s, pass_s, 1e-9) << checkpoint;
    EXPECT_NEAR(t.optimizer_hidden_s, 6.0, 1e-9) << checkpoint;
    EXPECT_NEAR(t.step_s, pass_s, 1e-9) << checkpoint;
  }
}

// llama-2-7b (P = 6,738,415,616) on one 2048-token sequence at stage 3, one rank, at 10 TFLOP/s:
// C = (6·P + 12·L·h·s)·2048 / 1e13 = 8.940 s a micro-batch, its forward F = C/3 = 2.980 s, the
// backward 2C/3 = 5.960 s. The optimizer state in host memory at 20 GB/s: U = 30·P / 20e9 =
// 10.108 s; the half params on NVMe (read 6 GB/s, write 4 GB/s): the fetch 4·P / 6e9 = 4.492 s
// on the drive, W = 2·P / 4e9 = 3.369 s. With c = 1 and the pass updating in the backward:
//   U hides in min(c, 2/3)·C = 5.960 s (the next forward's first trained gather waits for all of
//     U, so U hides nowhere past the backward);
//   W hides in min(c·(C − 4.492), F − 4.492/2) = min(4.448, 0.734) = 0.734 s;
//   hidden 6.694 s, and U + W − hidden = 13.477 − 6.694 = 6.783 s shows (where U's window of c·C
//   hid 8.940 + 0.734 = 9.674 s, more than the micro-batch, and 3.803 s showed).
TEST(TimeModelWindow, UpdateHidesInTheBackwardOnlyWhereWritesFollowIt) {
  const ModelShape m = *find_model_preset("llama-2-7b");
  TrainingShape tr;
  tr.seq_len = 2048;
  EngineSetup s;
  s.stage = 3;
  s.optimizer = OffloadDevice::kHost;
  s.params = OffloadDevice::kNvme;
  s.overlap_step = true;
  s.overlap_compute_fraction = 1.0;
  MachineProfile p;
  p.mem_adam_gbps = 20;
  p.nvme_read_gbps = 6;
  p.nvme_write_gbps = 4;
  p.gpu_tflops = 10;
  const StepPrediction t = predict_step(m, tr, s, p);
  ASSERT_NEAR(t.compute_s, 8.940, 1e-3);
  ASSERT_NEAR(t.pipeline_s, 10.108, 1e-3);
  ASSERT_NEAR(t.optimizer_step_s, 13.477, 1e-3);
  EXPECT_NEAR(t.optimizer_hidden_s, 6.694, 1e-3);
  EXPECT_NEAR(t.step_s, t.forward_backward_s + 6.783, 1e-3);
  // Never more than the micro-batch the pass meets.
  EXPECT_LE(t.optimizer_hidden_s, t.compute_s);
}

// The streamed pass (the optimizer state on NVMe) updating in the backward, at stage 2 on 8 ranks
// of one machine: a custom model of P = 8e9 parameters (1 layer of hidden 128, 1000-token
// sequences), whose micro-batch computes (6·P + 12·L·h·s)·s = 4.8001536e13 FLOPs, at 48.001536
// TFLOP/s exactly C = 1 s, its forward F = (2·P + 4·L·h·s)·s a third, 1/3 s. One sub-group a rank
// (Sg = 2^30 > Pr = 1e9), so the pass is its read, update and write one after the other, the
// machine's 8 ranks together: reads 12·P = 96 GB at 240 GB/s, 0.4 s; writes 96 GB at 240 GB/s,
// 0.4 s; the update 30·P = 240 GB at 2400 GB/s, 0.1 s: UW = 0.9 s (the uploads, 2·Pr at 1000
// GB/s, 2 ms, run beside it). The all-gather G = 2·P·7/8 at 100 GB/s = 0.14 s (the
// reduce-scatters, 4·P·7/8 = 0.28 s a micro-batch, hide behind C). The optimizer step is
// UW + G = 1.04 s.
//   A = min(c, 2/3)·C = 2/3 s of UW hides in the backward; R = 0.9 − 2/3 = 7/30 s is left, the
//   share f = R/UW = 7/27 of the partition, which the pass then takes from the first sub-group
//   up, the order the next forward gathers in; B = min(c·C, F) = 1/3 s; X = max(G, B) = 1/3 s.
//   The next forward: its first f of the modules wait for the pass, R, and their all-gathers,
//   f·G = 0.0363 s (f·X = 0.0864 s, shorter): 0.26963 s; the rest, written in the backward, at
//   its own pace, (1 − f)·X = 20/81 = 0.24691 s: 0.51654 s where alone it takes 1/3 s. So
//   0.18321 s shows: step = 1 + 0.18321 = 1.18321 s, the pass's critical path from the
//   backward's start (UW + f·G + (1 − f)·X), longer than the compute's 1 s.
// With c = 1 the same: the pass opens in the backward, so it has the backward's 2/3 of c and the
// next forward, one micro-batch (a window c·C = 1 s for UW and the forward's 1/3 s for G again
// hid all 1.04 s: step 1 s, shorter than the pass's 0.9 s followed by the forward it holds up).
// The writes at 24 GB/s (UW = 4 + 0.1 + 4 = 8.1 s): R = 8.1 − 2/3 = 7.43333 s, f = R/8.1 =
// 0.917695, the next forward max(7.43333 + 0.128477, 0.305898) + 0.082305/3 = 7.589246 s,
// 7.255912 s shows: step 8.255912 s = UW + f·G + (1 − f)·X. And where UW fits the backward (the
// drive at 2400 GB/s: UW = 0.04 + 0.1 + 0.04 = 0.18 s) nothing of it waits: G behind F, step
// C = 1 s. With 3 micro-batches a step the pass still meets one micro-batch, the last one's
// backward and the next step's first forward (the next forward's gathers wait for it; nothing
// after them does): step 3 + 0.18321 s; the 24 GB/s drive's 8.1 s pass shows 7.255912 s over
// the 3 s of compute.
TEST(TimeModelWindow, StreamedPassRunsOnIntoTheNextForwardModuleByModule) {
  ModelShape m = custom_model(8'000'000'000, 1, 128);
  TrainingShape tr;
  tr.seq_len = 1000;
  EngineSetup s;
  s.stage = 2;
  s.world_size = s.ranks_per_machine = 8;
  s.optimizer = OffloadDevice::kNvme;
  s.sub_group_params = std::uint64_t{1} << 30;
  s.overlap_step = true;
  MachineProfile p;
  p.mem_adam_gbps = 2400;
  p.h2d_gbps = 1000;
  p.gpu_tflops = 48.001536;
  p.gpu_link_gbps = 100;
  struct Case {
    std::uint64_t micro_batches;
    double fraction, drive_gbps, pass_s, step_s;
  };
  for (const Case& k :
       {Case{1, 2.0 / 3.0, 240, 0.9, 1.18321}, Case{1, 1.0, 240, 0.9, 1.18321},
        Case{1, 2.0 / 3.0, 24, 8.1, 8.255912}, Case{1, 2.0 / 3.0, 2400, 0.18, 1.0},
        Case{3, 2.0 / 3.0, 240, 0.9, 3.18321}, Case{3, 2.0 / 3.0, 24, 8.1, 10.255912}}) {
    SCOPED_TRACE(testing::Message() << "c " << k.fraction << " drive " << k.drive_gbps
                                    << " micro-batches " << k.micro_batches);
    s.overlap_compute_fraction = k.fraction;
    tr.grad_accum_steps = k.micro_batches;
    p.nvme_read_gbps = p.nvme_write_gbps = k.drive_gbps;
    const StepPrediction t = predict_step(m, tr, s, p);
    ASSERT_NEAR(t.compute_s, 1.0, 1e-12);
    ASSERT_NEAR(t.forward_backward_s, static_cast<double>(k.micro_batches), 1e-12);
    ASSERT_EQ(t.sub_groups, 1u);
    ASSERT_NEAR(t.pipeline_s, k.pass_s, 1e-12);
    ASSERT_NEAR(t.publish_gather_s, 0.14, 1e-12);
    EXPECT_NEAR(t.optimizer_step_s, k.pass_s + 0.14, 1e-12);
    EXPECT_NEAR(t.step_s, k.step_s, 1e-6);
    EXPECT_NEAR(t.optimizer_hidden_s, t.forward_backward_s + t.optimizer_step_s - t.step_s, 1e-12);
  }
}

}  // namespace
}  // namespace zinf::plan
