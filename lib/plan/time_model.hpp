// The time model: a training step's time from the bytes each tier must move and the machine's
// measured rates, overlapped the way the engine overlaps them (the max of overlapped parts, not
// their sum).
//
// Notation as in estimate.hpp; R ranks share one machine's memory bandwidth and NVMe, each rank
// has its own host↔device link. Rates are 1e9 bytes/s (GB/s).
//
// Optimizer step (what `zinf bench step` measures), per machine, over Pr·R parameters:
//   update   U = R·Pr·A / mem_adam_gbps, A = bytes the CPU Adam moves a parameter: read g
//            (4, fp32), read and write p, m, v (24), write the half copy (2): 30 B; on the
//            device (optimizer not offloaded) the same 30 B at gpu_mem_gbps.
//   NVMe     reads  R·Pr·(12 + 4 if gradients are on NVMe)   at nvme_read_gbps
//            writes R·Pr·12                                   at nvme_write_gbps
//            the pipeline runs reads and writes at once, so
//              io = max(reads/read_rate, writes/write_rate, (reads + writes)/duplex_rate)
//            with the duplex rate measured with both running; unknown, the drive is taken to
//            serve both from one budget: io = reads/read_rate + writes/write_rate.
//   pipeline over n = ceil(Pr / Sg) sub-groups with B buffers, per sub-group r, u, w (its
//            read, update and write alone) and i = io / n: a buffer cycles read → update →
//            write, so the rate is bounded by the drive (i), the CPU (u) and the buffers
//            ((r + u + w) / B):
//              T = max(i, u, (r + u + w) / B)
//              pipeline = (n − 1)·T + (r + u + w)     (the first read and last write are
//                                                      not overlapped)
//            State on the host: pipeline = U (no I/O).
//   upload   the new half params to their home, 2·Tr (the trainable shards, below): up to the
//            device (optimizer on the host, params on the device) or down from it (optimizer on
//            the device, params offloaded) at h2d_gbps; with the params on NVMe and the optimizer
//            state not, also R·2·Tr written to the drive at nvme_write_gbps: the host optimizer's
//            values are in host memory and only the writes remain; the device optimizer copies
//            each group down and then writes it, waiting for each, so the two add up for a rank,
//            while the machine's R ranks share the drive: max(R·W1, D + W1); with the
//            optimizer offloaded, the half output not streamed and the params in host memory,
//            R·2·2·Tr through memory at mem_adam_gbps (publish_pass() copies the store's half
//            array into the host shards: 2·Tr read, 2·Tr written a rank).
//   publish  stages 1-2: the new half params all-gathered, 2·T (the trainable groups: a step
//            republishes no frozen group), (N−1)/N of it per rank at gpu_link_gbps, once a step
//            after the step has written the shards (on the coordinator's stream, behind the
//            uploads; stage 3 gathers per module in the forward and backward instead)
//   optimizer_step = max(pipeline, upload) + publish   the half output streamed (streams_half:
//                                                    the optimizer state on NVMe, but not at
//                                                    stage 3 with the params in host memory): the
//                                                    pass writes each shard as its sub-group
//                                                    completes
//                  = pipeline + upload + publish     elsewhere: the engine runs the whole update
//                                                    and then writes the shards (run_optimizer():
//                                                    step(), then write_step() / publish_step())
//   frozen parameters (T trainable of P, Tr and Fr = Pr − Tr a rank's trainable and frozen
//            shares; docs/ENGINE.md "Frozen parameters"): with the optimizer state offloaded the
//            pass passes over the frozen sub-groups (no read of their master, moments or
//            gradient, no update, no write), and a step does not republish the frozen groups
//            (no step changes them), so where the half output streams (streams_half) the pass
//            does not read a frozen master for its half copy either. The update moves 30·Tr
//            bytes; NVMe reads 12·Tr, writes 12·Tr (+ 2·Tr with the half params' home on NVMe:
//            the trainable groups' new shards). The engine cuts sub-groups at both ends of each
//            run of trainable elements too: with k = max(1, ceil(runs / N)) a rank's share of
//            the model's trainable runs (ModelShape::trainable_runs, LoRA: one an adapted
//            projection; unknown for --trainable: 1), n = max(ceil(Tr / Sg), k), at least 1
//            (the frozen sub-groups between the runs move nothing and are not counted). The new
//            half params that go to their home (the upload) are 2·Tr: only the trainable
//            groups' shards are rewritten after a step. The optimizer on the
//            device moves 30·Tr too: it skips its frozen runs, whose moments it does not store.
//
// Forward and backward, per rank, for grad_accum_steps micro-batches each:
//   compute        F = (6·T + 4·(P − T) + 12·L·h·s)·s·b FLOPs per micro-batch (PaLM,
//                  Chowdhery et al. 2022, appendix B: 2 a parameter forward, 4 backward, of
//                  which a frozen parameter, which takes no weight gradient, does half: the
//                  input's gradient; an upper bound, as a frozen layer below every trainable
//                  one needs no input gradient either); activation checkpointing adds one more
//                  forward, (2·P + 4·L·h·s)·s·b (the 4/3 of the whole when nothing is frozen);
//                  compute = F / (gpu_tflops·1e12). Not modelled (0) when gpu_tflops is 0.
//   collectives    per micro-batch: stage 3 all-gathers 2·P twice (forward, backward) and
//                  reduce-scatters 4·T (the engine reduces fp32 gradients); stage 2
//                  reduce-scatters 4·T (at stages 2-3 a frozen module is never reduced); stage 1
//                  nothing: it adds each micro-batch's gradients into its full fp32 copy on the
//                  device. Each moves (N−1)/N of its bytes per rank at gpu_link_gbps. Not
//                  modelled (0) when gpu_link_gbps is 0.
//   step reduce    stage 1, once a step at step(), before the optimizer step and behind no
//                  compute: reduce-scatter the accumulated 4·T (a frozen group has no full copy
//                  and is never reduced), (N−1)/N per rank at gpu_link_gbps, with the optimizer
//                  offloaded the reduced 4·Tr coming down to the host as it goes (the max of
//                  the two)
//   bytes          reduce_scatter_bytes and all_gather_bytes per rank and step, as the engine's
//                  EngineCounters count them (a bucket's whole fp32 bytes into a reduce-scatter,
//                  a group's whole half bytes out of an all-gather; 0 with one rank): stage 1
//                  4·T and 2·T; stage 2 4·T·m and 2·T; stage 3 4·T·m and 2·2·P·m, m =
//                  grad_accum_steps (stage 3's persistent small tensors, gathered once a step
//                  instead, counted as the others)
//   param fetch    stage 3 with params offloaded: 2·2·Pr host→device (forward and backward)
//                  at h2d_gbps; from NVMe also R·2·2·Pr read at nvme_read_gbps (overlapped
//                  with the copy)
//   grad offload   optimizer offloaded, stages 2-3: 4·Tr device→host at h2d_gbps, the reduced
//                  fp32 gradients (stage 1's come down in its step reduce).
//                  Spilled gradients (gradients_on_nvme) also go to NVMe as the engine's
//                  SpillAccumulator moves them: every micro-batch writes each completed sub-group,
//                  R·4·Pr at nvme_write_gbps; every later micro-batch first reads the sums back,
//                  R·4·Pr at nvme_read_gbps, at the same time as the writes (io as for the
//                  pipeline: max(r, w, (r + w)/duplex), or r + w with no duplex rate).
//                  grad_offload_s is the mean over the micro-batches.
//   forward_backward = Σ over micro-batches of max(compute, collectives, param fetch, that
//                  micro-batch's grad offload) (the engine prefetches and reduces while
//                  modules compute)
// step, sequential (zinf.overlap_step false, or the optimizer on the device, which the engine
// does not overlap):
//   step = forward_backward + step_reduce + optimizer_step
// step, overlapped (zinf.overlap_step, the default, with the optimizer state offloaded: the
// optimizer pass of step t runs behind the compute of step t+1, docs/ENGINE.md "The overlapped
// step"): the pass meets one micro-batch, not the step (it updates in the last micro-batch's
// backward, or starts at step() and meets the next step's first micro-batch), and runs behind
// its compute and link transfers, not behind the micro-batch's time on the pass's own drive:
// where the params are on NVMe (the pass writes their new half shards there), the fetch of
// parameters reads that drive and the compute waits for it, so the fetch's NVMe time (drive; 0
// where no parameter is fetched from a drive) hides nothing. The gradient spill
// writes the drive too, in the backward, but a spilling pass starts at step() and meets the next
// forward, which spills nothing. Of that window at most c hides it, c = overlap_compute_fraction:
//   mb     = max(compute, collectives, param fetch, the gradients' link time)
//   hidden = min(optimizer_step, c·max(0, mb − drive))
//   step   = forward_backward + step_reduce + optimizer_step − hidden
// (where the half output does not stream the parts hide apart: below; where it streams and the
// pass updates in the backward, below too).
// The engine's pass runs during the backward where no global norm or loss scale decides the step
// first, from the last sub-group down as the backward makes them final; once the backward is
// over it turns and takes what is left from the first sub-group up (OverlappedStep::may_ascend),
// the order the next forward gathers in, and that forward's gather of a module waits only for
// that module's groups (OverlappedStep::await_module), then all-gathers stage 1-2's persistent
// groups (write_step() gathers nothing). So the streamed pass (UW = max(pipeline, upload), then
// G) has the backward, A, and runs on into the next forward, B, module by module; the pass opens
// in the backward, so A is the backward's share of c, and A + B at most about one micro-batch:
//   A  = min(c, 1 − F_fwd / F_mb)·max(0, mb − drive)
//   B  = min(c·max(0, mb − drive), max(0, forward − drive/2))       (forward: below)
//   S  = U / n, the first sub-group's update (U = update_alone_s, n sub-groups): a sub-group is
//        updated once all its groups are final (StoreState::sub_group_ready), and the first
//        sub-group's are final only when the backward ends, so at least its update is left then;
//        only the update waits (the pass opens at the backward's first reduction and reads on
//        while the update is held back), its half output is handed over once its writes are
//        submitted, and the next forward waits for the half shards, not the state's writes
//   R  = max(UW − A, S), left when the backward ends; f = R / UW, its share of the partition
//   X  = max(G, B), the next forward with its all-gathers
//   next forward = max(R + f·G, S + f·X) + (1 − f)·X    (its first f of the modules wait for
//                  the pass and then their all-gathers, none before the first sub-group's S;
//                  the rest were written in the backward)
//   hidden = UW + G − (next forward − B)
// With one micro-batch, nothing on the drive, G = 0 and c >= 2/3 (A + B = mb) that is
// step = step_reduce + max(forward_backward + S, UW + (A / UW)·B) where UW > A + S (else
// forward_backward + S): the compute and then the first sub-group's update, or the pass's
// critical path, the pass and then the forward of the modules it wrote in the backward.
// c = 2/3, the backward's share of the FLOPs, is the default. The pass opens in the
// backward only at stages 2-3 with the gradients in host memory (Engine's opens_in_backward_),
// and updates there only without exact clipping and fp16 loss scaling (in_backward_;
// EngineSetup::exact_clipping_or_loss_scaling). Otherwise (stage 1, which waits for step()'s
// reduction; spilled gradients; exact clipping; loss scaling) the updates start at step() and
// hide behind the next step's first forward at most, whatever c says:
//   hidden = min(optimizer_step, c·max(0, mb − drive), max(0, max(F_fwd / rate, stage 3's
//                forward all-gather, half the param fetch) − drive/2))
// with F_fwd = (2·P + 4·L·h·s)·s·b the forward's FLOPs: a third of a micro-batch's, a quarter
// with checkpointing, more with frozen parameters.
// Where the half output does not stream (the optimizer state on the host, or on NVMe at stage 3
// with the params in host memory) the engine runs the whole update U first and then writes the
// new half shards W (run_optimizer(), then write_step() -> publish_pass()), and the next
// forward's gather of a module waits until the pass has written its groups
// (OverlappedStep::await_module): no shard is written before U is over. So the parts hide apart:
// U behind the backward where the pass updates there, c·mb but at most the backward's share of
// the micro-batch's FLOPs (what is left of U then holds up the next forward; no fetch reads its
// drive: with the params on NVMe the state is on the host), else behind nothing; W to NVMe, written
// group by group and each flagged once on the drive, behind the next forward as above; W up to the
// device the same way (each group flagged as its copy is queued, Publisher::write_group, and the
// store's unpinned host array staged as each copy is issued, so the next forward's gathers fall
// between the uploads); W into host shards, copied from the store's half array, the same way; and
// stages 1-2's publish G, all-gathered module by module in the next forward, behind it as W:
//   hidden = min(U, updates in the backward ? min(c, 1 − F_fwd / F_mb)·mb : 0)
//          + min(W + G, c·max(0, mb − drive), max(0, max(F_fwd / rate, ...) − drive/2))
// The optimizer on the device does not overlap (above).
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "plan/estimate.hpp"
#include "plan/model.hpp"

