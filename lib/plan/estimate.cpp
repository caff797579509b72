#include "plan/estimate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "base/assert.hpp"

namespace zinf::plan {
namespace {

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return (a + b - 1) / b; }

}  // namespace

std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

std::string_view offload_name(Offload offload) {
  switch (offload) {
    case Offload::kNone:
      return "none";
    case Offload::kCpu:
      return "cpu";
    case Offload::kNvme:
      return "nvme";
  }
  return "?";
}

bool parse_offload(std::string_view text, Offload* offload) {
  std::string lower;
  for (char c : text) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "none" || lower == "device" || lower == "gpu") {
    *offload = Offload::kNone;
  } else if (lower == "cpu" || lower == "host") {
    *offload = Offload::kCpu;
  } else if (lower == "nvme") {
    *offload = Offload::kNvme;
  } else {
    return false;
  }
  return true;
}

Tier offload_tier(Offload offload) {
  switch (offload) {
    case Offload::kNone:
      return Tier::kDevice;
    case Offload::kCpu:
      return Tier::kHost;
    case Offload::kNvme:
      return Tier::kNvme;
  }
  return Tier::kDevice;
}

std::string_view state_kind_name(StateKind kind) {
  switch (kind) {
    case StateKind::kHalfParams:
      return "half_params";
    case StateKind::kMasterParams:
      return "fp32_master";
    case StateKind::kMoments:
      return "moments";
    case StateKind::kGradients:
      return "gradients";
    case StateKind::kActivations:
      return "activations";
    case StateKind::kPinnedPool:
      return "pinned_pool";
    case StateKind::kGatheredParams:
      return "gathered_params";
    case StateKind::kCommBuckets:
      return "comm_buckets";
    case StateKind::kReserved:
      return "reserved";
    case StateKind::kHalfCopy:
      return "half_copy";
  }
  return "?";
}

