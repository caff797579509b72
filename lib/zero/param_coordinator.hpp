// ParamCoordinator: where each rank's parameters live and when the full ones exist on the device.
//
// Groups come in two kinds (Partitioner groups; a module has one or more of each):
//   persistent   the full group stays on the device all the time; the rank's slice of it is the
//                rank's shard. Every group at stages 1 and 2; at stage 3 the groups of small
//                parameters (<= stage3_param_persistence_threshold elements each).
//   partitioned  stage 3: only the rank's shard is kept, on the device, in host memory or on
//                NVMe (one swap extent per group); gather() all-gathers the group into a device
//                buffer allocated for it, release() frees it.
//
// Order and prefetch. Until freeze_order() (the engine calls it at the first step), every gather
// appends its module to the recorded order. Afterwards a cursor follows the order; each gather
// issues, behind its own all-gather on the coordinator's stream, the all-gathers of the modules
// that come next in the order, as long as (a) the prefetched, unclaimed elements stay within
// prefetch_elements and (b) all gathered elements (in use plus prefetched) stay within
// max_live_elements. A gather of a module that was prefetched only waits for it (a hit). A
// gather that does not fit drops prefetched modules, the furthest first, and then gathers it
// anyway, as DeepSpeed does (its stage3_max_live_parameters limits prefetching, never the module
// the model needs): the live elements exceed max_live_elements only by the modules in use, and
// max_live_elements 0 prefetches nothing. Every decision depends only on the order
// of calls and the sizes, never on timing, so every rank issues the same collectives.
//
// NVMe shards are read into pinned staging blocks (PinnedPool, offload_param.buffer_count
// blocks, each one shard): the read is submitted when the gather is issued, the stream waits for
// it, copies the block to the device and returns the block, so reads of the next modules overlap
// the current module's compute.
//
// Steady state. After the first step gather() and release() allocate nothing: a released
// group's device buffer is kept as a spare for the next gather of that size (a vector reserved
// for one buffer per partitioned group, which bounds their count), each staging block has its
// own read record for the stream's host functions, and the collectives' names are made at
// create. Names for the trace are built only when tracing. The step after freeze_order() is the
// first to prefetch, and prefetching keeps more buffers live than the recorded step did; so that
// it too finds every buffer it needs, freeze_order() replays the recorded gathers and releases on
// sizes alone (no data moves, nothing is counted) under the frozen order's prefetching, which
// leaves behind as spares the buffers the following steps take. This holds when the steps repeat
// the recorded one's calls; a different pattern takes new buffers at its first step only. Spares
// are kept up to max_live_elements * 4 bytes (or the largest module's, when that is more), or up
// to what the replayed step left when that is more (groups of different sizes cannot share
// buffers), so that no step frees a buffer that the next one makes again.
//
// Trace (track given at create): an instant "issue <module>" when a module's all-gather is
// issued, "release <module>" when release() frees it, "drop <module>" when a prefetched module
// is freed unused, and a span "wait <module>" for gather()'s wait.
//
// Device memory is touched only by the device's own operations (copies, all-gathers), so any
// Device works, host-accessible or not: shards in host memory and the NVMe staging blocks are
// registered with the device (pinned on CUDA) and copied up; write_shard() takes host memory.
// A host shard may be lent instead (ParamCoordinatorOptions::shared_host_shards): a frozen
// group's shard is then the optimizer state's half copy of it, which holds the same bytes, so a
// frozen element takes 2 bytes of host memory fewer.
//
// Thread-safety: one thread (the rank's).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/aligned.hpp"
#include "device/device_ops.hpp"
#include "device/pinned_pool.hpp"
#include "io/swap_space.hpp"
#include "zero/caller_stream.hpp"
#include "zero/partitioner.hpp"
#include "zero/zero_counters.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/status.hpp"
#include "zinf/trace.hpp"

