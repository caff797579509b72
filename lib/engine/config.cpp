// Config parsing: DeepSpeed's JSON keys, zinf's own in "zinf". Every error starts with the dotted
// key that is wrong. Unknown keys inside "zero_optimization", "fp16", "bf16", "aio" and "zinf"
// are errors (a misspelt knob should not silently keep its default); DeepSpeed keys that zinf
// does not use are accepted by name; unknown top-level sections (scheduler, logging, ...) belong
// to other parts of a DeepSpeed job and are ignored.
#include "zinf/config.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

namespace zinf {
namespace {

using nlohmann::json;

std::string join(std::string_view path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

Status bad(std::string_view path, std::string_view key, const json& value, std::string_view why) {
  return Status::invalid_argument(fmt::format("{}: {} {}", join(path, key), value.dump(), why));
}

// Rejects keys of `object` not in `known`.
Status check_keys(const json& object, std::string_view path,
                  std::initializer_list<std::string_view> known) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    bool found = false;
    for (std::string_view k : known) found = found || it.key() == k;
    if (!found) {
      return Status::invalid_argument(fmt::format(
          "{}: unknown key (misspelt, or not supported by zinf)", join(path, it.key())));
    }
  }
  return Status::ok();
}

Status read_section(const json& root, std::string_view path, const char* key, const json** out) {
  *out = nullptr;
  if (!root.contains(key)) return Status::ok();
  const json& v = root.at(key);
  if (!v.is_object()) return bad(path, key, v, "is not an object");
  *out = &v;
  return Status::ok();
}

// A non-negative count; DeepSpeed configs often write counts as floats (1e9).
Status read_count(const json& object, std::string_view path, const char* key, std::uint64_t* out) {
  if (!object.contains(key)) return Status::ok();
  const json& v = object.at(key);
  if (v.is_number_unsigned()) {
    *out = v.get<std::uint64_t>();
  } else if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    *out = static_cast<std::uint64_t>(v.get<std::int64_t>());
  } else if (v.is_number_float() && v.get<double>() >= 0 && v.get<double>() < 1.8e19 &&
             std::floor(v.get<double>()) == v.get<double>()) {
    *out = static_cast<std::uint64_t>(v.get<double>());
  } else {
    return bad(path, key, v, "is not a non-negative whole number");
  }
  return Status::ok();
}

template <typename T>
Status read_count_as(const json& object, std::string_view path, const char* key, T* out) {
  std::uint64_t value = static_cast<std::uint64_t>(*out);
  ZINF_RETURN_IF_ERROR(read_count(object, path, key, &value));
  if (value > static_cast<std::uint64_t>(std::numeric_limits<T>::max())) {
    return bad(path, key, object.at(key), "is too large");
  }
  *out = static_cast<T>(value);
  return Status::ok();
}

Status read_number(const json& object, std::string_view path, const char* key, double* out) {
  if (!object.contains(key)) return Status::ok();
  const json& v = object.at(key);
  if (!v.is_number()) return bad(path, key, v, "is not a number");
  *out = v.get<double>();
  return Status::ok();
}

Status read_bool(const json& object, std::string_view path, const char* key, bool* out) {
  if (!object.contains(key)) return Status::ok();
  const json& v = object.at(key);
  if (!v.is_boolean()) return bad(path, key, v, "is not true or false");
  *out = v.get<bool>();
  return Status::ok();
}

Status read_string(const json& object, std::string_view path, const char* key, std::string* out) {
  if (!object.contains(key)) return Status::ok();
  const json& v = object.at(key);
  if (!v.is_string()) return bad(path, key, v, "is not a string");
  *out = v.get<std::string>();
  return Status::ok();
}

