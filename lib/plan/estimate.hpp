// The memory estimator: the bytes of each kind of training state on each tier (device, host,
// NVMe), per rank and per machine, for a model, a training shape and an engine setup.
//
// Notation: P = parameters, N = ranks in the job (one per GPU), R = ranks per machine,
// Pr = ceil(P / N) = one rank's shard, h = hidden, L = layers, a = heads, V = vocab,
// s = sequence length, b = micro-batch. Half precision (bf16/f16) is 2 bytes, fp32 4.
//
// Per rank, as the engine allocates it (docs/ENGINE.md, "What each option costs"):
//   half params     stage 1-2: 2·P on the device (every rank holds all of them)
//                   stage 3:   2·Pr on the offload_param tier (device, host or NVMe)
//   fp32 master     4·Pr on the optimizer tier (device, host, NVMe)
//   moments (m, v)  8·Pr on the optimizer tier
//   gradients       the engine accumulates them in fp32: 4·Pr on the device with the optimizer
//                   there, else on the host; spilled (gradients_on_nvme, stages 2-3 with the
//                   optimizer on NVMe) 4·Pr on NVMe, one extent per sub-group, and on the host
//                   min(gradient_spill_buffers, ceil(Pr / Sg')) buffers of 4·Sg' bytes rounded
//                   up to 4 KiB, Sg' = min(Sg, Pr); stage 1 also keeps the full fp32
//                   gradients, 4·P (4·T with frozen parameters, below), on the device until
//                   the step reduces them
//   half copy       the new half params on the host before they go to their home. Streamed
//                   (optimizer on NVMe, shards not in host memory: offload_param nvme or none,
//                   or stages 1-2): each sub-group's half output goes from its pool buffer into
//                   the shards, one group at a time through a buffer of the largest group's
//                   shard, 2·ceil(max(layer, largest tensor) / N) (= 2·param_staging_params).
//                   Otherwise 2·Pr: the CPU optimizer writes them beside the master (optimizer
//                   on the host, or shards in host memory). With the optimizer on the device
//                   (offload_optimizer none on a GPU: lib/engine/device_state.cpp) 2·Pr on the
//                   device, the device optimizer's own half copy, which the shards are written
//                   from (the host's publish buffer is freed once the first values are placed);
//                   the frozen runs' half copy is rounded from the master with no scratch
//   activations     device, per micro-batch (Korthikanti et al. 2022, "Reducing Activation
//                   Recomputation in Large Transformer Models", eq. 1, 16-bit, no tensor or
//                   sequence parallelism):
//                     one layer   A1 = s·b·h·34 + 5·a·s²·b  (the second term is the attention
//                                 score matrices; flash attention does not store them)
//                     no checkpointing   L·A1
//                     checkpointing      L·2·s·b·h (each layer's input) + A1 (one layer
//                                        recomputed at a time)
//                     plus logits        6·s·b·V (half logits and their fp32 softmax)
//                   examples/train_lm's model (ModelKind::kTrainLm, fp32; T = s·b tokens,
//                   X = context_bytes·embed_dim, F = intermediate, V = 256; what
//                   examples/train_lm/model.cpp allocates for the forward pass):
//                     no checkpointing   4·T·(X + V + (L+1)·(2h+1) + L·F): the embedding
//                                        output, the probabilities, each residual stream, its
//                                        norm and 1/rms, each block's ffn activation
//                     checkpointing      4·T·(2h + 1 + max(F, X, V)): two residual buffers, one
//                                        1/rms, one buffer shared by the recomputed block's ffn
//                                        activation, the embedding output and the probabilities
//                                        + 4·L·T·h, each block's input (the checkpoints)
//                   With offload_activations (cpu_checkpointing) the checkpoints (L·2·s·b·h, or
//                   4·L·T·h) leave the device for the host (the engine's arena; NVMe beyond it
//                   is not planned here).
//   pinned pool     host, page-locked: optimizer on NVMe: buffer_count · Sg · (12, or 16 when
//                   gradients are spilled, + 2 when the half output streams) bytes,
//                   Sg = sub_group_size (a buffer holds one sub-group's master, m, v, gradient
//                   and half output); params on NVMe: + param_buffer_count
//                   staging blocks of one shard of the largest module each,
//                   2·ceil(max(layer, largest tensor) / N). Zero otherwise.
//   gathered params stage 3 only, device: 2·(min(P, max_live_params) + prefetch_bucket_params)
//                   for the layers being run and prefetched, + 2·persistent params (tensors
//                   below stage3_param_persistence_threshold stay gathered: norms and biases)
//   comm buckets    the gradient reducer's (lib/zero/grad_reducer.cpp, GradReducer::create),
//                   allocated at open for the engine's life, with chunk = reduce_bucket_params / N
//                   capped at the largest group's shard (param_staging_params, where set):
//                   device: 2·4·chunk·N (two fp32 buckets, one filling while one is reduced)
//                   + 2·4·chunk receive buffers with N > 1; host, pinned: 2·4·chunk that the
//                   reduced chunks come back through (a GPU; a host-memory device reads them in
//                   place, and one such rank at stages 2-3 with its gradients in host memory
//                   allocates no bucket at all: it adds them in place)
//   reserved        device: device_reserved_bytes (CUDA context, cuBLAS workspace, allocator
//                   slack), a fixed figure until the GPU backend measures it
// Frozen parameters (ModelShape::trainable_params; docs/ENGINE.md "What a frozen parameter
// costs"), T trainable of P, Tr = min(ceil(T / N), Pr) a rank's trainable share:
//   moments         8·Tr on the device (offload_optimizer none) and in host memory (cpu): the
//                   frozen sub-groups' moments stay zero and are never resident (host: fresh
//                   zero pages no step writes). On NVMe still 8·Pr: the swap file is preallocated
//                   whole at open (and for each new generation after a linked checkpoint save)
//                   before the frozen moments' room is given back, so the filesystem needs room
//                   for all of it then; in between it holds 8·Tr.
//   gradients       4·Tr: offloaded (cpu, nvme) the host accumulator is fresh zero pages that
//                   only reductions write, and a frozen group is never reduced, at any stage;
//                   on the device (optimizer none) the device optimizer gives a group of frozen
//                   runs no slot in its packed accumulator. Stage 1's full-size copies are 4·T:
//                   a frozen group has none. No group of the engine's mixes frozen and
//                   trainable parameters: its layout groups by module (ParameterLayout, the
//                   Partitioner's group_by_module), and register_parameter refuses a module that
//                   mixes them. (GradReducer would give a stage-1 group that did a full copy of
//                   all its elements and reduce it whole; only a Partitioner without
//                   group_by_module, which the engine never makes, has one.)
//                   The engine refuses gradients_on_nvme with a frozen parameter.
//   everything else as for trainable parameters: the fp32 master, the half params and the half
//                   copy (written from the master at finalize), but with the state in host
//                   memory or on the device (below).
//   Frozen and trainable elements meet at sub-group cuts widened to 1024 elements; those
//   widened edges (at most 2·1023 frozen elements a run of trainable ones) keep moments too,
//   which the estimate leaves out.
// Frozen parameters and the state in host memory (offload_optimizer cpu: StoreState keeps the
// master in host memory and the half copy beside it; docs/ENGINE.md "A frozen master its half copy
// holds exactly is not kept" and "A frozen shard the store's half copy holds is not copied"), with
// Fr = Pr − Tr a rank's frozen share. With the state on NVMe nothing changes (the master stays
// there, the half copy is kept or streamed as above); on the device, see the next paragraph.
// Whatever the values:
//   scratch         the four blocks a half-only master is read and written through, allocated
//                   wherever a sub-group holds frozen elements alone, before the values are seen:
//                   14·min(256 Ki, Sg, Pr) bytes (three fp32, one half), counted with the master
//   half params     stage 3 with offload_param cpu: every frozen group but the persistent ones is
//                   lent the half copy for a shard (share_host_shards looks at the layout alone:
//                   the half copy is the master narrowed either way): 2·Tr + 2·min(Fr, Pp), Pp
//                   the persistent params' shard (persistent_shard_params: a persistent group is
//                   never lent and is taken as frozen), + the groups beside runs off the cuts
//                   (below). Stages 1-2 and offload_param none or nvme: as above (2·P or 2·Pr on
//                   the device or NVMe).
// With the values exact in the run's half dtype (ModelShape::frozen_exact_in_half, zinf plan
// --frozen-exact: a bf16 checkpoint with bf16, an fp16 one with fp16) also:
//   fp32 master     4·Tr: a frozen sub-group's master is its half copy alone (the master array's
//                   zero pages are never written), + the runs off the cuts' (below)
//   half copy       2·Pr in host memory as above: it is what the frozen elements keep.
//   So a frozen element takes 6 B of host memory at stage 3 with cpu/cpu (master 4, half copy 2;
//   2 B with the flag), 6 B at stages 1-2 and at stage 3 with offload_param none or nvme (2 B
//   with the flag; there besides its 2 B half param on the device or NVMe).
//   Where runs meet the cuts: the engine lends a frozen group only where every sub-group over its
//   shard holds frozen elements alone, and keeps no master only of such sub-groups. A trainable
//   run's sub-groups are widened to 1024-element boundaries of the rank's partition
//   (frozen_cuts), and a rank's partition is each group's shard end to end, a shard
//   ceil(group / (128·N))·128 elements (the Partitioner pads to 128 elements a rank, not 1024), so
//   a run may begin or end off a cut: then the frozen groups its widened ends reach keep their
//   own shard, and their elements in the widened sub-groups their master. The rule
//   (trainable_runs_on_cuts): where every tensor of the model (tensor_params in estimate.cpp) is a
//   whole number of 1024·N elements, every group's shard is a whole number of 1024 (a group is
//   whole tensors at 16-element alignment) and so every run begins and ends on a cut: nothing
//   more is kept. Otherwise each of the trainable runs (ModelShape::trainable_runs, at least one)
//   is charged at either end the shard of the largest frozen group (its largest tensor and a
//   bias, in shards of 128·N) and 1023 elements of groups that lie inside the widened edge, 2 B
//   each, and with the flag the master of the 2·1023 frozen elements the edges hold, 4 B each
//   (each capped at the whole shard's). An upper bound: an edge holds fewer than 1024 elements,
//   so it reaches one group past those that lie wholly inside it. A model given by parameter
//   count is taken as made of the tensors the estimate assumes for it elsewhere (norms of h,
//   matrices of V·h, h·h and h·I), which the engine's model need not be: there the rule is an
//   assumption, not a bound, as is the one run an unknown count of runs (--trainable) is taken as.
// Frozen parameters and the state in device memory (offload_optimizer none on a GPU: DeviceState's
// DeviceOptimizer; docs/ENGINE.md "What a frozen parameter costs"). Whatever the values, nothing
// more than above (no scratch: a half-only master is read and written through the host). With the
// values exact in the run's half dtype (--frozen-exact) also:
//   fp32 master     4·Tr on the device: a frozen run of a bf16/f16 group whose every element its
//                   half copy holds exactly keeps no master (a "half-only" run), and the others'
//                   masters are packed around them. The device optimizer's runs are the
//                   parameters' own pieces of the partition (its group ranges), not the store's
//                   sub-groups widened to 1024 elements, so no frozen element keeps a master
//                   beside a trainable run: nothing for runs off the cuts. Left out: each stretch
//                   of runs that keep a master (a trainable run; a frozen group's padding is
//                   frozen with it) begins at the next multiple of 16 elements plus its
//                   partition offset modulo 16, at most 30 elements (120 B) past where packing end
//                   to end would put it (under 8 KiB for Llama-2-7B's 64 LoRA runs on one GPU,
//                   where no tensor is padded); and the host block a half-only master is uploaded
//                   through (2 B an element, at most 1 Mi elements: 2 MiB), which the engine's
//                   MemoryReport leaves out too.
//   half copy       2·Pr on the device as above: it is what the frozen elements keep.
//   So a frozen element takes 6 B of device memory for its state with optimizer none (master 4,
//   half copy 2), 2 B with the flag, besides its half params (2 B of the shard at stage 3, 2 B an
//   element of the model at stages 1-2).
// The engine's MemoryReport counts half params, master, moments, gradients, half copy and
// pinned pool (engine_bytes()); activations belong to the training code, gathered params are
// transient, the reducer's buckets are the engine's but outside its MemoryReport, and the
// reserved bytes belong to the runtime.
// Per machine: every tier's per-rank bytes × R (each rank holds an equal shard, and the R ranks
// of a machine share its host memory and NVMe).
//
// Thread-safety: values and pure functions.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "plan/model.hpp"
#include "zinf/config.hpp"
#include "zinf/status.hpp"

