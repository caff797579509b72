#include "plan/config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <fstream>

#include "base/assert.hpp"

namespace zinf::plan {

bool exact_clipping_or_loss_scaling(const PlanConfig& c) {
  return (c.gradient_clipping > 0 && !c.clip_from_previous_step) || c.fp16;
}

Config engine_config(const PlanConfig& c) {
  const EngineSetup& s = c.setup;
  ZINF_ASSERT_MSG(s.exact_clipping_or_loss_scaling == exact_clipping_or_loss_scaling(c),
                  "engine_config: setup.exact_clipping_or_loss_scaling disagrees with "
                  "gradient_clipping, clip_from_previous_step and fp16");
  Config e;
  e.train_micro_batch_size_per_gpu = c.micro_batch;
  e.gradient_accumulation_steps = c.grad_accum_steps;
  e.gradient_clipping = c.gradient_clipping;
  e.clip_from_previous_step = c.clip_from_previous_step;
  e.fp16.enabled = c.fp16;
  e.bf16_enabled = !c.fp16;
  ZeroConfig& z = e.zero;
  z.stage = s.stage;
  z.offload_optimizer.device = s.optimizer;
  z.offload_optimizer.nvme_path = c.nvme_path;
  z.offload_optimizer.buffer_count = s.buffer_count;
  z.offload_param.device = s.params;
  z.offload_param.nvme_path = c.nvme_path;
  z.offload_param.buffer_count = s.param_buffer_count;
  z.offload_param.buffer_params = s.param_buffer_params;
  z.sub_group_size = s.sub_group_params;
  z.reduce_bucket_size = s.reduce_bucket_params;
  z.stage3_prefetch_bucket_size = s.prefetch_bucket_params;
  z.stage3_max_live_parameters = s.max_live_params;
  z.stage3_param_persistence_threshold = s.persistence_threshold_params;
  e.aio_block_bytes = s.io_block_bytes;
  e.aio_queue_depth = s.io_queue_depth;
  e.world_size = static_cast<int>(s.world_size);
  e.ranks_per_machine = static_cast<int>(s.ranks_per_machine);
  e.pinned_pool_bytes = std::max(c.pinned_pool_bytes, pinned_pool_bytes(s));
  e.gradients_on_nvme = s.gradients_on_nvme;
  e.gradient_spill_buffers = s.gradient_spill_buffers;
  e.device_reserved_bytes = s.device_reserved_bytes;
  e.overlap_step = s.overlap_step;
  if (c.activation_host_bytes > 0) {
    e.activations.cpu_checkpointing = true;
    e.activations.host_bytes = c.activation_host_bytes;
  }
  return e;
}

Result<PlanConfig> plan_config(const Config& e) {
  PlanConfig c;
  EngineSetup& s = c.setup;
  const ZeroConfig& z = e.zero;
  c.micro_batch = e.train_micro_batch_size_per_gpu;
  c.grad_accum_steps = e.gradient_accumulation_steps;
  s.stage = z.stage;
  s.optimizer = z.offload_optimizer.device;
  s.buffer_count = z.offload_optimizer.buffer_count;
  s.params = z.offload_param.device;
  s.param_buffer_count = z.offload_param.buffer_count;
  s.param_buffer_params = z.offload_param.buffer_params;
  s.sub_group_params = z.sub_group_size;
  s.reduce_bucket_params = z.reduce_bucket_size;
  s.prefetch_bucket_params = z.stage3_prefetch_bucket_size;
  s.max_live_params = z.stage3_max_live_parameters;
  s.persistence_threshold_params = z.stage3_param_persistence_threshold;
  s.io_block_bytes = e.aio_block_bytes;
  s.io_queue_depth = e.aio_queue_depth;
  // zinf.world_size 0 means "any" to the engine; the planner plans for one rank then.
  s.world_size = e.world_size > 0 ? static_cast<std::uint64_t>(e.world_size) : 1;
  s.ranks_per_machine = static_cast<std::uint64_t>(e.ranks_per_machine);
  s.gradients_on_nvme = e.gradients_on_nvme;
  s.gradient_spill_buffers = e.gradient_spill_buffers;
  s.device_reserved_bytes = e.device_reserved_bytes;
  s.overlap_step = e.overlap_step;
  c.pinned_pool_bytes = e.pinned_pool_bytes;
  c.gradient_clipping = e.gradient_clipping;
  c.clip_from_previous_step = e.clip_from_previous_step;
  c.fp16 = e.fp16.enabled;
  s.exact_clipping_or_loss_scaling = exact_clipping_or_loss_scaling(c);
  // The planner models offloaded checkpoints in the host arena only (none on the activation
  // NVMe tier): a config that offloads them with no arena reads as checkpoints on the device.
  if (e.activations.cpu_checkpointing) c.activation_host_bytes = e.activations.host_bytes;
  ZINF_RETURN_IF_ERROR(validate_setup(s));
  const std::string& opt_path = z.offload_optimizer.nvme_path;
  const std::string& param_path = z.offload_param.nvme_path;
  const bool opt_nvme = s.optimizer == OffloadDevice::kNvme;
  const bool param_nvme = s.params == OffloadDevice::kNvme;
  if (opt_nvme && param_nvme && opt_path != param_path) {
    return Status::invalid_argument(fmt::format(
        "zero_optimization.offload_param.nvme_path: \"{}\" differs from offload_optimizer's "
        "\"{}\" (the planner sizes one NVMe directory)",
        param_path, opt_path));
  }
  c.nvme_path = opt_nvme ? opt_path : param_nvme ? param_path : "";
  if (opt_nvme && c.nvme_path.empty()) {
    return Status::invalid_argument(
        "zero_optimization.offload_optimizer.nvme_path: needed for state on nvme");
  }
  if (param_nvme && c.nvme_path.empty()) {
    return Status::invalid_argument(
        "zero_optimization.offload_param.nvme_path: needed for parameters on nvme");
  }
  return c;
}

std::string config_to_json(const PlanConfig& config) {
  return zinf::config_to_json(engine_config(config));
}

Result<PlanConfig> config_from_json(std::string_view text) {
  ZINF_ASSIGN_OR_RETURN(Config e, parse_config(text));
  return plan_config(e);
}

Status write_config(const PlanConfig& config, const std::string& path) {
  std::ofstream file(path, std::ios::out | std::ios::trunc);
  if (!file) return status_from_errno(fmt::format("open {}", path), errno);
  file << config_to_json(config);
  file.close();
  if (!file) return status_from_errno(fmt::format("write {}", path), errno);
  return Status::ok();
}

}  // namespace zinf::plan
