#include "plan/time_model.hpp"

#include <algorithm>

#include "base/arith.hpp"
#include "base/assert.hpp"
#include "tier/state_store.hpp"

namespace zinf::plan {
namespace {

constexpr double kGiga = 1e9;

double seconds(double bytes, double gbps) { return gbps > 0 ? bytes / (gbps * kGiga) : 0.0; }

// The NVMe pipeline reading `read_bytes` and writing `write_bytes` (all ranks of a machine) in
// `sub_groups` sub-groups with `buffers` blocks; out->update_alone_s must be set. See the header
// for the formula.
void nvme_pipeline(double read_bytes, double write_bytes, std::uint64_t sub_groups,
                   std::uint64_t buffers, const MachineProfile& profile, StepPrediction* out) {
  ZINF_ASSERT_MSG(profile.nvme_read_gbps > 0 && profile.nvme_write_gbps > 0,
                  "predict_step: no NVMe rates for state on NVMe");
  ZINF_ASSERT(sub_groups > 0);
  out->nvme_read_bytes += static_cast<std::uint64_t>(read_bytes);
  out->nvme_write_bytes += static_cast<std::uint64_t>(write_bytes);
  out->io_read_s = seconds(read_bytes, profile.nvme_read_gbps);
  out->io_write_s = seconds(write_bytes, profile.nvme_write_gbps);
  const double both_bytes = read_bytes + write_bytes;
  out->io_alone_s = profile.nvme_duplex_gbps > 0
                        ? std::max({out->io_read_s, out->io_write_s,
                                    seconds(both_bytes, profile.nvme_duplex_gbps)})
                        : out->io_read_s + out->io_write_s;
  out->sub_groups = sub_groups;
  out->buffers = buffers;
  // Per sub-group times: every rank of the machine steps its own sub-group at once, so one
  // "sub-group time" covers R sub-groups sharing the drive and the memory.
  const double fraction = 1.0 / static_cast<double>(sub_groups);
  const double r = out->io_read_s * fraction;
  const double w = out->io_write_s * fraction;
  const double u = out->update_alone_s * fraction;
  const double io = out->io_alone_s * fraction;
  const double per_sub_group =
      std::max({io, u, (r + u + w) / static_cast<double>(std::max<std::uint64_t>(1, buffers))});
  out->pipeline_s = static_cast<double>(sub_groups - 1) * per_sub_group + (r + u + w);
}

// The optimizer pipeline over one machine's shards of `shard_params` elements, of which
// `trainable_params` train (see the header for the formula).
void predict_pipeline(std::uint64_t shard_params, std::uint64_t trainable_params,
                      std::uint64_t trainable_runs, const EngineSetup& s,
                      const MachineProfile& profile, StepPrediction* out) {
  const double ranks = static_cast<double>(s.ranks_per_machine);
  const bool on_device = s.optimizer == OffloadDevice::kNone;
  // The pass steps the trainable share: the device optimizer skips its frozen runs (their moments
  // are zero and not stored, lib/engine/device_optimizer.cpp); offloaded, the pass passes over
  // the frozen sub-groups, and reads nothing of them even where the half output streams (the
  // frozen groups' shards are not republished, so their half copy is not handed on).
  const std::uint64_t stepped = trainable_params;
  // Read the fp32 gradient (4), read and write p, m, v (24), write the half copy (2).
  const double adam_bytes_per_param = 30.0;
  const double adam_gbps = on_device ? profile.gpu_mem_gbps : profile.mem_adam_gbps;
  ZINF_ASSERT_MSG(adam_gbps > 0, "predict_step: no memory bandwidth for the optimizer");
  out->adam_memory_bytes =
      static_cast<std::uint64_t>(ranks * static_cast<double>(stepped) * adam_bytes_per_param);
  // Device optimizers run per GPU, in parallel; the CPU optimizer of R ranks shares one memory.
  out->update_alone_s =
      on_device ? seconds(static_cast<double>(stepped) * adam_bytes_per_param, adam_gbps)
                : seconds(static_cast<double>(out->adam_memory_bytes), adam_gbps);

  if (s.optimizer != OffloadDevice::kNvme) {
    out->sub_groups = ceil_div(shard_params, s.sub_group_params);
    out->buffers = 0;
    out->pipeline_s = out->update_alone_s;
    return;
  }
  const double read_per_param = s.gradients_on_nvme ? 16.0 : 12.0;
  const double write_per_param = 12.0;
  // With the half params' home on NVMe too, the pass writes the new half shards of the trainable
  // groups: a frozen group's shard already holds what a step would write.
  const double half_write_per_param = s.params == OffloadDevice::kNvme ? 2.0 : 0.0;
  const double stepped_params = ranks * static_cast<double>(stepped);
  const double read_bytes = stepped_params * read_per_param;
  const double write_bytes =
      stepped_params * write_per_param + stepped_params * half_write_per_param;
  // The pass cuts its sub-groups at both ends of each trainable run as well as every Sg
  // elements: at least a sub-group a run. The frozen gaps between runs are sub-groups too, but
  // passed over, reading and writing nothing, they take no part in the pipeline's time. At least
  // one either way: a rank steps at least one element, and predict_step() counts a run at least.
  std::uint64_t sub_groups = ceil_div(stepped, s.sub_group_params);
  if (stepped < shard_params) sub_groups = std::max(sub_groups, trainable_runs);
  nvme_pipeline(read_bytes, write_bytes, sub_groups, s.buffer_count, profile, out);
}

// A micro-batch's FLOPs, and its forward's: 6 a token for a trainable parameter and 4 for a
// frozen one, 12·L·h·s for the attention (of which the forward does 2 a parameter and 4·L·h·s),
// and checkpointing's second forward. `attention` is L·h·s; counts as doubles.
struct MicroBatchFlops {
  double forward = 0;
  double total = 0;
};

MicroBatchFlops micro_batch_flops(double params, double trainable, double attention, double tokens,
                                  bool checkpoint_activations) {
  MicroBatchFlops f;
  f.forward = (2.0 * params + 4.0 * attention) * tokens;
  f.total = (6.0 * trainable + 4.0 * (params - trainable) + 12.0 * attention) * tokens;
  if (checkpoint_activations) f.total += f.forward;
  return f;
}

// Whether the engine's overlapped pass opens during the backward (Engine's opens_in_backward_:
// the state gates the pass on each sub-group's reductions and the reducer zeroes its
// accumulator group by group): at stages 2-3 with the gradients in host memory. At stage 1,
// which reduce-scatters at step(), and with the gradients spilled to NVMe, whose sub-groups are
// read whole, it starts at step().
bool pass_opens_in_backward(const EngineSetup& s) { return s.stage >= 2 && !s.gradients_on_nvme; }

// Whether the pass updates during the backward (Engine's in_backward_): where it opens there and
// nothing global decides the step first. With exact clipping or fp16 loss scaling it only reads
// ahead until step() has the norm or the overflow check, and the updates meet the next forward.
bool updates_in_backward(const EngineSetup& s) {
  return pass_opens_in_backward(s) && !s.exact_clipping_or_loss_scaling;
}

// The part of a streamed pass that shows where it updates in the backward and runs on into the
// next forward (the header's formula): `pass_s` its update and writes (UW), `first_s` the first
// sub-group's update (S), `gather_s` stage 1-2's all-gather (G), `backward_s` and `forward_s` the
// backward's and the next forward's windows (A, B). The pass does A of UW in the backward, from
// the last sub-group down, but a sub-group is updated only once all its groups are final
// (StoreState::sub_group_ready), and the backward makes the first sub-group's final last. Only
// the update waits for that: the pass opens at the backward's first reduction and its reads go
// on while the update is held back, so the first sub-group's read is done by then; its half
// output is handed over as soon as its writes are submitted, and the next forward waits for the
// half shards only, not the state's writes. So at least that sub-group's update, S, is left when
// the backward ends. The rest, R = max(UW − A, S), is the share f = R / UW of the partition from
// the first sub-group up, which the next forward gathers first, each module waiting for its
// writes and then its all-gather. So that forward runs its first f of the modules behind the
// pass: R, then their all-gathers f·G, or, if longer, the first sub-group's wait S and then its
// own f·X, X = max(G, B) the forward with its all-gathers; and the rest, written in the
// backward, at its own pace, (1 − f)·X. Without the pass it takes B.
double streamed_pass_shown(double pass_s, double first_s, double gather_s, double backward_s,
                           double forward_s) {
  const double rest_s = std::max(pass_s - backward_s, first_s);
  const double rest_share = pass_s > 0 ? rest_s / pass_s : 0.0;
  const double alone_s = std::max(gather_s, forward_s);
  const double next_forward_s =
      std::max(rest_s + rest_share * gather_s, first_s + rest_share * alone_s) +
      (1.0 - rest_share) * alone_s;
  return std::clamp(next_forward_s - forward_s, 0.0, pass_s + gather_s);
}
}  // namespace

StepPrediction predict_step(const ModelShape& model, const TrainingShape& training,
                            const EngineSetup& s, const MachineProfile& profile) {
  ZINF_ASSERT_MSG(validate_setup(s).is_ok(), "predict_step: invalid setup");
  StepPrediction out;
  const std::uint64_t p = param_count(model);
  const std::uint64_t pr = ceil_div(p, s.world_size);
  const double ranks = static_cast<double>(s.ranks_per_machine);
  const double n = static_cast<double>(s.world_size);

  const std::uint64_t t = trainable_param_count(model);
  const std::uint64_t tr = trainable_shard_params(model, s.world_size);
  // A rank's share of the trainable runs: each rank's partition holds 1/N of the model's.
  const std::uint64_t runs =
      std::max<std::uint64_t>(1, ceil_div(model.trainable_runs, s.world_size));
  predict_pipeline(pr, tr, runs, s, profile, &out);
  // The new half params go to their home: uploaded to the device when the optimizer ran on the
  // host; downloaded when it ran on the device but the params live offloaded; written to NVMe
  // (outside the pipeline) when the optimizer state is not on NVMe and the params live there.
  // The device optimizer's shards come down and go to the drive group by group, each copy waited
  // for before its write and each write before the next copy (DeviceState::publish_step ->
  // ParamCoordinator::write_shard_from_device): the two add up for a rank (below for R ranks).
  // With the optimizer on the host the values are in host memory already and only the writes
  // remain. Only the trainable groups' shards are republished: no step changes a frozen one.
  const double half_bytes = 2.0 * static_cast<double>(tr);
  if (s.optimizer != OffloadDevice::kNone && s.params == OffloadDevice::kNone) {
    out.param_upload_s = seconds(half_bytes, profile.h2d_gbps);
  } else if (s.optimizer == OffloadDevice::kNone && s.params != OffloadDevice::kNone) {
    out.param_upload_s = seconds(half_bytes, profile.h2d_gbps);
  }
  if (s.params == OffloadDevice::kNvme && s.optimizer != OffloadDevice::kNvme) {
    out.nvme_write_bytes += static_cast<std::uint64_t>(ranks * half_bytes);
    const double drive_s = seconds(ranks * half_bytes, profile.nvme_write_gbps);
    if (s.optimizer == OffloadDevice::kNone) {
      // Each rank waits for its own copy down and then its own writes, but the machine's R ranks
      // share the drive: one rank's download overlaps the others' writes, so the drive's R·W1 or
      // one rank's D + W1, whichever is longer.
      const double own_writes_s = seconds(half_bytes, profile.nvme_write_gbps);
      out.param_upload_s = std::max(drive_s, out.param_upload_s + own_writes_s);
    } else {
      out.param_upload_s += drive_s;
    }
  }
  // Where the half output does not stream with the pass (streams_half: only the optimizer state
  // on NVMe streams it), the engine runs the whole update first and only then hands every
  // trainable shard's new half to its home: run_optimizer() calls the state's step() and then
  // write_step() or publish_step(). With the optimizer offloaded the update fills the store's
  // half array and publish_pass() uploads it, writes it to NVMe or copies it to the host shards;
  // on the device DeviceOptimizer::step() synchronizes and publish_step() copies each group down
  // and writes it. Streamed, the pass writes each shard as its sub-group completes, beside the
  // update.
  const bool writes_follow_update = !streams_half(s);
  // Not streamed, an offloaded pass's new half values land in the store's half array and
  // publish_pass() then copies them into the host shards where the params live in host memory:
  // 2·Tr read and 2·Tr written a rank through the machine's memory, which its R ranks share.
  if (writes_follow_update && s.optimizer != OffloadDevice::kNone &&
      s.params == OffloadDevice::kHost) {
    out.param_upload_s += seconds(ranks * 2.0 * half_bytes, profile.mem_adam_gbps);
  }
  // Collectives move fp32 gradients into their reduce-scatters (the engine fills its buckets with
  // the fp32 gradients and reduce-scatters them as such: lib/zero/grad_reducer.cpp, reduce_group)
  // and half params out of their all-gathers; each moves (N-1)/N of its bytes per rank.
  const double micro_batches =
      static_cast<double>(std::max<std::uint64_t>(1, training.grad_accum_steps));
  const double link_share = (n - 1.0) / n;
  // Stages 1-2 all-gather the new half params once a step, as the optimizer step publishes them:
  // part of the optimizer step, beside their upload. Only the trainable groups are republished
  // (the engine's publish after a step leaves the frozen groups, which no step changes), 2·T.
  const double published = s.stage == 3 ? 0.0 : 2.0 * static_cast<double>(t);
  out.publish_gather_s = seconds(published * link_share, profile.gpu_link_gbps);
  // The all-gather follows the writes in every placement: the step's publish() all-gathers the
  // persistent groups from their new shards once they are written, on the coordinator's stream
  // behind the uploads (Publisher::write_shards, then publish()).
  out.optimizer_step_s = (writes_follow_update ? out.pipeline_s + out.param_upload_s
                                               : std::max(out.pipeline_s, out.param_upload_s)) +
                         out.publish_gather_s;

  // Forward and backward of one micro-batch.
  const double tokens = static_cast<double>(training.seq_len * training.micro_batch);
  const double attention = static_cast<double>(model.layers * model.hidden * training.seq_len);
  // The forward alone: 2 a parameter, frozen or not, and the attention's forward third
  // (4·L·h·s). Checkpointing runs it once more: without frozen parameters the 4/3 of the whole.
  const MicroBatchFlops flops =
      micro_batch_flops(static_cast<double>(p), static_cast<double>(t), attention, tokens,
                        training.checkpoint_activations);
  const double forward_flops = flops.forward;
  out.compute_s = profile.gpu_tflops > 0 ? flops.total / (profile.gpu_tflops * 1e12) : 0.0;

  // Per micro-batch, behind its compute: stage 3 all-gathers every module for the forward and
  // again for the backward, and stages 2-3 reduce-scatter the trainable gradients (a frozen
  // module is never reduced). Stage 1 adds each micro-batch's gradients into its full fp32 copy
  // on the device and reduces nothing until step().
  const double gathered = s.stage == 3 ? 2.0 * 2.0 * static_cast<double>(p) : 0.0;
  const double reduced = s.stage == 1 ? 0.0 : 4.0 * static_cast<double>(t);
  out.collectives_s = seconds((gathered + reduced) * link_share, profile.gpu_link_gbps);
  // Stage 1 reduce-scatters the accumulated full gradients of the trainable groups once a step,
  // at step() (a frozen group has no full copy and is not reduced: 4·T; the engine's groups,
  // one module's each, are all frozen or all trainable), and the reduced
  // fp32 shard comes down to an offloaded optimizer's accumulator chunk by chunk as it goes
  // (GradReducer::reduce_accumulated), 4·Tr: before the optimizer step can begin, behind no
  // compute.
  const double step_reduced = s.stage == 1 ? 4.0 * static_cast<double>(t) : 0.0;
  if (s.stage == 1) {
    out.step_reduce_s = seconds(step_reduced * link_share, profile.gpu_link_gbps);
    if (s.optimizer != OffloadDevice::kNone) {
      out.step_reduce_s =
          std::max(out.step_reduce_s, seconds(4.0 * static_cast<double>(tr), profile.h2d_gbps));
    }
  }
  // The bytes per rank and step as the engine's counters count them (EngineCounters: the whole
  // bucket into a reduce-scatter, the whole group out of an all-gather), with more than one rank.
  if (s.world_size > 1) {
    out.reduce_scatter_bytes =
        static_cast<std::uint64_t>(s.stage == 1 ? step_reduced : micro_batches * reduced);
    out.all_gather_bytes = static_cast<std::uint64_t>(micro_batches * gathered + published);
  }

  // The fetch's time on the drive, where the parameters live on NVMe: all ranks of the machine
  // read their modules from it, half for the forward and half for the backward.
  double fetch_drive_s = 0.0;
  if (s.stage == 3 && s.params != OffloadDevice::kNone) {
    const double fetch_bytes = 2.0 * 2.0 * static_cast<double>(pr);
    out.param_fetch_s = seconds(fetch_bytes, profile.h2d_gbps);
    if (s.params == OffloadDevice::kNvme) {
      out.nvme_read_bytes += static_cast<std::uint64_t>(ranks * fetch_bytes);
      fetch_drive_s = seconds(ranks * fetch_bytes, profile.nvme_read_gbps);
      out.param_fetch_s = std::max(out.param_fetch_s, fetch_drive_s);
    }
  }
  // Gradient offload of the first micro-batch and of each later one (they differ when spilled:
  // later micro-batches read the sums back before adding).
  double offload_first_s = 0.0, offload_later_s = 0.0, offload_link_s = 0.0;
  if (s.optimizer != OffloadDevice::kNone && s.stage != 1) {
    // The reduced fp32 chunks come down as they are (GradReducer::accumulate): 4 B an element.
    offload_link_s = seconds(4.0 * static_cast<double>(tr), profile.h2d_gbps);
    offload_first_s = offload_later_s = offload_link_s;
    if (s.gradients_on_nvme) {
      const double spill_bytes = ranks * 4.0 * static_cast<double>(pr);
      out.nvme_write_bytes += static_cast<std::uint64_t>(micro_batches * spill_bytes);
      out.nvme_read_bytes += static_cast<std::uint64_t>((micro_batches - 1.0) * spill_bytes);
      const double write_s = seconds(spill_bytes, profile.nvme_write_gbps);
      const double read_s = seconds(spill_bytes, profile.nvme_read_gbps);
      const double both_s =
          profile.nvme_duplex_gbps > 0
              ? std::max({read_s, write_s, seconds(2.0 * spill_bytes, profile.nvme_duplex_gbps)})
              : read_s + write_s;
      offload_first_s = std::max(offload_first_s, write_s);
      offload_later_s = std::max(offload_later_s, both_s);
    }
  }
  out.grad_offload_s = (offload_first_s + (micro_batches - 1.0) * offload_later_s) / micro_batches;
  const double others_s = std::max({out.compute_s, out.collectives_s, out.param_fetch_s});
  out.forward_backward_s = std::max(others_s, offload_first_s) +
                           (micro_batches - 1.0) * std::max(others_s, offload_later_s);
  if (s.overlap_step && s.optimizer != OffloadDevice::kNone) {
    const double fraction = std::clamp(s.overlap_compute_fraction, 0.0, 1.0);
    // The pass uses an NVMe drive where the optimizer state is there, and where the parameters'
    // home is (it writes the new half params there, param_upload_s). Only parameters on NVMe are
    // fetched from a drive, and then the pass uses it too: the micro-batch's parameter fetch
    // reads that drive, and what waits on the fetch waits on the drive, so the drive's part of
    // the window is the fetch's, and what writes the drive hides in the micro-batch's time less
    // the drive's, never behind compute that itself waits for it. With the optimizer state on
    // the host only the half writes use the drive: the update hides apart from them (below).
    // The gradient spill writes that drive in the backward; it is not part of the window (the
    // micro-batch counts the gradients' link time only), and the pass that meets a spilling
    // micro-batch starts at step() and meets the next forward, which spills nothing.
    const double drive_s = fetch_drive_s;
    // One micro-batch's time, not the step's: the pass that updates in the backward does so in
    // the last micro-batch's, and one that starts at step() meets the next step's first
    // micro-batch.
    const double micro_batch_s =
        std::max({out.compute_s, out.collectives_s, out.param_fetch_s, offload_link_s});
    const double window_s = fraction * std::max(0.0, micro_batch_s - drive_s);
    // A pass that starts at step() (stage 1, spilled gradients) or updates only after it (exact
    // clipping, loss scaling) hides behind the next step's first forward at most: the forward's
    // FLOPs (a third of a micro-batch's, a quarter with checkpointing, more with frozen
    // parameters, which do less of the backward), stage 3's forward all-gather (half of the
    // micro-batch's gathers) and the forward's half of the parameter fetch, less the forward's
    // half of the fetch's time on the drive.
    const double forward_compute_s =
        profile.gpu_tflops > 0 ? forward_flops / (profile.gpu_tflops * 1e12) : 0.0;
    const double forward_gather_s = seconds(gathered / 2.0 * link_share, profile.gpu_link_gbps);
    const double forward_s =
        std::max({forward_compute_s, forward_gather_s, out.param_fetch_s / 2.0});
    const double at_step_window_s = std::min(window_s, std::max(0.0, forward_s - drive_s / 2.0));
    if (writes_follow_update) {
      // The next forward's gather of a module waits for the pass to have written its groups
      // (OverlappedStep::await_module, the publisher's written flags), and none is written before
      // the whole update is over. The update meets no fetch from its own drive (with the params
      // on NVMe the optimizer state is on the host): it hides behind the backward's part of c of
      // the micro-batch where it runs there (below), and behind nothing where it starts at step()
      // (the next forward's first gather of a module with trained parameters waits for all of
      // it; Publisher::begin_pass flags frozen groups written, so a frozen prefix of the forward
      // runs meanwhile, but the planner knows how many parameters train, not where: it counts no
      // such prefix, a deliberately conservative cap). After it the new shards go home
      // group by group, each flagged written as its copy is queued (Publisher::write_group), so
      // they meet the next forward module by module: the NVMe params' writes, whose fetch reads the
      // same drive, and the uploads to the device alike (their source, the store's unpinned host
      // array, is staged as each copy is issued, so the writes run at the link's rate and the
      // forward's gathers fall between them). The copies into host shards the same way. At stages
      // 1-2 the persistent groups are all-gathered module by module in the next forward
      // (await_module), behind its compute. So the update's window ends with the backward: c of
      // the micro-batch, at most the backward's share of its FLOPs (2/3, 3/4 with checkpointing,
      // about 1/2 with most parameters frozen); what is left of the update when the backward ends
      // holds up the next forward, whose window the writes have to themselves. Together they
      // hide at most one micro-batch: the last backward and the next forward.
      const double backward_share = flops.total > 0 ? 1.0 - flops.forward / flops.total : 0.0;
      const double update_window_s =
          updates_in_backward(s) ? std::min(fraction, backward_share) * micro_batch_s : 0.0;
      out.optimizer_hidden_s =
          std::min(out.pipeline_s, update_window_s) +
          std::min(out.param_upload_s + out.publish_gather_s, at_step_window_s);
    } else if (updates_in_backward(s)) {
      // Streamed, the pass updates and writes each sub-group as the backward makes it final, from
      // the last down, and runs on into the next forward: once the backward is over it turns and
      // takes what is left from the first sub-group up (OverlappedStep::may_ascend), the order
      // the next forward gathers in, and that forward's gather of a module waits only for that
      // module's groups (OverlappedStep::await_module), which then all-gathers the stage 1-2
      // persistent groups (write_step() gathers nothing). The pass opens in the backward: it has
      // the backward's share of c, not the forward before it, so together with the next forward
      // its windows are at most one micro-batch (the last backward and the next forward).
      const double backward_share = flops.total > 0 ? 1.0 - flops.forward / flops.total : 0.0;
      const double backward_window_s =
          std::min(fraction, backward_share) * std::max(0.0, micro_batch_s - drive_s);
      out.optimizer_hidden_s =
          out.optimizer_step_s -
          streamed_pass_shown(
              out.optimizer_step_s - out.publish_gather_s,
              out.update_alone_s / static_cast<double>(std::max<std::uint64_t>(1, out.sub_groups)),
              out.publish_gather_s, backward_window_s, at_step_window_s);
    } else {
      out.optimizer_hidden_s = std::min(out.optimizer_step_s, at_step_window_s);
    }
  }
  out.step_s =
      out.forward_backward_s + out.step_reduce_s + out.optimizer_step_s - out.optimizer_hidden_s;
  return out;
}

StepOnlyLayout step_only_layout(const StepOnlySpec& spec) {
  StepOnlyLayout l;
  const bool nvme = spec.tier == OffloadDevice::kNvme;
  const std::uint64_t grads_bytes = 4;
  const std::uint64_t half_bytes = 2;
  l.bytes_per_param = 12 + grads_bytes + half_bytes;
  // The StateStore sizes sub-groups in multiples of kSubGroupParamQuantum parameters, never more
  // than the partition.
  l.sub_group_params =
      spec.sub_group_bytes / (kSubGroupParamQuantum * l.bytes_per_param) * kSubGroupParamQuantum;
  if (l.sub_group_params == 0) return l;
  l.sub_group_params = std::min(l.sub_group_params, spec.params);
  l.sub_groups = ceil_div(spec.params, l.sub_group_params);
  if (!nvme) return l;
  // A block holds the sub-group's NVMe pieces, each at a 4 KiB-aligned slot.
  auto slot = [&](std::uint64_t bytes_per_param) {
    return (l.sub_group_params * bytes_per_param + 4095) / 4096 * 4096;
  };
  l.block_bytes = 3 * slot(4);
  if (spec.grads_on_nvme) l.block_bytes += slot(grads_bytes);
  if (spec.half_on_nvme) l.block_bytes += slot(half_bytes);
  l.blocks = spec.pool_bytes / l.block_bytes;
  l.read_per_param = 12 + (spec.grads_on_nvme ? grads_bytes : 0);
  l.write_per_param = 12 + (spec.half_on_nvme && spec.half_written ? half_bytes : 0);
  return l;
}

bool step_only_starts_at_step(const StepOnlySpec& spec) {
  return spec.stage < 2 || spec.grads_on_nvme || spec.exact_clipping_or_loss_scaling;
}

StepPrediction predict_optimizer_step(const StepOnlySpec& spec, const MachineProfile& profile) {
  const StepOnlyLayout l = step_only_layout(spec);
  ZINF_ASSERT(l.sub_group_params > 0);
  ZINF_ASSERT(spec.tier != OffloadDevice::kNvme || l.blocks >= 2);
  ZINF_ASSERT_MSG(profile.mem_adam_gbps > 0, "predict_optimizer_step: no memory bandwidth");
  StepPrediction out;
  const double params = static_cast<double>(spec.params);
  out.adam_memory_bytes = static_cast<std::uint64_t>(params * 30.0);
  out.update_alone_s = seconds(params * 30.0, profile.mem_adam_gbps);
  out.sub_groups = l.sub_groups;
  if (spec.tier == OffloadDevice::kNvme) {
    nvme_pipeline(params * static_cast<double>(l.read_per_param),
                  params * static_cast<double>(l.write_per_param), l.sub_groups, l.blocks, profile,
                  &out);
  } else {
    out.pipeline_s = out.update_alone_s;
  }
  out.optimizer_step_s = out.pipeline_s;
  ZINF_ASSERT(spec.compute_s >= 0);
  ZINF_ASSERT(spec.micro_batches >= 1);
  out.forward_backward_s = spec.compute_s;
  if (spec.compute_s > 0 && spec.overlap) {
    const double unhidden = spec.host_compute ? out.update_alone_s : 0.0;
    double fraction = std::clamp(spec.overlap_fraction, 0.0, 1.0);
    // The shares of a micro-batch's FLOPs counted as predict_step counts them, for a model with
    // nothing frozen and the attention's FLOPs left out (--step-only has no shape): the forward
    // 1/3, 1/4 with checkpointing.
    const MicroBatchFlops flops =
        micro_batch_flops(1.0, 1.0, 0.0, 1.0, spec.checkpoint_activations);
    const double forward_share = flops.forward / flops.total;
    const bool starts_at_step = step_only_starts_at_step(spec);
    if (spec.tier == OffloadDevice::kNvme && spec.streams_half) {
      // The pass streams its writes (predict_step's streamed pass). Where the updates start at
      // step() they meet the next forward at most.
      if (starts_at_step) fraction = std::min(fraction, forward_share);
    } else {
      // The optimizer state in host memory, or on NVMe with the half copy kept in host memory
      // (stage 3, params in host memory: the pass does not stream, and its whole pipeline, reads
      // and writes of the state included, is the update here): the whole update runs before any
      // write, and the next
      // forward's first gather of a module with trained parameters waits for all of it
      // (predict_step's writes_follow_update; conservative where the forward starts frozen). The
      // update hides in the backward, at most its share, where the pass updates there, and
      // behind nothing where it starts at step(). --step-only counts no writes or all-gather,
      // which predict_step hides behind the next forward.
      fraction = starts_at_step ? 0.0 : std::min(fraction, 1.0 - forward_share);
    }
    // The pass meets one micro-batch, as in predict_step.
    const double micro_batch_s = spec.compute_s / static_cast<double>(spec.micro_batches);
    out.optimizer_hidden_s =
        std::clamp(out.optimizer_step_s - unhidden, 0.0, fraction * micro_batch_s);
  }
  out.step_s = out.forward_backward_s + out.optimizer_step_s - out.optimizer_hidden_s;
  return out;
}

}  // namespace zinf::plan
