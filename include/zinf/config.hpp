// Config: what an Engine is asked to do, read from a DeepSpeed JSON config.
//
// One schema for the engine, the planner (`zinf plan --out` writes it) and the command line
// (`zinf config check FILE` reports on it): DeepSpeed's keys mean what DeepSpeed documents, zinf's
// own knobs are in a "zinf" section. Every key is optional; a missing key takes the default
// written beside its field below. docs/ENGINE.md lists every key and what zinf does with it.
//
//   {
//     "train_micro_batch_size_per_gpu": 1,
//     "gradient_accumulation_steps": 1,
//     "gradient_clipping": 1.0,
//     "fp16": {"enabled": false, "loss_scale": 0, "initial_scale_power": 16,
//              "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
//     "bf16": {"enabled": true},
//     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
//                                              "weight_decay": 0.01}},
//     "zero_optimization": {
//       "stage": 3,
//       "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 4},
//       "offload_param": {"device": "cpu", "nvme_path": "/nvme", "buffer_count": 5},
//       "sub_group_size": 67108864,
//       "reduce_bucket_size": 67108864,
//       "stage3_prefetch_bucket_size": 60397977,
//       "stage3_max_live_parameters": 1000000000,
//       "stage3_param_persistence_threshold": 81920
//     },
//     "aio": {"block_size": 1048576, "queue_depth": 32},
//     "zinf": {"world_size": 4, "ranks_per_machine": 4, "pinned_pool_bytes": 4294967296,
//              "gradients_on_nvme": false, "gradient_spill_buffers": 4,
//              "device_reserved_bytes": 1073741824,
//              "cpu_threads": 0, "collective_timeout_ms": 60000}
//   }
//
// Every key is either used, accepted with no effect in zinf (DeepSpeed keys for the training
// program's side: logging, and knobs whose only value is what zinf always does), or refused;
// check_config() says which, and why, for each key of a file. Keys are case-sensitive, as
// DeepSpeed's are. An unknown or refused key fails parse_config() with a message that starts with
// its dotted name. As DeepSpeed does, zinf refuses a key given twice in one object and a
// deprecated key given with its replacement; it also refuses a setting given under two other
// names DeepSpeed has for it (a stage3_ key and its field name, "bf16" and its older name
// "bfloat16"), of which DeepSpeed reads one. "auto" (the Hugging Face Trainer's
// placeholder) is refused for a key whose value zinf reads (one it uses, or one it accepts only
// at some values, such as aio.use_gds or communication_data_type): nothing fills it in. A key
// under zero_optimization other than the stage takes its default, as DeepSpeed's ZeRO config
// drops "auto"; a key accepted with no effect whatever its value takes it. The exceptions are
// train_batch_size and train_micro_batch_size_per_gpu, where "auto" counts as not given: zinf
// derives them as DeepSpeed does (resolve_batch_sizes()). That needs a number in one of the two:
// where each is "auto" or absent (and one is "auto"), the "auto" ones are refused, as DeepSpeed
// refuses a config with neither. A config with no batch key at all runs micro-batches of 1.
//
// Units: DeepSpeed's `*_size`, `*_parameters` and `*_threshold` keys count parameters
// (elements), except aio.block_size, which is bytes (DeepSpeed's own meaning); zinf's `*_bytes`
// are bytes. The fields below say their unit in their name where DeepSpeed's key does not.
// Offload devices are "none", "cpu" and "nvme". Numbers may be written as floats (1e9), as
// DeepSpeed configs often do.
//
// Errors: parse_config() and validate() return kInvalidArgument whose message starts with the
// dotted key that is wrong ("zero_optimization.stage: 4 is not 1, 2 or 3"), and kNotFound /
// kIoError naming the file for load_config().
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/optim.hpp"
#include "zinf/schedule.hpp"
#include "zinf/status.hpp"

