// Config parsing and writing: the one schema of the engine, the planner and the CLI.
//
// Every key zinf knows is in a table below with what zinf does with it: used (read into Config),
// accepted with no effect in zinf (and why), or refused (and why). A key that is in no table is
// refused as unknown; keys are case-sensitive, as DeepSpeed's are, and a key that differs from a
// known one only in case is refused with a hint. The walk over a JSON object reports every key in
// file order (check_config); parse_config() fails with the first refused key's report, so the
// engine, the planner and `zinf config check` give the same message for the same file.
//
// To add a section (say "monitor"), give it a table of its keys and a row in kRootKeys that
// points at it (or a walk function, as the optimizer has, when one key decides what the others
// mean), and read its values into Config in the readers.
#include "zinf/config.hpp"

#include <fmt/format.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <sstream>

#include "engine/config_names.hpp"
#include "engine/schedule.hpp"

namespace zinf {
namespace {

// Keeps the file's key order, so "the first key" of a report is the first in the file.
using Json = nlohmann::ordered_json;

std::string join(std::string_view path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

// The optimizer's keys as read, before the type's defaults are filled in.
struct OptimizerInput {
  std::optional<double> lr, beta1, beta2, eps, weight_decay, lr_decay;
  std::optional<bool> bias_correction;
  bool adam_w_mode = true;
  bool torch_adam = false;
};

// The state of one walk: the config being filled and the report of every key seen.
struct Walk {
  Config* config = nullptr;
  std::vector<KeyReport>* reports = nullptr;
  OptimizerInput optimizer;

  void used(const std::string& key) { reports->push_back({key, KeyUse::kUsed, ""}); }
  void no_effect(const std::string& key, std::string why) {
    reports->push_back({key, KeyUse::kNoEffect, std::move(why)});
  }
  void refuse(const std::string& key, std::string why) {
    reports->push_back({key, KeyUse::kRefused, std::move(why)});
  }
};

// A reader checks one value and stores it; it returns the reason when the value is refused
// (the caller prefixes the key).
using Why = std::optional<std::string>;
using Reader = Why (*)(const Json& value, Walk& w);

struct Key;
using WalkFn = void (*)(const Json& value, const std::string& key, Walk& w);

// One key of a section. Exactly one of read, keys, walk is set for a used key; a key with
// no_effect or refused set is accepted (or refused) whatever its value, unless it also has a
// reader that refuses some values (aio.use_gds: false is fine, true is refused).
struct Key {
  std::string_view name;
  Reader read = nullptr;
  std::span<const Key> keys = {};  // a section: its keys
  WalkFn walk = nullptr;           // a section with its own walk
  std::string_view no_effect = {};
  std::string_view refused = {};
};

// --- value readers --------------------------------------------------------------------------

Why not_a(const Json& v, std::string_view what) {
  return fmt::format("{} is not {}", v.dump(), what);
}

// A non-negative count; DeepSpeed configs often write counts as floats (1e9).
Why count_of(const Json& v, std::uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<std::uint64_t>();
  } else if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    *out = static_cast<std::uint64_t>(v.get<std::int64_t>());
  } else if (v.is_number_float() && v.get<double>() >= 0 && v.get<double>() < 1.8e19 &&
             std::floor(v.get<double>()) == v.get<double>()) {
    *out = static_cast<std::uint64_t>(v.get<double>());
  } else {
    return not_a(v, "a non-negative whole number");
  }
  return std::nullopt;
}

template <typename T>
Why count_as(const Json& v, T* out) {
  std::uint64_t value = 0;
  if (Why why = count_of(v, &value)) return why;
  if (value > static_cast<std::uint64_t>(std::numeric_limits<T>::max())) {
    return fmt::format("{} is too large", v.dump());
  }
  *out = static_cast<T>(value);
  return std::nullopt;
}

Why number_of(const Json& v, double* out) {
  if (!v.is_number()) return not_a(v, "a number");
  *out = v.get<double>();
  return std::nullopt;
}

Why number_opt(const Json& v, std::optional<double>* out) {
  double x = 0;
  if (Why why = number_of(v, &x)) return why;
  *out = x;
  return std::nullopt;
}

Why bool_of(const Json& v, bool* out) {
  if (!v.is_boolean()) return not_a(v, "true or false");
  *out = v.get<bool>();
  return std::nullopt;
}

Why string_of(const Json& v, std::string* out) {
  if (!v.is_string()) return not_a(v, "a string");
  *out = v.get<std::string>();
  return std::nullopt;
}

// A boolean that zinf supports only at `supported`: the other value is refused with `why`.
Why only_bool(const Json& v, bool supported, std::string_view why) {
  bool b = supported;
  if (Why bad = bool_of(v, &b)) return bad;
  if (b != supported) return fmt::format("{} is not supported: {}", v.dump(), why);
  return std::nullopt;
}

Why device_of(const Json& v, OffloadDevice* out) {
  if (!v.is_string() || !parse_offload_device(v.get<std::string>(), out)) {
    return not_a(v, "\"none\", \"cpu\" or \"nvme\"");
  }
  return std::nullopt;
}

// --- the tables -------------------------------------------------------------------------------

// A reader from one expression of the value `v` and the walk `w`.
#define ZINF_READ(expr) [](const Json& v, [[maybe_unused]] Walk& w) -> Why { return expr; }

// A number zinf supports only at `supported` (DeepSpeed's default): others refused with `why`.
Why only_number(const Json& v, double supported, std::string_view why) {
  double x = supported;
  if (Why bad = number_of(v, &x)) return bad;
  if (x != supported) return fmt::format("{} is not supported: {}", v.dump(), why);
  return std::nullopt;
}

constexpr std::string_view kOverlapsIo =
    "zinf always overlaps the reads and writes of the next and previous sub-groups with the "
    "update";

constexpr std::string_view kPinMemory =
    "zinf pins exactly its staging blocks, bounded by zinf.pinned_pool_bytes, whatever this "
    "says";

const Key kOffloadOptimizerKeys[] = {
    {.name = "device", .read = ZINF_READ(device_of(v, &w.config->zero.offload_optimizer.device))},
    {.name = "nvme_path",
     .read = ZINF_READ(string_of(v, &w.config->zero.offload_optimizer.nvme_path))},
    {.name = "buffer_count",
     .read = ZINF_READ(count_as(v, &w.config->zero.offload_optimizer.buffer_count))},
    {.name = "pin_memory",
     .read = ZINF_READ(bool_of(v, &w.config->zero.offload_optimizer.pin_memory)),
     .no_effect = kPinMemory},
    {.name = "pipeline", .no_effect = kOverlapsIo},
    {.name = "pipeline_read", .no_effect = kOverlapsIo},
    {.name = "pipeline_write", .no_effect = kOverlapsIo},
    {.name = "fast_init", .no_effect = "zinf writes the initial state once, in sub-groups"},
    {.name = "ratio",
     .read = ZINF_READ(only_number(v, 1.0, "zinf offloads all of the optimizer state or none")),
     .no_effect = "1.0 offloads all of the optimizer state, as zinf does"},
};

const Key kOffloadParamKeys[] = {
    {.name = "device", .read = ZINF_READ(device_of(v, &w.config->zero.offload_param.device))},
    {.name = "nvme_path", .read = ZINF_READ(string_of(v, &w.config->zero.offload_param.nvme_path))},
    {.name = "buffer_count",
     .read = ZINF_READ(count_as(v, &w.config->zero.offload_param.buffer_count))},
    {.name = "buffer_size",
     .read = ZINF_READ(count_as(v, &w.config->zero.offload_param.buffer_params)),
     .no_effect = "zinf sizes each staging block to the largest parameter shard it stages, so no "
                  "size can be too small"},
    {.name = "pin_memory",
     .read = ZINF_READ(bool_of(v, &w.config->zero.offload_param.pin_memory)),
     .no_effect = kPinMemory},
    {.name = "max_in_cpu",
     .no_effect = "zinf keeps no host cache of NVMe parameters beyond the staging blocks"},
};

constexpr std::string_view kAlwaysOverlaps =
    "zinf always reduces gradients in buckets overlapped with the backward pass";

Why read_cpu_offload(const Json& v, Walk& w) {
  bool on = false;
  if (Why bad = bool_of(v, &on)) return bad;
  if (on) w.config->zero.offload_optimizer.device = OffloadDevice::kHost;
  return std::nullopt;
}

Why read_cpu_offload_params(const Json& v, Walk& w) {
  bool on = false;
  if (Why bad = bool_of(v, &on)) return bad;
  if (on) w.config->zero.offload_param.device = OffloadDevice::kHost;
  return std::nullopt;
}

const Key kZeroKeys[] = {
    {.name = "stage", .read = ZINF_READ(count_as(v, &w.config->zero.stage))},
    {.name = "offload_optimizer", .keys = kOffloadOptimizerKeys},
    {.name = "offload_param", .keys = kOffloadParamKeys},
    {.name = "cpu_offload", .read = read_cpu_offload},
    {.name = "cpu_offload_params", .read = read_cpu_offload_params},
    {.name = "cpu_offload_use_pin_memory",
     .read = ZINF_READ(bool_of(v, &w.config->zero.offload_param.pin_memory)),
     .no_effect = kPinMemory},
    {.name = "sub_group_size", .read = ZINF_READ(count_as(v, &w.config->zero.sub_group_size))},
    {.name = "reduce_bucket_size",
     .read = ZINF_READ(count_as(v, &w.config->zero.reduce_bucket_size))},
    {.name = "stage3_prefetch_bucket_size",
     .read = ZINF_READ(count_as(v, &w.config->zero.stage3_prefetch_bucket_size))},
    {.name = "stage3_max_live_parameters",
     .read = ZINF_READ(count_as(v, &w.config->zero.stage3_max_live_parameters))},
    {.name = "stage3_param_persistence_threshold",
     .read = ZINF_READ(count_as(v, &w.config->zero.stage3_param_persistence_threshold))},
    {.name = "overlap_comm", .no_effect = kAlwaysOverlaps},
    {.name = "contiguous_gradients",
     .no_effect = "zinf always accumulates each rank's gradients in one contiguous fp32 buffer"},
    {.name = "reduce_scatter",
     .no_effect = "zinf always reduce-scatters gradients into their owners' shards"},
    {.name = "allgather_partitions",
     .no_effect =
         "stages 1-2 all-gather the updated parameters after every step, as DeepSpeed does"},
    {.name = "allgather_bucket_size",
     .no_effect = "zinf gathers whole modules, bounded by stage3_max_live_parameters"},
    {.name = "stage3_max_reuse_distance",
     .no_effect =
         "zinf releases a gathered module after use and prefetches it again in recorded order"},
    {.name = "stage3_gather_16bit_weights_on_model_save",
     .no_effect =
         "saving consolidated weights is the training program's, through Engine::read_parameters"},
    {.name = "stage3_gather_fp16_weights_on_model_save",
     .no_effect =
         "saving consolidated weights is the training program's, through Engine::read_parameters"},
    {.name = "gather_16bit_weights_on_model_save",
     .no_effect =
         "saving consolidated weights is the training program's, through Engine::read_parameters"},
    {.name = "round_robin_gradients",
     .no_effect = "a DeepSpeed stage 1-2 copy schedule; zinf's reduction order is fixed"},
    {.name = "elastic_checkpoint",
     .no_effect = "zinf checkpoints reshard to any world size on load"},
    {.name = "memory_efficient_linear",
     .no_effect =
         "a PyTorch module replacement in DeepSpeed's stage 3; the model is the program's"},
    {.name = "ignore_unused_parameters",
     .no_effect =
         "parameters without a gradient in a step are the training program's to hand zeros for"},
    {.name = "load_from_fp32_weights",
     .no_effect = "zinf checkpoints always restore the fp32 master"},
    {.name = "zero_hpz_partition_size",
     .read = ZINF_READ(only_number(v, 1.0, "zinf has no hierarchical partitions")),
     .no_effect = "1: no hierarchical partitioning, as in zinf"},
    {.name = "zero_quantized_weights",
     .read = ZINF_READ(only_bool(v, false, "zinf gathers parameters unquantized")),
     .no_effect = "false: parameters gathered unquantized, as in zinf"},
    {.name = "zero_quantized_gradients",
     .read = ZINF_READ(only_bool(v, false, "zinf reduces gradients unquantized")),
     .no_effect = "false: gradients reduced unquantized, as in zinf"},
};

const Key kFp16Keys[] = {
    {.name = "enabled", .read = ZINF_READ(bool_of(v, &w.config->fp16.enabled))},
    {.name = "loss_scale", .read = ZINF_READ(number_of(v, &w.config->fp16.loss_scale))},
    {.name = "initial_scale_power",
     .read = ZINF_READ(count_as(v, &w.config->fp16.initial_scale_power))},
    {.name = "loss_scale_window",
     .read = ZINF_READ(count_as(v, &w.config->fp16.loss_scale_window))},
    {.name = "hysteresis", .read = ZINF_READ(count_as(v, &w.config->fp16.hysteresis))},
    {.name = "min_loss_scale", .read = ZINF_READ(number_of(v, &w.config->fp16.min_loss_scale))},
    {.name = "consecutive_hysteresis",
     .read = ZINF_READ(only_bool(v, false,
                                 "zinf refills the hysteresis after loss_scale_window good steps, "
                                 "as DeepSpeed's default does"))},
    {.name = "auto_cast", .no_effect = "casting the model's inputs is the training program's"},
    {.name = "fp16_master_weights_and_grads",
     .read = ZINF_READ(only_bool(v, false, "zinf keeps an fp32 master and fp32 gradients")),
     .no_effect = "false: fp32 master and gradients, as in zinf"},
};

const Key kBf16Keys[] = {
    {.name = "enabled", .read = ZINF_READ(bool_of(v, &w.config->bf16_enabled))},
    {.name = "immediate_grad_update",
     .no_effect = "zinf accumulates gradients in fp32 and updates at step()"},
};

constexpr std::string_view kIoEngine =
    "zinf's io_uring engine submits and reaps in batches from one thread per ring";

const Key kAioKeys[] = {
    {.name = "block_size", .read = ZINF_READ(count_as(v, &w.config->aio_block_bytes))},
    {.name = "queue_depth", .read = ZINF_READ(count_as(v, &w.config->aio_queue_depth))},
    {.name = "thread_count", .no_effect = kIoEngine},
    {.name = "intra_op_parallelism", .no_effect = kIoEngine},
    {.name = "single_submit", .no_effect = kIoEngine},
    {.name = "overlap_events", .no_effect = kIoEngine},
    {.name = "use_gds",
     .read = ZINF_READ(only_bool(v, false, "zinf has no GPUDirect Storage path")),
     .no_effect = "false: no GPUDirect Storage, as in zinf"},
};

constexpr std::string_view kPlannerOnly =
    "read by `zinf plan` for its per-machine memory figures; the engine allocates no memory "
    "for it";

constexpr std::string_view kMonitorActivations =
    "zinf reports the store's traffic in MemoryReport and its trace";

const Key kZinfKeys[] = {
    {.name = "world_size", .read = ZINF_READ(count_as(v, &w.config->world_size))},
    {.name = "ranks_per_machine",
     .read = ZINF_READ(count_as(v, &w.config->ranks_per_machine)),
     .no_effect = kPlannerOnly},
    {.name = "pinned_pool_bytes", .read = ZINF_READ(count_as(v, &w.config->pinned_pool_bytes))},
    {.name = "gradients_on_nvme", .read = ZINF_READ(bool_of(v, &w.config->gradients_on_nvme))},
    {.name = "gradient_spill_buffers",
     .read = ZINF_READ(count_as(v, &w.config->gradient_spill_buffers))},
    {.name = "overlap_step", .read = ZINF_READ(bool_of(v, &w.config->overlap_step))},
    {.name = "device_reserved_bytes",
     .read = ZINF_READ(count_as(v, &w.config->device_reserved_bytes)),
     .no_effect = kPlannerOnly},
    {.name = "cpu_threads", .read = ZINF_READ(count_as(v, &w.config->cpu_threads))},
    {.name = "collective_timeout_ms",
     .read = ZINF_READ(count_as(v, &w.config->collective_timeout_ms))},
    {.name = "io_timeout_ms", .read = ZINF_READ(count_as(v, &w.config->io_timeout_ms))},
    {.name = "io_timeouts_max", .read = ZINF_READ(count_as(v, &w.config->io_timeouts_max))},
    {.name = "keep_last", .read = ZINF_READ(count_as(v, &w.config->keep_last))},
    {.name = "group_max_elements",
     .read = ZINF_READ(count_as(v, &w.config->zero.group_max_elements))},
    {.name = "activation_host_bytes",
     .read = ZINF_READ(count_as(v, &w.config->activations.host_bytes))},
    {.name = "activation_nvme_path",
     .read = ZINF_READ(string_of(v, &w.config->activations.nvme_path))},
    {.name = "activation_nvme_bytes",
     .read = ZINF_READ(count_as(v, &w.config->activations.nvme_bytes))},
};

const Key kActivationKeys[] = {
    {.name = "partition_activations",
     .no_effect = "DeepSpeed partitions each checkpoint over the model-parallel group; zinf has no "
                  "model parallelism (that group is one rank), and its data-parallel ranks hold "
                  "different activations"},
    {.name = "cpu_checkpointing",
     .read = ZINF_READ(bool_of(v, &w.config->activations.cpu_checkpointing))},
    {.name = "contiguous_memory_optimization",
     .no_effect = "zinf's offloaded checkpoints always share one contiguous pinned arena"},
    {.name = "number_checkpoints",
     .no_effect = "zinf's host arena is sized by zinf.activation_host_bytes, not by a count"},
    {.name = "synchronize_checkpoint_boundary",
     .no_effect = "Engine::load_activation() returns once the checkpoint is on the device"},
    {.name = "profile", .no_effect = kMonitorActivations},
};

void walk_optimizer(const Json& section, const std::string& path, Walk& w);
void walk_scheduler(const Json& section, const std::string& path, Walk& w);

constexpr std::string_view kProgramSide =
    "the training program's data loading, logging or checkpoint bookkeeping; zinf does not see "
    "it";
constexpr std::string_view kMonitor =
    "logging of the training program; zinf reports through "
    "StepReport, its trace and its counters";

const Key kRootKeys[] = {
    {.name = "train_batch_size", .no_effect = kProgramSide},
    {.name = "train_micro_batch_size_per_gpu",
     .read = ZINF_READ(count_as(v, &w.config->train_micro_batch_size_per_gpu)),
     .no_effect =
         "the training program sizes its batches; `zinf plan` reads it for activation memory"},
    {.name = "gradient_accumulation_steps",
     .read = ZINF_READ(count_as(v, &w.config->gradient_accumulation_steps)),
     .no_effect = "the engine accumulates every micro-batch handed to it between two step() calls"},
    {.name = "gradient_clipping", .read = ZINF_READ(number_of(v, &w.config->gradient_clipping))},
    {.name = "fp16", .keys = kFp16Keys},
    {.name = "bf16", .keys = kBf16Keys},
    {.name = "optimizer", .walk = walk_optimizer},
    {.name = "zero_optimization", .keys = kZeroKeys},
    {.name = "aio", .keys = kAioKeys},
    {.name = "zinf", .keys = kZinfKeys},
    {.name = "scheduler", .walk = walk_scheduler},
    {.name = "steps_per_print", .no_effect = kProgramSide},
    {.name = "wall_clock_breakdown", .no_effect = kMonitor},
    {.name = "memory_breakdown", .no_effect = kMonitor},
    {.name = "dump_state", .no_effect = kMonitor},
    {.name = "tensorboard", .no_effect = kMonitor},
    {.name = "wandb", .no_effect = kMonitor},
    {.name = "csv_monitor", .no_effect = kMonitor},
    {.name = "comet", .no_effect = kMonitor},
    {.name = "flops_profiler", .no_effect = kMonitor},
    {.name = "comms_logger", .no_effect = kMonitor},
    {.name = "activation_checkpointing", .keys = kActivationKeys},
    {.name = "zero_allow_untested_optimizer",
     .no_effect = "zinf runs only its own optimizers (optimizer.type)"},
    {.name = "zero_force_ds_cpu_optimizer",
     .no_effect = "zinf runs only its own optimizers (optimizer.type)"},
    {.name = "prescale_gradients",
     .read = ZINF_READ(only_bool(v, false, "zinf averages gradients after the reduction"))},
    {.name = "gradient_predivide_factor",
     .read = ZINF_READ(only_number(v, 1.0, "zinf averages after the reduction")),
     .no_effect = "1.0: gradients averaged after the reduction, as in zinf"},
    {.name = "amp", .refused = "NVIDIA Apex AMP is not supported; use fp16 or bf16"},
    {.name = "communication_data_type",
     .refused = "zinf reduces gradients in the parameter's dtype and accumulates in fp32; no other "
                "communication dtype is supported"},
    {.name = "sparse_attention", .refused = "a model feature zinf does not provide"},
    {.name = "pipeline", .refused = "pipeline parallelism is not supported"},
    {.name = "elasticity", .refused = "elastic training is not supported"},
    {.name = "compression_training", .refused = "compression training is not supported"},
    {.name = "data_efficiency", .refused = "data efficiency is not supported"},
    {.name = "curriculum_learning", .refused = "curriculum learning is not supported"},
    {.name = "autotuning",
     .refused = "DeepSpeed's autotuner is not supported; `zinf plan` chooses the setup"},
};

#undef ZINF_READ

// --- the walk ---------------------------------------------------------------------------------

const Key* find_key(std::span<const Key> keys, std::string_view name) {
  for (const Key& k : keys) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

bool equal_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

std::string unknown_key_why(std::span<const Key> keys, std::string_view name) {
  for (const Key& k : keys) {
    if (equal_ignoring_case(k.name, name)) {
      return fmt::format("unknown key (keys are case-sensitive: \"{}\")", k.name);
    }
  }
  return "unknown key (misspelt, or not supported by zinf)";
}

constexpr std::string_view kAutoWhy =
    "\"auto\" is a placeholder that the Hugging Face Trainer fills in before DeepSpeed reads the "
    "config; zinf has no trainer to fill it: write the value";

void walk_keys(const Json& object, const std::string& path, std::span<const Key> keys, Walk& w);

void walk_key(const Key& k, const Json& value, const std::string& key, Walk& w) {
  if (!k.refused.empty()) return w.refuse(key, std::string(k.refused));
  if (value.is_string() && value.get<std::string>() == "auto") {
    if (!k.no_effect.empty()) return w.no_effect(key, std::string(k.no_effect));
    return w.refuse(key, std::string(kAutoWhy));
  }
  if (k.walk != nullptr || !k.keys.empty()) {
    if (!value.is_object()) return w.refuse(key, not_a(value, "an object").value());
    if (k.walk != nullptr) return k.walk(value, key, w);
    return walk_keys(value, key, k.keys, w);
  }
  if (k.read != nullptr) {
    if (Why why = k.read(value, w)) return w.refuse(key, *why);
  }
  if (!k.no_effect.empty()) return w.no_effect(key, std::string(k.no_effect));
  w.used(key);
}

void walk_keys(const Json& object, const std::string& path, std::span<const Key> keys, Walk& w) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    const std::string key = join(path, it.key());
    const Key* k = find_key(keys, it.key());
    if (k == nullptr) {
      w.refuse(key, unknown_key_why(keys, it.key()));
      continue;
    }
    walk_key(*k, it.value(), key, w);
  }
}