namespace zinf {

struct ParamCoordinatorOptions {
  // Where partitioned shards live (stage 3); ignored when no group is partitioned.
  OffloadDevice shard_tier = OffloadDevice::kNone;
  std::size_t prefetch_elements = 50'000'000;
  std::size_t max_live_elements = 1'000'000'000;
  // Pinned staging blocks for NVMe shards (>= 1).
  std::size_t staging_blocks = 4;
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  Trace* trace = nullptr;
  int trace_track = 0;
  // Per group (empty: none), shard tier host: host memory that already holds the rank's shard of
  // partitioned group g as every write_shard() of it would (the optimizer state's half copy,
  // OptimizerState::share_host_shards), or nullptr. For such a group the coordinator keeps no
  // host shard of its own (host_bytes() leaves it out): the gather copies up from this memory,
  // and write_shard() / write_shard_part() of the same bytes do nothing. REQUIRES: the memory is
  // registered with the device, outlives the coordinator, and nothing writes it while a gather
  // of its group may be in flight other than through unshare_host_shard() first.
  std::vector<const std::byte*> shared_host_shards;
};

struct CoordinatorModule {
  std::string name;
  std::vector<std::uint32_t> groups;  // partitioner groups, persistent and partitioned
};

class ParamCoordinator {
 public:
  // `persistent[g]` says which groups stay gathered. `swap` (required when shard_tier is kNvme
  // and some group is partitioned) gets one extent per partitioned group, and `io` the staging
  // pool's registration. Allocates every persistent buffer and every device/host shard but the
  // lent ones (options.shared_host_shards).
  static Result<std::unique_ptr<ParamCoordinator>> create(const Partitioner& partitioner, int rank,
                                                          Device& device, Communicator& comm,
                                                          std::vector<CoordinatorModule> modules,
                                                          std::vector<bool> persistent,
                                                          const ParamCoordinatorOptions& options,
                                                          SwapSpace* swap, IoEngine* io,
                                                          ZeroCounters* counters);
  ~ParamCoordinator();

  // Stores this rank's new shard of group g (shard_element_count elements of the group's dtype,
  // host memory, read before the call returns or before publish() returns). For persistent
  // groups it lands in the rank's slice of the full buffer, to be all-gathered by publish().
  // REQUIRES: no gather in flight or in use (after drop_prefetched(), nothing gathered).
  Status write_shard(std::uint32_t g, const void* shard);
  // Elements [first, first + count) of g's shard alone, from `values` (count elements, host
  // memory, read as write_shard() reads it): the overlapped step writes a group that straddles
  // its pass's turn in two parts. kUnsupported for a shard on NVMe (its blocks are checksummed
  // whole); writes_shard_parts() says where it works.
  Status write_shard_part(std::uint32_t g, std::size_t first, std::size_t count,
                          const void* values);
  bool writes_shard_parts(std::uint32_t g) const {
    return persistent_[g] || options_.shard_tier != OffloadDevice::kNvme;
  }
  // The same from device memory of this device (a GPU-resident optimizer's new values), read
  // before publish() returns: device-to-device into device shards and persistent groups, down
  // into host shards, and through a staging block to NVMe.
  Status write_shard_from_device(std::uint32_t g, const void* device_shard);
  // Whether group g's host shard is the memory options.shared_host_shards[g] lends.
  bool shares_host_shard(std::uint32_t g) const { return shared_[g] != nullptr; }
  // Gives group g a host shard of its own again, a copy of the lent memory, which the lender may
  // then rewrite (a checkpoint load that makes the optimizer step a frozen sub-group again).
  // Nothing when g shares none. REQUIRES: no gather of g in flight or in use.
  Status unshare_host_shard(std::uint32_t g);
  // Waits until every write_shard() so far has read its host memory, and returns the wait's own
  // status: ok when it did, so the caller may free or reuse the memory those writes read from,
  // even after an earlier call failed. A failure (kTimeout: the stream is stuck; or the stream
  // itself failed) means queued writes may still read their memory; it becomes the sticky error
  // when it is the first.
  Status drain_writes();
  // drain_writes(), then the first (sticky) error: what the caller checks before reusing the
  // memory for the next writes or before publish() (the engine streams a step's shards through
  // one staging buffer). Whatever it returns, the drain was tried; drain_writes() alone says
  // whether it completed.
  Status wait_writes() {
    (void)drain_writes();  // a drain that failed is the sticky error when it is the first
    return error_;
  }
  // All-gathers every persistent group (after write_shard of each), or those of them for which
  // want(g) holds (after a step, the groups it rewrote). Collective: every rank all-gathers the
  // same groups in the same order.
  Status publish() {
    return publish([](std::uint32_t) { return true; });
  }
  template <typename Want>
  Status publish(Want want) {
    for (std::uint32_t g = 0; g < partitioner_.group_count(); ++g) {
      if (persistent_[g] && want(g)) ZINF_RETURN_IF_ERROR(publish_group(g));
    }
    return publish_wait();
  }
  // The same for the persistent ones of `groups` (ascending, each once): a walk over those groups
  // alone, not over every group (a write of a few parameters publishes theirs). Collective: every
  // rank passes the same groups.
  Status publish(std::span<const std::uint32_t> groups);
  // The same for persistent group g alone, queued on the coordinator's stream (after the
  // write_shard() of g queued there); publish_wait() waits for every one queued. Collective: every
  // rank calls it for the same groups in the same order. The overlapped step publishes each
  // module's persistent groups this way when it is first gathered.
  Status publish_group(std::uint32_t g);
  Status publish_wait();

