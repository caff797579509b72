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
// 1820·2048 = 3,727,360 parameters (18 B each), 1074 of them, and a 1 GiB pool, with the
// gradients in host memory at 1000 GB/s each way the drive reads 12·4e9 = 48 GB in 0.048 s and
// writes 14·4e9 = 56 GB in 0.056 s; each sub-group's update, 6/1074 s, is the longest stage, so
// the pass takes 1073·6/1074 + (6 + 0.104)/1074 = 6.000097 s, of which c·6 = 6 s hides (not the
// backward's 4 s, 4.5 s with checkpointing): step = 6 + 6.000097 − 6 = 6.000097 s. With the
// gradients spilled (read 16·4e9 = 64 GB, 0.064 s: 6.000112 s) the engine's pass starts at
// step(), as a plan's does: it meets the next forward only, 1/3 of 6 s, 2 s (1/4 with
// checkpointing, 1.5 s).
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
  spec.half_on_nvme = true;
  p.nvme_read_gbps = 1000;
  p.nvme_write_gbps = 1000;
  const double pass_s = (1073.0 * 6.0 + 6.0 + 0.048 + 0.056) / 1074.0;
  ASSERT_NEAR(pass_s, 6.000097, 1e-6);
  for (const bool checkpoint : {false, true}) {
    spec.checkpoint_activations = checkpoint;
    spec.grads_on_nvme = false;
    t = predict_optimizer_step(spec, p);
    EXPECT_EQ(t.sub_groups, 1074u) << checkpoint;
    EXPECT_NEAR(t.optimizer_step_s, pass_s, 1e-9) << checkpoint;
    EXPECT_NEAR(t.optimizer_hidden_s, 6.0, 1e-9) << checkpoint;
    EXPECT_NEAR(t.step_s, pass_s, 1e-9) << checkpoint;
    spec.grads_on_nvme = true;
    t = predict_optimizer_step(spec, p);
    EXPECT_NEAR(t.optimizer_step_s, 6.000112, 1e-6) << checkpoint;
    EXPECT_NEAR(t.optimizer_hidden_s, checkpoint ? 1.5 : 2.0, 1e-9) << checkpoint;
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
// TFLOP/s exactly C = 1 s, its forward F = (2·P + 4·L·h·s)·s a third, 1/3 s. A rank's shard is
// Pr = 1e9; Sg = 2.5e8 cuts it into n = 4 sub-groups, which the 8 ranks step together: reads
// 12·P = 96 GB at 240 GB/s, 0.4 s in all, r = 0.1 s a sub-group; writes the same, w = 0.1 s;
// the update 30·P = 240 GB at 2400 GB/s, 0.1 s, u = 0.025 s; 4 buffers. The pipeline is
// (n − 1)·max(r + w, u, (r + u + w)/4) + r + u + w = 3·0.2 + 0.225: UW = 0.825 s (the uploads,
// 2·Pr at 1000 GB/s, 2 ms, run beside it). The all-gather G = 2·P·7/8 at 100 GB/s = 0.14 s (the
// reduce-scatters, 4·P·7/8 = 0.28 s a micro-batch, hide behind C).
//   A = min(c, 2/3)·C = 2/3 s of UW hides in the backward, but the first sub-group, whose groups
//   the backward makes final last, is updated only after it: its update S = u = 0.025 s is left
//   (only the update waits: its read went on in the backward, its half output is handed over
//   once its writes are submitted, and the next forward waits for the half shards alone). UW − A
//   = 0.158333 s is more, so R = 0.158333 s, f = R/UW = 0.191919. B = min(c·C, F) = 1/3 s;
//   X = max(G, B) = 1/3 s. The next forward: its first f of the modules wait for the pass and
//   their all-gathers, R + f·G = 0.185202 s (longer than S + f·X = 0.088973 s), and the rest,
//   written in the backward, (1 − f)·X = 0.269360 s: 0.454562 s where alone it takes 1/3 s. So
//   0.121229 s shows: step 1.121229 s. With c = 1 the same: the pass opens in the backward, so
//   it has the backward's 2/3 of c and the next forward, one micro-batch.
// The drive at 24 GB/s (r = w = 1 s: UW = 3·2 + 2.025 = 8.025 s): R = 8.025 − 2/3 = 7.358333 s,
// more than S, f = R/UW = 0.916926; the next forward max(R + f·G = 7.486703, S + f·X =
// 0.330642) + (1 − f)·X = 0.027691: 7.514394 s, 7.181061 s shows: step 8.181061 s.
// Where S matters (UW − A < S, R = S): at 2400 GB/s (r = w = 0.01 s, u = 0.025 s: UW = 3·0.025 +
// 0.045 = 0.12 s) UW fits the backward, but S = 0.025 s does not: f = S/UW = 0.208333, the next
// forward max(S + f·G = 0.054167, S + f·X = 0.094444) + (1 − f)·X = 0.263889: 0.358333 s, S
// shows, step 1.025 s. With one sub-group a rank (Sg = 2^30 > Pr) S is the whole update,
// u = 0.1 s, but the sub-group's read ran in the backward: UW = 0.04 + 0.1 + 0.04 = 0.18 s,
// R = S = 0.1 s, f = 0.1/0.18 = 0.555556, the next forward max(0.1 + f·G = 0.177778,
// 0.1 + f·X = 0.285185) + (1 − f)·X = 0.148148: 0.433333 s, step 1.1 s. At 240 GB/s, UW = 0.9 s:
// R = max(0.9 − 2/3, 0.1) = 0.233333 s, f = 0.259259, max(R + f·G = 0.269630, S + f·X =
// 0.186420) + (1 − f)·X = 0.246914: 0.516543 s, step 1.183210 s.
// With 3 micro-batches a step the pass still meets one micro-batch, the last one's backward and
// the next step's first forward (the next forward's gathers wait for it; nothing after them
// does): step 3 + 0.121229 s; the 24 GB/s drive's 8.025 s pass shows 7.181061 s over the 3 s of
// compute.
TEST(TimeModelWindow, StreamedPassRunsOnIntoTheNextForwardModuleByModule) {
  ModelShape m = custom_model(8'000'000'000, 1, 128);
  TrainingShape tr;
  tr.seq_len = 1000;
  EngineSetup s;
  s.stage = 2;
  s.world_size = s.ranks_per_machine = 8;
  s.optimizer = OffloadDevice::kNvme;
  s.overlap_step = true;
  MachineProfile p;
  p.mem_adam_gbps = 2400;
  p.h2d_gbps = 1000;
  p.gpu_tflops = 48.001536;
  p.gpu_link_gbps = 100;
  struct Case {
    std::uint64_t micro_batches, sub_groups;
    double fraction, drive_gbps, pass_s, step_s;
  };
  for (const Case& k :
       {Case{1, 4, 2.0 / 3.0, 240, 0.825, 1.121229}, Case{1, 4, 1.0, 240, 0.825, 1.121229},
        Case{1, 4, 2.0 / 3.0, 24, 8.025, 8.181061}, Case{1, 4, 2.0 / 3.0, 2400, 0.12, 1.025},
        Case{1, 1, 2.0 / 3.0, 2400, 0.18, 1.1}, Case{1, 1, 2.0 / 3.0, 240, 0.9, 1.183210},
        Case{3, 4, 2.0 / 3.0, 240, 0.825, 3.121229}, Case{3, 4, 2.0 / 3.0, 24, 8.025, 10.181061}}) {
    SCOPED_TRACE(testing::Message()
                 << "c " << k.fraction << " drive " << k.drive_gbps << " micro-batches "
                 << k.micro_batches << " sub-groups " << k.sub_groups);
    s.overlap_compute_fraction = k.fraction;
    s.sub_group_params = k.sub_groups == 1 ? std::uint64_t{1} << 30 : 250'000'000;
    tr.grad_accum_steps = k.micro_batches;
    p.nvme_read_gbps = p.nvme_write_gbps = k.drive_gbps;
    const StepPrediction t = predict_step(m, tr, s, p);
    ASSERT_NEAR(t.compute_s, 1.0, 1e-12);
    ASSERT_NEAR(t.forward_backward_s, static_cast<double>(k.micro_batches), 1e-12);
    ASSERT_EQ(t.sub_groups, k.sub_groups);
    ASSERT_NEAR(t.pipeline_s, k.pass_s, 1e-12);
    ASSERT_NEAR(t.publish_gather_s, 0.14, 1e-12);
    EXPECT_NEAR(t.optimizer_step_s, k.pass_s + 0.14, 1e-12);
    EXPECT_NEAR(t.step_s, k.step_s, 1e-6);
    EXPECT_NEAR(t.optimizer_hidden_s, t.forward_backward_s + t.optimizer_step_s - t.step_s, 1e-12);
  }
}

}  // namespace
}  // namespace zinf::plan
