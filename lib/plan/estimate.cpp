#include "plan/estimate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "base/arith.hpp"
#include "base/assert.hpp"
#include "engine/param_groups.hpp"
#include "zero/partitioner.hpp"

namespace zinf::plan {

std::string_view memory_tier_name(MemoryTier tier) {
  switch (tier) {
    case MemoryTier::kDevice:
      return "device";
    case MemoryTier::kHost:
      return "host";
    case MemoryTier::kNvme:
      return "nvme";
  }
  return "?";
}

MemoryTier memory_tier(OffloadDevice offload) {
  switch (offload) {
    case OffloadDevice::kNone:
      return MemoryTier::kDevice;
    case OffloadDevice::kHost:
      return MemoryTier::kHost;
    case OffloadDevice::kNvme:
      return MemoryTier::kNvme;
  }
  return MemoryTier::kDevice;
}

std::string_view memory_use_name(MemoryUse kind) {
  switch (kind) {
    case MemoryUse::kHalfParams:
      return "half_params";
    case MemoryUse::kMasterParams:
      return "fp32_master";
    case MemoryUse::kMoments:
      return "moments";
    case MemoryUse::kGradients:
      return "gradients";
    case MemoryUse::kActivations:
      return "activations";
    case MemoryUse::kPinnedPool:
      return "pinned_pool";
    case MemoryUse::kGatheredParams:
      return "gathered_params";
    case MemoryUse::kCommBuckets:
      return "comm_buckets";
    case MemoryUse::kReserved:
      return "reserved";
    case MemoryUse::kHalfCopy:
      return "half_copy";
  }
  return "?";
}

Status validate_setup(const EngineSetup& s) {
  if (s.stage < 1 || s.stage > 3) {
    return Status::invalid_argument(
        fmt::format("zero_optimization.stage: {} is not 1, 2 or 3", s.stage));
  }
  if (s.params != OffloadDevice::kNone && s.stage != 3) {
    return Status::invalid_argument(
        fmt::format("zero_optimization.offload_param.device: {} needs stage 3, not {}",
                    offload_device_name(s.params), s.stage));
  }
  if (s.gradients_on_nvme && s.optimizer != OffloadDevice::kNvme) {
    return Status::invalid_argument(
        "zinf.gradients_on_nvme: needs zero_optimization.offload_optimizer.device nvme");
  }
  if (s.gradients_on_nvme && s.stage == 1) {
    return Status::invalid_argument("zinf.gradients_on_nvme: needs stage 2 or 3");
  }
  if (s.gradients_on_nvme && (s.gradient_spill_buffers == 0 || s.gradient_spill_buffers > 64)) {
    return Status::invalid_argument(
        fmt::format("zinf.gradient_spill_buffers: {} is not in 1..64", s.gradient_spill_buffers));
  }
  if (s.world_size == 0 || s.ranks_per_machine == 0 || s.world_size % s.ranks_per_machine != 0) {
    return Status::invalid_argument(
        fmt::format("zinf.world_size {} is not a nonzero multiple of zinf.ranks_per_machine {}",
                    s.world_size, s.ranks_per_machine));
  }
  if (s.sub_group_params == 0) {
    return Status::invalid_argument("zero_optimization.sub_group_size: must be positive");
  }
  if (s.optimizer == OffloadDevice::kNvme && s.buffer_count < 2) {
    return Status::invalid_argument(fmt::format(
        "zero_optimization.offload_optimizer.buffer_count: {} is below 2 (one buffer cannot "
        "overlap I/O with the update)",
        s.buffer_count));
  }
  return Status::ok();
}

bool streams_half(const EngineSetup& s) {
  return s.optimizer == OffloadDevice::kNvme && !(s.stage == 3 && s.params == OffloadDevice::kHost);
}

std::uint64_t sub_group_bytes_per_param(const EngineSetup& setup) {
  return (setup.gradients_on_nvme ? 16 : 12) + (streams_half(setup) ? 2 : 0);
}

std::uint64_t pinned_pool_bytes(const EngineSetup& s) {
  std::uint64_t bytes = 0;
  if (s.optimizer == OffloadDevice::kNvme) {
    bytes += s.buffer_count * s.sub_group_params * sub_group_bytes_per_param(s);
  }
  if (s.params == OffloadDevice::kNvme) bytes += s.param_buffer_count * s.param_staging_params * 2;
  return bytes;
}

std::uint64_t MemoryEstimate::engine_bytes(MemoryTier tier) const {
  std::uint64_t total = 0;
  for (MemoryUse k : {MemoryUse::kHalfParams, MemoryUse::kMasterParams, MemoryUse::kMoments,
                      MemoryUse::kGradients, MemoryUse::kHalfCopy, MemoryUse::kPinnedPool}) {
    total += bytes(k, tier);
  }
  return total;
}

std::uint64_t MemoryEstimate::rank_tier_bytes(MemoryTier tier) const {
  std::uint64_t total = 0;
  for (const auto& row : rank_bytes) total += row[static_cast<int>(tier)];
  return total;
}

std::uint64_t activation_checkpoint_bytes(const ModelShape& m, const TrainingShape& t) {
  if (!t.checkpoint_activations) return 0;
  const std::uint64_t tokens = t.seq_len * t.micro_batch;
  // Each layer's input: h values a token, 2-byte halves in the transformer, fp32 in train_lm.
  const std::uint64_t bytes_per_value = m.kind == ModelKind::kTrainLm ? 4 : 2;
  return m.layers * tokens * m.hidden * bytes_per_value;
}

std::uint64_t activation_arena_bytes(const ModelShape& m, const TrainingShape& t) {
  if (!t.offload_activations || m.layers == 0) return 0;
  const std::uint64_t layer_bytes = activation_checkpoint_bytes(m, t) / m.layers;
  return m.layers * ((layer_bytes + 255) / 256 * 256);
}

std::uint64_t activation_bytes(const ModelShape& m, const TrainingShape& t) {
  const std::uint64_t tokens = t.seq_len * t.micro_batch;
  const std::uint64_t checkpoints = t.offload_activations ? 0 : activation_checkpoint_bytes(m, t);
  if (m.kind == ModelKind::kTrainLm) {
    const std::uint64_t h = m.hidden;
    const std::uint64_t x = m.context_bytes * m.embed_dim;
    const std::uint64_t per_token =
        t.checkpoint_activations
            ? 2 * h + 1 + std::max({m.intermediate, x, m.vocab})
            : x + m.vocab + (m.layers + 1) * (2 * h + 1) + m.layers * m.intermediate;
    return 4 * tokens * per_token + checkpoints;
  }
  const std::uint64_t sbh = tokens * m.hidden;
  const std::uint64_t scores =
      t.flash_attention ? 0 : 5 * m.heads * t.seq_len * t.seq_len * t.micro_batch;
  const std::uint64_t one_layer = 34 * sbh + scores;
  const std::uint64_t layers =
      t.checkpoint_activations ? checkpoints + one_layer : m.layers * one_layer;
  const std::uint64_t logits = 6 * tokens * m.vocab;
  return layers + logits;
}

std::uint64_t persistent_params(const ModelShape& model, const EngineSetup& setup) {
  return setup.persistence_threshold_params >= model.hidden ? small_tensor_params(model) : 0;
}

std::uint64_t persistent_shard_params(const ModelShape& model, const EngineSetup& setup) {
  return ceil_div(persistent_params(model, setup), setup.world_size);
}

std::uint64_t trainable_shard_params(const ModelShape& model, std::uint64_t world_size) {
  // trainable_param_count() is at most param_count(): at most a rank's shard Pr.
  return ceil_div(trainable_param_count(model), world_size);
}

namespace {

// The element counts of the tensors the engine is taken to register for `m` (any of them may be
// frozen or trainable). A shaped transformer: the embeddings, the head, each layer's projections,
// norms and biases, and with LoRA every adapter tensor any target could give (r x h, r x the
// key/value width, r x I). examples/train_lm's model: its embedding, projections and biases. A
// model given by count: the tensors the estimate assumes for it elsewhere (norms of h, matrices of
// V x h, h x h and h x I).
std::vector<std::uint64_t> tensor_params(const ModelShape& m) {
  const std::uint64_t h = m.hidden;
  if (m.kind == ModelKind::kTrainLm) {
    const std::uint64_t f = m.intermediate;
    return {256 * m.embed_dim, m.context_bytes * m.embed_dim * h, h, h * f, f, h * 256, 256};
  }
  const std::uint64_t kv_width =
      m.heads == 0 ? h : (m.kv_heads == 0 ? m.heads : m.kv_heads) * (h / m.heads);
  std::vector<std::uint64_t> out = {h, m.vocab * h, h * h, h * m.intermediate};
  if (m.param_count_override == 0) {
    out.push_back(h * kv_width);
    if (m.positions != 0) out.push_back(m.positions * h);
    if (m.biases) out.insert(out.end(), {kv_width, m.intermediate});
  }
  if (m.lora_rank != 0) {
    out.insert(out.end(), {m.lora_rank * h, m.lora_rank * kv_width, m.lora_rank * m.intermediate});
  }
  return out;
}

}  // namespace

bool trainable_runs_on_cuts(const ModelShape& model, std::uint64_t world_size) {
  const std::uint64_t multiple = kFrozenCutElements * world_size;
  for (std::uint64_t params : tensor_params(model)) {
    if (params % multiple != 0) return false;
  }
  return true;
}

std::uint64_t largest_frozen_group_shard_params(const ModelShape& model, std::uint64_t world_size) {
  // A module's bias at least the persistence threshold shares its weight's group.
  std::uint64_t group_params = largest_tensor_params(model);
  if (model.biases) group_params += std::max(model.hidden, model.intermediate);
  const std::uint64_t slice_params = kShardAlignmentElements * world_size;
  return ceil_div(group_params, slice_params) * kShardAlignmentElements;
}

MemoryEstimate estimate_memory(const ModelShape& model, const TrainingShape& training,
                               const EngineSetup& s) {
  ZINF_ASSERT_MSG(validate_setup(s).is_ok(), "estimate_memory: invalid setup");
  ZINF_ASSERT_MSG(!s.gradients_on_nvme || frozen_param_count(model) == 0,
                  "estimate_memory: the engine refuses gradients_on_nvme with frozen parameters");
  MemoryEstimate e;
  const std::uint64_t p = param_count(model);
  const std::uint64_t pr = ceil_div(p, s.world_size);
  const std::uint64_t tr = trainable_shard_params(model, s.world_size);
  e.param_count = p;
  e.shard_params = pr;
  e.trainable_params = trainable_param_count(model);
  e.trainable_shard_params = tr;
  e.ranks_per_machine = s.ranks_per_machine;
  auto add = [&e](MemoryUse kind, MemoryTier tier, std::uint64_t bytes) {
    e.rank_bytes[static_cast<int>(kind)][static_cast<int>(tier)] += bytes;
  };
  const MemoryTier optimizer_tier = memory_tier(s.optimizer);

  // With the state in host memory a frozen share keeps the scratch blocks of half-only masters,
  // at stage 3 with the shards there too lends its groups (but the persistent ones) the half copy
  // for a shard, whatever the values, and with values exact in the half dtype keeps no master
  // (estimate.hpp, "Frozen parameters and the state in host memory"). With the state in device
  // memory, values exact in the half dtype keep no master there either (estimate.hpp, "Frozen
  // parameters and the state in device memory").
  const std::uint64_t frozen_shard_params = pr - tr;
  const bool frozen_on_host = frozen_shard_params > 0 && s.optimizer == OffloadDevice::kHost;
  const bool frozen_on_device = frozen_shard_params > 0 && s.optimizer == OffloadDevice::kNone;
  const bool half_only = (frozen_on_host || frozen_on_device) && model.frozen_exact_in_half;
  const bool lent = frozen_on_host && s.stage == 3 && s.params == OffloadDevice::kHost;
  // The trainable runs that may meet a frozen neighbour off a 1024-element cut, each widening its
  // sub-groups over at most 1023 frozen elements at either end.
  const std::uint64_t runs_off_cuts = trainable_runs_on_cuts(model, s.world_size)
                                          ? 0
                                          : std::max<std::uint64_t>(1, model.trainable_runs);
  if (s.stage == 3) {
    std::uint64_t shard_bytes = 2 * pr;
    if (lent) {
      // Each run off the cuts keeps the frozen groups its two widened ends reach: at either end
      // at most the largest frozen group's shard and the 1023 elements of groups inside it.
      const std::uint64_t kept_params =
          runs_off_cuts * 2 *
          (largest_frozen_group_shard_params(model, s.world_size) + kFrozenCutElements - 1);
      shard_bytes = std::min(
          2 * pr, 2 * tr + 2 * std::min(frozen_shard_params, persistent_shard_params(model, s)) +
                      2 * kept_params);
    }
    add(MemoryUse::kHalfParams, memory_tier(s.params), shard_bytes);
  } else {
    add(MemoryUse::kHalfParams, MemoryTier::kDevice, 2 * p);
  }
  // In host memory a run off the cuts keeps the masters of the at most 2 x 1023 frozen elements
  // its sub-groups were widened over. The device optimizer's runs are the parameters' own pieces,
  // not widened: there a frozen element keeps no master wherever it lies (the packing's alignment
  // slack, at most 30 elements a stretch of runs that keep one, is left out).
  const std::uint64_t widened_params =
      frozen_on_host ? runs_off_cuts * 2 * (kFrozenCutElements - 1) : 0;
  const std::uint64_t master_params = half_only ? std::min(pr, tr + widened_params) : pr;
  add(MemoryUse::kMasterParams, optimizer_tier, 4 * master_params);
  if (frozen_on_host) {
    // The four scratch blocks a half-only master is read and written through, allocated wherever
    // a sub-group is frozen: three of fp32 and one of halves, a chunk each, up to 256 Ki elements
    // and at most a sub-group.
    const std::uint64_t chunk_params =
        std::min({std::uint64_t{kHalfOnlyChunkElements}, s.sub_group_params,
                  std::max<std::uint64_t>(pr, 1)});
    add(MemoryUse::kMasterParams, MemoryTier::kHost, (3 * 4 + 2) * chunk_params);
  }
  // The frozen elements' moments are never resident, except in the swap file, which is
  // preallocated whole (the header says when).
  add(MemoryUse::kMoments, optimizer_tier, 8 * (optimizer_tier == MemoryTier::kNvme ? pr : tr));
  if (optimizer_tier == MemoryTier::kNvme && (4 * std::min(s.sub_group_params, pr)) % 4096 == 0 &&
      (4 * pr) % 4096 == 0) {
    // The store's checkpoint layout (StateStore::layout): a 4096-byte header page in front of the
    // master and moments, which a checkpoint links instead of copying.
    add(MemoryUse::kMasterParams, MemoryTier::kNvme, 4096);
  }

  // The new half params before they go to their home. The optimizer on the device keeps its own
  // half copy of the shard there, which the shards are written from (the host's publish buffer
  // is freed once the first values are placed); it rounds the frozen runs' half copy from the
  // master in place (DeviceOps::narrow), with no scratch. Offloaded, on the host: streamed one
  // group at a time with the optimizer on NVMe and the shards not in host memory, else the whole
  // shard.
  if (s.optimizer == OffloadDevice::kNone) {
    add(MemoryUse::kHalfCopy, MemoryTier::kDevice, 2 * pr);
  } else {
    add(MemoryUse::kHalfCopy, MemoryTier::kHost,
        streams_half(s) ? 2 * s.param_staging_params : 2 * pr);
  }
  if (s.optimizer == OffloadDevice::kNone) {
    // The device optimizer's accumulator is packed: a group whose runs are all frozen gets no
    // slot (the host device's HostState maps zero pages a frozen range never writes).
    add(MemoryUse::kGradients, MemoryTier::kDevice, 4 * tr);
  } else if (s.gradients_on_nvme) {
    add(MemoryUse::kGradients, MemoryTier::kNvme, 4 * pr);
    const std::uint64_t sub_group = std::min(s.sub_group_params, pr);
    const std::uint64_t buffers = std::min(s.gradient_spill_buffers, ceil_div(pr, sub_group));
    add(MemoryUse::kGradients, MemoryTier::kHost, buffers * ((4 * sub_group + 4095) / 4096 * 4096));
  } else {
    // The host accumulator is fresh zero pages that only reductions write, and a frozen group is
    // never reduced at any stage (GradReducer: its slice is left as the zero pages), so only the
    // trainable share is ever resident.
    add(MemoryUse::kGradients, MemoryTier::kHost, 4 * tr);
  }
  // Stage 1's full-size fp32 gradient copies, one a trainable group: a frozen group has none, and
  // the engine's groups never mix the two (estimate.hpp).
  if (s.stage == 1) {
    add(MemoryUse::kGradients, MemoryTier::kDevice, 4 * trainable_param_count(model));
  }

  add(MemoryUse::kActivations, MemoryTier::kDevice, activation_bytes(model, training));
  if (training.offload_activations) {
    add(MemoryUse::kActivations, MemoryTier::kHost, activation_arena_bytes(model, training));
  }
  // The engine's store never makes a sub-group larger than the shard.
  EngineSetup capped = s;
  capped.sub_group_params = std::min(s.sub_group_params, pr);
  add(MemoryUse::kPinnedPool, MemoryTier::kHost, pinned_pool_bytes(capped));

  if (s.stage == 3) {
    const std::uint64_t live = std::min(p, s.max_live_params) + s.prefetch_bucket_params;
    add(MemoryUse::kGatheredParams, MemoryTier::kDevice,
        2 * std::min(p, live) + 2 * persistent_params(model, s));
  }
  // The gradient reducer's buffers, allocated at open for the engine's life (GradReducer::create):
  // two fp32 buckets of `chunk_params` elements from each of the N ranks' slices, chunk_params =
  // reduce_bucket / N capped at the largest group's shard (param_staging_params, where the setup
  // has it); with more than one rank two receive buffers of a chunk; and, the device not being
  // host memory, two pinned host buffers of a chunk that each reduced chunk comes back through.
  std::uint64_t chunk_params = std::max<std::uint64_t>(1, s.reduce_bucket_params / s.world_size);
  if (s.param_staging_params > 0) chunk_params = std::min(chunk_params, s.param_staging_params);
  const std::uint64_t receive_bytes = s.world_size > 1 ? 2 * 4 * chunk_params : 0;
  add(MemoryUse::kCommBuckets, MemoryTier::kDevice,
      2 * 4 * chunk_params * s.world_size + receive_bytes);
  add(MemoryUse::kCommBuckets, MemoryTier::kHost, 2 * 4 * chunk_params);
  add(MemoryUse::kReserved, MemoryTier::kDevice, s.device_reserved_bytes);
  return e;
}

}  // namespace zinf::plan
