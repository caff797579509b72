// Engine: one rank's share of ZeRO training (stages 1-3), the public face of zinf.
//
// A training program opens one Engine per rank (on LocalComm, one thread per rank), registers its
// parameters once with their initial values (or an initializer that produces them at finalize()),
// and then for every micro-batch:
//
//   forward, for each module m in order:   gather(m); parameter(name) -> device pointers;
//                                          compute; release(m)
//   backward, for each module in reverse:  gather(m); compute the gradients;
//                                          reduce_gradients(m, {name -> device gradient});
//                                          release(m)
//
// and after the last micro-batch of a batch, step(). What each stage does:
//   stage 1  every rank keeps all parameters on the device; gradients accumulate in full on each
//            rank and are reduce-scattered (averaged) into their owners' slices at step(); each
//            rank steps the optimizer over its slice of the fp32 master state only, and the
//            updated slices are all-gathered back into every rank's parameters.
//   stage 2  as stage 1, but reduce_gradients() reduce-scatters each module's gradients at once
//            (in buckets of reduce_bucket_size) into the owner's fp32 accumulator, so no rank
//            holds the full gradients.
//   stage 3  as stage 2, and each rank keeps only its slice of the parameters (on the device, in
//            host memory or on NVMe); gather(m) all-gathers module m's parameters, release(m)
//            frees them. After the first step the coordinator knows the order of the modules
//            and, at each gather, issues the gathers of the modules that follow while the current
//            one computes, within stage3_prefetch_bucket_size and stage3_max_live_parameters.
//            Parameters of at most stage3_param_persistence_threshold elements stay gathered.
//
// The optimizer state (fp32 master, moments) and the reduced gradients of the rank's slice live
// on the device (offload_optimizer "none": on HostDevice the CPU optimizer runs on the device
// memory, which is host memory; on a GPU the kernels' Adam/AdamW), in host memory ("cpu") or on
// NVMe ("nvme"), stepped by the tier's OptimizerPipeline in sub-groups of sub_group_size.
//
// Numerics. Every rank's gradients are averaged over ranks (kAverage: the sum in rank order, then
// divided by the world size) and summed over the micro-batches of the step; the optimizer sees
// their mean over micro-batches, divided by the loss scale, times the clipping coefficient
// (gradient_clipping / (norm + 1e-6) when the global norm exceeds gradient_clipping). The global
// norm, the overflow check (any inf or NaN on any rank) and the loss-scale update all happen
// before any parameter or optimizer state changes, so a skipped step changes nothing but the
// loss scale. With f32 device parameters the result equals a single-process optimizer run on the
// mean gradient (the equivalence tests check 1e-6 relative).
//
// Errors. Bad input (an unknown module or parameter, a gradient of the wrong size, registering
// after finalize) returns kInvalidArgument / kNotFound / kFailedPrecondition naming what was
// wrong, before anything changes: the engine stays usable. Operating errors (a collective that
// failed or timed out, an I/O error) are sticky: every later call returns the first one.
// Collectives: gather(), release() (no collective, but keeps the order), reduce_gradients(),
// step(), finalize() and read_parameters() issue collectives, so every rank must make the same
// calls in the same order; a call rejected for bad input on one rank only leaves the other ranks
// waiting in their next collective until collective_timeout_ms, then failing with kTimeout.
//
// Device support: any Device. On one that is not host_accessible() (CudaDevice) the engine
// touches device memory only through the device's copies, its collectives and stream operations
// (lib/device/device_ops.hpp: gradients widened into fp32 buckets on the device, reduced chunks
// copied back to host memory and accumulated there, or with offload_optimizer "none" accumulated,
// normed and stepped on the device); the parameters handed out by parameter() and the gradients
// given to reduce_gradients() are device pointers and are never dereferenced by the host. With
// "none" there, the optimizer must be Adam or AdamW with bias correction (the device's Adam
// kernel): open() returns kUnsupported naming optimizer.type (or
// optimizer.params.bias_correction) otherwise. That Adam rounds every operation where the CPU
// optimizer fuses multiply-adds, so results match a CPU run to float rounding, not to the bit.
//
// Thread-safety: call an Engine from one thread (its rank's); the engine runs its own stream,
// I/O and optimizer threads. Different ranks' engines run on different threads concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/log.hpp"
#include "zinf/schedule.hpp"
#include "zinf/status.hpp"
#include "zinf/trace.hpp"