Status read_offload(const json& zero, const char* key, bool param, OffloadConfig* out) {
  const json* section = nullptr;
  ZINF_RETURN_IF_ERROR(read_section(zero, "zero_optimization", key, &section));
  if (section == nullptr) return Status::ok();
  const std::string path = join("zero_optimization", key);
  if (param) {
    ZINF_RETURN_IF_ERROR(check_keys(
        *section, path,
        {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"}));
  } else {
    ZINF_RETURN_IF_ERROR(
        check_keys(*section, path,
                   {"device", "nvme_path", "pin_memory", "buffer_count", "pipeline",
                    "pipeline_read", "pipeline_write", "fast_init", "ratio"}));
  }
  if (section->contains("device")) {
    const json& d = section->at("device");
    if (!d.is_string() || !parse_offload_device(d.get<std::string>(), &out->device)) {
      return bad(path, "device", d, "is not \"none\", \"cpu\" or \"nvme\"");
    }
  }
  ZINF_RETURN_IF_ERROR(read_string(*section, path, "nvme_path", &out->nvme_path));
  ZINF_RETURN_IF_ERROR(read_bool(*section, path, "pin_memory", &out->pin_memory));
  ZINF_RETURN_IF_ERROR(read_count_as(*section, path, "buffer_count", &out->buffer_count));
  if (param) ZINF_RETURN_IF_ERROR(read_count_as(*section, path, "buffer_size", &out->buffer_size));
  return Status::ok();
}

Status parse_optimizer_section(const json& section, Config* c) {
  ZINF_RETURN_IF_ERROR(check_keys(section, "optimizer", {"type", "params"}));
  if (section.contains("type")) {
    const json& t = section.at("type");
    std::string text = t.is_string() ? t.get<std::string>() : "";
    for (char& ch : text) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (!t.is_string() || !parse_optimizer(text, &c->optimizer.kind)) {
      return bad("optimizer", "type", t, "is not \"Adam\", \"AdamW\", \"Adagrad\" or \"Lion\"");
    }
  }
  const json* params = nullptr;
  ZINF_RETURN_IF_ERROR(read_section(section, "optimizer", "params", &params));
  if (params == nullptr) return Status::ok();
  const std::string path = "optimizer.params";
  ZINF_RETURN_IF_ERROR(check_keys(*params, path,
                                  {"lr", "betas", "eps", "weight_decay", "bias_correction",
                                   "lr_decay", "adam_w_mode", "torch_adam", "amsgrad"}));
  OptimizerParams& o = c->optimizer;
  ZINF_RETURN_IF_ERROR(read_number(*params, path, "lr", &o.lr));
  ZINF_RETURN_IF_ERROR(read_number(*params, path, "eps", &o.eps));
  ZINF_RETURN_IF_ERROR(read_number(*params, path, "weight_decay", &o.weight_decay));
  ZINF_RETURN_IF_ERROR(read_number(*params, path, "lr_decay", &o.lr_decay));
  ZINF_RETURN_IF_ERROR(read_bool(*params, path, "bias_correction", &o.bias_correction));
  bool amsgrad = false;
  ZINF_RETURN_IF_ERROR(read_bool(*params, path, "amsgrad", &amsgrad));
  if (amsgrad) return bad(path, "amsgrad", params->at("amsgrad"), "is not supported");
  if (params->contains("betas")) {
    const json& b = params->at("betas");
    if (!b.is_array() || b.size() != 2 || !b[0].is_number() || !b[1].is_number()) {
      return bad(path, "betas", b, "is not a pair of numbers");
    }
    o.beta1 = b[0].get<double>();
    o.beta2 = b[1].get<double>();
  }
  return Status::ok();
}

Status parse_root(const json& root, Config* c) {
  ZINF_RETURN_IF_ERROR(read_count_as(root, "", "train_micro_batch_size_per_gpu",
                                     &c->train_micro_batch_size_per_gpu));
  ZINF_RETURN_IF_ERROR(
      read_count_as(root, "", "gradient_accumulation_steps", &c->gradient_accumulation_steps));
  ZINF_RETURN_IF_ERROR(read_number(root, "", "gradient_clipping", &c->gradient_clipping));

  const json* s = nullptr;
  ZINF_RETURN_IF_ERROR(read_section(root, "", "fp16", &s));
  if (s != nullptr) {
    ZINF_RETURN_IF_ERROR(
        check_keys(*s, "fp16",
                   {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
                    "hysteresis", "min_loss_scale", "consecutive_hysteresis", "auto_cast"}));
    Fp16Config& f = c->fp16;
    ZINF_RETURN_IF_ERROR(read_bool(*s, "fp16", "enabled", &f.enabled));
    ZINF_RETURN_IF_ERROR(read_number(*s, "fp16", "loss_scale", &f.loss_scale));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, "fp16", "initial_scale_power", &f.initial_scale_power));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, "fp16", "loss_scale_window", &f.loss_scale_window));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, "fp16", "hysteresis", &f.hysteresis));
    ZINF_RETURN_IF_ERROR(read_number(*s, "fp16", "min_loss_scale", &f.min_loss_scale));
  }
  ZINF_RETURN_IF_ERROR(read_section(root, "", "bf16", &s));
  if (s != nullptr) {
    ZINF_RETURN_IF_ERROR(check_keys(*s, "bf16", {"enabled", "immediate_grad_update"}));
    ZINF_RETURN_IF_ERROR(read_bool(*s, "bf16", "enabled", &c->bf16_enabled));
  }
  ZINF_RETURN_IF_ERROR(read_section(root, "", "optimizer", &s));
  if (s != nullptr) ZINF_RETURN_IF_ERROR(parse_optimizer_section(*s, c));

  ZINF_RETURN_IF_ERROR(read_section(root, "", "zero_optimization", &s));
  if (s != nullptr) {
    const std::string path = "zero_optimization";
    ZINF_RETURN_IF_ERROR(check_keys(*s, path,
                                    {"stage",
                                     "offload_optimizer",
                                     "offload_param",
                                     "sub_group_size",
                                     "reduce_bucket_size",
                                     "stage3_prefetch_bucket_size",
                                     "stage3_max_live_parameters",
                                     "stage3_param_persistence_threshold",
                                     "overlap_comm",
                                     "contiguous_gradients",
                                     "reduce_scatter",
                                     "allgather_partitions",
                                     "allgather_bucket_size",
                                     "stage3_max_reuse_distance",
                                     "stage3_gather_16bit_weights_on_model_save",
                                     "stage3_gather_fp16_weights_on_model_save",
                                     "round_robin_gradients",
                                     "elastic_checkpoint",
                                     "memory_efficient_linear",
                                     "ignore_unused_parameters",
                                     "load_from_fp32_weights"}));
    ZeroConfig& z = c->zero;
    ZINF_RETURN_IF_ERROR(read_count_as(*s, path, "stage", &z.stage));
    ZINF_RETURN_IF_ERROR(read_offload(*s, "offload_optimizer", false, &z.offload_optimizer));
    ZINF_RETURN_IF_ERROR(read_offload(*s, "offload_param", true, &z.offload_param));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, path, "sub_group_size", &z.sub_group_size));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, path, "reduce_bucket_size", &z.reduce_bucket_size));
    ZINF_RETURN_IF_ERROR(
        read_count_as(*s, path, "stage3_prefetch_bucket_size", &z.stage3_prefetch_bucket_size));
    ZINF_RETURN_IF_ERROR(
        read_count_as(*s, path, "stage3_max_live_parameters", &z.stage3_max_live_parameters));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, path, "stage3_param_persistence_threshold",
                                       &z.stage3_param_persistence_threshold));
  }
  ZINF_RETURN_IF_ERROR(read_section(root, "", "aio", &s));
  if (s != nullptr) {
    ZINF_RETURN_IF_ERROR(check_keys(*s, "aio",
                                    {"block_size", "queue_depth", "thread_count", "single_submit",
                                     "overlap_events", "use_gds"}));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, "aio", "block_size", &c->aio_block_size));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, "aio", "queue_depth", &c->aio_queue_depth));
  }
  ZINF_RETURN_IF_ERROR(read_section(root, "", "zinf", &s));
  if (s != nullptr) {
    ZINF_RETURN_IF_ERROR(check_keys(
        *s, "zinf",
        {"world_size", "ranks_per_machine", "pinned_pool_bytes", "gradients_on_nvme",
         "gradient_spill_buffers", "device_reserved_bytes", "cpu_threads", "collective_timeout_ms",
         "io_timeout_ms", "io_timeouts_max", "group_max_elements"}));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, "zinf", "world_size", &c->world_size));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, "zinf", "ranks_per_machine", &c->ranks_per_machine));
    ZINF_RETURN_IF_ERROR(read_count(*s, "zinf", "pinned_pool_bytes", &c->pinned_pool_bytes));
    ZINF_RETURN_IF_ERROR(read_bool(*s, "zinf", "gradients_on_nvme", &c->gradients_on_nvme));
    ZINF_RETURN_IF_ERROR(
        read_count_as(*s, "zinf", "gradient_spill_buffers", &c->gradient_spill_buffers));
    ZINF_RETURN_IF_ERROR(
        read_count(*s, "zinf", "device_reserved_bytes", &c->device_reserved_bytes));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, "zinf", "cpu_threads", &c->cpu_threads));
    ZINF_RETURN_IF_ERROR(
        read_count_as(*s, "zinf", "collective_timeout_ms", &c->collective_timeout_ms));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, "zinf", "io_timeout_ms", &c->io_timeout_ms));
    ZINF_RETURN_IF_ERROR(read_count_as(*s, "zinf", "io_timeouts_max", &c->io_timeouts_max));
    ZINF_RETURN_IF_ERROR(
        read_count_as(*s, "zinf", "group_max_elements", &c->zero.group_max_elements));
  }
  return Status::ok();
}