// --- the optimizer ----------------------------------------------------------------------------
//
// DeepSpeed builds the optimizer in deepspeed/runtime/engine.py (_configure_basic_optimizer):
// "params" are passed as keyword arguments to DeepSpeedCPUAdam / FusedAdam (or torch.optim.Adam
// and AdamW with torch_adam), DeepSpeedCPUAdagrad (torch.optim.Adagrad without offload) and
// DeepSpeedCPULion / FusedLion, so a key that optimizer has no argument for is a TypeError there
// and refused here. docs/ENGINE.md tables the defaults and where each comes from.

struct ParamKey {
  std::string_view name;
  bool adam, adagrad, lion;  // which types take it
};

const ParamKey kOptimizerParamKeys[] = {
    {"lr", true, true, true},
    {"betas", true, false, true},
    {"eps", true, true, false},
    {"weight_decay", true, true, true},
    {"bias_correction", true, false, false},
    {"amsgrad", true, true, false},
    {"adam_w_mode", true, false, false},
    {"torch_adam", true, false, false},
    {"fp32_optimizer_states", true, true, true},
    {"lr_decay", false, true, false},
    {"initial_accumulator_value", false, true, false},
};

Why read_optimizer_param(std::string_view name, const Json& v, Walk& w) {
  OptimizerInput& in = w.optimizer;
  if (name == "lr") return number_opt(v, &in.lr);
  if (name == "eps") return number_opt(v, &in.eps);
  if (name == "weight_decay") return number_opt(v, &in.weight_decay);
  if (name == "lr_decay") return number_opt(v, &in.lr_decay);
  if (name == "bias_correction") {
    bool b = true;
    if (Why bad = bool_of(v, &b)) return bad;
    if (in.torch_adam) {
      return std::string("is not an argument of torch.optim.Adam (torch_adam is true)");
    }
    in.bias_correction = b;
    return std::nullopt;
  }
  if (name == "betas") {
    if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number()) {
      return not_a(v, "a pair of numbers");
    }
    in.beta1 = v[0].get<double>();
    in.beta2 = v[1].get<double>();
    return std::nullopt;
  }
  if (name == "amsgrad") return only_bool(v, false, "AMSGrad is not implemented");
  if (name == "adam_w_mode") return bool_of(v, &in.adam_w_mode);
  if (name == "torch_adam") return bool_of(v, &in.torch_adam);
  if (name == "fp32_optimizer_states") {
    return only_bool(v, true, "zinf keeps the optimizer state in fp32");
  }
  if (name == "initial_accumulator_value") {
    double x = 0;
    if (Why bad = number_of(v, &x)) return bad;
    if (x != 0.0) return fmt::format("{} is not supported: the state sum starts at 0", v.dump());
    return std::nullopt;
  }
  return std::string("unknown key");
}

