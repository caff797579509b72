#include "plan/config.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <fstream>
#include <nlohmann/json.hpp>

namespace zinf::plan {
namespace {

using nlohmann::json;

// Reads an unsigned count at `key` of `object` (if there), naming `path` on a bad value.
Status read_count(const json& object, const char* key, const std::string& path,
                  std::uint64_t* out) {
  if (!object.contains(key)) return Status::ok();
  const json& v = object.at(key);
  if (v.is_number_unsigned()) {
    *out = v.get<std::uint64_t>();
  } else if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    *out = static_cast<std::uint64_t>(v.get<std::int64_t>());
  } else if (v.is_number_float() && v.get<double>() >= 0 && v.get<double>() < 1.8e19) {
    // DeepSpeed configs often write counts as 1e9.
    *out = static_cast<std::uint64_t>(v.get<double>());
  } else {
    return Status::invalid_argument(
        fmt::format("{}.{}: {} is not a non-negative number", path, key, v.dump()));
  }
  return Status::ok();
}

Status read_bool(const json& object, const char* key, const std::string& path, bool* out) {
  if (!object.contains(key)) return Status::ok();
  const json& v = object.at(key);
  if (!v.is_boolean()) {
    return Status::invalid_argument(
        fmt::format("{}.{}: {} is not true or false", path, key, v.dump()));
  }
  *out = v.get<bool>();
  return Status::ok();
}

Status read_offload(const json& object, const char* key, Offload* out, std::uint64_t* buffers,
                    std::string* nvme_path) {
  if (!object.contains(key)) return Status::ok();
  const json& section = object.at(key);
  const std::string path = fmt::format("zero_optimization.{}", key);
  if (!section.is_object()) {
    return Status::invalid_argument(fmt::format("{}: is not an object", path));
  }
  if (section.contains("device")) {
    const json& d = section.at("device");
    if (!d.is_string() || !parse_offload(d.get<std::string>(), out)) {
      return Status::invalid_argument(
          fmt::format("{}.device: {} is not \"none\", \"cpu\" or \"nvme\"", path, d.dump()));
    }
  }
  ZINF_RETURN_IF_ERROR(read_count(section, "buffer_count", path, buffers));
  if (section.contains("nvme_path") && section.at("nvme_path").is_string() && nvme_path->empty()) {
    *nvme_path = section.at("nvme_path").get<std::string>();
  }
  return Status::ok();
}

}  // namespace

std::string config_to_json(const PlanConfig& c) {
  const EngineSetup& s = c.setup;
  json zero;
  zero["stage"] = s.stage;
  json optimizer;
  optimizer["device"] = std::string(offload_name(s.optimizer));
  if (s.optimizer != Offload::kNone) optimizer["pin_memory"] = true;
  if (s.optimizer == Offload::kNvme) {
    optimizer["nvme_path"] = c.nvme_path;
    optimizer["buffer_count"] = s.buffer_count;
  }
  zero["offload_optimizer"] = optimizer;
  json param;
  param["device"] = std::string(offload_name(s.params));
  if (s.params != Offload::kNone) param["pin_memory"] = true;
  if (s.params == Offload::kNvme) {
    param["nvme_path"] = c.nvme_path;
    param["buffer_count"] = s.param_buffer_count;
    param["buffer_size"] = s.param_buffer_params;
  }
  zero["offload_param"] = param;
  zero["sub_group_size"] = s.sub_group_params;
  zero["reduce_bucket_size"] = s.reduce_bucket_params;
  zero["stage3_prefetch_bucket_size"] = s.prefetch_bucket_params;
  zero["stage3_max_live_parameters"] = s.max_live_params;
  zero["stage3_param_persistence_threshold"] = s.persistence_threshold_params;
  zero["overlap_comm"] = true;
  zero["contiguous_gradients"] = true;

  json out;
  out["train_micro_batch_size_per_gpu"] = c.micro_batch;
  out["gradient_accumulation_steps"] = c.grad_accum_steps;
  out["bf16"] = {{"enabled", true}};
  out["zero_optimization"] = zero;
  out["aio"] = {{"block_size", s.io_block_bytes}, {"queue_depth", s.io_queue_depth}};
  out["zinf"] = {{"world_size", s.world_size},
                 {"ranks_per_machine", s.ranks_per_machine},
                 {"pinned_pool_bytes", std::max(c.pinned_pool_bytes, pinned_pool_bytes(s))},
                 {"gradients_on_nvme", s.gradients_on_nvme},
                 {"gradient_spill_buffers", s.gradient_spill_buffers},
                 {"device_reserved_bytes", s.device_reserved_bytes}};
  return out.dump(2) + "\n";
}

