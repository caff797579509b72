// OptimizerState: this rank's optimizer partition (fp32 master, moments, fp32 gradient
// accumulator, in the partition layout of layout.hpp) behind one interface, with one
// implementation per home. The engine holds an OptimizerState and never asks which one it has;
// the factory below picks it from the config and the device, once, at finalize.
//
//   DeviceState (device_state.cpp)  offload_optimizer "none" on a device that is not
//       host-accessible (a GPU): the state in device memory, stepped by the device's kernels
//       (DeviceOptimizer); the new values go to the shards from device memory.
//   HostState (host_state.cpp)      offload_optimizer "none" on a host-accessible device
//       (HostDevice): the state in that memory, stepped in place by the CPU optimizer, which
//       writes each half group's new values into the Publisher's buffer in the same pass.
//   StoreState (store_state.cpp)    offload_optimizer "cpu" or "nvme": a StateStore (host
//       arrays or NVMe extents, gradients possibly spilled to NVMe) stepped by the
//       OptimizerPipeline in sub-groups; the new half values stream into the shards, or are
//       read from the store's half array, or are narrowed from the master (publisher.hpp).
//
// Every implementation gives the same answers to the same calls (tests/engine/
// optimizer_state_test.cpp checks them against one contract): the master and moments it was
// loaded with or stepped to, the state a checkpoint writes and reads, the optimizer's update,
// and its memory figures.
//
// Thread-safety: one thread (the rank's).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/function_ref.hpp"
#include "engine/layout.hpp"
#include "engine/publisher.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "tier/optimizer_pipeline.hpp"
#include "tier/state_store.hpp"
#include "zero/grad_accumulator.hpp"
#include "zero/zero_counters.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"
#include "zinf/status.hpp"

namespace zinf {

// What a state implementation is built on; everything must outlive it.
struct StateContext {
  const Config* config = nullptr;
  Device* device = nullptr;
  const ParameterLayout* layout = nullptr;
  Publisher* publisher = nullptr;
  int rank = 0;
  std::chrono::milliseconds timeout{60'000};
  ZeroCounters* counters = nullptr;
  Trace* trace = nullptr;
  IoEngine* io = nullptr;     // with the swap space
  SwapSpace* swap = nullptr;  // when anything is on NVMe
  // The coordinator's pinned staging blocks, which zinf.pinned_pool_bytes bounds together with
  // the optimizer's pool.
  std::uint64_t param_staging_bytes = 0;
  // Parameter groups (param_groups.hpp): the runs of the partition and each group's
  // hyper-parameters for the first step. Empty: one group, config->optimizer.
  std::span<const OptimizerRange> group_ranges;
  std::span<const OptimizerParams> groups;
};

// Where the GradReducer adds the reduced gradients.
struct GradTarget {
  float* accumulator = nullptr;       // host-writable floats, or device memory (on_device)
  GradAccumulator* custom = nullptr;  // instead of `accumulator` (gradients on NVMe)
  bool on_device = false;             // `accumulator` is device memory of a GPU
  bool zeroed = false;                // the accumulator holds fresh zero pages
  // Per partitioner group (empty: partition offsets): where its slice starts in `accumulator`,
  // GradReducerOptions::kNoRoom for a frozen group given none (on_device only).
  std::vector<std::size_t> group_offsets = {};
};

// The overlapped step's gate (step_gated()): whether the gradients of partition elements
// [first, first + count) are final: > 0 yes, 0 not yet, < 0 the pass is called off.
using RangeReady = int (*)(void* user, std::size_t first, std::size_t count);
// Descending: whether the pass may take partition elements [0, end), not yet begun, from the
// partition's start up instead (see OptimizerPipeline's StepArgs::ascend).
using RangeAscend = bool (*)(void* user, std::size_t end);
struct PassGate {
  bool descending = false;  // from the partition's end to its start
  RangeReady ready = nullptr;
  RangeAscend ascend = nullptr;  // optional
  void* user = nullptr;
  // Optional: each update reads the gradient scale here instead of step_gated()'s grad_scale
  // (StepArgs::late_grad_scale): a pass that reads ahead before step() decides the scale.
  const float* grad_scale = nullptr;
};

// Callbacks over the partition: (first element, element count, values).
using MasterVisitor = FunctionRef<void(std::size_t, std::size_t, const float*)>;
using StateVisitor = FunctionRef<Status(std::size_t, std::size_t, const float*)>;
using StateFill = FunctionRef<Status(std::size_t, std::size_t, float*)>;

class OptimizerState {
 public:
  virtual ~OptimizerState() = default;