// The keys of the optimizer section itself (walk_optimizer reads them; this names them for the
// case hint).
const Key kOptimizerKeys[] = {{.name = "type"}, {.name = "params"}};

void walk_optimizer(const Json& section, const std::string& path, Walk& w) {
  // The type decides the defaults and which params keys mean anything, wherever it is written.
  OptimizerKind kind = w.config->optimizer.kind;
  bool typed = false;
  bool type_ok = true;
  if (section.contains("type")) {
    const Json& t = section.at("type");
    std::string text = t.is_string() ? t.get<std::string>() : "";
    for (char& ch : text) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    type_ok = t.is_string() && parse_optimizer(text, &kind);
    typed = type_ok;
  }
  const Json* params = nullptr;
  for (auto it = section.begin(); it != section.end(); ++it) {
    const std::string key = join(path, it.key());
    if (it.key() == "type") {
      if (type_ok) {
        w.used(key);
      } else {
        w.refuse(key, not_a(it.value(), "\"Adam\", \"AdamW\", \"Adagrad\" or \"Lion\"").value());
      }
    } else if (it.key() == "params") {
      if (!it.value().is_object()) {
        w.refuse(key, not_a(it.value(), "an object").value());
        continue;
      }
      params = &it.value();
      // torch_adam changes which other keys torch accepts: read it first.
      if (params->contains("torch_adam") && params->at("torch_adam").is_boolean()) {
        w.optimizer.torch_adam = params->at("torch_adam").get<bool>();
      }
      const bool adam = kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW;
      for (auto p = params->begin(); p != params->end(); ++p) {
        const std::string pkey = join(key, p.key());
        const ParamKey* pk = nullptr;
        for (const ParamKey& c : kOptimizerParamKeys) {
          if (c.name == p.key()) pk = &c;
        }
        if (p.key() == "max_grad_norm") {
          w.refuse(pkey, "DeepSpeed refuses it too: use the top-level gradient_clipping");
          continue;
        }
        const bool takes = pk != nullptr && (adam                              ? pk->adam
                                             : kind == OptimizerKind::kAdagrad ? pk->adagrad
                                                                               : pk->lion);
        if (!takes) {
          w.refuse(pkey, fmt::format("unknown key (not a parameter of DeepSpeed's {})",
                                     deepspeed_type_name(kind)));
          continue;
        }
        if (p.value().is_string() && p.value().get<std::string>() == "auto") {
          w.refuse(pkey, std::string(kAutoWhy));
          continue;
        }
        if (Why why = read_optimizer_param(p.key(), p.value(), w)) {
          w.refuse(pkey, *why);
        } else if (p.key() == "adam_w_mode" && kind == OptimizerKind::kAdamW) {
          w.no_effect(pkey, "type AdamW always decays decoupled (DeepSpeed: AdamW or adam_w_mode)");
        } else if (p.key() == "fp32_optimizer_states" || p.key() == "amsgrad" ||
                   p.key() == "initial_accumulator_value") {
          w.no_effect(pkey, "its value is zinf's only behaviour");
        } else {
          w.used(pkey);
        }
      }
    } else {
      w.refuse(key, unknown_key_why(kOptimizerKeys, it.key()));
    }
  }
  // No type: zinf's default optimizer (Config's, torch.optim.AdamW's defaults) with these params.
  OptimizerParams o =
      typed ? deepspeed_optimizer_defaults(kind, w.optimizer.torch_adam) : w.config->optimizer;
  const OptimizerInput& in = w.optimizer;
  if (kind == OptimizerKind::kAdam && in.adam_w_mode) kind = OptimizerKind::kAdamW;
  o.kind = kind;
  if (in.lr) o.lr = *in.lr;
  if (in.beta1) o.beta1 = *in.beta1;
  if (in.beta2) o.beta2 = *in.beta2;
  if (in.eps) o.eps = *in.eps;
  if (in.weight_decay) o.weight_decay = *in.weight_decay;
  if (in.lr_decay) o.lr_decay = *in.lr_decay;
  if (in.bias_correction) o.bias_correction = *in.bias_correction;
  w.config->optimizer = o;
}