  // Called by issue() before it moves any of `module`'s groups, on the thread that called
  // gather(): the overlapped step waits there until the module's new values are written (a
  // prefetch must not gather the shards the step is still writing). An error fails the gather.
  using IssueHook = Status (*)(void* user, std::size_t module);
  // And before a prefetch: false skips `module` this time (a pass opened in the backward may be
  // writing its shards, and the program cannot gather it before step() anyway).
  using PrefetchFilter = bool (*)(void* user, std::size_t module);
  void set_issue_hook(IssueHook hook, PrefetchFilter may_prefetch, void* user) {
    issue_hook_ = hook;
    may_prefetch_ = may_prefetch;
    issue_hook_user_ = user;
  }

  // See the file comment. module indexes modules as given to create().
  Status gather(std::size_t module);
  Status release(std::size_t module);
  bool gathered(std::size_t module) const;
  // The full group's device buffer when it is available (persistent, or its module gathered);
  // nullptr otherwise.
  void* group_data(std::uint32_t g) const;

  // Waits for and frees every prefetched (unclaimed) module. Returns the first error.
  Status drop_prefetched();
  // When `module` is prefetched (issued, not yet gathered), waits until its copies have read its
  // shards: the overlapped step may rewrite them once the module's gradients are final, and a
  // module may be reduced without being gathered. Nothing otherwise.
  Status settle_prefetch(std::size_t module);
  // Stops recording; later gathers follow and prefetch the recorded order. The first call sizes
  // the spare buffers for the steps to come (see the file comment).
  void freeze_order();
  // Sets the recorded order (a checkpoint's) and freezes it. REQUIRES: every index is a module.
  void restore_order(std::vector<std::size_t> order);
  bool order_frozen() const { return frozen_; }
  const std::vector<std::size_t>& order() const { return order_; }
  // The first module in use, or -1. O(1) when none is in use (a count of them is kept at every
  // change of a module's state): the engine asks before every write_parameters() and checkpoint
  // call; a walk over the modules finds the index only when some module is in use.
  long first_in_use() const;
  // The caller's compute stream (null: none, gather() waits on the host). With one, gather()
  // makes it wait for the module's all-gather instead, and release() makes the coordinator's
  // stream wait for the caller's work queued so far, so a later gather into the same buffer runs
  // after it; a buffer freed rather than kept as a spare waits for that work on the host.
  void set_caller_stream(CallerStream* caller) { caller_ = caller; }

  // Bytes of parameters kept per tier.
  std::uint64_t device_bytes() const;
  std::uint64_t host_bytes() const;
  std::uint64_t nvme_bytes() const;
  // Bytes of the pinned staging blocks for NVMe shards (part of host_bytes()).
  std::uint64_t staging_bytes() const;