namespace zinf::plan {

enum class MemoryTier : std::uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
inline constexpr int kMemoryTierCount = 3;
// "device", "host", "nvme".
std::string_view memory_tier_name(MemoryTier tier);

// The memory tier where offloaded state of `device` lives (none: the device).
MemoryTier memory_tier(OffloadDevice offload);

enum class MemoryUse : std::uint8_t {
  kHalfParams = 0,
  kMasterParams,
  kMoments,
  kGradients,
  kActivations,
  kPinnedPool,
  kGatheredParams,
  kCommBuckets,
  kReserved,
  kHalfCopy,
};
inline constexpr int kMemoryUseCount = 10;
// "half_params", "fp32_master", "moments", "gradients", "activations", "pinned_pool",
// "gathered_params", "comm_buckets", "reserved", "half_copy".
std::string_view memory_use_name(MemoryUse kind);

struct TrainingShape {
  std::uint64_t seq_len = 2048;
  std::uint64_t micro_batch = 1;
  std::uint64_t grad_accum_steps = 1;
  bool checkpoint_activations = false;
  // With checkpointing: the checkpoints live off the device (activation_checkpointing's
  // cpu_checkpointing; train_lm --offload-activations cpu|nvme).
  bool offload_activations = false;
  // Flash attention does not keep the a·s² score matrices for backward.
  bool flash_attention = true;
};

// The engine's knobs that change memory or time. The defaults are DeepSpeed's.
struct EngineSetup {
  int stage = 3;                                   // ZeRO stage 1, 2 or 3
  std::uint64_t world_size = 1;                    // N: ranks (GPUs) in the job
  std::uint64_t ranks_per_machine = 1;             // R: GPUs per machine
  OffloadDevice optimizer = OffloadDevice::kNone;  // fp32 master, m, v
  OffloadDevice params = OffloadDevice::kNone;     // half params; stage 3 only
  // Gradients accumulated on NVMe (only with optimizer on NVMe, stages 2-3), through
  // gradient_spill_buffers sub-group-sized host buffers.
  bool gradients_on_nvme = false;
  std::uint64_t gradient_spill_buffers = 4;
  std::uint64_t sub_group_params = 1'000'000'000;  // Sg: parameters the optimizer steps at once
  std::uint64_t buffer_count = 4;        // sub-group buffers in the pinned pool (optimizer on NVMe)
  std::uint64_t param_buffer_count = 5;  // half-param staging buffers (params on NVMe)
  std::uint64_t param_buffer_params = 100'000'000;  // DeepSpeed's buffer_size (informational)
  // Parameters of one staging block for params on NVMe: one shard of the largest module.
  std::uint64_t param_staging_params = 0;
  std::uint64_t reduce_bucket_params = 500'000'000;
  std::uint64_t prefetch_bucket_params = 50'000'000;
  std::uint64_t max_live_params = 1'000'000'000;
  std::uint64_t persistence_threshold_params = 100'000;
  std::uint64_t device_reserved_bytes = std::uint64_t{1} << 30;
  std::uint64_t io_block_bytes = std::uint64_t{1} << 20;
  std::uint64_t io_queue_depth = 32;
  // zinf.overlap_step: with the optimizer offloaded, the optimizer pass runs behind the next
  // step's compute (time_model.hpp), at most behind this fraction of one micro-batch's forward +
  // backward: 2/3, the backward's share of the compute, is the engine's schedule with updates
  // during the backward.
  bool overlap_step = true;
  double overlap_compute_fraction = 2.0 / 3.0;
  // Exact clipping (gradient_clipping > 0 without zinf.clip_from_previous_step) or fp16 loss
  // scaling: the step's global norm or overflow check needs every gradient, so the engine updates
  // nothing before step() (Engine's in_backward_) and the pass hides behind the next forward at
  // most, as where it starts at step().
  bool exact_clipping_or_loss_scaling = false;
};

// OK when `setup` is one the engine can run: stage in 1..3, params offloaded only at stage 3,
// gradients_on_nvme only at stages 2-3 with the optimizer on NVMe, world_size a nonzero multiple of
// ranks_per_machine, and at least 2 sub-group buffers when the optimizer is on NVMe.
Status validate_setup(const EngineSetup& setup);

// Whether the step streams its half output into the shards (optimizer on NVMe, shards not in
// host memory) instead of keeping a host copy of the whole shard.
bool streams_half(const EngineSetup& setup);
// Bytes one sub-group buffer holds per parameter: 12 (fp32 master, m, v), 16 when gradients are
// spilled to NVMe and travel with the state, + 2 for the half output's slot when it streams.
std::uint64_t sub_group_bytes_per_param(const EngineSetup& setup);
// Pinned-pool bytes the setup needs (the formula above).
std::uint64_t pinned_pool_bytes(const EngineSetup& setup);

struct MemoryEstimate {
  // bytes[kind][tier] for one rank.
  std::array<std::array<std::uint64_t, kMemoryTierCount>, kMemoryUseCount> rank_bytes{};
  std::uint64_t ranks_per_machine = 1;
  std::uint64_t param_count = 0;
  std::uint64_t shard_params = 0;            // Pr
  std::uint64_t trainable_params = 0;        // T (= param_count with nothing frozen)
  std::uint64_t trainable_shard_params = 0;  // Tr