// --- the scheduler ----------------------------------------------------------------------------
//
// parse_scheduler_section() (engine/schedule.cpp) reads the section and names the first key it
// refuses; validate() checks the values against the optimizer's lr (LrSchedule::create()).
void walk_scheduler(const Json& section, const std::string& path, Walk& w) {
  const Json& params = section.contains("params") ? section.at("params") : Json::object();
  for (auto it = params.begin(); params.is_object() && it != params.end(); ++it) {
    if (it.value() == "auto") return w.refuse(path + ".params." + it.key(), std::string(kAutoWhy));
  }
  if (const Status s = parse_scheduler_section(section, &w.config->scheduler); !s.is_ok()) {
    const std::string message(s.message());
    const std::size_t colon = message.find(": ");
    return w.refuse(message.substr(0, colon), message.substr(colon + 2));
  }
  for (auto it = section.begin(); it != section.end(); ++it) {
    if (it.key() != "params") w.used(join(path, it.key()));
    for (auto p = params.begin(); it.key() == "params" && p != params.end(); ++p) {
      w.used(path + ".params." + p.key());
    }
  }
}

Status invalid(std::string_view key, std::string_view why) {
  return Status::invalid_argument(fmt::format("{}: {}", key, why));
}

// Walks `text` into `config`, reporting every key; fails only when it is not a JSON object.
Status walk_text(std::string_view text, Config* config, std::vector<KeyReport>* reports) {
  Json root = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Status::invalid_argument("config: not valid JSON");
  if (!root.is_object()) return Status::invalid_argument("config: not a JSON object");
  Walk w;
  w.config = config;
  w.reports = reports;
  walk_keys(root, "", kRootKeys, w);
  return Status::ok();
}

}  // namespace