  // Where the reducer accumulates.
  virtual GradTarget grad_target() = 0;
  // This rank's sum of squares of the accumulated gradients (inf or NaN when any is).
  virtual Result<double> local_sum_of_squares() = 0;
  // Each parameter group's hyper-parameters for the following steps (as many groups as the
  // context gave, kind unchanged). Allocates nothing.
  virtual Status set_group_params(std::span<const OptimizerParams> groups) = 0;
  // The same for a state of one group.
  Status set_optimizer_params(const OptimizerParams& params) {
    return set_group_params(std::span<const OptimizerParams>(&params, 1));
  }
  // One optimizer step at step number `step` (from 1), the gradients times grad_scale.
  virtual Result<StepStats> step(std::int64_t step, float grad_scale) = 0;
  // After step(): the new parameters into every trainable group's shard, and the gathered groups
  // published. A frozen group (ParameterLayout::frozen_group) is left as it is: a step never
  // changes it (learning rate 0).
  virtual Status publish_step() = 0;
  // Whether step() and write_step() may run on the step runner's thread while the rank's thread
  // gathers (zinf.overlap_step; step_runner.hpp). Only the store's state does: its pass is long
  // (NVMe, or a host pass over the whole partition), the others' are a device kernel or one
  // in-memory pass.
  virtual bool overlaps() const { return false; }
  // Whether step_gated() may run while the gradients are still being reduced: the pass reads
  // them from the host accumulator, which a reduction into other elements leaves alone (not
  // spilled to NVMe, where a sub-group's gradients are read whole). REQUIRES: overlaps().
  virtual bool gates() const { return false; }
  // step() in `gate.descending` order, each sub-group updated only once gate.ready says its
  // elements' gradients are final (OptimizerPipeline's StepArgs::ready): started during the
  // backward pass, it updates what the backward has finished, or only reads ahead until step().
  // Called off before any update (gate.ready < 0), it fails with kAborted and leaves the state as
  // it was, so the next step may run. On the step runner's thread. REQUIRES: gates().
  virtual Result<StepStats> step_gated(std::int64_t step, float grad_scale, const PassGate& gate) {
    (void)step, (void)grad_scale, (void)gate;
    return Status::unsupported("step_gated: the state cannot update during the backward");
  }
  // After step(), on the step runner's thread: every trainable group's shard written, in group
  // order, through the publisher (which counts the frozen ones written at the pass's start); the
  // persistent groups are left for the rank's thread to all-gather. REQUIRES: overlaps().
  virtual Status write_step() {
    return Status::unsupported("write_step: the state does not overlap");
  }
  // The shards from the fp32 master, as at finalize (and after a checkpoint is loaded), then the
  // persistent groups all-gathered when `gather_persistent`; when not, the shard writes are
  // waited for, so that a failed one shows here, and the caller all-gathers them
  // (Publisher::publish()).
  virtual Status publish_master(bool gather_persistent) = 0;
  // Per group (empty: none): host memory registered with the device that holds this rank's
  // shard of group g as every publish of it writes it and that no step rewrites, for the
  // coordinator to keep as g's host shard instead of a copy
  // (ParamCoordinatorOptions::shared_host_shards), or nullptr; nullptr for a persistent group
  // (`persistent[g]`, gathered once and kept, never read from a host shard). Called once, before
  // the coordinator is made; the memory outlives the coordinator. Before the state rewrites a lent
  // shard beside a gather (a checkpoint load that makes the optimizer step it again) it takes it
  // back (ParamCoordinator::unshare_host_shard).
  virtual Result<std::vector<const std::byte*>> share_host_shards(
      const std::vector<bool>& /*persistent*/) {
    return std::vector<const std::byte*>{};
  }
  // The first placement, at finalize, once the coordinator exists.
  virtual Status place_initial() { return publish_master(/*gather_persistent=*/true); }
  // Loading a checkpoint: master elements [first, first + count) were just written (through
  // write_state(kParams)) and are `values`. A state may round them now into what its shards are
  // published from, while they are in cache, or write the shards of the groups they complete;
  // when such calls covered the whole partition in order, from element 0 (after
  // update_master_range(): its span, widened to whole groups, in order from its start),
  // write_loaded() then writes those shards without reading the master again. Errors are those
  // of writing shards.
  virtual Status master_loaded(std::size_t first, std::size_t count, const float* values) {
    (void)first, (void)count, (void)values;
    return Status::ok();
  }
  // After a checkpoint load or Engine::write_parameters' pass: every shard from the new master
  // (after update_master_range(): the shards of its span's changed groups), as publish_master()
  // writes them, the writes waited for; the persistent groups are not all-gathered. Local: the
  // ranks agree that every rank's writes succeeded before any of them all-gathers
  // (Publisher::publish()), so a rank whose write failed fails every rank in the same call
  // instead of leaving them in the all-gather.
  virtual Status write_loaded() { return publish_master(/*gather_persistent=*/false); }