Result<PlanConfig> config_from_json(std::string_view text) {
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return Status::invalid_argument("config: not a JSON object");
  }
  PlanConfig c;
  EngineSetup& s = c.setup;
  ZINF_RETURN_IF_ERROR(read_count(root, "train_micro_batch_size_per_gpu", "", &c.micro_batch));
  ZINF_RETURN_IF_ERROR(read_count(root, "gradient_accumulation_steps", "", &c.grad_accum_steps));
  if (root.contains("zero_optimization")) {
    const json& zero = root.at("zero_optimization");
    const std::string path = "zero_optimization";
    if (!zero.is_object()) return Status::invalid_argument("zero_optimization: is not an object");
    std::uint64_t stage = static_cast<std::uint64_t>(s.stage);
    ZINF_RETURN_IF_ERROR(read_count(zero, "stage", path, &stage));
    s.stage = static_cast<int>(std::min<std::uint64_t>(stage, 100));
    ZINF_RETURN_IF_ERROR(
        read_offload(zero, "offload_optimizer", &s.optimizer, &s.buffer_count, &c.nvme_path));
    ZINF_RETURN_IF_ERROR(
        read_offload(zero, "offload_param", &s.params, &s.param_buffer_count, &c.nvme_path));
    if (zero.contains("offload_param") && zero.at("offload_param").is_object()) {
      ZINF_RETURN_IF_ERROR(read_count(zero.at("offload_param"), "buffer_size",
                                      "zero_optimization.offload_param", &s.param_buffer_params));
    }
    ZINF_RETURN_IF_ERROR(read_count(zero, "sub_group_size", path, &s.sub_group_params));
    ZINF_RETURN_IF_ERROR(read_count(zero, "reduce_bucket_size", path, &s.reduce_bucket_params));
    ZINF_RETURN_IF_ERROR(
        read_count(zero, "stage3_prefetch_bucket_size", path, &s.prefetch_bucket_params));
    ZINF_RETURN_IF_ERROR(read_count(zero, "stage3_max_live_parameters", path, &s.max_live_params));
    ZINF_RETURN_IF_ERROR(read_count(zero, "stage3_param_persistence_threshold", path,
                                    &s.persistence_threshold_params));
  }
  if (root.contains("aio")) {
    const json& aio = root.at("aio");
    if (!aio.is_object()) return Status::invalid_argument("aio: is not an object");
    ZINF_RETURN_IF_ERROR(read_count(aio, "block_size", "aio", &s.io_block_bytes));
    ZINF_RETURN_IF_ERROR(read_count(aio, "queue_depth", "aio", &s.io_queue_depth));
  }
  if (root.contains("zinf")) {
    const json& z = root.at("zinf");
    if (!z.is_object()) return Status::invalid_argument("zinf: is not an object");
    ZINF_RETURN_IF_ERROR(read_count(z, "world_size", "zinf", &s.world_size));
    ZINF_RETURN_IF_ERROR(read_count(z, "ranks_per_machine", "zinf", &s.ranks_per_machine));
    ZINF_RETURN_IF_ERROR(read_count(z, "pinned_pool_bytes", "zinf", &c.pinned_pool_bytes));
    ZINF_RETURN_IF_ERROR(read_bool(z, "gradients_on_nvme", "zinf", &s.gradients_on_nvme));
    ZINF_RETURN_IF_ERROR(
        read_count(z, "gradient_spill_buffers", "zinf", &s.gradient_spill_buffers));
    ZINF_RETURN_IF_ERROR(read_count(z, "device_reserved_bytes", "zinf", &s.device_reserved_bytes));
  }
  ZINF_RETURN_IF_ERROR(validate_setup(s));
  if ((s.optimizer == Offload::kNvme || s.params == Offload::kNvme) && c.nvme_path.empty()) {
    return Status::invalid_argument(
        "zero_optimization.offload_optimizer.nvme_path: needed for state on nvme");
  }
  return c;
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