namespace zinf::plan {

// What a machine can do; every rate in GB/s (1e9 bytes/s). Zero means unknown.
struct MachineProfile {
  double mem_adam_gbps = 0;   // the fp32 Adam access pattern (zinf probe: mem_adam_pattern_gbps)
  double nvme_read_gbps = 0;  // the machine's NVMe path, all drives together
  double nvme_write_gbps = 0;
  // Bytes read + written per second with reads and writes at once; 0 = unknown, and the drive
  // is taken to serve them from one budget (io = reads/read_rate + writes/write_rate).
  double nvme_duplex_gbps = 0;
  // The request size and queue depth those rates were measured at (0: unknown); the plan
  // configures the engine's I/O the same way.
  std::uint64_t nvme_block_bytes = 0;
  std::uint64_t nvme_queue_depth = 0;
  double h2d_gbps = 20;        // per GPU, host↔device (PCIe 4.0 x16 in practice)
  double gpu_mem_gbps = 1000;  // device memory bandwidth, for the optimizer on the device
  double gpu_tflops = 0;       // achieved dense half-precision TFLOP/s; 0 = not modelled
  double gpu_link_gbps = 0;    // collective bus bandwidth per GPU; 0 = not modelled
  int cpu_cores = 0;
  // Where each figure came from, for the output ("file ~/.cache/zinf/machine.json",
  // "measured now", "--nvme-read-gbps").
  std::string memory_source;
  std::string nvme_source;
  std::string gpu_source = "defaults (pass --h2d-gbps, --gpu-mem-gbps, --gpu-tflops)";
};

struct StepPrediction {
  // Optimizer step.
  double update_alone_s = 0;  // U
  double io_read_s = 0;
  double io_write_s = 0;
  double io_alone_s = 0;  // io_read_s + io_write_s
  double pipeline_s = 0;
  double param_upload_s = 0;
  double publish_gather_s = 0;  // stages 1-2: the new half params all-gathered
  double optimizer_step_s = 0;
  std::uint64_t sub_groups = 0;
  std::uint64_t buffers = 0;
  // Forward and backward.
  double compute_s = 0;
  double collectives_s = 0;
  double param_fetch_s = 0;
  double grad_offload_s = 0;
  double forward_backward_s = 0;
  double optimizer_hidden_s = 0;  // of optimizer_step_s, behind compute (the overlapped step)
  double step_reduce_s = 0;       // stage 1's reduce-scatter at step(), behind no compute
  double step_s = 0;
  // Traffic per step, per machine.
  std::uint64_t nvme_read_bytes = 0;
  std::uint64_t nvme_write_bytes = 0;
  std::uint64_t adam_memory_bytes = 0;
  // Collectives per step, per rank, as EngineCounters counts them (see above).
  std::uint64_t reduce_scatter_bytes = 0;
  std::uint64_t all_gather_bytes = 0;
};

// REQUIRES: validate_setup(setup) is OK; profile.mem_adam_gbps > 0; NVMe rates > 0 when any
// state is on NVMe.
StepPrediction predict_step(const ModelShape& model, const TrainingShape& training,
                            const EngineSetup& setup, const MachineProfile& profile);

// The optimizer step alone on one rank, as `zinf bench step --params N --tier T --sub-group S
// --pool P` runs it over a StateStore (lib/tier/state_store.hpp), whose sizing this follows:
//   pieces per parameter: fp32 master, m, v (12 B), fp32 gradient (4 B), bf16 half copy (2 B):
//                         18 B, of which `tier` nvme puts master, m, v and, as flagged, the
//                         gradient and the half copy on NVMe
//   sub-group            sub_group_bytes counts every piece, whatever its tier:
//                         Sg = min(floor(S / (18·2048))·2048, N) parameters
//   block                the NVMe pieces of one sub-group, each rounded up to 4 KiB;
//                         B = floor(P / block) blocks in the pool
//   NVMe traffic         reads 12 (+4 gradient) B, writes 12 (+2 half) B a parameter
//   update               30 B a parameter through memory at mem_adam_gbps
struct StepOnlySpec {
  std::uint64_t params = 0;
  OffloadDevice tier = OffloadDevice::kNvme;  // kNvme or kHost (everything in host memory)
  std::uint64_t sub_group_bytes = std::uint64_t{64} << 20;
  std::uint64_t pool_bytes = std::uint64_t{1} << 30;
  bool grads_on_nvme = true;  // StateStore's default puts every piece on NVMe
  bool half_on_nvme = true;
  // Whether the pass streams its half output, as streams_half() says for the engine's placement
  // (lib/engine/store_state.cpp, kStreamed): on tier nvme, except at stage 3 with the params in
  // host memory, where the store keeps a host half array (kFromStore; half_on_nvme false) and
  // the whole pass runs before the shards are written from it. Not streamed, the pass hides as
  // tier host's update does (below). Ignored on tier host, which never streams.
  bool streams_half = true;
  // Whether a half copy on NVMe (half_on_nvme) is written to the drive each pass, 2 B a
  // parameter: the StateStore's own (bench step) writes it, but the engine's streamed pass keeps
  // it in the pool block (StoreMedium::kBlock) and writes new half shards only to the params'
  // NVMe home (stage 3, params on NVMe), as predict_step counts them.
  bool half_written = true;
  // ZeRO stage: at stage 1, which reduce-scatters at step(), the pass starts there, as it does
  // with the gradients spilled (grads_on_nvme): predict_step's pass_opens_in_backward.
  int stage = 3;
  // A training step around the optimizer step (compute_s 0: the optimizer step alone, as bench
  // step runs it): the program's compute of a step, measured (forward + backward + gathers +
  // reductions of every micro-batch), in micro_batches alike micro-batches; host_compute when
  // it runs on this machine's CPU cores (HostDevice, as examples/train_lm); overlap for
  // zinf.overlap_step.
  double compute_s = 0;
  std::uint64_t micro_batches = 1;
  bool host_compute = false;
  bool overlap = true;
  double overlap_fraction = 2.0 / 3.0;  // c, as EngineSetup::overlap_compute_fraction
  // As EngineSetup::exact_clipping_or_loss_scaling: the pass hides behind the next forward only
  // on the NVMe tier, and behind nothing in host memory.
  bool exact_clipping_or_loss_scaling = false;
  // As TrainingShape::checkpoint_activations: the forward runs twice, a quarter of the compute.
  bool checkpoint_activations = false;
};

struct StepOnlyLayout {
  std::uint64_t bytes_per_param = 0;
  std::uint64_t sub_group_params = 0;  // 0: sub_group_bytes is under 2048 parameters
  std::uint64_t sub_groups = 0;
  std::uint64_t block_bytes = 0;  // 0 on the host tier
  std::uint64_t blocks = 0;
  std::uint64_t read_per_param = 0;
  std::uint64_t write_per_param = 0;
};

StepOnlyLayout step_only_layout(const StepOnlySpec& spec);

// Whether the spec's pass updates only from step(), as predict_step's updates_in_backward says
// for an engine: at stage 1 (the reduce-scatter at step()) and with the gradients spilled (read
// whole at step()) the pass starts there; with exact clipping or loss scaling its updates wait
// for step().
bool step_only_starts_at_step(const StepOnlySpec& spec);

// With spec.compute_s, forward_backward_s is that compute and step_s the training step: the
// sum with overlap off, and with overlap on the pass meets one micro-batch, mb = compute / m
// with m = spec.micro_batches (predict_step's window):
//   hidden = min(optimizer_step − H, c·mb),   step = compute + optimizer_step − hidden
// with c = spec.overlap_fraction (as in predict_step). On tier nvme, whose pass streams its
// writes (spec.streams_half), c is at most the forward's share of a micro-batch where the
// updates start at step() (exact clipping or loss scaling, stage 1, spilled gradients):
// predict_step's FLOP count with nothing frozen and no attention term, 1/3, or 1/4 with
// spec.checkpoint_activations; without them the streamed pass hides in c·mb,
// not module by module as predict_step's streamed pass does (the measured 1B step of train_lm,
// whose forward shares the host's cores with the pass, is the check of this form:
// docs/PLAN.md). On tier host, and on tier nvme where the pass does not stream (stage 3, params
// in host memory), the optimizer step is the update alone (the whole pipeline, with the state on
// NVMe), which hides as predict_step's U: c at most the backward's share (2/3, 3/4 with
// checkpointing), and 0 where the updates start at step(). H is the part of the pass that cannot
// hide: 0 when the compute runs elsewhere (a GPU), so on tier nvme with one micro-batch and c = 1
// step = max(compute, optimizer_step); the update U when the compute runs on the host's
// cores, which the update's threads then share (all of them, at the memory's bandwidth). With
// one micro-batch, c = 2/3 (the pass behind the backward) and F = compute/3 the forward:
// step = F + max(2F + H, optimizer_step).
// REQUIRES: step_only_layout(spec).sub_group_params > 0, at least 2 blocks on NVMe,
// profile.mem_adam_gbps > 0, NVMe rates > 0 for tier nvme, spec.compute_s >= 0,
// spec.micro_batches >= 1.
StepPrediction predict_optimizer_step(const StepOnlySpec& spec, const MachineProfile& profile);

}  // namespace zinf::plan