  // Calls fn over the fp32 master in partition order, in pieces, covering at least elements
  // [begin, end) (pieces outside it may be skipped).
  virtual Status read_master(std::size_t begin, std::size_t end, MasterVisitor fn) = 0;
  // Calls fn over all of `piece` (the master or a moment the optimizer has) in partition order.
  virtual Status read_state(Piece piece, StateVisitor fn) = 0;
  // Calls fn over `piece` in partition order, in pieces, covering at least elements [begin, end)
  // (pieces outside it may be skipped), reading no more of the state than the pieces it hands
  // over (one parameter's moment, Engine::read_optimizer_state). This one reads it all, which
  // costs nothing where the state is an array in host memory; a state whose read moves or reads
  // the elements it hands over reads only those that cover the range.
  virtual Status read_state_range(Piece piece, std::size_t begin, std::size_t end,
                                  StateVisitor fn) {
    (void)begin, (void)end;
    return read_state(piece, fn);
  }
  // fill(first, count, out) writes elements of `piece`, in partition order.
  virtual Status write_state(Piece piece, StateFill fill) = 0;
  // write_state(kParams) where `out` holds the master's current elements when fill(first,
  // count, out) is called, for fill to change some of them in place (Engine::write_parameters).
  // This one reads each piece back through read_master(); a state may read ahead.
  virtual Status update_master(StateFill fill) {
    return write_state(Piece::kParams, [&](std::size_t first, std::size_t count, float* out) {
      ZINF_RETURN_IF_ERROR(
          read_master(first, first + count, [&](std::size_t f, std::size_t n, const float* in) {
            const std::size_t a = std::max(f, first);
            const std::size_t b = std::min(f + n, first + count);
            if (a < b && out + (a - first) != in + (a - f)) {
              std::memmove(out + (a - first), in + (a - f), (b - a) * sizeof(float));
            }
          }));
      return fill(first, count, out);
    });
  }
  // update_master() over partition elements [begin, end) only (Engine::write_parameters of a
  // few parameters): fill is called over at least that range, in order, and the master outside
  // what it is called over is left as it is. A state may widen the range (to whole groups, so
  // that master_loaded() over it lets write_loaded() write those groups' shards alone); when the
  // calls covered the widened range in order, write_loaded() then writes only the shards of the
  // groups it overlaps that `changed` chooses (the indices of the groups whose master fill may
  // change, in increasing order, each once: chosen_group(); empty: every group), and
  // master_loaded() rounds only theirs. `changed` may list only the range's groups, and is
  // copied: its cost is the groups it lists, not the model's. fill
  // leaves the other groups' elements as it finds them (a range joined across groups between
  // two runs of changed ones, shares_rewrite): their shards are neither rounded nor written, so
  // they stay what they are. This one updates the whole master, and write_loaded() writes every
  // shard.
  virtual Status update_master_range(std::size_t begin, std::size_t end,
                                     std::span<const std::uint32_t> changed, StateFill fill) {
    (void)begin, (void)end, (void)changed;
    return update_master(fill);
  }
  // Whether an update_master_range() that ends at element `end` and a later one that starts at
  // element `begin` (end <= begin) would both read and rewrite one block of the master (the
  // store's NVMe sub-group holding elements end - 1 and begin), so that one call across the gap
  // (its groups left out of `changed`) costs less than the two (Engine::write_parameters then
  // makes one). The answer may differ between ranks (a rank's sub-groups are cut at its frozen
  // pieces). This one: the master is in memory, where two calls cost no more than their
  // elements.
  virtual bool shares_rewrite(std::size_t end, std::size_t begin) const {
    (void)end, (void)begin;
    return false;
  }
  // Loading a linked rank file in place: whether the state's home can take the file whose block
  // checksums are `sums` as it is (StateStore::adoptable), and then doing so
  // (StateStore::adopt_checkpoint): nothing is read, each block is checked when first read.
  virtual bool adoptable(const std::vector<FileBlockSum>& sums) const {
    (void)sums;
    return false;
  }
  virtual Status adopt_checkpoint(const std::string& path, const std::string& later_name,
                                  const std::vector<FileBlockSum>& sums) {
    (void)path, (void)later_name, (void)sums;
    return Status::unsupported("adopt_checkpoint: the state's home cannot");
  }
  // The state now holds step `step` (a checkpoint was written into it).
  virtual void restored(std::int64_t step) { (void)step; }
  // A checkpoint rank file without copying: when the state's home can (the master and moments on
  // NVMe in the checkpoint layout, StateStore::linkable()), writes `header` (4096 bytes) in front
  // of them and hard-links its file as `path`, appending the file's block checksums to *sums
  // (StateStore::link_checkpoint). False when it cannot (the caller writes the file).
  virtual Result<bool> link_checkpoint(const void* header, const std::string& path,
                                       const std::string& later_name,
                                       std::vector<FileBlockSum>* sums) {
    (void)header, (void)path, (void)later_name, (void)sums;
    return false;
  }