Status validate_setup(const EngineSetup& s) {
  if (s.stage < 1 || s.stage > 3) {
    return Status::invalid_argument(
        fmt::format("zero_optimization.stage: {} is not 1, 2 or 3", s.stage));
  }
  if (s.params != Offload::kNone && s.stage != 3) {
    return Status::invalid_argument(
        fmt::format("zero_optimization.offload_param.device: {} needs stage 3, not {}",
                    offload_name(s.params), s.stage));
  }
  if (s.gradients_on_nvme && s.optimizer != Offload::kNvme) {
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
  if (s.optimizer == Offload::kNvme && s.buffer_count < 2) {
    return Status::invalid_argument(fmt::format(
        "zero_optimization.offload_optimizer.buffer_count: {} is below 2 (one buffer cannot "
        "overlap I/O with the update)",
        s.buffer_count));
  }
  return Status::ok();
}

bool streams_half(const EngineSetup& s) {
  return s.optimizer == Offload::kNvme && !(s.stage == 3 && s.params == Offload::kCpu);
}

std::uint64_t sub_group_bytes_per_param(const EngineSetup& setup) {
  return (setup.gradients_on_nvme ? 16 : 12) + (streams_half(setup) ? 2 : 0);
}

std::uint64_t pinned_pool_bytes(const EngineSetup& s) {
  std::uint64_t bytes = 0;
  if (s.optimizer == Offload::kNvme) {
    bytes += s.buffer_count * s.sub_group_params * sub_group_bytes_per_param(s);
  }
  if (s.params == Offload::kNvme) bytes += s.param_buffer_count * s.param_staging_params * 2;
  return bytes;
}

std::uint64_t MemoryEstimate::engine_bytes(Tier tier) const {
  std::uint64_t total = 0;
  for (StateKind k : {StateKind::kHalfParams, StateKind::kMasterParams, StateKind::kMoments,
                      StateKind::kGradients, StateKind::kHalfCopy, StateKind::kPinnedPool}) {
    total += bytes(k, tier);
  }
  return total;
}

std::uint64_t MemoryEstimate::rank_tier_bytes(Tier tier) const {
  std::uint64_t total = 0;
  for (const auto& row : rank_bytes) total += row[static_cast<int>(tier)];
  return total;
}

std::uint64_t activation_bytes(const ModelShape& m, const TrainingShape& t) {
  const std::uint64_t sbh = t.seq_len * t.micro_batch * m.hidden;
  const std::uint64_t scores =
      t.flash_attention ? 0 : 5 * m.heads * t.seq_len * t.seq_len * t.micro_batch;
  const std::uint64_t one_layer = 34 * sbh + scores;
  const std::uint64_t layers =
      t.checkpoint_activations ? m.layers * 2 * sbh + one_layer : m.layers * one_layer;
  const std::uint64_t logits = 6 * t.seq_len * t.micro_batch * m.vocab;
  return layers + logits;
}

MemoryEstimate estimate_memory(const ModelShape& model, const TrainingShape& training,
                               const EngineSetup& s) {
  ZINF_ASSERT_MSG(validate_setup(s).is_ok(), "estimate_memory: invalid setup");
  MemoryEstimate e;
  const std::uint64_t p = param_count(model);
  const std::uint64_t pr = ceil_div(p, s.world_size);
  e.param_count = p;
  e.shard_params = pr;
  e.ranks_per_machine = s.ranks_per_machine;
  auto add = [&e](StateKind kind, Tier tier, std::uint64_t bytes) {
    e.rank_bytes[static_cast<int>(kind)][static_cast<int>(tier)] += bytes;
  };
  const Tier optimizer_tier = offload_tier(s.optimizer);

  if (s.stage == 3) {
    add(StateKind::kHalfParams, offload_tier(s.params), 2 * pr);
  } else {
    add(StateKind::kHalfParams, Tier::kDevice, 2 * p);
  }
  add(StateKind::kMasterParams, optimizer_tier, 4 * pr);
  add(StateKind::kMoments, optimizer_tier, 8 * pr);

  // The new half params on the host before they go to their home: streamed one group at a time
  // with the optimizer on NVMe and the shards not in host memory, else the whole shard.
  add(StateKind::kHalfCopy, Tier::kHost, streams_half(s) ? 2 * s.param_staging_params : 2 * pr);
  if (s.optimizer == Offload::kNone) {
    add(StateKind::kGradients, Tier::kDevice, 4 * pr);
  } else if (s.gradients_on_nvme) {
    add(StateKind::kGradients, Tier::kNvme, 4 * pr);
    const std::uint64_t sub_group = std::min(s.sub_group_params, pr);
    const std::uint64_t buffers = std::min(s.gradient_spill_buffers, ceil_div(pr, sub_group));
    add(StateKind::kGradients, Tier::kHost, buffers * ((4 * sub_group + 4095) / 4096 * 4096));
  } else {
    add(StateKind::kGradients, Tier::kHost, 4 * pr);
  }
  if (s.stage == 1) add(StateKind::kGradients, Tier::kDevice, 4 * p);

  add(StateKind::kActivations, Tier::kDevice, activation_bytes(model, training));
  // The engine's store never makes a sub-group larger than the shard.
  EngineSetup capped = s;
  capped.sub_group_params = std::min(s.sub_group_params, pr);
  add(StateKind::kPinnedPool, Tier::kHost, pinned_pool_bytes(capped));

  if (s.stage == 3) {
    const std::uint64_t live = std::min(p, s.max_live_params) + s.prefetch_bucket_params;
    const std::uint64_t persistent =
        s.persistence_threshold_params >= model.hidden ? small_tensor_params(model) : 0;
    add(StateKind::kGatheredParams, Tier::kDevice, 2 * std::min(p, live) + 2 * persistent);
  }
  add(StateKind::kCommBuckets, Tier::kDevice, 2 * 2 * s.reduce_bucket_params);
  add(StateKind::kReserved, Tier::kDevice, s.device_reserved_bytes);
  return e;
}

}  // namespace zinf::plan