  std::uint64_t bytes(MemoryUse kind, MemoryTier tier) const {
    return rank_bytes[static_cast<int>(kind)][static_cast<int>(tier)];
  }
  std::uint64_t rank_tier_bytes(MemoryTier tier) const;
  std::uint64_t machine_tier_bytes(MemoryTier tier) const {
    return rank_tier_bytes(tier) * ranks_per_machine;
  }
  // The part of rank_tier_bytes(tier) the engine allocates and reports (MemoryReport): half
  // params, master, moments, gradients, half copy, pinned pool.
  std::uint64_t engine_bytes(MemoryTier tier) const;
};

// Activation bytes of one micro-batch on one rank's device (the formula above), logits included,
// checkpoints included unless offloaded.
std::uint64_t activation_bytes(const ModelShape& model, const TrainingShape& training);
// The checkpoints' bytes (each layer's input) with checkpoint_activations; 0 without.
std::uint64_t activation_checkpoint_bytes(const ModelShape& model, const TrainingShape& training);
// The pinned host arena (zinf.activation_host_bytes) that holds the checkpoints of a micro-batch
// with offload_activations: the arena places each checkpoint at a 256-byte boundary
// (lib/engine/activation_store.cpp), so each layer's input counts rounded up to 256 bytes, as
// examples/train_lm sizes it. 0 without offload_activations.
std::uint64_t activation_arena_bytes(const ModelShape& model, const TrainingShape& training);

// A rank's trainable share: ceil(T / N), at most its shard ceil(P / N) (T <= P).
std::uint64_t trainable_shard_params(const ModelShape& model, std::uint64_t world_size);

// The parameters stage 3 keeps gathered for the whole run (stage3_param_persistence_threshold
// at least h: the norms and biases, small_tensor_params()), 0 where the threshold is below h;
// and a rank's shard of them, ceil(that / N).
std::uint64_t persistent_params(const ModelShape& model, const EngineSetup& setup);
std::uint64_t persistent_shard_params(const ModelShape& model, const EngineSetup& setup);

// The 1024 and 128 of the next two functions (and of the header's notes) are the engine's
// constants, which estimate.cpp takes from where the engine defines them: kFrozenCutElements
// (lib/engine/param_groups.hpp), the multiple a trainable run's sub-groups are widened to (a
// 4 KiB page of fp32), and kShardAlignmentElements (lib/zero/partitioner.hpp), the multiple a
// rank's slice of a group is.

// Whether every trainable run begins and ends on a 1024-element cut of each rank's partition on
// `world_size` ranks: every tensor of the model a whole number of 1024·world_size elements (the
// header's rule; a sufficient condition, so false may be a run that does line up).
bool trainable_runs_on_cuts(const ModelShape& model, std::uint64_t world_size);
// A rank's shard of the largest group a frozen tensor can be in: its largest tensor, with a bias
// where the model has them, padded to 128·world_size elements and split.
std::uint64_t largest_frozen_group_shard_params(const ModelShape& model, std::uint64_t world_size);

// REQUIRES: validate_setup(setup) is OK; no gradients_on_nvme with frozen parameters.
MemoryEstimate estimate_memory(const ModelShape& model, const TrainingShape& training,
                               const EngineSetup& setup);

}  // namespace zinf::plan