OptimizerParams deepspeed_optimizer_defaults(OptimizerKind kind, bool torch_adam) {
  OptimizerParams o;
  o.kind = kind;
  o.lr = 1e-3;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.bias_correction = true;
  o.lr_decay = 0.0;
  switch (kind) {
    case OptimizerKind::kAdam:
      o.weight_decay = 0.0;  // DeepSpeedCPUAdam, FusedAdam, torch.optim.Adam
      break;
    case OptimizerKind::kAdamW:
      // DeepSpeedCPUAdam and FusedAdam: 0; torch.optim.AdamW (torch_adam): 0.01.
      o.weight_decay = torch_adam ? 1e-2 : 0.0;
      break;
    case OptimizerKind::kAdagrad:
      // DeepSpeedCPUAdagrad and torch.optim.Adagrad agree.
      o.lr = 1e-2;
      o.eps = 1e-10;
      o.weight_decay = 0.0;
      break;
    case OptimizerKind::kLion:
      // DeepSpeedCPULion and FusedLion.
      o.weight_decay = 0.0;
      break;
  }
  return o;
}

std::string_view key_use_name(KeyUse use) {
  switch (use) {
    case KeyUse::kUsed:
      return "used";
    case KeyUse::kNoEffect:
      return "accepted, no effect in zinf";
    case KeyUse::kRefused:
      return "refused";
  }
  return "?";
}

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
  } else if (text == "cpu") {
    *device = OffloadDevice::kHost;
  } else if (text == "nvme") {
    *device = OffloadDevice::kNvme;
  } else {
    return false;
  }
  return true;
}

