// The config's checker and writer: validate() checks a Config's values against each other (the
// reader, config.cpp, checks each key alone), and config_to_json() writes the one schema back out.
#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "engine/config_names.hpp"
#include "engine/config_walk.hpp"
#include "zinf/config.hpp"

namespace zinf {
namespace {

using OrderedJson = nlohmann::ordered_json;

using config_detail::invalid;

// The keys the schedule's type takes in DeepSpeed, each written out; a value that means "not
// given" (a negative warmup_max_lr, cycle_second_*) is left out, so it is not given when read back.
OrderedJson scheduler_to_json(const ScheduleConfig& s) {
  OrderedJson p;
  switch (s.kind) {
    case ScheduleKind::kNone:
      break;
    case ScheduleKind::kWarmupLR:
    case ScheduleKind::kWarmupDecayLR:
    case ScheduleKind::kWarmupCosineLR:
      if (s.kind != ScheduleKind::kWarmupLR) p["total_num_steps"] = s.total_num_steps;
      if (s.kind == ScheduleKind::kWarmupCosineLR) {
        p["warmup_min_ratio"] = s.warmup_min_ratio;
        p["cos_min_ratio"] = s.cos_min_ratio;
      } else {
        p["warmup_min_lr"] = s.warmup_min_lr;
        if (s.warmup_max_lr >= 0) p["warmup_max_lr"] = s.warmup_max_lr;
      }
      p["warmup_num_steps"] = s.warmup_num_steps;
      p["warmup_type"] = s.warmup_linear ? "linear" : "log";
      break;
    case ScheduleKind::kOneCycle:
      p["cycle_min_lr"] = s.cycle_min_lr;
      p["cycle_max_lr"] = s.cycle_max_lr;
      p["decay_lr_rate"] = s.decay_lr_rate;
      p["cycle_first_step_size"] = s.cycle_first_step_size;
      if (s.cycle_second_step_size >= 0) p["cycle_second_step_size"] = s.cycle_second_step_size;
      p["cycle_first_stair_count"] = s.cycle_first_stair_count;
      if (s.cycle_second_stair_count >= 0) {
        p["cycle_second_stair_count"] = s.cycle_second_stair_count;
      }
      p["decay_step_size"] = s.decay_step_size;
      p["cycle_momentum"] = s.cycle_momentum;
      p["cycle_min_mom"] = s.cycle_min_mom;
      p["cycle_max_mom"] = s.cycle_max_mom;
      p["decay_mom_rate"] = s.decay_mom_rate;
      break;
  }
  p["last_batch_iteration"] = s.last_batch_iteration;
  return {{"type", std::string(schedule_name(s.kind))}, {"params", p}};
}

}  // namespace

std::string_view deepspeed_type_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam:
      return "Adam";
    case OptimizerKind::kAdamW:
      return "AdamW";
    case OptimizerKind::kAdagrad:
      return "Adagrad";
    case OptimizerKind::kLion:
      return "Lion";
  }
  return "?";
}