namespace zinf {

// Where a kind of state lives when it is not on the device.
enum class OffloadDevice : std::uint8_t {
  kNone = 0,  // on the device (the accelerator's memory; host memory on HostDevice)
  kHost = 1,  // host DRAM ("cpu" in DeepSpeed configs)
  kNvme = 2,  // swap files under nvme_path, moved through the pinned pool
};
// "none", "cpu", "nvme" (the names DeepSpeed configs use).
std::string_view offload_device_name(OffloadDevice device);
// Accepts "none", "cpu", "nvme" (DeepSpeed's values, case-sensitive as in DeepSpeed).
bool parse_offload_device(std::string_view text, OffloadDevice* device);

struct OffloadConfig {
  OffloadDevice device = OffloadDevice::kNone;
  // Directory of the swap files when device is kNvme (the Env's nvme_paths override it); JSON
  // null reads as "" (DeepSpeed's Optional[Path]).
  std::string nvme_path;
  // Pinned-pool blocks: optimizer sub-groups in flight (>= 2), or parameter shards staged from
  // NVMe at once (>= 1, bounding the stage-3 prefetch of NVMe-resident shards). DeepSpeed's
  // defaults: 4 for offload_optimizer, 5 for offload_param (ZeroConfig sets that one).
  std::size_t buffer_count = 4;
  // offload_param only ("buffer_size"): DeepSpeed's staging buffer size in parameters. Accepted
  // with no effect: the engine sizes each staging block to the largest parameter shard instead.
  std::size_t buffer_params = 100'000'000;
  // Accepted with no effect: the engine pins exactly its staging blocks (the pinned pool).
  bool pin_memory = true;
};

struct ZeroConfig {
  // 1: optimizer state partitioned; 2: also gradients; 3: also parameters. DeepSpeed's default
  // is 0 (ZeRO off), which zinf does not have: a config without a stage runs stage 3.
  int stage = 3;
  OffloadConfig offload_optimizer;
  // Stage 3 only (a stage-1/2 config with offload_param other than "none" is rejected, where
  // DeepSpeed ignores the section).
  OffloadConfig offload_param{.nvme_path = {}, .buffer_count = 5};
  // Parameters per optimizer sub-group: the unit the optimizer steps and moves at once.
  std::size_t sub_group_size = 1'000'000'000;
  // Elements of one reduce-scatter bucket over all ranks (not per rank): each rank's chunk of a
  // bucket is reduce_bucket_size / world elements (at least one, at most the largest group's
  // shard), so a bucket holds at most reduce_bucket_size elements of the whole group once that is
  // at least the world size (docs/ENGINE.md, "What a step does").
  std::size_t reduce_bucket_size = 500'000'000;
  // Stage 3: elements of parameters the coordinator may have gathered ahead of use.
  std::size_t stage3_prefetch_bucket_size = 50'000'000;
  // Stage 3: elements of gathered (not persistent) parameters alive at once, prefetched or in
  // use, as far as prefetching goes: a gather() that does not fit drops prefetched modules and
  // then gathers its module anyway, as DeepSpeed does, so only the modules in use can take the
  // count beyond it. 0: no prefetching.
  std::size_t stage3_max_live_parameters = 1'000'000'000;
  // Stage 3: a parameter of at most this many elements stays gathered on every rank (it is
  // gathered once, and again after each step); DeepSpeed's threshold.
  std::size_t stage3_param_persistence_threshold = 100'000;
  // The largest partitioner group (one stage-3 gather unit) in elements; 0: the partitioner's
  // own cap, 2^28 elements. zinf key "zinf.group_max_elements".
  std::size_t group_max_elements = 0;
};

struct Fp16Config {
  bool enabled = false;
  // 0: dynamic loss scaling; > 0: this static scale.
  double loss_scale = 0.0;
  // The dynamic scale starts at 2^initial_scale_power.
  int initial_scale_power = 16;
  // The dynamic scale doubles at every good step that makes the good steps since the last
  // overflow (or the start) a multiple of this, as DeepSpeed's ZeRO optimizers do: with 3 and no
  // overflow, at steps 3, 6, 9, ...
  std::int64_t loss_scale_window = 1000;
  // DeepSpeed's hysteresis: the this-many-th overflow since the start or the last doubling (in a
  // row or not) halves the scale, and so does each one after it until the scale doubles again;
  // with 1, every overflow halves the scale.
  int hysteresis = 2;
  // The floor of the dynamic scale; an overflow at it makes step() return kAborted.
  double min_loss_scale = 1.0;
};

// "activation_checkpointing" (DeepSpeed's section) and zinf's activation keys: where the
// checkpoints a training program saves through Engine::save_activation() live
// (docs/ACTIVATIONS.md). partition_activations, contiguous_memory_optimization,
// number_checkpoints, synchronize_checkpoint_boundary and profile are accepted with no effect.
struct ActivationConfig {
  // false: each checkpoint stays on the device (a copy the engine owns until it is loaded);
  // true: it goes to pinned host memory, and beyond host_bytes to NVMe when nvme_path is set.
  bool cpu_checkpointing = false;
  // "zinf.activation_host_bytes": the pinned host arena for offloaded checkpoints, allocated at
  // the first save (0: none; everything offloaded goes to NVMe).
  std::uint64_t host_bytes = std::uint64_t{1} << 30;
  // "zinf.activation_nvme_path": the directory of the activation swap file ("": no NVMe tier, a
  // checkpoint beyond host_bytes fails with kResourceExhausted naming zinf.activation_host_bytes).
  // Env::nvme_paths overrides it (its first directory) when it is set.
  std::string nvme_path;
  // "zinf.activation_nvme_bytes": that swap file's capacity, preallocated at the first
  // checkpoint that goes to NVMe.
  std::uint64_t nvme_bytes = std::uint64_t{4} << 30;
};

struct Config {
  // "train_batch_size": the samples of one step over every rank; 0 where the config does not
  // give it. DeepSpeed ties the three batch keys: train_batch_size =
  // train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size. Where
  // train_batch_size is given, resolve_batch_sizes() derives whichever of the other two is
  // missing and refuses three that disagree.
  std::size_t train_batch_size = 0;
  // The engine does not size batches (the program does); the value counts through the
  // arithmetic above, and `zinf plan` reads it for activation memory.
  // train_micro_batch_given: the config reader sets it where the key has a number (in code, a
  // value other than 1 counts as given without it).
  std::size_t train_micro_batch_size_per_gpu = 1;
  bool train_micro_batch_given = false;
  // The micro-batches of a step (validate() refuses 0, and a micro-batch of 0, as DeepSpeed's
  // _batch_assertion does). The engine accumulates every micro-batch handed to it between
  // two step() calls; with zinf.overlap_step it also begins the step's optimizer pass during the
  // backward of the gradient_accumulation_steps-th (docs/ENGINE.md "Updates during the
  // backward"), from the first step on when the count is declared: above 1, or
  // gradient_accumulation_given (the config reader sets it where the key is present). Otherwise
  // only after a step of exactly this many micro-batches, so that a program that accumulates
  // without saying so is not stopped by the pass having begun.
  std::size_t gradient_accumulation_steps = 1;
  bool gradient_accumulation_given = false;
  // Clip the global gradient norm (over every rank) to this; 0 turns clipping off.
  double gradient_clipping = 0.0;
  Fp16Config fp16;
  // "bf16" (or "bfloat16"): {"enabled"}. When set, every registered parameter must be bf16:
  // register_parameter() refuses another dtype naming this key. (fp16.enabled requires no dtype: it
  // turns on loss scaling, whatever the parameters' dtype.)
  bool bf16_enabled = false;
  // "optimizer": {"type": "Adam" | "AdamW" | "Adagrad" | "Lion" (any case), "params": {...}}.
  // Type "Adam" is AdamW (decoupled decay) unless params.adam_w_mode is false, as in DeepSpeed;
  // missing params take deepspeed_optimizer_defaults(type). Without an optimizer section the
  // defaults are OptimizerParams' (torch.optim.AdamW's).
  OptimizerParams optimizer;
  // "scheduler": {"type": "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR" | "OneCycle",
  // "params": {...}}, DeepSpeed's names, defaults and formulas (include/zinf/schedule.hpp).
  // Engine::open() sets it as set_lr_schedule() would; kind kNone (no section): the optimizer's
  // lr, constant. An unknown type or params key is refused naming it; validate() checks the
  // values against optimizer.lr (LrSchedule::create()).
  ScheduleConfig scheduler;
  ZeroConfig zero;
  // "aio": I/O request size ("block_size", bytes) and queue depth of the engine's IoEngine.
  std::size_t aio_block_bytes = std::size_t{1} << 20;
  // DeepSpeed's queue_depth default is 8; zinf's rings keep 32 pieces in flight unless told
  // otherwise (only the speed differs).
  std::size_t aio_queue_depth = 32;
  // "zinf": zinf's own section. world_size 0: any (else it must equal the communicator's).
  int world_size = 0;
  // Ranks sharing one machine's host memory and NVMe. Read by `zinf plan` only (its per-machine
  // sums); must divide world_size when that is set.
  int ranks_per_machine = 1;
  // When not 0, the most bytes of pinned blocks one rank may map (the optimizer step's pool,
  // sized buffer_count x one sub-group, and the NVMe parameter staging blocks): finalize() fails
  // with kResourceExhausted naming this key instead of mapping more.
  std::uint64_t pinned_pool_bytes = 0;
  // The fp32 gradient accumulator lives on NVMe (one extent per optimizer sub-group) with only
  // gradient_spill_buffers sub-group-sized host buffers; needs stage 2 or 3 and
  // offload_optimizer "nvme".
  bool gradients_on_nvme = false;
  std::size_t gradient_spill_buffers = 4;
  // The optimizer step with its state in a store (offload_optimizer "cpu" or "nvme") runs on
  // after step() returns: each group's new parameters are written as soon as the pass has
  // produced them, and gather() waits only for its own module's. The results are the same bits
  // as the sequential step's (false: step() returns once every parameter is published).
  bool overlap_step = true;
  // With gradient_clipping: step t's gradients are clipped by the coefficient of step t-1's norm
  // (the first step, and the first after a load that carries none, by its own), so no step waits
  // for its own norm and the overlapped step's pass can begin during the backward, as it does
  // without clipping. StepReport::clip_coef is the coefficient applied, grad_norm the step's own
  // norm. Off (false): each step is clipped by its own norm (torch, DeepSpeed).
  bool clip_from_previous_step = false;
  // Device memory the planner sets aside for the runtime (CUDA context, workspaces). Read by
  // `zinf plan` only; the engine allocates nothing for it.
  std::uint64_t device_reserved_bytes = std::uint64_t{1} << 30;
  // Threads of the CPU optimizer (0: every core).
  int cpu_threads = 0;
  // Longest wait for a collective or an I/O before the engine gives up with kTimeout.
  std::int64_t collective_timeout_ms = 60'000;
  // The optimizer step's wait for one NVMe read or write: after io_timeouts_max waits of
  // io_timeout_ms the transfer is cancelled and the step fails with kTimeout naming the extent
  // (0: wait forever, warning after each wait).
  std::int64_t io_timeout_ms = 60'000;
  std::uint32_t io_timeouts_max = 3;
  ActivationConfig activations;
  // Checkpoint tags kept in a checkpoint directory: after a save completes, the oldest complete
  // tags beyond this many are deleted (the new one always stays). 0: every tag is kept, as
  // DeepSpeed keeps them.
  int keep_last = 0;
};

// The defaults DeepSpeed gives each optimizer type when the config leaves a parameter out
// (DeepSpeedCPUAdam / FusedAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion), or torch.optim's with
// torch_adam (torch.optim.AdamW: weight_decay 0.01). docs/ENGINE.md tables them.
OptimizerParams deepspeed_optimizer_defaults(OptimizerKind kind, bool torch_adam = false);

// What zinf does with one key of a config file.
enum class KeyUse : std::uint8_t {
  kUsed = 0,      // read into Config, with DeepSpeed's meaning
  kNoEffect = 1,  // accepted; nothing in zinf changes with it (why says why)
  kRefused = 2,   // parse_config() fails on it (why says why)
};
// "used", "accepted, no effect in zinf", "refused".
std::string_view key_use_name(KeyUse use);

struct KeyReport {
  std::string key;  // dotted: "zero_optimization.offload_optimizer.device"
  KeyUse use = KeyUse::kUsed;
  // Why it has no effect or is refused; for kUsed, empty unless the value is read other than
  // at its face (zero_optimization.stage 0 runs as stage 1).
  std::string why;
};

// The JSON of a config written with comments (#, // and /* */) and trailing commas, which
// DeepSpeed's reader of config files (hjson) accepts: each replaced by spaces outside strings,
// line breaks kept, so that an error in the rest names its line and column. check_config() and
// parse_config() read their text through it; the rest of hjson (quoteless strings, commas left
// out) stays refused as JSON.
std::string strip_config_comments(std::string_view text);

// Every key of `json_text` (sections' keys, not the sections) in file order, with what zinf does
// with it. When no key is refused but validate() refuses values, each key it names is reported
// refused (validate() runs again without each, until it passes). parse_config() fails with
// "<key>: <why>" of the first key refused in file order, or, when only validate() refuses, of
// the first of its refusals. Fails only when the text is not a JSON object (a NUL byte, where
// the parser would end the text, is refused naming its offset).
Result<std::vector<KeyReport>> check_config(std::string_view json_text);

// Parses JSON text. Missing keys keep the defaults above; the result is validate()d.
Result<Config> parse_config(std::string_view json_text);
// A config file's text: kIoError naming the path when it cannot be read or is a directory (which
// opens and reads as nothing). load_config() and `zinf config check` read files through it.
Result<std::string> read_config_file(const std::string& path);
// Reads and parses a file; errors name the path.
Result<Config> load_config(const std::string& path);
// Checks ranges and combinations (for configs built in code); errors name the key. With
// zinf.world_size set, this includes resolve_batch_sizes() at that world size.
Status validate(const Config& config);
// DeepSpeed's batch arithmetic (deepspeed/runtime/config.py, _set_batch_related_parameters and
// _batch_assertion) at `world_size` ranks. Without train_batch_size nothing changes. With it, a
// count is given where its flag is set (the config reader sets it for the key) or its value is
// not the default 1 (a Config built in code gives a count by setting it). A missing
// train_micro_batch_size_per_gpu is train_batch_size / world_size / gradient_accumulation_steps,
// a missing gradient_accumulation_steps is train_batch_size / train_micro_batch_size_per_gpu /
// world_size, and with both missing the steps are 1 (divisions rounding down); counts that are
// given are kept. Then the product must equal train_batch_size, else kInvalidArgument naming
// train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps with all four
// figures. On success both are marked given. parse_config() calls it when zinf.world_size is set,
// Engine::open() with the communicator's world size.
Status resolve_batch_sizes(int world_size, Config* config);
// The config as JSON in the same format (2-space indented); parse_config() reads it back equal.
std::string config_to_json(const Config& config);

}  // namespace zinf