namespace zinf {

class FaultInjector;

// What an engine runs on; everything here must outlive the engine.
struct Env {
  Device* device = nullptr;      // this rank's device (required)
  Communicator* comm = nullptr;  // this rank's communicator, on `device` (required)
  // When not empty, the swap directories for everything on NVMe, overriding the config's
  // nvme_path keys (several directories stripe across drives).
  std::vector<std::string> nvme_paths;
  // When set, spans on tracks "engine" (gather, release, reduce, step phases) and the
  // pipeline's "read"/"update"/"write"; each rank's engine may share one Trace.
  Trace* trace = nullptr;
  // Tests only: faults injected into every NVMe transfer of this engine (lib/io/fault.hpp).
  std::shared_ptr<FaultInjector> io_faults;
};

// Writes the initial fp32 values of elements [first_element, first_element + element_count) of
// one parameter (flattened in row-major order of its shape) to out[0, element_count), and returns
// OK, or an error that fails finalize(). See ParameterSpec::initializer.
using ParameterInitializer =
    std::function<Status(std::size_t first_element, std::size_t element_count, float* out)>;

// Gives rank root's new fp32 values of parameter `name` to Engine::write_parameters (the batch
// form): fills `out`, exactly the parameter's element_count floats in row-major order of its
// shape, and returns OK, or an error that fails the call (see there). Called on the thread that
// runs write_parameters, on the root only.
using ParameterValues = std::function<Status(std::string_view name, std::span<float> out)>;

// A parameter to register. Its initial values come from exactly one of `initial_values` (copied
// at registration) or `initializer` (asked for them during finalize()).
struct ParameterSpec {
  std::string name;                 // unique, for example "layers.3.attn.qkv.weight"
  std::string module;               // the module that uses it, for example "layers.3"; not empty
  std::vector<std::int64_t> shape;  // {} is a scalar; every dimension > 0
  DType dtype = DType::kF32;        // the dtype of the device copy the model computes with
  // element_count(shape) fp32 values, read during the call (they become the fp32 master and,
  // rounded to `dtype`, the device copy). The engine keeps a copy (4 bytes an element) until
  // finalize() ends. REQUIRES: the same values on every rank.
  const float* initial_values = nullptr;
  // Instead of initial_values: called during finalize(), on the thread that runs it, for exactly
  // the elements of this parameter in this rank's partition (its slice of the fp32 master), each
  // element once and never outside [0, element_count(shape)): one call per run of the
  // parameter's elements in each piece the engine fills (a sub-group of sub_group_size elements
  // when the optimizer state is offloaded, else the whole partition). Nothing is copied at
  // registration, so a model need never be held whole in host memory.
  // REQUIRES: deterministic, the same value for an element on every rank whatever the order or
  // the split of the calls (ranks ask for different pieces, and the pieces change with the world
  // size, stage and sub_group_size); the function must not throw. An error it returns fails
  // finalize() with that code, naming the parameter and the elements. The engine drops the
  // function (and what it captured) when finalize() ends, successful or not.
  ParameterInitializer initializer = nullptr;
  // With an initializer, optionally: a hash of the values it gives (any 64-bit hash of them, the
  // same function on every rank, its low two bits unused; 0: none). finalize() compares it
  // across the ranks that give one, as it compares the initial_values, and fails naming the
  // parameter where it differs (a model built with a rank-dependent seed).
  std::uint64_t initializer_values_hash = 0;
  // The parameter group (add_param_group()) whose hyper-parameters step this parameter; "" is
  // the default group, the optimizer's own. A name no add_param_group() defined fails
  // finalize() naming the parameter and the group.
  std::string group = {};
  // False: a frozen parameter (requires_grad=False in torch, an adapter's base weight). It is
  // laid out, partitioned, gathered and released, checkpointed, read and written as any other,
  // and keeps its fp32 master and optimizer moments (the moments stay zero; the optimizer pass
  // streams them with the rest of the state), but it takes no gradients and no step changes it:
  // it steps in an internal group of learning rate 0 and weight decay 0 with a zero gradient, so
  // its master (and device copy) keep their bits. A module's parameters must be all trainable or
  // all frozen (register_parameter() refuses a mix with kInvalidArgument naming the module and
  // one parameter of each kind); reduce_gradients() of a frozen module is kInvalidArgument, and
  // the step needs the gradients of the trainable parameters only. Every rank must freeze the
  // same parameters (finalize() compares them). Not with zinf.gradients_on_nvme
  // (register_parameter() refuses it naming the key).
  bool trainable = true;
};

// A parameter group, as torch's param_groups (DeepSpeed takes them from the torch optimizer):
// its parameters step with the optimizer's hyper-parameters except those set here. The usual
// "no decay" group of biases and normalisation weights is {"no_decay", 0.0}.
struct ParamGroup {
  std::string name;  // not empty, unique
  // The group's weight decay; < 0: the optimizer's.
  double weight_decay = -1.0;
  // The group's learning rate is the optimizer's (as scheduled, or set_learning_rate()'s) times
  // this (>= 0). A group with its own lr in torch has lr_scale = its lr / the optimizer's lr.
  double lr_scale = 1.0;
};

// A parameter's device copy, valid while its module is gathered (always, at stages 1 and 2).
struct TensorView {
  void* data = nullptr;  // device pointer
  DType dtype = DType::kF32;
  std::size_t element_count = 0;
  std::vector<std::int64_t> shape;
};

// One parameter's gradient for reduce_gradients(): element_count elements of `dtype` (f32, bf16
// or f16) at device pointer `data`, read before reduce_gradients() returns.
struct GradientRef {
  std::string_view name;
  const void* data = nullptr;
  std::size_t element_count = 0;
  DType dtype = DType::kF32;
};

// What one step() did.
struct StepReport {
  std::int64_t step = 0;         // optimizer steps applied so far (counting this one)
  bool skipped = false;          // an overflow (inf/NaN gradient on some rank): nothing changed
  int micro_batches = 0;         // reduce_gradients() rounds averaged into this step
  double loss_scale = 1.0;       // the scale this step's gradients carried
  double next_loss_scale = 1.0;  // the scale for the next micro-batches
  double grad_norm = 0.0;        // global L2 norm of the mean unscaled gradient, before clipping
  double clip_coef = 1.0;        // the factor clipping applied (1: none)
  // Wall time of each phase, nanoseconds.
  std::int64_t reduce_ns = 0;  // the backward's last buckets, and stage 1's reduce-scatter
  std::int64_t norm_ns = 0;    // local norms and the all-reduce of norm and overflow flag
  // The optimizer step over this rank's slice; with the state on NVMe and bf16/f16 parameters
  // whose shards are not in host memory, also the shards' writes, which stream with the pass.
  std::int64_t optimizer_ns = 0;
  std::int64_t publish_ns = 0;  // new parameters to the device copies / shards (and gathers)
  std::int64_t wall_ns = 0;
  // Bytes the optimizer step moved to and from NVMe (fp32 master, moments), and bytes of
  // parameter shards written to NVMe (stage 3, offload_param "nvme").
  std::uint64_t optimizer_nvme_read_bytes = 0;
  std::uint64_t optimizer_nvme_write_bytes = 0;
  std::uint64_t param_nvme_write_bytes = 0;
  // Bytes of fp32 master read back from NVMe to publish parameters the optimizer pass does not
  // write in their dtype (f32 parameters, or a mix of half dtypes).
  std::uint64_t master_nvme_read_bytes = 0;
  // The overlapped step (zinf.overlap_step, the optimizer state in a store): step() decided this
  // step and returned while its optimizer pass runs on. optimizer_ns, publish_ns, the NVMe byte
  // counts and hidden_ns above and below are then the previous applied step's pass (finished by
  // now; zero on the first step), not this one's.
  bool overlapped = false;
  // Of that pass's time (optimizer_ns + publish_ns), the part during which the caller was not
  // waiting for it: hidden behind the caller's compute.
  std::int64_t hidden_ns = 0;
  // Time gather() waited since the previous step() for parameters the pass had not yet written.
  std::int64_t gather_wait_ns = 0;
  // This step's pass began during its backward (the overlapped step with no gradient_clipping
  // and no loss scaling, stages 2-3, gradients in host memory): it updated each part of the
  // state as soon as the reductions into it were over, from the last module to the first.
  bool in_backward = false;
  // This step's pass began during its backward but only read ahead (gradient_clipping or loss
  // scaling: the same runs otherwise): with the state on NVMe it read its first sub-groups into
  // the pinned pool while the backward ran, and it updated only once step() had decided the
  // scale (its optimizer_ns and hidden_ns in the next report count from there). For a skipped
  // step it was called off and changed nothing.
  bool read_ahead = false;
};

// Bytes of this rank's state on each tier, fixed at finalize() (but host_bytes, below).
struct MemoryReport {
  std::uint64_t device_bytes = 0;  // parameters (full or shard), gradient accumulators, buckets
  // Host-tier optimizer state and shards, pinned pools: every host array and block allocated,
  // its pages written yet or not (a frozen element's zero moments count). But the fp32 master
  // of the frozen sub-groups kept as their half copy alone (docs/ENGINE.md "Frozen parameters"),
  // whose pages no write is ever given: it grows back when a write or a load gives one its
  // master. The scratch blocks of those sub-groups' reads and writes count.
  // A frozen group's shard the state's half copy lends the coordinator (stage 3, shards and
  // state in host memory) is counted once, as the half copy; it grows back by the shard when a
  // checkpoint load gives the group its own shard again.
  std::uint64_t host_bytes = 0;
  std::uint64_t nvme_bytes = 0;  // swap extents
  // Activations (save_activation(), set_activation_bytes(); docs/ACTIVATIONS.md), outside the
  // figures above. The most bytes of activations on the device at once since open(): the
  // checkpoints the engine keeps there (cpu_checkpointing false) plus the bytes the caller said
  // it holds (set_activation_bytes), sampled at each of those calls.
  std::uint64_t activation_device_bytes_peak = 0;
  std::uint64_t activation_host_bytes = 0;  // the pinned arena and NVMe staging blocks
  std::uint64_t activation_nvme_bytes = 0;  // the activation swap file's capacity
  // Bytes of checkpoints written to and read back from NVMe since open().
  std::uint64_t activation_nvme_write_bytes = 0;
  std::uint64_t activation_nvme_read_bytes = 0;
};

// Running totals since open().
struct EngineCounters {
  std::uint64_t gathers = 0;               // gather() calls
  std::uint64_t gathers_issued = 0;        // module all-gathers issued (demand + prefetch)
  std::uint64_t prefetches_issued = 0;     // issued ahead of their gather()
  std::uint64_t prefetch_hits = 0;         // gather() found its module prefetched
  std::uint64_t prefetches_dropped = 0;    // prefetched, then freed unused (max_live or step)
  std::uint64_t order_misses = 0;          // gather() of a module off the recorded order
  std::uint64_t live_elements = 0;         // gathered elements now (persistent ones excluded)
  std::uint64_t live_elements_peak = 0;    // most at once since open()
  std::uint64_t persistent_elements = 0;   // elements kept gathered (stage 3)
  std::uint64_t all_gather_bytes = 0;      // bytes received by all-gathers (this rank)
  std::uint64_t reduce_scatter_bytes = 0;  // bytes sent into reduce-scatters (this rank)
  // Gradient buckets reduce-scattered. Both stay 0 for one rank at stages 2-3 on a
  // host-accessible device with the gradients in host memory: it adds them in place.
  std::uint64_t buckets_reduced = 0;
  std::uint64_t param_nvme_read_bytes = 0;
  std::uint64_t param_nvme_write_bytes = 0;
  std::uint64_t steps = 0;
  std::uint64_t skipped_steps = 0;
  // zinf.gradients_on_nvme: fp32 gradient sub-groups written to and read back from NVMe, and
  // the writes that were evictions (every spill buffer held partial sums of another sub-group).
  std::uint64_t grad_spill_write_bytes = 0;
  std::uint64_t grad_spill_read_bytes = 0;
  std::uint64_t grad_spill_read_backs = 0;
  std::uint64_t grad_spill_evictions = 0;
};

// What Engine::verify_swap() read back.
struct SwapCheckReport {
  std::uint64_t blocks = 0;          // swap blocks read back, each matching its checksum
  std::uint64_t bytes = 0;           // their bytes
  std::uint64_t skipped_blocks = 0;  // never written, or lost by a failed write: nothing to check
};

class ScopedGather;

class Engine {
 public:
  // Checks the config (validate(), errors naming the key), the Env (device, communicator, world
  // size against zinf.world_size) and each NVMe directory (that a file can be created there:
  // errors name the key and the path). Buffers are sized at finalize(), when the parameters are
  // known.
  static Result<std::unique_ptr<Engine>> open(const Config& config, const Env& env);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers one parameter. kInvalidArgument (naming it) for an empty or duplicate name, an
  // empty module, a bad shape, or neither or both of initial_values and initializer set;
  // kFailedPrecondition after finalize().
  Status register_parameter(const ParameterSpec& spec);

