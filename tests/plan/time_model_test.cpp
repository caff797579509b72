// The time model against hand-worked numbers: the optimizer pipeline's bottleneck and fill, the
// overlap of forward/backward parts (max, not sum), and per-machine sharing of drive and memory.
#include "plan/time_model.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "plan/estimate.hpp"
#include "plan/model.hpp"

namespace zinf::plan {
namespace {

MachineProfile profile(double adam, double read, double write) {
  MachineProfile p;
  p.mem_adam_gbps = adam;
  p.nvme_read_gbps = read;
  p.nvme_write_gbps = write;
  return p;
}

// A bench-step run with state only (master, m, v) on NVMe and sub-groups of exactly 2^24
// parameters: sub_group_bytes counts all 18 B a parameter, so 18·2^24.
StepOnlySpec state_only(std::uint64_t params, std::uint64_t pool_bytes) {
  StepOnlySpec spec;
  spec.params = params;
  spec.tier = OffloadDevice::kNvme;
  spec.sub_group_bytes = 18u << 24;
  spec.pool_bytes = pool_bytes;
  spec.grads_on_nvme = false;
  spec.half_on_nvme = false;
  return spec;
}

// The case the tests of the training step below work by hand: llama-2-7b on 2048-token
// sequences, one micro-batch of one sequence, ZeRO stage 3 on one rank.
struct Llama7b {
  ModelShape m;
  TrainingShape tr;
  EngineSetup s;
};

Llama7b llama_7b_stage3() {
  Llama7b c{*find_model_preset("llama-2-7b"), {}, {}};
  c.tr.seq_len = 2048;
  c.s.stage = 3;
  return c;
}

// llama-2-7b's attention term L·h·s on 2048-token sequences: 32 layers of hidden size 4096.
constexpr double kLlamaAttention = 32.0 * 4096 * 2048;

// One 2048-token sequence through llama-2-7b with `params` parameters, every one trained: 6 FLOPs
// a parameter and token and 12·L·h·s the attention's, of which the forward does 2 and 4·L·h·s.
double llama_flops(double params) { return (6 * params + 12 * kLlamaAttention) * 2048; }
double llama_forward_flops(double params) { return (2 * params + 4 * kLlamaAttention) * 2048; }

// docs/PLAN.md's streamed pass that updates in the backward, written out: of its update and
// writes UW and stage 1-2's all-gather G, the part the backward's window A and the next forward's
// window B hide. The pass does A of UW in the backward, but not the first sub-group's update S
// (its groups final only when the backward ends; its read goes on before); the rest
// R = max(UW − A, S) is the share f = R/UW of the partition the next forward gathers first, so
// that forward runs max(R + f·G, S + f·X) on it, X = max(G, B), and (1 − f)·X on the rest: it
// shows that less B. Each test that uses it checks one case by hand as well.
double streamed_hidden(double uw, double s, double g, double a, double b) {
  const double r = std::max(uw - a, s);
  const double f = uw > 0 ? r / uw : 0.0;
  const double x = std::max(g, b);
  return uw + g - (std::max(r + f * g, s + f * x) + (1 - f) * x - b);
}

// S: the update alone over the machine's ranks, of one sub-group of each.
double first_update(const StepPrediction& t) {
  return t.update_alone_s / static_cast<double>(t.sub_groups);
}

// Of the optimizer step, what the step shows: `exposed_s`, after the forward and backward.
void expect_exposed(const StepPrediction& t, double exposed_s) {
  EXPECT_NEAR(t.optimizer_step_s - t.optimizer_hidden_s, exposed_s, 1e-3);
  EXPECT_NEAR(t.step_s, t.forward_backward_s + exposed_s, 1e-3);
}

TEST(TimeModel, StepOnlyLayoutFollowsTheStateStore) {
  // --sub-group 64MiB: floor(64 MiB / (18 B·2048))·2048 = 3,727,360 params a sub-group. With
  // every piece on NVMe a block holds 4 fp32 pieces of 14,909,440 B (whole pages) and the bf16
  // piece of 7,454,720 B: 67,092,480 B, 16 of them in 1 GiB.
  StepOnlySpec spec;
  spec.params = 1'000'000'000;
  spec.sub_group_bytes = 64u << 20;
  spec.pool_bytes = 1u << 30;
  const StepOnlyLayout l = step_only_layout(spec);
  EXPECT_EQ(l.bytes_per_param, 18u);
  EXPECT_EQ(l.sub_group_params, 3'727'360u);
  EXPECT_EQ(l.sub_groups, 269u);
  EXPECT_EQ(l.block_bytes, 67'092'480u);
  EXPECT_EQ(l.blocks, 16u);
  EXPECT_EQ(l.read_per_param, 16u);
  EXPECT_EQ(l.write_per_param, 14u);
  spec.grads_on_nvme = false;
  spec.half_on_nvme = false;
  EXPECT_EQ(step_only_layout(spec).block_bytes, 3u * 14'909'440u);
  EXPECT_EQ(step_only_layout(spec).read_per_param, 12u);
}

TEST(TimeModel, NvmeBoundStepIsIoPlusOneSubGroupsFill) {
  // 1e9 params, sub-group 2^24, 1 GiB pool -> 5 blocks of 12·2^24 bytes; 60 sub-groups.
  // read 12e9 B at 2 GB/s = 6 s, write 12e9 B at 1 GB/s = 12 s, update 30e9 B at 20 GB/s = 1.5 s.
  // Per sub-group r = 0.1, w = 0.2, u = 0.025: T = r + w = 0.3; step = 59·0.3 + 0.325.
  const StepPrediction t =
      predict_optimizer_step(state_only(1'000'000'000, 1u << 30), profile(20, 2, 1));
  EXPECT_EQ(t.buffers, 5u);
  EXPECT_EQ(t.sub_groups, 60u);
  EXPECT_DOUBLE_EQ(t.io_read_s, 6.0);
  EXPECT_DOUBLE_EQ(t.io_write_s, 12.0);
  EXPECT_DOUBLE_EQ(t.io_alone_s, 18.0);
  EXPECT_DOUBLE_EQ(t.update_alone_s, 1.5);
  EXPECT_NEAR(t.step_s, 59 * 0.3 + 0.325, 1e-9);
  EXPECT_EQ(t.nvme_read_bytes, 12'000'000'000u);
  EXPECT_EQ(t.nvme_write_bytes, 12'000'000'000u);
  // Every piece on NVMe: 16 B read, 14 B written a parameter.
  StepOnlySpec all = state_only(1'000'000'000, 1u << 30);
  all.grads_on_nvme = true;
  all.half_on_nvme = true;
  const StepPrediction a = predict_optimizer_step(all, profile(20, 2, 1));
  EXPECT_DOUBLE_EQ(a.io_alone_s, 16e9 / 2e9 + 14e9 / 1e9);
}

TEST(TimeModel, DuplexRateBoundsReadsAndWritesAtOnce) {
  // The same reads (12e9 B at 2 GB/s alone = 6 s) and writes (12e9 B at 1 GB/s alone = 12 s),
  // on a drive that moves 2.5 GB/s with both at once: io = max(6, 12, 24e9 / 2.5e9 = 9.6) = 12.
  MachineProfile p = profile(20, 2, 1);
  p.nvme_duplex_gbps = 2.5;
  StepPrediction t = predict_optimizer_step(state_only(1'000'000'000, 1u << 30), p);
  EXPECT_DOUBLE_EQ(t.io_alone_s, 12.0);
  // A drive whose reads and writes share 1.6 GB/s: 24e9 / 1.6e9 = 15 s.
  p.nvme_duplex_gbps = 1.6;
  t = predict_optimizer_step(state_only(1'000'000'000, 1u << 30), p);
  EXPECT_DOUBLE_EQ(t.io_alone_s, 15.0);
  // Per sub-group the drive takes io / n = 0.25 s; the first read (0.1) and last write (0.2)
  // are alone: step = 59·0.25 + 0.1 + 0.025 + 0.2.
  EXPECT_NEAR(t.step_s, 59 * 0.25 + 0.325, 1e-9);
}

TEST(TimeModel, CpuBoundStepIsUpdatePlusFill) {
  // Same run with 1 GB/s of memory bandwidth: update 30 s, u = 0.5 per sub-group.
  const StepPrediction t =
      predict_optimizer_step(state_only(1'000'000'000, 1u << 30), profile(1, 2, 1));
  EXPECT_DOUBLE_EQ(t.update_alone_s, 30.0);
  EXPECT_NEAR(t.step_s, 59 * 0.5 + 0.8, 1e-9);
  // Never below max(io, update), never above their sum.
  EXPECT_GE(t.step_s, std::max(t.io_alone_s, t.update_alone_s));
  EXPECT_LE(t.step_s, t.io_alone_s + t.update_alone_s);
}

TEST(TimeModel, HostTierIsTheUpdateAlone) {
  StepOnlySpec spec;
  spec.params = 256'000'000;
  spec.tier = OffloadDevice::kHost;
  const StepPrediction t = predict_optimizer_step(spec, profile(12, 0, 0));
  EXPECT_DOUBLE_EQ(t.io_alone_s, 0.0);
  EXPECT_DOUBLE_EQ(t.step_s, 256e6 * 30 / 12e9);
  EXPECT_EQ(t.nvme_read_bytes, 0u);
}

TEST(TimeModel, OneSubGroupRunsSerially) {
  // A sub-group as large as the run leaves nothing to overlap: read + update + write.
  const StepPrediction t =
      predict_optimizer_step(state_only(1 << 24, std::uint64_t{12} << 26), profile(10, 2, 1));
  EXPECT_EQ(t.sub_groups, 1u);
  EXPECT_NEAR(t.step_s, t.io_read_s + t.io_write_s + t.update_alone_s, 1e-12);
}

TEST(TimeModel, RanksOfAMachineShareTheDriveAndTheMemory) {
  const ModelShape m = custom_model(8'000'000'000, 32, 4096);
  TrainingShape tr;
  EngineSetup s;
  s.stage = 3;
  s.optimizer = OffloadDevice::kNvme;
  s.sub_group_params = 1 << 24;
  s.buffer_count = 4;
  s.world_size = 8;
  s.ranks_per_machine = 8;
  const StepPrediction one_machine = predict_step(m, tr, s, profile(40, 6, 4));
  s.ranks_per_machine = 1;  // eight machines, one GPU each
  const StepPrediction eight_machines = predict_step(m, tr, s, profile(40, 6, 4));
  EXPECT_NEAR(one_machine.io_alone_s, 8 * eight_machines.io_alone_s, 1e-9);
  EXPECT_NEAR(one_machine.update_alone_s, 8 * eight_machines.update_alone_s, 1e-9);
  // 1e9 params a rank, 8 ranks on one drive: 8·12e9 / 6e9 + 8·12e9 / 4e9.
  EXPECT_NEAR(one_machine.io_alone_s, 96e9 / 6e9 + 96e9 / 4e9, 1e-9);
}

TEST(TimeModel, ForwardBackwardPartsOverlap) {
  auto [m, tr, s] = llama_7b_stage3();
  tr.micro_batch = 4;
  tr.grad_accum_steps = 2;
  s.world_size = 8;
  s.ranks_per_machine = 8;
  s.optimizer = OffloadDevice::kHost;
  s.params = OffloadDevice::kHost;
  MachineProfile p = profile(40, 0, 0);
  p.gpu_tflops = 200;
  p.gpu_link_gbps = 100;
  p.h2d_gbps = 25;
  const StepPrediction t = predict_step(m, tr, s, p);
  const double params = static_cast<double>(param_count(m));
  const double flops = (6 * params + 12.0 * 32 * 4096 * 2048) * 2048 * 4;
  EXPECT_NEAR(t.compute_s, flops / 200e12, 1e-9);
  // Two half all-gathers and the fp32 reduce-scatter (lib/zero/grad_reducer.cpp reduces the
  // gradients in fp32).
  EXPECT_NEAR(t.collectives_s, (2 * 2 + 4) * params * 7 / 8 / 100e9, 1e-9);
  const double shard = static_cast<double>((param_count(m) + 7) / 8);
  EXPECT_NEAR(t.param_fetch_s, 4 * shard / 25e9, 1e-9);
  // The reduced fp32 shard comes down to the host accumulator.
  EXPECT_NEAR(t.grad_offload_s, 4 * shard / 25e9, 1e-9);
  EXPECT_NEAR(t.forward_backward_s,
              2 * std::max({t.compute_s, t.collectives_s, t.param_fetch_s, t.grad_offload_s}),
              1e-12);
  // The overlapped step (the default) opens the pass in the last micro-batch's backward, two
  // thirds of one micro-batch's compute; the half output does not stream to host shards, so the
  // pass then copies the new half shards W into them (8 ranks' 2·Pr read and 2·Pr written, 4·P
  // at 40 GB/s = 0.674 s), which meet the next forward module by module: the update U hides
  // behind the backward's 2F, W behind the forward F = 0.596 s, all of it but W − F. So the whole
  // micro-batch (3F) hides: step = micro-batch + optimizer step.
  ASSERT_GT(t.optimizer_step_s, t.forward_backward_s / 3);
  const double micro_batch = t.forward_backward_s / 2;
  const double forward = micro_batch / 3;
  EXPECT_NEAR(t.param_upload_s, 4 * params / 40e9, 1e-9);
  ASSERT_GT(t.param_upload_s, forward);
  ASSERT_GT(t.optimizer_step_s - t.param_upload_s, 2 * forward);
  EXPECT_NEAR(t.optimizer_hidden_s, 3 * forward, 1e-9);
  EXPECT_NEAR(t.step_s, micro_batch + t.optimizer_step_s, 1e-9);
  // Checkpointing recomputes the forward: 4/3 of the FLOPs.
  tr.checkpoint_activations = true;
  EXPECT_NEAR(predict_step(m, tr, s, p).compute_s, t.compute_s * 4 / 3, 1e-9);
}

// Stage 1 adds each micro-batch's gradients into its full fp32 copy and reduce-scatters the sum
// once, at step() (GradReducer::reduce_accumulated), the reduced shard coming down to the host
// optimizer as it goes: with 4 micro-batches the forward and backward is 4 computes, nothing
// reduced behind them, and the step pays one reduction, behind no compute, before the optimizer
// step; the new params' all-gather is the optimizer step's publish. The half output does not
// stream with the host optimizer: the engine runs the update U, then queues the uploads W of the
// new shards on the coordinator's stream and all-gathers them behind the uploads G
// (run_optimizer(): step(), then publish_step()), so the optimizer step is U + W + G = 5.054 +
// 0.067 + 0.236 = 5.357 s.
TEST(TimeModel, StageOneReducesOnceAStepBehindNoCompute) {
  const ModelShape m = *find_model_preset("llama-2-7b");
  TrainingShape tr;
  tr.seq_len = 2048;
  tr.micro_batch = 1;
  tr.grad_accum_steps = 4;
  EngineSetup s;
  s.stage = 1;
  s.world_size = 8;
  s.ranks_per_machine = 8;
  s.optimizer = OffloadDevice::kHost;
  s.overlap_step = false;
  MachineProfile p = profile(40, 0, 0);
  p.gpu_tflops = 400;
  p.gpu_link_gbps = 50;
  p.h2d_gbps = 25;
  const StepPrediction t = predict_step(m, tr, s, p);
  const double params = static_cast<double>(param_count(m));
  const double shard = static_cast<double>((param_count(m) + 7) / 8);
  EXPECT_EQ(t.collectives_s, 0.0);
  EXPECT_EQ(t.grad_offload_s, 0.0);
  EXPECT_NEAR(t.forward_backward_s, 4 * t.compute_s, 1e-12);
  // 4·P through the link (7/8 of it a rank), 27 GB: 0.47 s; the shard's 4·Pr at 25 GB/s: 0.13 s.
  EXPECT_NEAR(t.step_reduce_s, std::max(4 * params * 7 / 8 / 50e9, 4 * shard / 25e9), 1e-12);
  EXPECT_NEAR(t.step_reduce_s, 4 * params * 7 / 8 / 50e9, 1e-12);
  EXPECT_NEAR(t.publish_gather_s, 2 * params * 7 / 8 / 50e9, 1e-12);
  EXPECT_NEAR(t.optimizer_step_s, t.pipeline_s + t.param_upload_s + t.publish_gather_s, 1e-12);
  EXPECT_NEAR(t.optimizer_step_s, 5.357, 1e-3);
  EXPECT_NEAR(t.step_s, t.forward_backward_s + t.step_reduce_s + t.optimizer_step_s, 1e-12);
  // Overlapped, the pass begins at step(), after the reduction. The next forward's first
  // gather waits for the whole update (OverlappedStep::await_module): it hides behind nothing.
  // The uploads, flagged group by group as they are queued, and the all-gathers of the new
  // params then meet that forward module by module, behind its compute: W + G = 0.067 + 0.236 s
  // behind the forward's third of one micro-batch's compute (0.223 s / 3 = 0.074 s, a twelfth of
  // the four), even where the fraction asks for the backward's two thirds (the default) or all
  // of it.
  ASSERT_GT(t.optimizer_step_s, t.forward_backward_s);
  s.overlap_step = true;
  const double micro_batch = t.forward_backward_s / 4;
  ASSERT_GT(t.publish_gather_s, micro_batch / 3);
  for (const double fraction : {2.0 / 3.0, 1.0}) {
    s.overlap_compute_fraction = fraction;
    const StepPrediction o = predict_step(m, tr, s, p);
    EXPECT_NEAR(o.optimizer_hidden_s, micro_batch / 3, 1e-12) << fraction;
    EXPECT_NEAR(o.step_s, t.step_s - micro_batch / 3, 1e-12) << fraction;
  }
  s.overlap_compute_fraction = 0.25;
  EXPECT_NEAR(predict_step(m, tr, s, p).optimizer_hidden_s, micro_batch / 4, 1e-12);
  // With checkpointing the forward is a quarter of a micro-batch's FLOPs.
  s.overlap_compute_fraction = 2.0 / 3.0;
  tr.checkpoint_activations = true;
  const StepPrediction c = predict_step(m, tr, s, p);
  EXPECT_NEAR(c.optimizer_hidden_s, c.forward_backward_s / 4 / 4, 1e-12);
  tr.checkpoint_activations = false;
  s.overlap_step = false;
  s.overlap_compute_fraction = 2.0 / 3.0;
  // A slow host link makes the shard's way down the bound.
  p.h2d_gbps = 1;
  EXPECT_NEAR(predict_step(m, tr, s, p).step_reduce_s, 4 * shard / 1e9, 1e-12);
  // The optimizer on the device keeps the reduced shard there.
  s.optimizer = OffloadDevice::kNone;
  EXPECT_NEAR(predict_step(m, tr, s, p).step_reduce_s, 4 * params * 7 / 8 / 50e9, 1e-12);
}

// zinf.overlap_step: the optimizer pass of step t runs behind the compute of step t+1. Streamed
// and updating in the backward (stage 3, one micro-batch, nothing frozen), it has the backward,
// A = min(c, 2/3)·fb, and runs on into the next forward, B = min(c, 1/3)·fb, whose modules each
// wait for their own writes, and the first sub-group's update, S = U/n, for the backward's end:
// with c = 1 the step is max(compute + S, the pass's critical path), the pass and then the forward
// of the modules it wrote in the backward, opt + (A/opt)·B, where opt is longer than A + S;
// sequential (overlap off, or the optimizer on the device, which the engine does not overlap)
// the sum.
TEST(TimeModel, OverlappedStepIsTheMaxOfComputeAndThePassesCriticalPath) {
  auto [m, tr, s] = llama_7b_stage3();
  s.optimizer = OffloadDevice::kNvme;
  s.sub_group_params = 1 << 24;
  MachineProfile p = profile(40, 6, 4);
  p.h2d_gbps = 1000;
  // Two machines: compute 1/5 of the optimizer pass, and 5 times it.
  for (const double tflops : {0.0, 1.0}) {
    p.gpu_tflops = tflops;
    s.overlap_step = false;
    const StepPrediction seq = predict_step(m, tr, s, p);
    const double fb = seq.forward_backward_s;
    const double opt = seq.optimizer_step_s;
    EXPECT_NEAR(seq.step_s, fb + opt, 1e-12);
    EXPECT_EQ(seq.optimizer_hidden_s, 0.0);
    s.overlap_step = true;
    for (const double fraction : {1.0, 1.0 / 3.0, 0.0}) {
      s.overlap_compute_fraction = fraction;
      const StepPrediction ovl = predict_step(m, tr, s, p);
      EXPECT_EQ(ovl.forward_backward_s, fb);
      EXPECT_EQ(ovl.optimizer_step_s, opt);
      const double backward = std::min(fraction, 2.0 / 3.0) * fb;
      // Without compute the forward has no window: its compute, all-gather and fetch are 0.
      const double forward = tflops > 0 ? std::min(fraction, 1.0 / 3.0) * fb : 0.0;
      const double hidden = streamed_hidden(opt, first_update(ovl), 0.0, backward, forward);
      EXPECT_NEAR(ovl.optimizer_hidden_s, hidden, 1e-9) << tflops << " " << fraction;
      EXPECT_NEAR(ovl.step_s, fb + opt - hidden, 1e-9) << tflops << " " << fraction;
      if (fraction == 1.0 && tflops > 0) {
        const double first = first_update(ovl);
        const double pass = opt > backward + first ? opt + backward / opt * forward : 0.0;
        EXPECT_NEAR(ovl.step_s, std::max(fb + first, pass), 1e-9) << tflops;
      }
    }
    s.overlap_compute_fraction = 1.0;
  }
  // The numbers behind the two regimes, by hand: P = 6,738,415,616 params in n = ceil(P/2^24) =
  // 402 sub-groups, 12 B read and 12 B written a parameter at 6 and 4 GB/s, 13.476831 + 20.215247
  // = 33.692078 s of I/O (a sub-group's 0.083811 s, longer than its update, 30·P/402 at 40 GB/s,
  // 0.012572 s): opt = 401·0.083811 + 0.083811 + 0.012572 = 33.704650 s. The compute at 1
  // TFLOP/s, (6·P + 12·32·4096·2048)·2048 = 89.398721 s, hides all of it but the first
  // sub-group's update, S = 0.012572 s, which waits for the backward's end (its read does not):
  // step 89.411293 s.
  p.gpu_tflops = 1.0;
  const StepPrediction slow_gpu = predict_step(m, tr, s, p);
  EXPECT_NEAR(slow_gpu.forward_backward_s, 89.398721, 1e-6);
  EXPECT_NEAR(slow_gpu.optimizer_step_s, 33.704650, 1e-6);
  EXPECT_NEAR(slow_gpu.step_s, 89.411293, 1e-6);
  p.gpu_tflops = 0.0;
  const StepPrediction no_compute = predict_step(m, tr, s, p);
  EXPECT_LT(no_compute.forward_backward_s, no_compute.optimizer_step_s);
  // The micro-batch is the gradients' way down, whose backward's 2/3 hides the pass; the next
  // forward computes nothing to hide it behind.
  EXPECT_NEAR(no_compute.step_s, no_compute.optimizer_step_s + no_compute.forward_backward_s / 3.0,
              1e-9);
  // The optimizer on the device: never overlapped.
  s.optimizer = OffloadDevice::kNone;
  p.gpu_tflops = 1.0;
  const StepPrediction on_device = predict_step(m, tr, s, p);
  EXPECT_EQ(on_device.optimizer_hidden_s, 0.0);
  EXPECT_NEAR(on_device.step_s, on_device.forward_backward_s + on_device.optimizer_step_s, 1e-12);
}

// --step-only with --compute-s: the training step around the optimizer step. Overlapped, the
// pass hides behind c of the compute (1: all of it; 2/3: the backward), all but its update where
// the compute runs on the host's cores.
TEST(TimeModel, StepOnlyWithComputeIsTheMaxOrTheSum) {
  StepOnlySpec spec = state_only(1'000'000'000, 1u << 30);
  const StepPrediction alone = predict_optimizer_step(spec, profile(20, 2, 1));
  const double opt = alone.optimizer_step_s;
  // 30 B a parameter at 20 GB/s.
  EXPECT_NEAR(alone.update_alone_s, 1.5, 1e-12);
  EXPECT_GT(opt, 18.0);  // the writes alone: 12e9 B at 1 GB/s
  for (const double compute : {5.0, 17.5, 26.0, 40.0}) {
    spec.compute_s = compute;
    spec.overlap = false;
    spec.host_compute = false;
    const StepPrediction seq = predict_optimizer_step(spec, profile(20, 2, 1));
    EXPECT_EQ(seq.optimizer_step_s, opt);
    EXPECT_EQ(seq.forward_backward_s, compute);
    EXPECT_NEAR(seq.step_s, compute + opt, 1e-9) << compute;
    spec.overlap = true;
    spec.overlap_fraction = 1.0;
    const StepPrediction gpu = predict_optimizer_step(spec, profile(20, 2, 1));
    EXPECT_NEAR(gpu.step_s, std::max(compute, opt), 1e-9) << compute;
    spec.host_compute = true;
    const StepPrediction host = predict_optimizer_step(spec, profile(20, 2, 1));
    EXPECT_NEAR(host.step_s, std::max(compute + 1.5, opt), 1e-9) << compute;
    EXPECT_NEAR(host.optimizer_hidden_s, compute + opt - host.step_s, 1e-9) << compute;
    // Behind the backward only: the forward (a third) and then the longer of the backward and
    // the pass.
    spec.overlap_fraction = 2.0 / 3.0;
    const double forward = compute / 3.0;
    const StepPrediction backward = predict_optimizer_step(spec, profile(20, 2, 1));
    EXPECT_NEAR(backward.step_s, forward + std::max(2.0 * forward + 1.5, opt), 1e-9) << compute;
    spec.host_compute = false;
    const StepPrediction backward_gpu = predict_optimizer_step(spec, profile(20, 2, 1));
    EXPECT_NEAR(backward_gpu.step_s, forward + std::max(2.0 * forward, opt), 1e-9) << compute;
  }
}

// gradients_on_nvme as the engine runs it: each micro-batch writes the shard's fp32 gradients,
// and every later one reads them back while it writes (no duplex rate: one budget).
TEST(TimeModel, SpilledGradientsWriteEveryMicroBatchAndReadBackLaterOnes) {
  const ModelShape m = *find_model_preset("llama-2-7b");
  EngineSetup s;
  s.stage = 3;
  s.world_size = 4;
  s.ranks_per_machine = 4;
  s.optimizer = OffloadDevice::kNvme;
  s.gradients_on_nvme = true;
  s.sub_group_params = 1 << 24;
  MachineProfile p = profile(40, 6, 4);
  p.h2d_gbps = 1000;  // the drive, not the link, bounds the offload
  const double shard = static_cast<double>((param_count(m) + 3) / 4);
  const double spill = 4 * 4 * shard;  // R * 4 B * Pr
  for (std::uint64_t micro : {1u, 3u}) {
    TrainingShape tr;
    tr.grad_accum_steps = micro;
    const StepPrediction t = predict_step(m, tr, s, p);
    const double first = spill / 4e9;
    const double later = spill / 6e9 + spill / 4e9;
    const double k = static_cast<double>(micro);
    EXPECT_NEAR(t.forward_backward_s, first + (k - 1) * later, 1e-9) << micro;
    EXPECT_NEAR(t.grad_offload_s, (first + (k - 1) * later) / k, 1e-9) << micro;
    // The pipeline reads master, m, v and the gradients (16 B) and writes 12 B a parameter.
    EXPECT_NEAR(static_cast<double>(t.nvme_write_bytes), 4 * 12 * shard + k * spill, 1e3) << micro;
    EXPECT_NEAR(static_cast<double>(t.nvme_read_bytes), 4 * 16 * shard + (k - 1) * spill, 1e3)
        << micro;
  }
}

// With the gradients spilled to NVMe the engine does not open the pass in the backward (the
// pipeline reads a sub-group's gradients whole, once every reduction into it has run): it starts
// at step() and hides behind the next step's first forward at most, whatever --overlap-fraction
// asks: the forward's compute (a third of a micro-batch's FLOPs, a quarter with checkpointing)
// and its all-gather, not the gradient spill, which writes to the drive the pass reads and
// writes. With the gradients in host memory the same setup updates in the backward and runs on
// into the next forward. By hand, without checkpointing and c = 2/3: the micro-batch is the
// link's, (2·2·P + 4·P)·3/4 at 100 GB/s = 0.404305 s (the compute 0.223497 s), A = (1 − F/C)·mb
// = 0.269536 s (F/C = 0.333334), B = the forward's all-gather 2·P·3/4 at 100 GB/s = 0.101076 s;
// the pass reads 12 B and writes 12 B of each of the machine's P params, 13.476831 + 20.215247 s,
// and updates 30·P at 40 GB/s, 5.053812 s, in n = ceil(P/4 / 2^24) = 101 sub-groups: UW =
// 33.692078 + 5.053812/101 = 33.742116 s, S = 5.053812/101 = 0.050038 s (the first sub-group's
// update), R = UW − A = 33.472580 s, f
// = R/UW = 0.992012, and R outlasts S + f·B: the next forward takes R + (1 − f)·B, so hidden =
// A + f·B = 0.269536 + 0.100269 = 0.369805 s.
TEST(TimeModel, SpilledGradientsPassStartsAtStepBehindTheNextForward) {
  auto [m, tr, s] = llama_7b_stage3();
  s.world_size = 4;
  s.ranks_per_machine = 4;
  s.optimizer = OffloadDevice::kNvme;
  s.sub_group_params = 1 << 24;
  MachineProfile p = profile(40, 6, 4);
  p.h2d_gbps = 1000;
  p.gpu_tflops = 400;
  p.gpu_link_gbps = 100;
  const double params = static_cast<double>(param_count(m));
  const double forward_flops = llama_forward_flops(params);
  const double flops = llama_flops(params);
  // Stage 3 all-gathers the half params for the forward (2·P bytes), (N-1)/N of them a rank.
  const double forward_gather = 2 * params * 0.75 / 100e9;
  for (const bool checkpoint : {false, true}) {
    tr.checkpoint_activations = checkpoint;
    const double all_flops = flops + (checkpoint ? forward_flops : 0.0);
    const double forward_compute = forward_flops / 400e12;
    EXPECT_NEAR(forward_compute / (all_flops / 400e12), checkpoint ? 0.25 : 1.0 / 3.0, 1e-2);
    for (const double fraction : {2.0 / 3.0, 1.0}) {
      s.overlap_compute_fraction = fraction;
      s.gradients_on_nvme = false;
      tr.grad_accum_steps = 1;
      const StepPrediction host = predict_step(m, tr, s, p);
      ASSERT_GT(host.optimizer_step_s, host.forward_backward_s);
      // The backward's share of the FLOPs and the forward's window, at most c of each.
      const double forward_share = forward_compute / (all_flops / 400e12);
      const double mb = host.forward_backward_s;
      const double window = fraction * mb;
      EXPECT_NEAR(host.optimizer_hidden_s,
                  streamed_hidden(host.optimizer_step_s, first_update(host), 0.0,
                                  std::min(fraction, 1.0 - forward_share) * mb,
                                  std::min(window, std::max(forward_compute, forward_gather))),
                  1e-9)
          << checkpoint << " " << fraction;
      if (!checkpoint && fraction < 1.0) {
        EXPECT_NEAR(host.optimizer_hidden_s, 0.369805, 1e-6);
      }
      s.gradients_on_nvme = true;
      // One micro-batch and three: the pass meets the next step's first forward, which reads
      // nothing back.
      for (const std::uint64_t micro : {1u, 3u}) {
        tr.grad_accum_steps = micro;
        const StepPrediction spilled = predict_step(m, tr, s, p);
        EXPECT_NEAR(spilled.compute_s, all_flops / 400e12, 1e-9);
        const double forward = std::max(forward_compute, forward_gather);
        EXPECT_NEAR(spilled.optimizer_hidden_s, forward, 1e-9)
            << checkpoint << " " << fraction << " " << micro;
        EXPECT_NEAR(spilled.step_s, spilled.forward_backward_s + spilled.optimizer_step_s - forward,
                    1e-9)
            << checkpoint << " " << fraction << " " << micro;
      }
    }
  }
}

// The pass hides behind a micro-batch's compute and link transfers, never behind the NVMe time
// of the drive its own state is on. docs/PLAN.md's 70B case (everything on NVMe, gradients
// spilled, no compute or collectives modelled) hides none of it: its micro-batch is the spill
// write and a parameter fetch from that drive. Parameters in host memory come down over the
// host link, which the pass does not use: there the forward's half of the fetch hides it.
TEST(TimeModel, PassOnTheDriveHidesBehindNoNvmeTime) {
  auto [m, tr, s] = llama_7b_stage3();
  s.optimizer = OffloadDevice::kNvme;
  s.params = OffloadDevice::kNvme;
  s.gradients_on_nvme = true;
  s.sub_group_params = 1 << 24;
  const MachineProfile p = profile(40, 6, 4);  // the default 20 GB/s host link, no compute
  const double params = static_cast<double>(param_count(m));
  const StepPrediction spilled = predict_step(m, tr, s, p);
  // The micro-batch is the spill (4·P at 4 GB/s) and the fetch, 2·2·P read at 6 GB/s.
  EXPECT_NEAR(spilled.forward_backward_s, 4 * params / 4e9, 1e-9);
  EXPECT_NEAR(spilled.param_fetch_s, 4 * params / 6e9, 1e-9);
  EXPECT_EQ(spilled.optimizer_hidden_s, 0.0);
  EXPECT_NEAR(spilled.step_s, spilled.forward_backward_s + spilled.optimizer_step_s, 1e-9);
  // Gradients in host memory: the pass updates in the backward, behind c of the micro-batch's
  // time less the drive's. The fetch (4.5 s from the drive) outlasts the fp32 gradients coming
  // down (4·P at 20 GB/s, 1.35 s): nothing hides.
  s.gradients_on_nvme = false;
  const StepPrediction host_grads = predict_step(m, tr, s, p);
  ASSERT_GT(host_grads.optimizer_step_s, host_grads.forward_backward_s);
  EXPECT_EQ(host_grads.optimizer_hidden_s, 0.0);
  EXPECT_NEAR(host_grads.step_s, host_grads.forward_backward_s + host_grads.optimizer_step_s, 1e-9);
  // Parameters in host memory: the fetch (2·2·P at 20 GB/s) is link time, no drive's. The half
  // output does not stream there (streams_half): the pass copies the new half shards W into the
  // host shards after its whole update (2·P read and 2·P written at 40 GB/s, 0.674 s), and the
  // next forward's gather of a module waits for its groups (OverlappedStep::await_module).
  // Spilled, the pass starts at step(): the update hides behind nothing, W behind the next
  // forward, its half of the fetch (2·P at 20 GB/s = 0.674 s): all 0.674 s of it. With the
  // gradients in host memory the update hides in the backward, behind c of the micro-batch (the
  // fetch, 4·P at 20 GB/s = 1.348 s, as long as the gradients' way down): 0.898 s + W's 0.674 s.
  s.params = OffloadDevice::kHost;
  s.gradients_on_nvme = true;
  const StepPrediction host_params = predict_step(m, tr, s, p);
  EXPECT_NEAR(host_params.param_fetch_s, 4 * params / 20e9, 1e-9);
  EXPECT_NEAR(host_params.param_upload_s, 4 * params / 40e9, 1e-9);
  EXPECT_NEAR(host_params.optimizer_hidden_s, 4 * params / 40e9, 1e-9);
  s.gradients_on_nvme = false;
  const StepPrediction in_backward = predict_step(m, tr, s, p);
  ASSERT_GT(in_backward.optimizer_step_s, 2.0 / 3.0 * 4 * params / 20e9);
  EXPECT_NEAR(in_backward.optimizer_hidden_s, 2.0 / 3.0 * 4 * params / 20e9 + 4 * params / 40e9,
              1e-9);
  EXPECT_NEAR(in_backward.optimizer_hidden_s, 1.572, 1e-3);
}

// Compute that outlasts the parameters' fetch from the pass's drive hides the pass only for what
// it outlasts: the rest of it waits for the fetch, and the drive is busy. That holds where the
// optimizer state is on the drive (the whole pass uses it; with the state in host memory the
// update and the writes are timed apart: HostOptimizerWritesTheHalfShardsAfterTheUpdate). Where
// the updates meet the next forward, the forward's compute less the forward's half of the fetch
// hides it. By hand, at 10 TFLOP/s: C = 8.939872 s, F = 2.979957 s, the fetch 4·P at 6 GB/s =
// 4.492277 s; A = 2/3·(C − fetch) = 2.965063 s, B = F − fetch/2 = 0.733819 s. The pass reads 12 B
// and writes 14 B a param (the half shards too), 13.476831 + 23.584455 s, and updates 5.053812 s
// in 402 sub-groups: UW = 37.061286 + 5.053812/402 = 37.073858 s, S = 5.053812/402 = 0.012572 s,
// f = (UW −
// A)/UW = 0.920023; R outlasts S + f·B, so hidden = A + f·B = 3.640193 s. With c = 0.1: A = B =
// 0.1·(C − fetch) = 0.444760 s, f = 0.988003, hidden 0.884183 s.
TEST(TimeModel, PassHidesBehindComputeLessTheFetchFromItsDrive) {
  auto [m, tr, s] = llama_7b_stage3();
  s.params = OffloadDevice::kNvme;
  s.sub_group_params = 1 << 24;
  MachineProfile p = profile(40, 6, 4);  // the default 20 GB/s host link
  p.gpu_tflops = 10;
  const double params = static_cast<double>(param_count(m));
  const double compute = llama_flops(params) / 10e12;
  const double forward = llama_forward_flops(params) / 10e12;
  const double fetch = 4 * params / 6e9;  // 2·2·P read from the drive
  ASSERT_GT(compute, fetch);
  ASSERT_GT(forward, fetch / 2);
  for (const OffloadDevice optimizer : {OffloadDevice::kNvme}) {
    s.optimizer = optimizer;
    s.exact_clipping_or_loss_scaling = false;
    const StepPrediction backward = predict_step(m, tr, s, p);
    EXPECT_NEAR(backward.compute_s, compute, 1e-9);
    EXPECT_NEAR(backward.param_fetch_s, fetch, 1e-9);
    ASSERT_GT(backward.optimizer_step_s, compute - fetch);
    // The backward's window 2/3·(C − fetch), the next forward's F − fetch/2.
    EXPECT_NEAR(backward.optimizer_hidden_s,
                streamed_hidden(backward.optimizer_step_s, first_update(backward), 0.0,
                                2.0 / 3.0 * (compute - fetch), forward - fetch / 2),
                1e-9)
        << offload_device_name(optimizer);
    EXPECT_NEAR(backward.optimizer_step_s, 37.073858, 1e-6);
    EXPECT_NEAR(backward.optimizer_hidden_s, 3.640193, 1e-6);
    s.exact_clipping_or_loss_scaling = true;
    const StepPrediction at_step = predict_step(m, tr, s, p);
    EXPECT_NEAR(at_step.optimizer_hidden_s, forward - fetch / 2, 1e-9)
        << offload_device_name(optimizer);
    EXPECT_NEAR(at_step.step_s,
                at_step.forward_backward_s + at_step.optimizer_step_s - (forward - fetch / 2),
                1e-9);
    // A small c: the window c·(mb − drive) bounds the pass that waits for step() too, which
    // never hides more than the one updating in the backward.
    s.overlap_compute_fraction = 0.1;
    s.exact_clipping_or_loss_scaling = false;
    const StepPrediction small_backward = predict_step(m, tr, s, p);
    EXPECT_NEAR(small_backward.optimizer_hidden_s,
                streamed_hidden(small_backward.optimizer_step_s, first_update(small_backward), 0.0,
                                0.1 * (compute - fetch), 0.1 * (compute - fetch)),
                1e-9);
    EXPECT_NEAR(small_backward.optimizer_hidden_s, 0.884183, 1e-6);
    s.exact_clipping_or_loss_scaling = true;
    const StepPrediction small_at_step = predict_step(m, tr, s, p);
    ASSERT_LT(0.1 * (compute - fetch), forward - fetch / 2);
    EXPECT_NEAR(small_at_step.optimizer_hidden_s, 0.1 * (compute - fetch), 1e-9)
        << offload_device_name(optimizer);
    s.overlap_compute_fraction = EngineSetup{}.overlap_compute_fraction;
  }
}

// With the optimizer state in host memory and the params' home on NVMe the engine runs the whole
// update (run_optimizer(): the pass fills the store's half array only) and then writes every
// trainable shard's new half to the drive (write_step() -> publish_pass()); the next forward's
// gathers wait for those writes module by module. So the writes W follow the update U, at step()
// at the earliest, and hide behind the next forward only, less the forward's half of the fetch
// from the same drive; U hides behind the backward where the pass updates there (c of the
// micro-batch), and behind nothing where it starts at step() (exact clipping). Worked by hand
// from that schedule for llama-2-7b on one rank: U = 30·P at 40 GB/s = 5.054 s, W = 2·P at
// 4 GB/s = 3.369 s, the micro-batch's compute C = (6·P + 12·L·h·s)·s at 10 TFLOP/s = 8.940 s, its
// forward F = (2·P + 4·L·h·s)·s = 2.980 s, the fetch 2·2·P at 6 GB/s = 4.492 s (the forward's
// half 2.246 s):
//   sequential:                 U + W = 8.423 s, nothing hidden;
//   c = 2/3, in the backward:   U behind c·C = 5.960 s, all of it; W behind F − 2.246 = 0.734 s,
//                               2.635 s over: 2.635 s shows;
//   c = 2/3, exact clipping:    U shows whole, W as above: 5.054 + 2.635 = 7.689 s shows;
//   c = 0.1, in the backward:   U behind 0.894 s, 4.160 s over; W behind min(0.1·(C − 4.492),
//                               0.734) = 0.445 s, 2.924 s over: 7.084 s shows.
TEST(TimeModel, HostOptimizerWritesTheHalfShardsAfterTheUpdate) {
  auto [m, tr, s] = llama_7b_stage3();
  s.optimizer = OffloadDevice::kHost;
  s.params = OffloadDevice::kNvme;
  MachineProfile p = profile(40, 6, 4);  // the default 20 GB/s host link
  p.gpu_tflops = 10;
  const double params = static_cast<double>(param_count(m));
  const double compute = llama_flops(params) / 10e12;
  const double forward = llama_forward_flops(params) / 10e12;
  const double fetch = 4 * params / 6e9;
  const double update = 30 * params / 40e9;
  const double writes = 2 * params / 4e9;
  // The figures the comment works with, so that each case is the regime it names.
  ASSERT_NEAR(update, 5.054, 1e-3);
  ASSERT_NEAR(writes, 3.369, 1e-3);
  ASSERT_NEAR(compute, 8.940, 1e-3);
  ASSERT_NEAR(forward, 2.980, 1e-3);
  ASSERT_NEAR(fetch, 4.492, 1e-3);
  struct Case {
    bool overlap;
    double fraction;
    bool exact_clipping;
    double exposed_s;  // of the optimizer step, what the step shows
  };
  const Case cases[] = {
      {false, 2.0 / 3.0, false, 8.423},
      {true, 2.0 / 3.0, false, 2.635},
      {true, 2.0 / 3.0, true, 7.689},
      {true, 0.1, false, 7.084},
  };
  for (const Case& k : cases) {
    s.overlap_step = k.overlap;
    s.overlap_compute_fraction = k.fraction;
    s.exact_clipping_or_loss_scaling = k.exact_clipping;
    const StepPrediction t = predict_step(m, tr, s, p);
    SCOPED_TRACE(testing::Message() << "overlap " << k.overlap << " c " << k.fraction
                                    << " exact clipping " << k.exact_clipping);
    EXPECT_NEAR(t.compute_s, compute, 1e-9);
    EXPECT_NEAR(t.param_fetch_s, fetch, 1e-9);
    EXPECT_NEAR(t.optimizer_step_s, update + writes, 1e-9);
    expect_exposed(t, k.exposed_s);
  }
}

// With the optimizer state in host memory and the params on the device the half output does not
// stream either: the engine runs the whole update U, then queues the uploads W of the new shards
// on the coordinator's stream (run_optimizer(): step(), then write_step() or publish_step()),
// and at stages 1-2 all-gathers them, G. The next forward's first gather of a module with
// trained parameters waits for the update (OverlappedStep::await_module): U hides behind the
// backward where the pass updates there and
// behind nothing where it starts at step(). Each group is flagged written as its upload is
// queued (Publisher::write_group), and the unpinned host source makes each copy return once
// staged, so the uploads meet the next forward module by module, like NVMe writes: W + G hide
// behind that forward. Worked by hand for llama-2-7b at 10 TFLOP/s (C = 8.940 s a micro-batch,
// its forward F = 2.980 s), the host link at 20 GB/s:
//   stage 3, one rank: U = 30·P at 40 GB/s = 5.054 s, W = 2·P at 20 GB/s = 0.674 s;
//     sequential U + W = 5.728 s shows; in the backward (c = 2/3) U behind c·C = 5.960 s and W
//     behind min(c·C, F) = 2.980 s, nothing shows; exact clipping: U shows, 5.054 s.
//   stage 2, 8 ranks on a 50 GB/s link: U = 8·30·P/8 at 40 GB/s = 5.054 s, W = 2·P/8 at 20 GB/s
//     = 0.084 s, G = 2·P·7/8 at 50 GB/s = 0.236 s; sequential 5.374 s; exact clipping: W + G =
//     0.320 s behind F, U = 5.054 s shows.
TEST(TimeModel, HostOptimizerUploadsFollowTheUpdateAndHideBehindTheNextForward) {
  auto [m, tr, s] = llama_7b_stage3();
  s.optimizer = OffloadDevice::kHost;
  s.params = OffloadDevice::kNone;
  MachineProfile p = profile(40, 0, 0);  // the default 20 GB/s host link
  p.gpu_tflops = 10;
  p.gpu_link_gbps = 50;
  const double params = static_cast<double>(param_count(m));
  const double update = 30 * params / 40e9;
  const double upload = 2 * params / 20e9;
  ASSERT_NEAR(update, 5.054, 1e-3);
  ASSERT_NEAR(upload, 0.674, 1e-3);
  struct Case {
    int stage;
    bool overlap;
    bool exact_clipping;
    double optimizer_step_s;
    double exposed_s;  // of the optimizer step, what the step shows
  };
  const Case cases[] = {
      {3, false, false, 5.728, 5.728}, {3, true, false, 5.728, 0.0},  {3, true, true, 5.728, 5.054},
      {2, false, false, 5.374, 5.374}, {2, true, true, 5.374, 5.054},
  };
  for (const Case& k : cases) {
    s.stage = k.stage;
    s.world_size = s.ranks_per_machine = k.stage == 3 ? 1 : 8;
    s.overlap_step = k.overlap;
    s.exact_clipping_or_loss_scaling = k.exact_clipping;
    const StepPrediction t = predict_step(m, tr, s, p);
    SCOPED_TRACE(testing::Message() << "stage " << k.stage << " overlap " << k.overlap
                                    << " exact clipping " << k.exact_clipping);
    EXPECT_NEAR(t.pipeline_s, update, 1e-3);
    EXPECT_NEAR(t.optimizer_step_s, k.optimizer_step_s, 1e-3);
    expect_exposed(t, k.exposed_s);
  }
}

// Streamed (the optimizer state on NVMe) the pass updates and writes each shard in the backward,
// but overlapped the engine leaves the stage 1-2 all-gather of the new params to the next forward
// (write_step() gathers nothing; OverlappedStep::await_module all-gathers each module's groups):
// the update and writes hide behind the backward's window A, the rest of them and the all-gather
// G behind the next forward, module by module.
// Worked by hand for llama-2-7b at stage 2 on 8 ranks, 100 TFLOP/s (C = 0.894 s a micro-batch,
// its forward F = 0.298 s), a 50 GB/s link, no drive read by the forward: A = 2/3 · 0.894 =
// 0.596 s, G = 2·P·7/8 at 50 GB/s = 0.236 s; the pipeline (12 B a param read and 12 written
// through a 6/4 GB/s drive: UW = 33.791 s) is longer than A, so the next forward meets
// f = (UW − A)/UW = 0.982 of the pass and waits for it module by module: 0.893 s hides,
// A + f·F + (1 − f)·G.
TEST(TimeModel, StreamedPassLeavesTheAllGatherToTheNextForward) {
  auto [m, tr, s] = llama_7b_stage3();
  s.stage = 2;
  s.world_size = s.ranks_per_machine = 8;
  s.optimizer = OffloadDevice::kNvme;
  s.sub_group_params = 1 << 24;
  s.overlap_step = true;
  MachineProfile p = profile(40, 6, 4);
  p.gpu_tflops = 100;
  p.gpu_link_gbps = 50;
  const StepPrediction t = predict_step(m, tr, s, p);
  const double params = static_cast<double>(param_count(m));
  ASSERT_NEAR(t.compute_s, 0.894, 1e-3);
  ASSERT_NEAR(t.publish_gather_s, 2 * params * 7 / 8 / 50e9, 1e-12);
  ASSERT_NEAR(t.publish_gather_s, 0.236, 1e-3);
  ASSERT_GT(t.optimizer_step_s - t.publish_gather_s, 2.0 / 3.0 * t.compute_s);
  // The pass has f = (UW − A)/UW of the partition left when the next forward begins: that
  // forward's first f of the modules wait for it and then for their all-gathers, the rest have
  // their shards and hide G behind F: A + f·F + (1 − f)·G.
  const double uw = t.optimizer_step_s - t.publish_gather_s;
  const double left = (uw - 2.0 / 3.0 * t.compute_s) / uw;
  EXPECT_NEAR(t.optimizer_hidden_s,
              2.0 / 3.0 * t.compute_s + left * t.compute_s / 3 + (1 - left) * t.publish_gather_s,
              1e-9);
  EXPECT_NEAR(t.optimizer_hidden_s,
              streamed_hidden(uw, first_update(t), t.publish_gather_s, 2.0 / 3.0 * t.compute_s,
                              t.compute_s / 3),
              1e-9);
  EXPECT_NEAR(uw, 33.791, 1e-3);
  EXPECT_NEAR(t.optimizer_hidden_s, 0.893, 1e-3);
  // With exact clipping the pass updates only after step(): the whole step meets the forward.
  s.exact_clipping_or_loss_scaling = true;
  EXPECT_NEAR(predict_step(m, tr, s, p).optimizer_hidden_s, t.compute_s / 3, 1e-9);
}

// The engine updates during the backward only where nothing global decides the step first
// (Engine's in_backward_): with exact clipping or fp16 loss scaling the updates wait for step()
// and meet the next forward only, the forward's share of a micro-batch's FLOPs: a third, a
// quarter with checkpointing, and about a half where most parameters are frozen (a twentieth
// trains here) (their backward
// computes no weight gradients), whatever --overlap-fraction asks above it. Without them the
// pass updates in the backward, the backward's share of c, and runs on into the next forward,
// whose modules wait for it one by one: more than the backward's window, less than the sum. By
// hand, every parameter trained, no checkpointing, c = 1: C = 0.223497 s, F = 0.074499 s, A = C
// − F = 0.148998 s, B = F; UW = 33.692078 + 5.053812/101 = 33.742116 s (the machine's 12 B read
// and 12 B written a param at 6 and 4 GB/s, the update at 40 GB/s in 101 sub-groups), S =
// 5.053812/101 = 0.050038 s, f = (UW − A)/UW = 0.995584; R outlasts S + f·B, so hidden = A + f·B =
// 0.223168 s (the backward's window alone 0.148998 s, the sum 0.223497 s).
TEST(TimeModel, ExactClippingOrLossScalingHidesThePassBehindTheNextForward) {
  auto [m, tr, s] = llama_7b_stage3();
  s.world_size = 4;
  s.ranks_per_machine = 4;
  s.optimizer = OffloadDevice::kNvme;
  s.sub_group_params = 1 << 24;
  MachineProfile p = profile(40, 6, 4);
  p.h2d_gbps = 1000;
  p.gpu_tflops = 400;  // no link figure: the compute is the micro-batch
  const double params = static_cast<double>(param_count(m));
  const double attention = kLlamaAttention;
  struct Case {
    bool checkpoint;
    double trainable;
  };
  for (const Case c :
       {Case{false, params}, Case{true, params}, Case{false, std::floor(params / 20)}}) {
    tr.checkpoint_activations = c.checkpoint;
    m.trainable_params = static_cast<std::uint64_t>(c.trainable);
    const double forward = 2 * params + 4 * attention;
    const double all = 6 * c.trainable + 4 * (params - c.trainable) + 12 * attention +
                       (c.checkpoint ? forward : 0.0);
    const double share = forward / all;
    for (const double fraction : {0.2, 2.0 / 3.0, 1.0}) {
      s.overlap_compute_fraction = fraction;
      s.exact_clipping_or_loss_scaling = false;
      const StepPrediction backward = predict_step(m, tr, s, p);
      ASSERT_GT(backward.optimizer_step_s, backward.compute_s);
      EXPECT_NEAR(backward.compute_s, all * 2048 / 400e12, 1e-9);
      // Updating in the backward: its share of c, then on into the next forward.
      EXPECT_NEAR(backward.optimizer_hidden_s,
                  streamed_hidden(backward.optimizer_step_s, first_update(backward), 0.0,
                                  std::min(fraction, 1.0 - share) * backward.compute_s,
                                  std::min(fraction, share) * backward.compute_s),
                  1e-9)
          << c.checkpoint << " " << c.trainable << " " << fraction;
      EXPECT_GT(backward.optimizer_hidden_s, std::min(fraction, 1.0 - share) * backward.compute_s);
      if (!c.checkpoint && c.trainable == params && fraction == 1.0) {
        EXPECT_NEAR(backward.optimizer_step_s, 33.742116, 1e-6);
        EXPECT_NEAR(backward.optimizer_hidden_s, 0.223168, 1e-6);
      }
      s.exact_clipping_or_loss_scaling = true;
      const StepPrediction at_step = predict_step(m, tr, s, p);
      EXPECT_NEAR(at_step.optimizer_hidden_s, std::min(fraction, share) * at_step.compute_s, 1e-9)
          << c.checkpoint << " " << c.trainable << " " << fraction;
      EXPECT_NEAR(at_step.step_s,
                  at_step.forward_backward_s + at_step.optimizer_step_s -
                      std::min(fraction, share) * at_step.compute_s,
                  1e-9);
    }
  }
  // The shares the three cases stand for.
  EXPECT_NEAR((2 * params + 4 * attention) / (6 * params + 12 * attention), 1.0 / 3.0, 1e-12);
  EXPECT_NEAR((2 * params + 4 * attention) / (8 * params + 16 * attention), 0.25, 1e-12);
  const double lora = std::floor(params / 20);
  EXPECT_GT((2 * params + 4 * attention) / (6 * lora + 4 * (params - lora) + 12 * attention), 0.45);
}

// --step-only: --compute-s is the whole step's compute over its --grad-accum micro-batches, and
// the pass meets one of them: hidden = min(pass, c·compute/m), c at most the next forward's share
// with exact clipping or loss scaling: 1/3 (2 FLOPs a parameter of 6), 1/4 with checkpointing
// (2 of 8: the forward runs twice), as predict_step counts them.
TEST(TimeModel, StepOnlyPassHidesBehindOneMicroBatch) {
  StepOnlySpec spec = state_only(1'000'000'000, 1u << 30);
  spec.compute_s = 6.0;
  const MachineProfile p = profile(20, 2, 1);
  for (const bool checkpoint : {false, true}) {
    spec.checkpoint_activations = checkpoint;
    const double forward_share = checkpoint ? 2.0 / 8.0 : 2.0 / 6.0;
    for (const std::uint64_t micro : {1u, 3u}) {
      spec.micro_batches = micro;
      const double mb = 6.0 / static_cast<double>(micro);
      for (const double fraction : {0.25, 2.0 / 3.0, 1.0}) {
        spec.overlap_fraction = fraction;
        spec.exact_clipping_or_loss_scaling = false;
        const StepPrediction t = predict_optimizer_step(spec, p);
        ASSERT_GT(t.optimizer_step_s, 6.0);
        EXPECT_NEAR(t.optimizer_hidden_s, fraction * mb, 1e-12) << micro << " " << fraction;
        EXPECT_NEAR(t.step_s, 6.0 + t.optimizer_step_s - fraction * mb, 1e-9);
        spec.exact_clipping_or_loss_scaling = true;
        EXPECT_NEAR(predict_optimizer_step(spec, p).optimizer_hidden_s,
                    std::min(fraction, forward_share) * mb, 1e-12)
            << checkpoint << " " << micro << " " << fraction;
      }
    }
  }
}

}  // namespace
}  // namespace zinf::plan
