#include "plan/estimate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "base/arith.hpp"
#include "base/assert.hpp"

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

  // Frozen values exact in the half dtype, the state in host memory (estimate.hpp): the frozen
  // shard's masters are kept as the half copy alone, and at stage 3 with the shards in host
  // memory its groups but the persistent ones are lent that half copy for a shard.
  const std::uint64_t frozen_shard = pr - tr;
  const bool half_only =
      model.frozen_exact_in_half && frozen_shard > 0 && s.optimizer == OffloadDevice::kHost;
  const bool lent = half_only && s.stage == 3 && s.params == OffloadDevice::kHost;
  if (s.stage == 3) {
    std::uint64_t shard = 2 * pr;
    if (lent) shard = 2 * tr + 2 * std::min(frozen_shard, persistent_shard_params(model, s));
    add(MemoryUse::kHalfParams, memory_tier(s.params), shard);
  } else {
    add(MemoryUse::kHalfParams, MemoryTier::kDevice, 2 * p);
  }
  add(MemoryUse::kMasterParams, optimizer_tier, 4 * (half_only ? tr : pr));
  if (half_only) {
    // The four scratch blocks a half-only master is read and written through: three of fp32 and
    // one of halves, a chunk each, up to 256 Ki elements and at most a sub-group.
    const std::uint64_t chunk =
        std::min({kHalfOnlyChunkParams, s.sub_group_params, std::max<std::uint64_t>(pr, 1)});
    add(MemoryUse::kMasterParams, MemoryTier::kHost, (3 * 4 + 2) * chunk);
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
  // two fp32 buckets of `chunk` elements from each of the N ranks' slices, chunk =
  // reduce_bucket / N capped at the largest group's shard (param_staging_params, where the setup
  // has it); with more than one rank two receive buffers of a chunk; and, the device not being
  // host memory, two pinned host buffers of a chunk that each reduced chunk comes back through.
  std::uint64_t chunk = std::max<std::uint64_t>(1, s.reduce_bucket_params / s.world_size);
  if (s.param_staging_params > 0) chunk = std::min(chunk, s.param_staging_params);
  const std::uint64_t receive = s.world_size > 1 ? 2 * 4 * chunk : 0;
  add(MemoryUse::kCommBuckets, MemoryTier::kDevice, 2 * 4 * chunk * s.world_size + receive);
  add(MemoryUse::kCommBuckets, MemoryTier::kHost, 2 * 4 * chunk);
  add(MemoryUse::kReserved, MemoryTier::kDevice, s.device_reserved_bytes);
  return e;
}

}  // namespace zinf::plan
