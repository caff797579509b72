// The config's key tables: every key zinf knows, with what zinf does with it (config.cpp's header
// comment says how they are walked). To add a section, give it a table here and a row in
// kRootKeys that points at it.
#include <fmt/format.h>

#include <cctype>
#include <string>
#include <string_view>

#include "engine/config_walk.hpp"

namespace zinf::config_detail {
namespace {

// --- the tables -------------------------------------------------------------------------------

// A reader from one expression of the value `v` and the walk `w`.
#define ZINF_READ(expr) [](const Json& v, [[maybe_unused]] Walk& w) -> Why { return expr; }

// A boolean whose value changes nothing in zinf.
Why any_bool(const Json& v) {
  bool b = false;
  return bool_of(v, &b);
}

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
     .read = ZINF_READ(path_of(v, &w.config->zero.offload_optimizer.nvme_path))},
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
    {.name = "super_offload",
     .read = ZINF_READ(only_bool(v, false, "zinf has no SuperOffload step")),
     .no_effect = "false: DeepSpeed's ordinary offloaded step, as in zinf"},
    {.name = "convert_grad_on_cpu",
     .no_effect = "where the gradients are widened to fp32 is zinf's choice; the values are the "
                  "same"},
    {.name = "cpuadam_cores_perc",
     .no_effect = "zinf.cpu_threads sets the threads of the CPU optimizer"},
};