Status validate(const Config& c) {
  const ZeroConfig& z = c.zero;
  if (z.stage < 1 || z.stage > 3) {
    return invalid("zero_optimization.stage", fmt::format("{} is not 1, 2 or 3", z.stage));
  }
  // DeepSpeed asserts both are above 0 (deepspeed/runtime/config.py, _batch_assertion).
  if (c.train_micro_batch_size_per_gpu == 0) {
    return invalid("train_micro_batch_size_per_gpu", "0 is below 1");
  }
  if (c.gradient_accumulation_steps == 0) {
    return invalid("gradient_accumulation_steps", "0 is below 1");
  }
  if (z.offload_param.device != OffloadDevice::kNone && z.stage != 3) {
    return invalid("zero_optimization.offload_param.device",
                   fmt::format("\"{}\" needs stage 3 (stage {} keeps every parameter on the "
                               "device; DeepSpeed ignores offload_param below stage 3, so the "
                               "section asks for nothing there: remove it)",
                               offload_device_name(z.offload_param.device), z.stage));
  }
  if (z.offload_optimizer.device == OffloadDevice::kNvme && z.offload_optimizer.buffer_count < 2) {
    return invalid("zero_optimization.offload_optimizer.buffer_count",
                   fmt::format("{} is below 2 (one sub-group is updated while another moves)",
                               z.offload_optimizer.buffer_count));
  }
  if (z.offload_param.device == OffloadDevice::kNvme && z.offload_param.buffer_count < 1) {
    return invalid("zero_optimization.offload_param.buffer_count", "0 is below 1");
  }
  if (!c.activations.nvme_path.empty() && c.activations.nvme_bytes == 0) {
    return invalid("zinf.activation_nvme_bytes",
                   "0, and zinf.activation_nvme_path is set (the swap file needs a capacity)");
  }
  if (c.keep_last < 0) {
    return invalid("zinf.keep_last", fmt::format("{} is below 0 (0 keeps every tag)", c.keep_last));
  }
  if (c.gradients_on_nvme && z.stage == 1) {
    return invalid("zinf.gradients_on_nvme",
                   "needs stage 2 or 3 (stage 1 keeps full fp32 gradients on the device until the "
                   "step)");
  }
  if (c.gradients_on_nvme && z.offload_optimizer.device != OffloadDevice::kNvme) {
    return invalid("zinf.gradients_on_nvme",
                   fmt::format("needs zero_optimization.offload_optimizer.device \"nvme\" (it is "
                               "\"{}\"): the gradients spill into the optimizer's NVMe store",
                               offload_device_name(z.offload_optimizer.device)));
  }
  if (c.gradient_spill_buffers == 0 || c.gradient_spill_buffers > 64) {
    // Each buffer may have one write in flight; the swap space's op table is shared with the
    // optimizer pipeline and the parameter staging.
    return invalid("zinf.gradient_spill_buffers",
                   fmt::format("{} is not in 1..64", c.gradient_spill_buffers));
  }
  if (z.reduce_bucket_size == 0) {
    return invalid("zero_optimization.reduce_bucket_size",
                   "0 is below 1 (DeepSpeed then reduces each gradient on its own; zinf reduces "
                   "in buckets: give a size in elements, DeepSpeed's default is 5e8)");
  }
  if (!(c.gradient_clipping >= 0.0) || !std::isfinite(c.gradient_clipping)) {
    return invalid(
        "gradient_clipping",
        fmt::format("{} is not a finite number >= 0 (0 turns clipping off)", c.gradient_clipping));
  }
  const Fp16Config& f = c.fp16;
  if (f.enabled && c.bf16_enabled) {
    return invalid("fp16.enabled", "fp16 and bf16 are both enabled; choose one");
  }
  if (!(f.loss_scale >= 0.0) || !std::isfinite(f.loss_scale)) {
    return invalid("fp16.loss_scale", fmt::format("{} is not >= 0 (0: dynamic)", f.loss_scale));
  }
  if (f.initial_scale_power < 0 || f.initial_scale_power > 64) {
    return invalid("fp16.initial_scale_power",
                   fmt::format("{} is not in 0..64", f.initial_scale_power));
  }
  if (f.loss_scale_window < 1) {
    return invalid("fp16.loss_scale_window", fmt::format("{} is below 1", f.loss_scale_window));
  }
  if (f.hysteresis < 1) {
    return invalid("fp16.hysteresis", fmt::format("{} is below 1", f.hysteresis));
  }
  if (!(f.min_loss_scale > 0.0)) {
    return invalid("fp16.min_loss_scale", fmt::format("{} is not > 0", f.min_loss_scale));
  }
  const OptimizerParams& o = c.optimizer;
  if (!(o.lr >= 0.0) || !std::isfinite(o.lr)) {
    return invalid("optimizer.params.lr", fmt::format("{} is not a finite number >= 0", o.lr));
  }
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0) || !(o.beta2 >= 0.0 && o.beta2 < 1.0)) {
    return invalid("optimizer.params.betas",
                   fmt::format("[{}, {}] are not both in [0, 1)", o.beta1, o.beta2));
  }
  if (!(o.eps >= 0.0)) return invalid("optimizer.params.eps", fmt::format("{} is below 0", o.eps));
  if (!(o.weight_decay >= 0.0)) {
    return invalid("optimizer.params.weight_decay", fmt::format("{} is below 0", o.weight_decay));
  }
  if (!(o.lr_decay >= 0.0) || !std::isfinite(o.lr_decay)) {
    return invalid("optimizer.params.lr_decay", fmt::format("{} is below 0", o.lr_decay));
  }
  if (c.scheduler.kind != ScheduleKind::kNone) {
    // Errors name the scheduler.params key.
    ZINF_RETURN_IF_ERROR(LrSchedule::create(c.scheduler, o.lr).status());
  }
  if (c.aio_block_bytes == 0 || c.aio_block_bytes % 4096 != 0) {
    return invalid("aio.block_size",
                   fmt::format("{} is not a positive multiple of 4096", c.aio_block_bytes));
  }
  if (c.aio_queue_depth == 0 || c.aio_queue_depth > 4096) {
    return invalid("aio.queue_depth", fmt::format("{} is not in 1..4096", c.aio_queue_depth));
  }
  if (c.world_size < 0) return invalid("zinf.world_size", "is below 0");
  if (c.ranks_per_machine < 1) {
    return invalid("zinf.ranks_per_machine", fmt::format("{} is below 1", c.ranks_per_machine));
  }
  if (c.world_size > 0 && c.world_size % c.ranks_per_machine != 0) {
    return invalid("zinf.ranks_per_machine", fmt::format("{} does not divide zinf.world_size {}",
                                                         c.ranks_per_machine, c.world_size));
  }
  if (c.cpu_threads < 0) return invalid("zinf.cpu_threads", "is below 0");
  if (c.collective_timeout_ms < 1) {
    return invalid("zinf.collective_timeout_ms",
                   fmt::format("{} is below 1", c.collective_timeout_ms));
  }
  if (c.io_timeout_ms < 1) {
    return invalid("zinf.io_timeout_ms", fmt::format("{} is below 1", c.io_timeout_ms));
  }
  if (c.world_size > 0) {
    Config resolved = c;
    ZINF_RETURN_IF_ERROR(resolve_batch_sizes(c.world_size, &resolved));
  }
  return Status::ok();
}