  // Lays out the partitions, checks with every rank that all registered the same parameters
  // and initial values (kInvalidArgument naming the first parameter that differs and the ranks),
  // allocates every buffer, opens swap space, and places the initial values (calling the
  // initializers). Called by the first gather(), reduce_gradients() or step() if not before.
  // Collective. With no parameters registered, kFailedPrecondition and registration stays open.
  // On any other failure the engine stays unfinalized and every later call returns the same
  // error (register_parameter quotes it): open a new engine. A failure of this rank's own after
  // those checks (an initializer, memory, the swap files) also aborts the communicator, so that
  // the other ranks fail at once naming this rank: the new engine needs a new communicator.
  Status finalize();
  bool finalized() const;

  // Makes `module`'s parameters available on the device; on return they are ready to read (with
  // a compute stream: ready for the work queued on it after the call, see set_compute_stream).
  // kNotFound for an unknown module (nothing changes); kFailedPrecondition when it is gathered
  // already; kResourceExhausted when it does not fit stage3_max_live_parameters beside the
  // modules still gathered. A no-op (beyond checks) at stages 1 and 2.
  Status gather(std::string_view module);
  // The device copy of a parameter of a gathered module. kNotFound for an unknown parameter,
  // kFailedPrecondition when its module is not gathered.
  Result<TensorView> parameter(std::string_view name) const;
  // Frees the module's gathered parameters (stage 3; persistent ones stay). kNotFound for an
  // unknown module, kFailedPrecondition when it is not gathered. Without a compute stream
  // (set_compute_stream), on a device that is not host-accessible the caller's work reading them
  // must have finished (its stream synchronised): the next gather may write into the freed
  // buffers on the engine's stream. With one, the engine orders that for the caller.
  Status release(std::string_view module);