 private:
  // Waits for the work queued on the coordinator's stream so far (see the .cpp).
  Status wait_stream_for_writes();
  // A write of lent group g's elements from `first` on: ok when `values` is the lent memory
  // there (nothing to copy), else kInternal.
  Status check_shared(std::uint32_t g, std::size_t first, const void* values);
  enum class State : std::uint8_t { kIdle, kPrefetched, kInUse };
  struct Module {
    std::string name;
    std::vector<std::uint32_t> groups;       // all
    std::vector<std::uint32_t> partitioned;  // the ones gather() moves
    std::size_t elements = 0;                // padded elements of `partitioned`
    State state = State::kIdle;
    std::unique_ptr<Event> ready;
  };
  struct Call {
    std::size_t module = 0;
    bool gather = false;  // else release
  };
  struct SpareBuffer {
    std::size_t bytes = 0;
    DeviceBuffer buffer;
  };
  // One NVMe shard read in flight, in the record of the staging block it reads into: the block's
  // lease is held until the stream has copied the block up.
  struct ShardRead {
    SwapSpace* swap = nullptr;
    SwapTicket ticket;
    PinnedPool::Lease lease;
    std::chrono::milliseconds timeout{0};
    bool abandoned = false;  // the read outlived a cancel: the block is kept out of the pool
  };
  ParamCoordinator(const Partitioner& partitioner, int rank, Device& device, Communicator& comm,
                   const ParamCoordinatorOptions& options, SwapSpace* swap, ZeroCounters* counters);
  Status issue(std::size_t m, bool prefetch);
  Status wait_ready(std::size_t m);
  // A device buffer of `bytes` for a gather: a spare one of that size, else a new one.
  Result<DeviceBuffer> take_buffer(std::size_t bytes);
  // Frees a module's gathered buffers; the trace instant is `what` + its name.
  void free_module(std::size_t m, const char* what);
  // Every change of a module's state goes through here, which keeps in_use_count_.
  void set_state(Module& mod, State state);
  void prefetch_after(std::size_t position);
  // Replays calls_ without moving data (see the file comment); errors only end it early.
  void warm_up();
  void note_live();
  // A trace instant named `what` + `module_name`.
  void instant(const char* what, const std::string& module_name);
  // Host functions on the stream around an NVMe shard's copy up: wait for the read into the
  // staging block, then return the block. `user` is the block's ShardRead. Both run also after
  // earlier work on the stream failed, so a block goes back only once its read is over.
  static Status redeem_shard_read(ShardRead& read);
  static Status wait_shard_read(void* user, const Status& upstream);
  static Status release_shard_block(void* user, const Status& upstream);

  const Partitioner& partitioner_;
  const int rank_;
  Device& device_;
  Communicator& comm_;
  ParamCoordinatorOptions options_;
  SwapSpace* swap_;
  ZeroCounters* counters_;
  std::vector<Module> modules_;
  std::size_t in_use_count_ = 0;  // modules in State::kInUse
  std::vector<bool> persistent_;
  std::vector<DeviceBuffer> full_;  // per group: persistent, or gathered
  // Gather buffers freed by release(), kept for the next gather of a group of the same size so
  // that the steady state allocates nothing: at most max_live_elements * 4 bytes in all. A new
  // buffer is made only when no spare of its size exists, so there are never more buffers of a
  // size than groups of that size: the capacity reserved at create (one per partitioned group)
  // is never exceeded.
  std::vector<SpareBuffer> spare_;
  std::size_t spare_bytes_ = 0;
  std::size_t spare_bytes_max_ = 0;  // see the file comment
  // Per group: "params group <g> (module 'm')", the collectives' name.
  std::vector<std::string> group_names_;
  std::vector<DeviceBuffer> device_shard_;    // per partitioned group, shard tier none
  std::vector<RegisteredBuffer> host_shard_;  // per partitioned group, shard tier host
  // Per group: the lent host shard (options.shared_host_shards), or nullptr; such a group has no
  // host_shard_.
  std::vector<const std::byte*> shared_;
  std::vector<ExtentId> extent_;  // per partitioned group, shard tier nvme
  std::unique_ptr<PinnedPool> staging_;
  std::vector<ShardRead> reads_;  // per staging block
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> done_;     // publish_wait()
  std::unique_ptr<Event> written_;  // wait_stream_for_writes()
  std::vector<std::size_t> order_;
  std::vector<Call> calls_;  // gathers and releases until the order is frozen
  bool dry_run_ = false;     // warm_up(): issue() takes buffers only, wait_ready() returns
  std::vector<std::size_t> prefetched_;  // modules in kPrefetched, in issue order
  std::size_t cursor_ = 0;
  bool frozen_ = false;
  std::size_t live_elements_ = 0;
  std::size_t prefetched_elements_ = 0;
  CallerStream* caller_ = nullptr;
  IssueHook issue_hook_ = nullptr;
  PrefetchFilter may_prefetch_ = nullptr;
  void* issue_hook_user_ = nullptr;
  bool caller_pending_ = false;  // release(): the caller's work must end before a buffer is freed
  Status error_;
};

}  // namespace zinf