const Key kOffloadParamKeys[] = {
    {.name = "device", .read = ZINF_READ(device_of(v, &w.config->zero.offload_param.device))},
    {.name = "nvme_path", .read = ZINF_READ(path_of(v, &w.config->zero.offload_param.nvme_path))},
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

// DeepSpeed caps the elements of all persistent parameters together at this (its default,
// sys.maxsize, is no cap); zinf has no such cap.
constexpr std::uint64_t kSysMaxsize = 9'223'372'036'854'775'807ULL;
constexpr std::string_view kNoPersistenceCap =
    "9223372036854775807 (sys.maxsize, DeepSpeed's default): no cap on the persistent "
    "parameters' elements, as in zinf";

Why read_model_persistence(const Json& v, [[maybe_unused]] Walk& w) {
  std::uint64_t cap = 0;
  if (Why bad = count_of(v, &cap)) return bad;
  if (cap < kSysMaxsize) {
    return fmt::format(
        "{} is not supported: zinf does not cap the persistent parameters' elements "
        "(stage3_param_persistence_threshold alone decides which persist)",
        v.dump());
  }
  return std::nullopt;
}

constexpr std::string_view kReleasesAfterUse =
    "zinf releases a gathered module after use and prefetches it again in recorded order";
constexpr std::string_view kGathersModules =
    "zinf gathers whole registered modules; how fine they are is the program's registration";
constexpr std::string_view kSameGatheredValues =
    "how DeepSpeed's stage 3 runs its gathers; zinf's all-gather gives the same values";
constexpr std::string_view kMonitorZero = "DeepSpeed's own logging and debug checks";

const Key kZeroKeys[] = {
    // DeepSpeed's stage 0 (ZeRO off: every rank holds the whole optimizer state) runs as stage 1,
    // which steps the same numbers with the state partitioned (zinf config check notes it).
    {.name = "stage",
     .read = [](const Json& v, Walk& w) -> Why {
       if (Why why = count_as(v, &w.config->zero.stage)) return why;
       if (w.config->zero.stage == 0) {
         w.config->zero.stage = 1;
         w.note =
             "0 (ZeRO off in DeepSpeed) runs as stage 1: the same numbers, with the optimizer "
             "state partitioned over the ranks";
       }
       return std::nullopt;
     }},
    {.name = "offload_optimizer", .keys = kOffloadOptimizerKeys},
    {.name = "offload_param", .keys = kOffloadParamKeys},
    {.name = "cpu_offload", .read = read_cpu_offload},
    // DeepSpeed's pydantic config spells it "cpu_offload_param"; releases before it read
    // "cpu_offload_params". Both mean offload_param.device "cpu".
    {.name = "cpu_offload_param", .read = read_cpu_offload_params},
    {.name = "cpu_offload_params", .read = read_cpu_offload_params},
    {.name = "cpu_offload_use_pin_memory",
     .read = ZINF_READ(bool_of(v, &w.config->zero.offload_param.pin_memory)),
     .no_effect = kPinMemory},
    // DeepSpeed's 0 makes each parameter a sub-group of its own; zinf's sub-groups are runs of
    // the partition's elements, and the numbers do not depend on their size: 0 keeps zinf's
    // default (zinf config check notes it).
    {.name = "sub_group_size",
     .read = [](const Json& v, Walk& w) -> Why {
       std::size_t size = 0;
       if (Why why = count_as(v, &size)) return why;
       if (size > 0) {
         w.config->zero.sub_group_size = size;
       } else {
         w.note = fmt::format(
             "0 (in DeepSpeed a sub-group per parameter) keeps zinf's default, {}: zinf's "
             "sub-groups are runs of elements, and the numbers do not depend on their size",
             w.config->zero.sub_group_size);
       }
       return std::nullopt;
     }},
    {.name = "reduce_bucket_size",
     .read = ZINF_READ(count_as(v, &w.config->zero.reduce_bucket_size))},
    // The stage-3 fields under both of DeepSpeed's names: DeepSpeedZeroConfig declares
    // prefetch_bucket_size with the alias stage3_prefetch_bucket_size, and so on, and reads
    // either (config.cpp refuses the two together).
    {.name = "stage3_prefetch_bucket_size",
     .read = ZINF_READ(count_as(v, &w.config->zero.stage3_prefetch_bucket_size))},
    {.name = "prefetch_bucket_size",
     .read = ZINF_READ(count_as(v, &w.config->zero.stage3_prefetch_bucket_size))},
    {.name = "stage3_max_live_parameters",
     .read = ZINF_READ(count_as(v, &w.config->zero.stage3_max_live_parameters))},
    {.name = "max_live_parameters",
     .read = ZINF_READ(count_as(v, &w.config->zero.stage3_max_live_parameters))},
    {.name = "stage3_param_persistence_threshold",
     .read = ZINF_READ(count_as(v, &w.config->zero.stage3_param_persistence_threshold))},
    {.name = "param_persistence_threshold",
     .read = ZINF_READ(count_as(v, &w.config->zero.stage3_param_persistence_threshold))},
    {.name = "stage3_model_persistence_threshold",
     .read = read_model_persistence,
     .no_effect = kNoPersistenceCap},
    {.name = "model_persistence_threshold",
     .read = read_model_persistence,
     .no_effect = kNoPersistenceCap},
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
    {.name = "stage3_max_reuse_distance", .no_effect = kReleasesAfterUse},
    {.name = "max_reuse_distance", .no_effect = kReleasesAfterUse},
    {.name = "stage3_module_granularity_threshold", .no_effect = kGathersModules},
    {.name = "module_granularity_threshold", .no_effect = kGathersModules},
    {.name = "stage3_use_all_reduce_for_fetch_params", .no_effect = kSameGatheredValues},
    {.name = "use_all_reduce_for_fetch_params", .no_effect = kSameGatheredValues},
    {.name = "stage3_allgather_sequential", .no_effect = kSameGatheredValues},
    {.name = "allgather_sequential", .no_effect = kSameGatheredValues},
    {.name = "use_multi_rank_bucket_allreduce",
     .no_effect = "zinf always reduce-scatters gradients into their owners' shards"},
    {.name = "log_trace_cache_warnings", .no_effect = kMonitorZero},
    {.name = "enable_sanity_checks", .no_effect = kMonitorZero},
    {.name = "override_module_apply",
     .no_effect = "a PyTorch nn.Module hook of DeepSpeed's stage 3; the model is the program's"},
    {.name = "legacy_stage1",
     .read = ZINF_READ(only_bool(v, false, "zinf has one stage 1")),
     .no_effect = "false: DeepSpeed's current stage 1, as in zinf"},
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
    {.name = "zero_quantized_nontrainable_weights",
     .read = ZINF_READ(only_bool(v, false, "zinf keeps parameters unquantized")),
     .no_effect = "false: parameters kept unquantized, as in zinf"},
    {.name = "mics_shard_size",
     .read = ZINF_READ(only_number(v, -1.0, "zinf shards over every rank (no MiCS groups)")),
     .no_effect = "-1: no MiCS groups, every rank holds a shard, as in zinf"},
    {.name = "mics_hierarchical_params_gather",
     .read = ZINF_READ(only_bool(v, false, "zinf has no MiCS groups")),
     .no_effect = "false: no MiCS groups, as in zinf"},
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
    {.name = "auto_cast",
     .no_effect = "casting the model's inputs is the training program's (zinf.torch's forward "
                  "casts them with it, docs/PYTHON.md)"},
    {.name = "fp16_master_weights_and_grads",
     .read = ZINF_READ(only_bool(v, false, "zinf keeps an fp32 master and fp32 gradients")),
     .no_effect = "false: fp32 master and gradients, as in zinf"},
};

// fp16's loss-scaling keys written under bf16: bf16 has the range of fp32 and is not loss-scaled,
// by DeepSpeed or by zinf.
constexpr std::string_view kNoBf16LossScale = "fp16's loss scaling: bf16 needs none";

const Key kBf16Keys[] = {
    {.name = "enabled", .read = ZINF_READ(bool_of(v, &w.config->bf16_enabled))},
    {.name = "immediate_grad_update",
     .no_effect = "zinf accumulates gradients in fp32 and updates at step()"},
    {.name = "check_grad_overflow",
     .read = ZINF_READ(any_bool(v)),
     .no_effect = "zinf checks every step's gradients for inf and NaN and skips such a step "
                  "whatever the dtype, as DeepSpeed does with true"},
    {.name = "bf16_master_weights_and_grads",
     .read = ZINF_READ(only_bool(v, false, "zinf keeps an fp32 master and fp32 gradients")),
     .no_effect = "false: fp32 master and gradients, as in zinf"},
    {.name = "bf16_optimizer_states",
     .read = ZINF_READ(only_bool(v, false, "zinf keeps the optimizer state in fp32")),
     .no_effect = "false: fp32 optimizer state, as in zinf"},
    {.name = "loss_scale", .no_effect = kNoBf16LossScale},
    {.name = "initial_scale_power", .no_effect = kNoBf16LossScale},
    {.name = "loss_scale_window", .no_effect = kNoBf16LossScale},
    {.name = "hysteresis", .no_effect = kNoBf16LossScale},
    {.name = "consecutive_hysteresis", .no_effect = kNoBf16LossScale},
    {.name = "min_loss_scale", .no_effect = kNoBf16LossScale},
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
    "zinf reports the store's bytes and NVMe traffic in Engine::memory()";

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
    {.name = "clip_from_previous_step",
     .read = ZINF_READ(bool_of(v, &w.config->clip_from_previous_step))},
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

// DeepSpeed's names of fp32 (deepspeed/runtime/config.py, DtypeEnum.fp32), and the others of its
// dtypes, lower case: "fp32", "torch.float32", "float32", "float".
bool is_fp32_name(std::string text) {
  for (char& ch : text) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return text == "fp32" || text == "torch.float32" || text == "float32" || text == "float";
}

// communication_data_type: DeepSpeed reduces gradients in the parameters' 16-bit dtype unless this
// says otherwise (runtime/engine.py, communication_data_type); zinf always reduces in fp32, so
// "fp32" and null (not set) are accepted and a 16-bit dtype is refused
// (config.py, get_communication_data_type, lowercases the value).
// A communication dtype key zinf honours only as fp32: null (not set) and fp32 are accepted,
// anything else refused with `why_not` after the value.
Why fp32_communication_dtype(const Json& v, std::string_view why_not) {
  if (v.is_null()) return std::nullopt;
  if (!v.is_string()) return not_a(v, "\"fp16\", \"bf16\" or \"fp32\"");
  if (is_fp32_name(v.get<std::string>())) return std::nullopt;
  return fmt::format("{} is not supported: {}", v.dump(), why_not);
}

Why read_communication_dtype(const Json& v, [[maybe_unused]] Walk& w) {
  return fp32_communication_dtype(v,
                                  "zinf reduce-scatters gradients in fp32 (widened from the "
                                  "parameters' dtype) and accumulates them in fp32");
}

// data_types.grad_accum_dtype: the dtype DeepSpeed accumulates gradients in over micro-batches;
// zinf accumulates in fp32.
Why read_grad_accum_dtype(const Json& v, [[maybe_unused]] Walk& w) {
  if (v.is_null()) return std::nullopt;
  if (v.is_string() && is_fp32_name(v.get<std::string>())) return std::nullopt;
  return fmt::format("{} is not supported: zinf accumulates gradients in fp32", v.dump());
}

// gradient_accumulation_dtype: DeepSpeed reads no key of this name (its accumulation dtype is
// data_types.grad_accum_dtype, runtime/config.py get_data_types_params), but configs carry it
// meaning that. fp32 is what zinf accumulates in; another dtype asks for what zinf does not do.
Why read_top_level_grad_accum_dtype(const Json& v, Walk& w) {
  if (Why why = read_grad_accum_dtype(v, w)) {
    return fmt::format(
        "{} (DeepSpeed reads no key of this name: its accumulation dtype is "
        "data_types.grad_accum_dtype)",
        *why);
  }
  return std::nullopt;
}

// The dtype of the gradients' reduction over the sequence-parallel group (DeepSpeed's Ulysses),
// fp32 by default (runtime/constants.py, SEQ_PARALLEL_COMMUNICATION_DATA_TYPE; config.py reads it
// with get_communication_data_type, which lowercases it and knows fp16, bf16 and fp32). zinf has
// no sequence parallelism, so fp32 (and null, "not set") is accepted and a 16-bit dtype, written
// for a sequence-parallel run, is refused.
Why read_seq_parallel_dtype(const Json& v, [[maybe_unused]] Walk& w) {
  return fp32_communication_dtype(
      v,
      "zinf has no sequence parallelism, so no gradient is reduced over a sequence-parallel "
      "group; write \"fp32\" (DeepSpeed's default) or remove the key");
}

constexpr std::string_view kNoSequenceParallel =
    "fp32 (DeepSpeed's default): zinf has no sequence parallelism, and reduces every gradient "
    "in fp32";

const Key kDataTypesKeys[] = {
    {.name = "grad_accum_dtype",
     .read = read_grad_accum_dtype,
     .no_effect = "zinf accumulates gradients in fp32, whatever the parameters' dtype"},
};

// DeepSpeed's checkpoint section (runtime/constants.py, CHECKPOINT; runtime/config.py reads
// tag_validation, load_universal, use_node_local_storage and parallel_write.pipeline_stage;
// model_checkpointing/config.py the writer).

// tag_validation: before a save DeepSpeed compares the tag every rank passes; "Warn" (its default)
// logs a mismatch, "Fail" raises, "Ignore" skips the comparison. DeepSpeed uppercases the value
// and refuses any other (get_checkpoint_tag_validation_mode). zinf always compares the ranks'
// tags and fails a save whose ranks name different tags (save_checkpoint: a checkpoint is one tag
// directory), so every one of the three values is accepted with no effect.
Why read_tag_validation(const Json& v, [[maybe_unused]] Walk& w) {
  if (!v.is_string()) return not_a(v, "\"Warn\", \"Ignore\" or \"Fail\"");
  std::string mode = v.get<std::string>();
  for (char& ch : mode) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (mode == "WARN" || mode == "IGNORE" || mode == "FAIL") return std::nullopt;
  return not_a(v, "\"Warn\", \"Ignore\" or \"Fail\"");
}

const Key kCheckpointParallelWriteKeys[] = {
    {.name = "pipeline_stage",
     .read = ZINF_READ(any_bool(v)),
     .no_effect = "DeepSpeed's pipeline engine alone reads it; zinf has no pipeline parallelism"},
};

const Key kCheckpointKeys[] = {
    {.name = "tag_validation",
     .read = read_tag_validation,
     .no_effect = "zinf always refuses a save whose ranks pass different tags, whatever this "
                  "says (a checkpoint is one tag directory); DeepSpeed's \"Fail\" does the same, "
                  "its \"Warn\" only logs a mismatch and \"Ignore\" skips the comparison"},
    {.name = "load_universal",
     .read = ZINF_READ(only_bool(
         v, false,
         "zinf cannot read DeepSpeed's universal checkpoints (ds_to_universal.py's output); its "
         "own checkpoints load at any world size without a conversion: write false")),
     .no_effect = "false: zinf loads its own checkpoints, which reshard to any world size"},
    {.name = "use_node_local_storage",
     .read = ZINF_READ(only_bool(
         v, false,
         "zinf saves one checkpoint directory that every rank reaches (rank 0 creates the tag and "
         "writes its manifest): give save_checkpoint a directory every machine shares and write "
         "false")),
     .no_effect = "false: one checkpoint directory that every rank reaches, as zinf saves"},
    {.name = "parallel_write", .keys = kCheckpointParallelWriteKeys},
    {.name = "writer",
     .no_effect = "how DeepSpeed writes its checkpoint files (its torch, fast and decoupled "
                  "writers and their buffers); zinf writes its own format through its io_uring "
                  "engine, every rank its own file in parallel"},
};

constexpr std::string_view kProgramSide =
    "the training program's data loading, logging or checkpoint bookkeeping; zinf does not see "
    "it";
constexpr std::string_view kMonitor =
    "logging of the training program; zinf reports through "
    "StepReport, its trace and its counters";
// The monitors zinf.deepspeed_compat writes (python/zinf/_monitor.py) or warns about; the engine
// itself still leaves them to the program.
constexpr std::string_view kMonitorWritten =
    "logging of the training program; the engine reports through StepReport, its trace and its "
    "counters, and zinf.deepspeed_compat writes this section as DeepSpeed does (docs/PYTHON.md)";
constexpr std::string_view kMonitorWarned =
    "logging of the training program; zinf.deepspeed_compat does not log to this service and "
    "warns when the section is enabled";

constexpr std::string_view kIgnoredByDeepSpeed =
    "DeepSpeed reads no key of this name either (it ignores keys it does not know)";

constexpr std::string_view kAutoBatch =
    "\"auto\": the Hugging Face Trainer computes it from the other batch keys; zinf derives it "
    "from them as DeepSpeed does";

const Key kRootKeys[] = {
    {.name = "train_batch_size",
     .read = [](const Json& v, Walk& w) -> Why {
       if (Why why = count_as(v, &w.config->train_batch_size)) return why;
       if (w.config->train_batch_size == 0) return std::string("0 is below 1");
       return std::nullopt;
     },
     .auto_no_effect = kAutoBatch},
    {.name = "train_micro_batch_size_per_gpu",
     .read = [](const Json& v, Walk& w) -> Why {
       w.config->train_micro_batch_given = true;
       return count_as(v, &w.config->train_micro_batch_size_per_gpu);
     },
     .auto_no_effect = kAutoBatch},
    {.name = "gradient_accumulation_steps",
     .read = [](const Json& v, Walk& w) -> Why {
       w.config->gradient_accumulation_given = true;
       return count_as(v, &w.config->gradient_accumulation_steps);
     }},
    {.name = "gradient_clipping", .read = ZINF_READ(number_of(v, &w.config->gradient_clipping))},
    {.name = "fp16", .keys = kFp16Keys},
    {.name = "bf16", .keys = kBf16Keys},
    // DeepSpeed's older name of the bf16 section, read when "bf16" is absent
    // (deepspeed/runtime/precision_config.py, get_bfloat16_config; config.cpp refuses both).
    {.name = "bfloat16", .keys = kBf16Keys},
    {.name = "optimizer", .walk = walk_optimizer},
    {.name = "zero_optimization", .keys = kZeroKeys},
    {.name = "aio", .keys = kAioKeys},
    {.name = "zinf", .keys = kZinfKeys},
    {.name = "scheduler", .walk = walk_scheduler},
    {.name = "steps_per_print", .no_effect = kProgramSide},
    {.name = "dataloader_drop_last",
     .no_effect = "the data loader's (zinf.torch's initialize(training_data=...) drops a partial "
                  "last batch with it); the engine never sees the batches"},
    {.name = "wall_clock_breakdown", .no_effect = kMonitor},
    {.name = "memory_breakdown", .no_effect = kMonitor},
    {.name = "dump_state", .no_effect = kMonitor},
    {.name = "tensorboard", .no_effect = kMonitorWritten},
    {.name = "wandb", .no_effect = kMonitorWarned},
    {.name = "csv_monitor", .no_effect = kMonitorWritten},
    {.name = "comet", .no_effect = kMonitorWarned},
    {.name = "flops_profiler", .no_effect = kMonitor},
    {.name = "comms_logger", .no_effect = kMonitor},
    // In LLaMA-Factory's example configs.
    {.name = "comms_config", .no_effect = kIgnoredByDeepSpeed},
    {.name = "monitor_config", .no_effect = kIgnoredByDeepSpeed},
    {.name = "disable_allgather",
     .no_effect = "DeepSpeed reads it but nothing in its engine uses it; zinf all-gathers the "
                  "updated parameters after every step as DeepSpeed does"},
    // DeepSpeed-Chat's generation engine for RLHF, off by default (runtime/config.py,
    // HybridEngineConfig.enabled False).
    {.name = "hybrid_engine",
     .refused = "DeepSpeed-Chat's hybrid engine (RLHF generation) is not supported",
     .refused_when_enabled = true},
    {.name = "compile",
     .no_effect = "torch.compile (and DeepCompile) is the training program's: compile the model "
                  "before handing it to zinf; the engine runs no compiler"},
    {.name = "activation_checkpointing", .keys = kActivationKeys},
    {.name = "zero_allow_untested_optimizer",
     .no_effect = "zinf runs only its own optimizers (optimizer.type)"},
    {.name = "zero_force_ds_cpu_optimizer",
     .no_effect = "zinf runs only its own optimizers (optimizer.type)"},
    {.name = "prescale_gradients",
     .read = ZINF_READ(only_bool(v, false, "zinf averages gradients after the reduction")),
     .no_effect = "false: gradients averaged after the reduction, as in zinf"},
    {.name = "gradient_predivide_factor",
     .read = ZINF_READ(only_number(v, 1.0, "zinf averages after the reduction")),
     .no_effect = "1.0: gradients averaged after the reduction, as in zinf"},
    {.name = "amp",
     .refused = "NVIDIA Apex AMP is not supported; use fp16 or bf16",
     .refused_when_enabled = true},
    {.name = "communication_data_type",
     .read = read_communication_dtype,
     .no_effect = "zinf reduce-scatters and accumulates gradients in fp32, whatever the "
                  "parameters' dtype"},
    {.name = "data_types", .keys = kDataTypesKeys},
    {.name = "gradient_accumulation_dtype",
     .read = read_top_level_grad_accum_dtype,
     .no_effect = "DeepSpeed reads no key of this name (its accumulation dtype is "
                  "data_types.grad_accum_dtype); fp32 is what zinf accumulates gradients in"},
    // DeepSpeed reads seq_parallel_comm_data_type (runtime/constants.py); its docstring there
    // spells the key seq_parallel_communication_data_type, which configs copy and DeepSpeed
    // ignores. Both read the same here.
    {.name = "seq_parallel_comm_data_type",
     .read = read_seq_parallel_dtype,
     .no_effect = kNoSequenceParallel},
    {.name = "seq_parallel_communication_data_type",
     .read = read_seq_parallel_dtype,
     .no_effect = kNoSequenceParallel},
    // DeepSpeed's CSR reduction of torch.nn.Embedding gradients (runtime/constants.py,
    // SPARSE_GRADIENTS, false by default).
    {.name = "sparse_gradients",
     .read = ZINF_READ(only_bool(v, false,
                                 "DeepSpeed then reduces the gradients of the embedding modules "
                                 "as sparse tensors; zinf reduces every gradient dense: write "
                                 "false")),
     .no_effect = "false: every gradient reduced dense, as in zinf"},
    // DeepSpeed's torch.autocast mode (runtime/config.py, get_torch_autocast_enabled, false by
    // default): the parameters stay in their dtype and the forward of the lower-precision-safe
    // modules runs under torch.autocast. zinf's mixed precision keeps 16-bit parameters with an
    // fp32 master, which is not the same computation.
    {.name = "torch_autocast",
     .refused = "DeepSpeed's torch.autocast mode is not supported; zinf's mixed precision is its "
                "bf16 or fp16 section (16-bit parameters, an fp32 master): enable one of those",
     .refused_when_enabled = true},
    {.name = "checkpoint", .keys = kCheckpointKeys},
    {.name = "sparse_attention", .refused = "a model feature zinf does not provide"},
    {.name = "pipeline", .refused = "pipeline parallelism is not supported"},
    {.name = "elasticity",
     .refused = "elastic training is not supported",
     .refused_when_enabled = true},
    {.name = "compression_training", .refused = "compression training is not supported"},
    {.name = "data_efficiency",
     .refused = "data efficiency is not supported",
     .refused_when_enabled = true},
    {.name = "curriculum_learning",
     .refused = "curriculum learning is not supported",
     .refused_when_enabled = true},
    {.name = "autotuning",
     .refused = "DeepSpeed's autotuner is not supported; `zinf plan` chooses the setup",
     .refused_when_enabled = true},
};

#undef ZINF_READ

}  // namespace

std::span<const Key> root_keys() { return kRootKeys; }

}  // namespace zinf::config_detail