  // The stream the caller computes on (null, the default: none), a stream of Env::device; on a
  // GPU one from wrap_cuda_stream() (a caller's cudaStream_t) or Device::create_stream(). With
  // it, the engine orders itself with the caller's work by events, not host waits:
  //   gather(m)             returns once m's all-gather is issued; the compute stream waits for
  //                         it, so work queued there after the call reads the gathered values;
  //   release(m)            the engine's stream waits for the work queued on the compute stream
  //                         so far before a later gather overwrites m's buffers (a buffer freed
  //                         rather than kept for reuse waits for it on the host);
  //   reduce_gradients(m)   reads the gradients after the work queued on the compute stream so
  //                         far (which may still be writing them), and returns without waiting
  //                         for the read: the compute stream waits for it, so work queued there
  //                         after the call may overwrite them. On a host-accessible device
  //                         (HostDevice), where host code reads them, it waits on the host for
  //                         that work first. Bucket reuse may still block the host on earlier
  //                         reduce-scatters, which may wait for the compute stream.
  //   step(), load_checkpoint(), write_parameters()  wait on the host for the work queued on
  //                         it so far first.
  // Errors of the engine's streams reach the compute stream through the waits (a HostDevice
  // stream that waits on a failed event fails too) and the engine's next host wait.
  // REQUIRES: no module gathered (else kFailedPrecondition naming it). Changing or clearing it,
  // and destroying the engine, wait on the host for the work queued on the old stream, which
  // must outlive the engine or be cleared first.
  Status set_compute_stream(Stream* stream);
  // gather(module), and a guard that release()s it when it goes out of scope, with typed views
  // of its parameters. The same errors as gather().
  Result<ScopedGather> scoped_gather(std::string_view module);