std::string config_to_json(const Config& c) {
  const ZeroConfig& z = c.zero;
  auto offload = [](const OffloadConfig& o, bool param) {
    OrderedJson j;
    j["device"] = std::string(offload_device_name(o.device));
    j["nvme_path"] = o.nvme_path;
    j["pin_memory"] = o.pin_memory;
    j["buffer_count"] = o.buffer_count;
    if (param) j["buffer_size"] = o.buffer_params;
    return j;
  };
  OrderedJson out;
  // With train_batch_size, the other two only where given (by their keys, derived, or set in code
  // to other than the default of 1, which resolve_batch_sizes() counts as given), so that the file
  // read back keeps them and derives what this config would.
  if (c.train_batch_size != 0) out["train_batch_size"] = c.train_batch_size;
  if (c.train_batch_size == 0 || c.train_micro_batch_given ||
      c.train_micro_batch_size_per_gpu != 1) {
    out["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
  }
  if (c.train_batch_size == 0 || c.gradient_accumulation_given ||
      c.gradient_accumulation_steps != 1) {
    out["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  }
  out["gradient_clipping"] = c.gradient_clipping;
  out["fp16"] = {{"enabled", c.fp16.enabled},
                 {"loss_scale", c.fp16.loss_scale},
                 {"initial_scale_power", c.fp16.initial_scale_power},
                 {"loss_scale_window", c.fp16.loss_scale_window},
                 {"hysteresis", c.fp16.hysteresis},
                 {"min_loss_scale", c.fp16.min_loss_scale}};
  out["bf16"] = {{"enabled", c.bf16_enabled}};
  // Every value written out, so the file means the same whatever the type's defaults are; only
  // the keys the type's DeepSpeed optimizer takes.
  const OptimizerParams& o = c.optimizer;
  OrderedJson params;
  params["lr"] = o.lr;
  switch (o.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      params["betas"] = {o.beta1, o.beta2};
      params["eps"] = o.eps;
      params["weight_decay"] = o.weight_decay;
      params["bias_correction"] = o.bias_correction;
      if (o.kind == OptimizerKind::kAdam) params["adam_w_mode"] = false;
      break;
    case OptimizerKind::kAdagrad:
      params["eps"] = o.eps;
      params["weight_decay"] = o.weight_decay;
      params["lr_decay"] = o.lr_decay;
      break;
    case OptimizerKind::kLion:
      params["betas"] = {o.beta1, o.beta2};
      params["weight_decay"] = o.weight_decay;
      break;
  }
  out["optimizer"] = {{"type", std::string(deepspeed_type_name(o.kind))}, {"params", params}};
  if (c.scheduler.kind != ScheduleKind::kNone) out["scheduler"] = scheduler_to_json(c.scheduler);
  OrderedJson zero;
  zero["stage"] = z.stage;
  zero["offload_optimizer"] = offload(z.offload_optimizer, false);
  zero["offload_param"] = offload(z.offload_param, true);
  zero["sub_group_size"] = z.sub_group_size;
  zero["reduce_bucket_size"] = z.reduce_bucket_size;
  zero["stage3_prefetch_bucket_size"] = z.stage3_prefetch_bucket_size;
  zero["stage3_max_live_parameters"] = z.stage3_max_live_parameters;
  zero["stage3_param_persistence_threshold"] = z.stage3_param_persistence_threshold;
  out["zero_optimization"] = zero;
  out["activation_checkpointing"] = {{"cpu_checkpointing", c.activations.cpu_checkpointing}};
  out["aio"] = {{"block_size", c.aio_block_bytes}, {"queue_depth", c.aio_queue_depth}};
  out["zinf"] = {{"world_size", c.world_size},
                 {"ranks_per_machine", c.ranks_per_machine},
                 {"pinned_pool_bytes", c.pinned_pool_bytes},
                 {"gradients_on_nvme", c.gradients_on_nvme},
                 {"gradient_spill_buffers", c.gradient_spill_buffers},
                 {"overlap_step", c.overlap_step},
                 {"clip_from_previous_step", c.clip_from_previous_step},
                 {"device_reserved_bytes", c.device_reserved_bytes},
                 {"cpu_threads", c.cpu_threads},
                 {"collective_timeout_ms", c.collective_timeout_ms},
                 {"io_timeout_ms", c.io_timeout_ms},
                 {"io_timeouts_max", c.io_timeouts_max},
                 {"keep_last", c.keep_last},
                 {"group_max_elements", z.group_max_elements},
                 {"activation_host_bytes", c.activations.host_bytes},
                 {"activation_nvme_path", c.activations.nvme_path},
                 {"activation_nvme_bytes", c.activations.nvme_bytes}};
  return out.dump(2) + "\n";
}

}  // namespace zinf