Result<std::vector<KeyReport>> check_config(std::string_view json_text) {
  Config c;
  std::vector<KeyReport> reports;
  ZINF_RETURN_IF_ERROR(walk_text(json_text, &c, &reports));
  for (const KeyReport& r : reports) {
    if (r.use == KeyUse::kRefused) return reports;
  }
  // Every key was read: a combination validate() refuses is reported against the key it names.
  const Status s = validate(c);
  if (!s.is_ok()) {
    const std::string message(s.message());
    const std::string key = message.substr(0, message.find(": "));
    const std::string why =
        message.size() > key.size() + 2 ? message.substr(key.size() + 2) : message;
    bool found = false;
    for (KeyReport& r : reports) {
      if (r.key == key) {
        r.use = KeyUse::kRefused;
        r.why = why;
        found = true;
      }
    }
    if (!found) reports.push_back({key, KeyUse::kRefused, why});
  }
  return reports;
}

Result<Config> parse_config(std::string_view json_text) {
  Config c;
  std::vector<KeyReport> reports;
  ZINF_RETURN_IF_ERROR(walk_text(json_text, &c, &reports));
  for (const KeyReport& r : reports) {
    if (r.use == KeyUse::kRefused) return invalid(r.key, r.why);
  }
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

}  // namespace zinf