  // Reduces this micro-batch's gradients of every parameter of `module`, exactly once each:
  // averaged over ranks into the owners' slices and added to what earlier micro-batches left.
  // Validates everything first: kNotFound for an unknown module or a parameter not in it,
  // kInvalidArgument for a missing or repeated parameter, a wrong element count or a null
  // pointer (each names the parameter). Returns once the gradients have been read (copied into
  // the reduce buckets), so their memory may be reused at once (with a compute stream on a device
  // that is not host-accessible: by work queued on that stream after the call, see
  // set_compute_stream); the last buckets' reduce-scatters go on behind the caller's next work
  // (an error there is returned by a later call).
  Status reduce_gradients(std::string_view module, std::span<const GradientRef> gradients);

  // Applies the optimizer to the gradients reduced since the last step (see the file comment).
  // REQUIRES: every parameter's gradients were reduced the same number (>= 1) of times since the
  // last step (else kFailedPrecondition naming a parameter). Releases any prefetched modules.
  // An fp16 overflow with the loss scale already at fp16.min_loss_scale is skipped as any other
  // and returns kAborted naming the key (not sticky: the next step may run). When the schedule's
  // lr or betas for this step are out of range (OneCycle's momentum past its cycle leaving [0, 1);
  // LrSchedule::check_at), returns kInvalidArgument naming the step, changing nothing (the step
  // count, the parameters and the optimizer state stay); not sticky: after a new schedule
  // (set_lr_schedule) whose values are in range, step() goes on.
  Result<StepReport> step();
  // step() with the accumulated gradients divided by `average_over` micro-batches instead of by
  // the number reduced since the last step (their mean): DeepSpeed divides every micro-batch's
  // loss by gradient_accumulation_steps however many a step has, so a step cut short (the end of
  // an epoch) passes gradient_accumulation_steps here to match it. 0 is step(). kInvalidArgument
  // (nothing changes) when it is below the micro-batches reduced, and when a pass opened during
  // the backward (zinf.overlap_step; its step has gradient_accumulation_steps micro-batches) and
  // it is not that number.
  Result<StepReport> step(int average_over);