Status invalid(std::string_view key, std::string_view why) {
  return Status::invalid_argument(fmt::format("{}: {}", key, why));
}

}  // namespace

std::string_view offload_device_name(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kHost:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "?";
}

bool parse_offload_device(std::string_view text, OffloadDevice* device) {
  if (text == "none") {
    *device = OffloadDevice::kNone;
  } else if (text == "cpu" || text == "host") {
    *device = OffloadDevice::kHost;
  } else if (text == "nvme") {
    *device = OffloadDevice::kNvme;
  } else {
    return false;
  }
  return true;
}

Status validate(const Config& c) {
  const ZeroConfig& z = c.zero;
  if (z.stage < 1 || z.stage > 3) {
    return invalid("zero_optimization.stage", fmt::format("{} is not 1, 2 or 3", z.stage));
  }
  if (z.offload_param.device != OffloadDevice::kNone && z.stage != 3) {
    return invalid("zero_optimization.offload_param.device",
                   fmt::format("\"{}\" needs stage 3 (stage {} keeps every parameter on the "
                               "device)",
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
  if (z.sub_group_size == 0) return invalid("zero_optimization.sub_group_size", "0 is below 1");
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
    return invalid("zero_optimization.reduce_bucket_size", "0 is below 1");
  }
  if (z.stage3_max_live_parameters == 0) {
    return invalid("zero_optimization.stage3_max_live_parameters", "0 is below 1");
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
  if (f.hysteresis < 1)
    return invalid("fp16.hysteresis", fmt::format("{} is below 1", f.hysteresis));
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
  if (c.aio_block_size == 0 || c.aio_block_size % 4096 != 0) {
    return invalid("aio.block_size",
                   fmt::format("{} is not a positive multiple of 4096", c.aio_block_size));
  }
  if (c.aio_queue_depth == 0 || c.aio_queue_depth > 4096) {
    return invalid("aio.queue_depth", fmt::format("{} is not in 1..4096", c.aio_queue_depth));
  }
  if (c.world_size < 0) return invalid("zinf.world_size", "is below 0");
  if (c.cpu_threads < 0) return invalid("zinf.cpu_threads", "is below 0");
  if (c.collective_timeout_ms < 1) {
    return invalid("zinf.collective_timeout_ms",
                   fmt::format("{} is below 1", c.collective_timeout_ms));
  }
  if (c.io_timeout_ms < 1) {
    return invalid("zinf.io_timeout_ms", fmt::format("{} is below 1", c.io_timeout_ms));
  }
  return Status::ok();
}

Result<Config> parse_config(std::string_view json_text) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Status::invalid_argument("config: not valid JSON");
  if (!root.is_object()) return Status::invalid_argument("config: not a JSON object");
  Config c;
  ZINF_RETURN_IF_ERROR(parse_root(root, &c));
  ZINF_RETURN_IF_ERROR(validate(c));
  return c;
}

Result<Config> load_config(const std::string& path) {
  std::ifstream file(path);
  if (!file) return status_from_errno(fmt::format("config {}", path), errno);
  std::stringstream text;
  text << file.rdbuf();
  Result<Config> c = parse_config(text.str());
  if (!c.is_ok()) return c.status().with_context(path);
  return c;
}

std::string config_to_json(const Config& c) {
  const ZeroConfig& z = c.zero;
  auto offload = [](const OffloadConfig& o, bool param) {
    json j;
    j["device"] = std::string(offload_device_name(o.device));
    j["nvme_path"] = o.nvme_path;
    j["pin_memory"] = o.pin_memory;
    j["buffer_count"] = o.buffer_count;
    if (param) j["buffer_size"] = o.buffer_size;
    return j;
  };
  json zero;
  zero["stage"] = z.stage;
  zero["offload_optimizer"] = offload(z.offload_optimizer, false);
  zero["offload_param"] = offload(z.offload_param, true);
  zero["sub_group_size"] = z.sub_group_size;
  zero["reduce_bucket_size"] = z.reduce_bucket_size;
  zero["stage3_prefetch_bucket_size"] = z.stage3_prefetch_bucket_size;
  zero["stage3_max_live_parameters"] = z.stage3_max_live_parameters;
  zero["stage3_param_persistence_threshold"] = z.stage3_param_persistence_threshold;
  zero["overlap_comm"] = true;
  zero["contiguous_gradients"] = true;
  json out;
  out["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
  out["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  out["gradient_clipping"] = c.gradient_clipping;
  out["fp16"] = {{"enabled", c.fp16.enabled},
                 {"loss_scale", c.fp16.loss_scale},
                 {"initial_scale_power", c.fp16.initial_scale_power},
                 {"loss_scale_window", c.fp16.loss_scale_window},
                 {"hysteresis", c.fp16.hysteresis},
                 {"min_loss_scale", c.fp16.min_loss_scale}};
  out["bf16"] = {{"enabled", c.bf16_enabled}};
  const OptimizerParams& o = c.optimizer;
  std::string type(optimizer_name(o.kind));
  out["optimizer"] = {{"type", type},
                      {"params",
                       {{"lr", o.lr},
                        {"betas", {o.beta1, o.beta2}},
                        {"eps", o.eps},
                        {"weight_decay", o.weight_decay},
                        {"bias_correction", o.bias_correction},
                        {"lr_decay", o.lr_decay}}}};
  out["zero_optimization"] = zero;
  out["aio"] = {{"block_size", c.aio_block_size}, {"queue_depth", c.aio_queue_depth}};
  out["zinf"] = {{"world_size", c.world_size},
                 {"ranks_per_machine", c.ranks_per_machine},
                 {"pinned_pool_bytes", c.pinned_pool_bytes},
                 {"gradients_on_nvme", c.gradients_on_nvme},
                 {"gradient_spill_buffers", c.gradient_spill_buffers},
                 {"device_reserved_bytes", c.device_reserved_bytes},
                 {"cpu_threads", c.cpu_threads},
                 {"collective_timeout_ms", c.collective_timeout_ms},
                 {"io_timeout_ms", c.io_timeout_ms},
                 {"io_timeouts_max", c.io_timeouts_max},
                 {"group_max_elements", z.group_max_elements}};
  return out.dump(2) + "\n";
}

}  // namespace zinf