  // Adds this state's bytes to `report` (device, host; NVMe is the swap space's).
  virtual void add_memory(MemoryReport& report) const = 0;
  // The pinned bytes this state mapped (zinf.pinned_pool_bytes).
  virtual std::uint64_t pinned_bytes() const { return 0; }
  // Bytes of master read back from NVMe so far to publish (see StepReport).
  virtual std::uint64_t master_read_bytes() const { return 0; }
};

// What the two homes that hold the whole partition in one memory (DeviceState, HostState)
// share: the context, each group's hyper-parameters (set_group_params() copies them for the
// next step), and writing the publisher's buffer to the shards.
class InMemoryState : public OptimizerState {
 public:
  Status set_group_params(std::span<const OptimizerParams> groups) override;

 protected:
  explicit InMemoryState(const StateContext& ctx);
  // Every group's shard from the publisher's buffer (publisher.hpp), or every trainable group's
  // unless `frozen_too` (after a step), then the persistent groups all-gathered when
  // `gather_persistent`, else the writes waited for (publish_master()).
  Status write_buffer(bool gather_persistent = true, bool frozen_too = true);

  StateContext ctx_;
  const ParameterLayout& layout_;
  Publisher& pub_;
  std::vector<OptimizerParams> groups_;
  const std::size_t partition_elements_;
};

// The pieces a checkpoint holds: the master and the moments the optimizer has.
std::vector<Piece> state_pieces(OptimizerKind kind);

// zinf.pinned_pool_bytes, when set, bounds the pinned blocks the engine maps: the optimizer
// step's pool and the NVMe parameter shards' staging blocks.
Status check_pinned_limit(const Config& config, std::uint64_t optimizer_pool,
                          std::uint64_t param_staging);

// The store's options for this rank's partition (offload_optimizer "cpu" or "nvme").
StateStoreOptions store_options(const Config& config, const ParameterLayout& layout, int rank);

// The context's groups and ranges, or one group (config->optimizer) over one range.
std::vector<OptimizerParams> context_groups(const StateContext& ctx);
std::vector<OptimizerRange> context_ranges(const StateContext& ctx);
// For each of `ranges` (over the partition of ctx.rank): whether it is the frozen parameters'
// group's (the last of ctx.groups, learning rate 0 and weight decay 0) and holds no trainable
// element, so its gradient is always zero and its moments stay zero once they are.
std::vector<bool> frozen_ranges(const StateContext& ctx, std::span<const OptimizerRange> ranges);
// kInvalidArgument when `groups` is not as many as the state was opened with or changes kind.
Status check_group_params(std::span<const OptimizerParams> groups, std::size_t count,
                          OptimizerKind kind);

// Builds the state for ctx.config on ctx.device: allocates it and loads the initial master
// (ctx.layout.fill_master) and zero moments. The engine calls place_initial() once the
// coordinator is set on the publisher.
Result<std::unique_ptr<OptimizerState>> open_optimizer_state(const StateContext& ctx);

// The three homes, for tests that check each alone against the contract.
Result<std::unique_ptr<OptimizerState>> open_device_state(const StateContext& ctx);
Result<std::unique_ptr<OptimizerState>> open_host_state(const StateContext& ctx);
Result<std::unique_ptr<OptimizerState>> open_store_state(const StateContext& ctx);

}  // namespace zinf