  // Checkpoints (docs/ENGINE.md "Checkpoints"), in DeepSpeed's layout: <dir>/<tag>/ per
  // checkpoint and <dir>/latest naming the newest. Collective: every rank calls them with the same
  // directory and tag, which all ranks can reach. Both finalize the engine if it is not yet.
  //
  // save_checkpoint writes <dir>/<tag>/: each rank's fp32 master and optimizer moments (wherever
  // they live) in rank<r>.zinfckpt, the client state (set_client_state) in client_state.bin, and
  // last manifest.json (world size, stage, optimizer, every parameter's place, step, loss scaler,
  // learning rate and schedule, gather order, each file's size and xxh3-64). Everything is
  // written into <dir>/.<tag>.tmp, synced and renamed to <dir>/<tag>; then <dir>/latest is
  // replaced atomically, and with zinf.keep_last > 0 older tags beyond that many are deleted
  // (by default none is). A save cut short
  // at any instant (a crash, a full disk) leaves `latest` naming the previous complete checkpoint.
  // A tag that exists already is replaced, as DeepSpeed's save writes over it: the complete new
  // tag is swapped in for the old one (renameat2 RENAME_EXCHANGE, or two renames where the
  // filesystem has no exchange), so a crash leaves the old tag or the new one, whole.
  // Creates `dir` if needed. kInvalidArgument, on every rank and before anything is written,
  // naming each rank's tag when the ranks pass different tags (whatever checkpoint.tag_validation
  // says: a checkpoint is one tag directory); kInvalidArgument for a tag that is not 1-200
  // characters of [A-Za-z0-9._-] (or starts with '.', or is "latest" or "latest.tmp");
  // kFailedPrecondition naming <dir>/<tag> when it exists and is not a checkpoint (neither a
  // manifest nor rank files), and when gradients were reduced since the last step or a module is
  // gathered (gradients are not saved). An I/O error names the file.
  Status save_checkpoint(std::string_view dir, std::string_view tag);
  // save_checkpoint(dir, "global_step<N>"), N the optimizer steps applied (DeepSpeed's default
  // tag).
  Status save_checkpoint(std::string_view dir);
  // load_checkpoint replaces the state (registered or trained) with the checkpoint's <dir>/<tag>
  // (`tag` empty: the one <dir>/latest names), restores the step, learning rate and schedule,
  // gather order and client state, and republishes the parameters from the loaded master, as a
  // step would. The saved loss scaler is restored only when this engine's is dynamic (fp16 on,
  // fp16.loss_scale 0) and the checkpoint's was too; otherwise loss_scale() is this engine's
  // initial one (1 without fp16, fp16.loss_scale when static, 2^initial_scale_power). Unlike
  // DeepSpeed, which takes the saved scaler, mode included, zinf deliberately keeps the scaler
  // this config asks for unless both are dynamic. The
  // checkpoint may come from another world size, stage, offload placement or sub_group_size: the
  // masters and moments are re-sliced by parameter name. kInvalidArgument naming the parameter when
  // the registered parameters (names, shapes) differ, or both optimizers when the optimizer
  // differs; kCorruption naming the file when a file's size or checksum does not match the
  // manifest; kNotFound naming <dir>/latest (or the manifest) when there is no checkpoint. Those
  // leave the engine as it was (every rank fails, the others with kAborted naming the rank). An
  // error while the state is being replaced, the republish's shard writes included, fails every
  // rank in this call the same way and is sticky.
  Status load_checkpoint(std::string_view dir, std::string_view tag = {});
  // The optimizer steps applied so far (StepReport::step of the last step(); a step skipped for
  // overflow does not count): 0 after open(), and the checkpoint's count after
  // load_checkpoint(), so a resumed run knows where it is.
  std::int64_t applied_steps() const;
  // An opaque blob saved with the next checkpoints (a data loader's position, say): rank 0's is
  // written, and load_checkpoint() gives every rank that blob (empty when none was saved).
  void set_client_state(std::string_view blob);
  const std::string& client_state() const;

  // The fp32 master values of parameter `name` (element_count floats into `out`). Collective
  // (each rank owns a slice): every rank must call it with the same name. kNotFound for an
  // unknown name. A rank that fails to read its slice (a read error of its state, a null `out`)
  // fails every rank in the call, the others with kAborted naming it; the error is not sticky.
  Status read_parameters(std::string_view name, float* out);
  // One optimizer moment of parameter `name`, whole, as read_parameters() gives its master:
  // `state` is "exp_avg" or "exp_avg_sq" (element_count floats into `out`; zeros before the
  // first step). Collective, as read_parameters(). Each rank reads its part of the parameter:
  // with the state on NVMe, the swap blocks (aio block_size) that hold it, the parameter's bytes
  // and at most two blocks more per call; in host memory, nothing but the slice; on a GPU
  // (offload_optimizer "none"), the slice comes to the host. kNotFound for an
  // unknown name; kInvalidArgument for a state the optimizer does not keep (Adagrad has no
  // exp_avg, Lion no exp_avg_sq), naming those it keeps. Like read_parameters, it waits for the
  // last step's pass, returns kFailedPrecondition ("call step() first") while the next step's
  // pass updates the state during the backward (the overlapped step's updates in the backward),
  // and fails every rank when one cannot read its slice, without a sticky error.
  Status read_optimizer_state(std::string_view name, std::string_view state, float* out);
  // Replaces the fp32 master of parameter `name` with rank `root`'s `values` (element_count
  // floats; the other ranks' `values` are ignored and may be null), and republishes the device
  // copies / shards from the master, as load_checkpoint() does; the optimizer moments stay.
  // Collective: every rank calls it with the same name and root. It updates this rank's slice
  // of the parameter's group alone and writes that group's shards alone (all-gathered again
  // where the group stays gathered); with the master on NVMe, the sub-groups holding that slice
  // are read and rewritten whole. To write many parameters, use the batch form below, one pass
  // for all of them. kNotFound for an unknown name; kFailedPrecondition when a module is gathered
  // or gradients were reduced since the last step; kInvalidArgument for a root outside the
  // world, and for a null `values` on the root (kAborted naming the root on the other ranks).
  // Errors once the master is being written are sticky, as for the batch form.
  Status write_parameters(std::string_view name, const float* values, int root = 0);
  // write_parameters() for many parameters at once: the fp32 masters of `names` are replaced
  // with rank `root`'s values, which `values` gives on the root one parameter at a time (each
  // name once, in the order the parameters lie in the layout, not the order of `names`), and the
  // device copies / shards are republished once; the optimizer moments and the other parameters'
  // masters stay. It updates this rank's slices of the named parameters' groups only, in runs of
  // neighbouring groups, writes those groups' shards only and all-gathers those of them that
  // stay gathered; with the master on NVMe, the sub-groups holding those slices are read and
  // rewritten whole, each once whatever the number of names (so two parameters far apart in one
  // sub-group cost it once). It holds one parameter's values at a time besides the state's own
  // sub-group buffers. Collective: every rank passes the same names in the same order and the
  // same root; `values` is only called on the root and may be empty elsewhere. Empty `names`:
  // nothing to write, OK (still collective: the ranks agree on it). Before anything is written, a
  // rank returns kNotFound naming an unknown name; kInvalidArgument naming a name given twice, or
  // for a root outside the world; kFailedPrecondition when a module is gathered or gradients were
  // reduced since the last step; kInvalidArgument for an empty `values` on the root; the others
  // return kAborted naming that rank (the outcomes are agreed, so a call refused on one rank does
  // not leave the others waiting), and every rank kInvalidArgument when the ranks' names or roots
  // differ. Once the pass has begun, an error (one `values` returned, which comes back with the
  // parameter's name; an I/O error, a write of the new shards included; a collective's) fails
  // every rank in this call, the others with kAborted naming the rank, and is sticky: some
  // masters may hold their new values and others not, and the ranks' shards may disagree.
  Status write_parameters(std::span<const std::string_view> names, const ParameterValues& values,
                          int root = 0);

  // Reads back every block of this rank's swap files that holds data (NVMe optimizer state,
  // parameter shards, spilled gradients) and checks it against the xxh3 checksum kept in memory
  // when it was written: kCorruption naming the extent, its offset and the file for the first bad
  // block, or the I/O error. Not collective, and it works after an operating error (a collective
  // that timed out when a rank died), so a surviving rank can show its swap files intact before
  // it exits. Nothing to check (no NVMe, not finalized): an empty report.
  // REQUIRES: no other call of this engine runs meanwhile (as for every call).
  Result<SwapCheckReport> verify_swap();

  // Activation checkpoints (docs/ACTIVATIONS.md; the config's activation_checkpointing section).
  // save_activation copies `bytes` at device pointer `data` off into the engine's store under
  // `key`: a device copy (cpu_checkpointing false), pinned host memory (within
  // zinf.activation_host_bytes) or beyond it NVMe (zinf.activation_nvme_path), asynchronously:
  // the memory at `data` must keep its values until the next save_activation() or
  // load_activation() returns. load_activation copies the checkpoint back into device pointer
  // `data` (its saved size) and frees it; it returns once the values are there. The keys' save
  // order of the first forward pass is recorded, and each load reads ahead from NVMe the
  // checkpoints that follow in reverse order. Not collective, and usable before finalize().
  // kInvalidArgument (empty key, null pointer, 0 bytes, a pointer the device refuses to copy as
  // not its memory), kFailedPrecondition (a key saved twice without a load), kNotFound (a load of
  // a key not saved): nothing changes (a refused load keeps the checkpoint). An I/O error
  // (kIoError, kCorruption when a block read back does not match its checksum) names the key, is
  // sticky, and aborts the communicator, so every other rank's next collective fails with it.
  Status save_activation(std::string_view key, const void* data, std::size_t bytes);
  Status load_activation(std::string_view key, void* data);
  // Returns once the last save_activation() has finished reading its device memory.
  Status flush_activations();
  // The bytes of activations the caller holds on the device now, outside the store (for
  // MemoryReport::activation_device_bytes_peak).
  void set_activation_bytes(std::uint64_t device_bytes);

  // The loss scale the gradients of the next micro-batches must carry: multiply the loss by it
  // before the backward pass (1 unless fp16 is enabled).
  double loss_scale() const;
  // Changes the learning rate for the following steps, overriding the schedule (if any) from
  // then on; each group runs at lr times its lr_scale. Cheap enough to call before
  // every step. kInvalidArgument naming the value for a NaN, infinite or negative rate (nothing
  // changes).
  [[nodiscard]] Status set_learning_rate(double lr);
  // The learning rate the next step runs with (the default group's): the schedule's, or the
  // last set_learning_rate()'s (the optimizer's own lr for the first step of a schedule started
  // at last_batch_iteration >= 0: see set_lr_schedule()).
  double learning_rate() const;
  // The (beta1, beta2) the next step runs with: OneCycle's cycled momentum where the schedule
  // cycles it (cycle_momentum), else the optimizer's betas (also for the first step of a
  // schedule started at last_batch_iteration >= 0).
  std::pair<double, double> betas() const;

  // Defines a parameter group (see ParamGroup). REQUIRES: before finalize(). kInvalidArgument
  // for an empty or repeated name, a weight_decay or lr_scale that is not finite, more than 62
  // groups; kFailedPrecondition after finalize().
  Status add_param_group(const ParamGroup& group);

  // Replaces the learning-rate schedule (by default the config's `scheduler` section, or none:
  // the optimizer's lr) and config().scheduler. DeepSpeed's semantics
  // (include/zinf/schedule.hpp): the k-th applied step (a step skipped for overflow does not count)
  // runs with lr_at(last_batch_iteration + k - 1), last_batch_iteration -1 unless the config sets
  // it, so a checkpoint (which keeps the step count) resumes the same curve; except that with
  // last_batch_iteration >= 0 the first step runs with the optimizer's own lr and betas, as
  // DeepSpeed's schedulers set them when built only at -1. kInvalidArgument naming the
  // scheduler.params key that is out of range.
  Status set_lr_schedule(const ScheduleConfig& schedule);

  int rank() const;
  int world_size() const;
  const Config& config() const;
  // Module names in order of first registration.
  std::vector<std::string> modules() const;
  // The recorded gather order (empty before the first step).
  std::vector<std::string> recorded_order() const;
  // A snapshot of the running totals, taken by each call (the reference stays valid for the
  // engine's life and is refreshed by the next call).
  const EngineCounters& counters() const;
  // REQUIRES: finalized().
  MemoryReport memory() const;

  class Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A module gathered for as long as this object lives (Engine::scoped_gather()):
//
//   ZINF_ASSIGN_OR_RETURN(zinf::ScopedGather fc1, engine.scoped_gather("fc1"));
//   ZINF_ASSIGN_OR_RETURN(std::span<const float> w, fc1.param<float>("fc1.w"));
//
// The destructor releases the module. An error there cannot be returned: it is logged (a warning
// naming the module), and an operating error stays sticky in the engine, so the next call
// returns it; call release() to see it directly. Thread-safety: as the Engine (its rank's thread).
class ScopedGather {
 public:
  ScopedGather(ScopedGather&& other) noexcept
      : engine_(std::exchange(other.engine_, nullptr)), module_(std::move(other.module_)) {}
  ScopedGather& operator=(ScopedGather&& other) noexcept {
    if (this != &other) {
      release_and_log();
      engine_ = std::exchange(other.engine_, nullptr);
      module_ = std::move(other.module_);
    }
    return *this;
  }
  ~ScopedGather() { release_and_log(); }

  // A parameter of this module as a span of T: T is float for an f32 parameter and
  // std::uint16_t (raw bits) for bf16 or f16 ones. kInvalidArgument naming the parameter and both
  // types when the parameter's dtype is not T's; Engine::parameter()'s errors otherwise (a
  // parameter of another module, not gathered, is kFailedPrecondition). The span points at device
  // memory (host memory on HostDevice) and is valid until the module is released.
  template <typename T>
  Result<std::span<const T>> param(std::string_view name) const {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, std::uint16_t>,
                  "ScopedGather::param<T>: T is float (f32) or std::uint16_t (bf16, f16)");
    if (engine_ == nullptr) {
      return Status::failed_precondition("ScopedGather::param: the module was released");
    }
    Result<TensorView> view = engine_->parameter(name);
    if (!view.is_ok()) return view.status();
    const bool matches =
        std::is_same_v<T, float> ? view->dtype == DType::kF32 : view->dtype != DType::kF32;
    if (!matches) {
      return Status::invalid_argument(
          std::string("parameter '")
              .append(name)
              .append("' is ")
              .append(dtype_name(view->dtype))
              .append(", asked for as ")
              .append(std::is_same_v<T, float> ? "float (f32)" : "std::uint16_t (bf16 or f16)"));
    }
    return std::span<const T>(static_cast<const T*>(view->data), view->element_count);
  }

  // Releases the module now and returns release()'s status; later calls return OK.
  Status release() {
    if (engine_ == nullptr) return Status::ok();
    return std::exchange(engine_, nullptr)->release(module_);
  }
  const std::string& module() const { return module_; }

 private:
  friend class Engine;
  ScopedGather(Engine* engine, std::string_view module) : engine_(engine), module_(module) {}
  void release_and_log() {
    Status status = release();
    if (!status.is_ok()) {
      log_warn("scoped gather of module '{}': release failed: {}", module_, status.to_string());
    }
  }

  Engine* engine_ = nullptr;
  std::string module_;
};

// Writes every parameter's full fp32 master of the checkpoint <dir>/<tag> (`tag` empty: the one
// <dir>/latest names; saved at any world size) to `out_path` as a safetensors file, in `dtype`
// f32 or bf16 (rounded to nearest even), tensors named as registered, in name order; written
// under a temporary name and renamed. Every rank file's checksum is verified first (kCorruption
// naming the file); kInvalidArgument for another dtype. Needs no Engine (`zinf ckpt export`).
Status export_checkpoint_safetensors(const std::string& dir, const std::string& tag,
                                     const std::string& out_path, DType dtype);

inline Result<ScopedGather> Engine::scoped_gather(std::string_view module) {
  ZINF_RETURN_IF_ERROR(gather(module));
  return ScopedGather(this, module);
}

}  // namespace zinf
