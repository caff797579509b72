// GradReducer: one rank's gradients, reduce-scattered over ranks into the owner of each slice.
//
// Every rank owns a slice of every partitioner group (Partitioner), and its fp32 gradient
// accumulator is those slices laid end to end: group g's slice starts at partition_offset(g)
// (the sum of the earlier groups' shard_element_count, or where options.group_offsets puts it: a
// device accumulator with no room for the frozen groups). Two ways in, by stage:
//
//   stages 2, 3  reduce(): the module's gradients are cut in buckets; a bucket takes the same
//                `chunk` elements from every rank's slice of the group (so it is world * chunk
//                elements, at most reduce_bucket_elements), is reduce-scattered (kAverage) so
//                rank r receives the mean of its own chunk, and the result is added to the
//                accumulator. Two buckets alternate: bucket k+1 is filled while k is reduced.
//   stage 1      reduce() adds the gradients into a full-size fp32 copy of each group on this
//                rank; reduce_accumulated() (at the step) reduce-scatters those in the same
//                buckets into the accumulator and zeroes them. A frozen group (options.frozen)
//                has no full copy and is not reduce-scattered (its slice is zeroed once).
//
// Gradients may be f32, bf16 or f16; they are widened to f32 in the bucket, so the averages and
// the sums over micro-batches are f32 whatever the parameter's dtype. Padding stays zero. An
// accumulator in memory is never cleared: a group's first reduction since zero() overwrites its
// slice. One rank with its accumulator in host memory skips the buckets: reduce_in_place().
// The reducer counts, per parameter, the micro-batches reduced since zero(), so the step can
// check that every parameter got the same number.
//
// Host work: on a host_accessible() device (HostDevice) buckets are filled by host code on the
// calling thread and results accumulated by host functions; the collectives run on the reducer's
// stream. On any other device (CudaDevice, an opaque HostDevice) the gradients and buckets are
// never touched by host code (see reduce_group): buckets are filled by DeviceOps on a
// fill stream (memset for padding, widen for gradients), each reduced chunk comes back by
// copy_d2h into a registered (pinned) host staging buffer and is added into the accumulator in
// host memory by a host function, or, with options.accumulator_on_device, added on the device by
// widen; stage 1's full-size gradients are device memory, summed by widen with accumulate.
// Both kinds of device run one bucket schedule (reduce_group); only the fill and the last hop
// into the accumulator differ. Nothing is allocated per bucket: each bucket has its own record
// for the host function that adds its chunk, reused once the bucket is free again.
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

#include "device/device_ops.hpp"
#include "zero/caller_stream.hpp"
#include "zero/grad_accumulator.hpp"
#include "zero/partitioner.hpp"
#include "zero/zero_counters.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/status.hpp"
#include "zinf/trace.hpp"

namespace zinf {

struct GradReducerOptions {
  // Elements of one bucket over all ranks (DeepSpeed's reduce_bucket_size); each rank's chunk is
  // this divided by the world size, at least one element.
  std::size_t bucket_elements = 500'000'000;
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  Trace* trace = nullptr;
  int trace_track = 0;
  // The accumulator is known to hold zeros already (fresh zero pages): create() then skips
  // clearing `accumulator` (the one given here; the float array given to create() is never
  // cleared: each group's first reduction overwrites its slice) and stage 1's full gradients.
  bool accumulator_zeroed = false;
  // When set, reduced chunks are added into this (lib/zero/grad_accumulator.hpp, e.g. one that
  // spills to NVMe) instead of the float array given to create(); it must outlive the reducer.
  GradAccumulator* accumulator = nullptr;
  // The accumulator is device memory of a device that is not host-accessible (offload_optimizer
  // "none" on a GPU): reduced chunks are added into it on the device, and a group's first chunk
  // since zero() overwrites instead, so nothing has to clear it. Excludes `accumulator`.
  bool accumulator_on_device = false;
  // Per parameter (indexed by ParamId; empty: none): a frozen parameter, which takes no
  // gradients. REQUIRES: a group holds only frozen or only trainable parameters wherever
  // gradients are partitioned (the engine groups by module, and a module is one or the other),
  // and `accumulator` is not set with a frozen parameter (at any stage). A frozen group (every
  // parameter of it frozen) is never reduced, at any stage; its slice of the accumulator is zeroed
  // once at create() and never written after, so the step's norm and update see a zero gradient
  // there. At stage 1 it has no full-size copy either (4 bytes an element less), and
  // reduce_accumulated() moves the trainable groups only; a stage-1 group that mixes the two is
  // reduced whole, zeros in its frozen ranges. micro_batches() counts only the trainable ones.
  std::vector<bool> frozen;
  // Per group (empty: each group's partition offset, the slices laid end to end): where group
  // g's slice starts in the accumulator, or kNoRoom for a group that has none (its slice is
  // never written: the device optimizer's gradients, which leave out the groups of frozen runs
  // only). REQUIRES: accumulator_on_device; a group with kNoRoom is frozen (above); slices with
  // room do not overlap and lie inside the accumulator.
  std::vector<std::size_t> group_offsets;
  static constexpr std::size_t kNoRoom = SIZE_MAX;
};

// One parameter's gradient as the reducer reads it (device memory; read by host code only when
// the device is host_accessible()).
struct GradSource {
  const void* data = nullptr;  // null: no gradient for this parameter in this call
  DType dtype = DType::kF32;
};

class GradReducer {
 public:
  // `accumulator`: partition_element_count() floats, or with options.group_offsets as many as
  // the slices given reach (group g's shard_element_count floats from group_offsets[g], for each
  // group with room), that host code may write (host memory, or device memory of a
  // host-accessible device), owned by the caller; never cleared (a group's first reduction since
  // zero() overwrites its slice), so it may start as anything. Ignored (may be null) when
  // options.accumulator is set. `counters` (optional) receives bucket and byte counts.
  static Result<std::unique_ptr<GradReducer>> create(const Partitioner& partitioner, int rank,
                                                     Device& device, Communicator& comm,
                                                     float* accumulator,
                                                     const GradReducerOptions& options,
                                                     ZeroCounters* counters);
  ~GradReducer();

  // The accumulator's size without options.group_offsets (every group's slice, end to end), and
  // where group g's slice starts in it (options.group_offsets[g] when given).
  static std::size_t partition_element_count(const Partitioner& partitioner);
  std::size_t partition_offset(std::uint32_t group) const { return offsets_[group]; }
  std::size_t chunk_elements() const { return chunk_elements_; }
  // Stage 1's full-size gradients of the trainable groups, bytes (0 at stages 2-3).
  std::size_t full_bytes() const;

  // Reduces the gradients of the parameters of `groups` (sources indexed by ParamId; every
  // parameter of these groups must have one). Collective over `groups` at stages 2 and 3; local
  // at stage 1. Returns once the sources have been read (copied into buckets); the last buckets'
  // reduce-scatters may still run, overlapping the caller's next work, until wait().
  Status reduce(std::span<const std::uint32_t> groups, std::span<const GradSource> sources);
  // Waits for every reduce-scatter issued so far (and its accumulation), then flushes the
  // accumulator (a spilling one writes its open sub-groups); their first error.
  Status wait();
  // Stage 1: reduce-scatters the full accumulators into the partition accumulator. Collective.
  Status reduce_accumulated();

  // The micro-batches every trainable parameter was reduced in since zero(); kFailedPrecondition
  // naming a parameter when they differ or are 0, or when every parameter is frozen.
  Result<int> micro_batches() const;
  // Parameter id's micro-batches reduced since zero() (or its group's zero_group()).
  std::uint32_t reduced(ParamId id) const { return counts_[id]; }
  // Zeroes the accumulator(s) and the counts (an accumulator in memory is not written: each
  // group's next reduction overwrites its slice).
  void zero();
  // Whether zero_group() can be used: the accumulator is the caller's float array in host
  // memory (not a spilling accumulator, not device memory).
  bool zeroes_groups() const { return memory_accumulator_ != nullptr; }
  // Zeroes group g's slice of the accumulator (its next reduction overwrites it), stage 1's full
  // gradients of g and the counts of g's parameters, as zero() does for all, while other groups
  // keep theirs (the overlapped step: the backward of the next step adds into a group once the pass
  // has read its gradients). REQUIRES: zeroes_groups(); no reduce-scatter of g in flight.
  void zero_group(std::uint32_t g);
  // Only the counts of zero_group(): g's parameters count as never reduced, while its slice of
  // the accumulator (and stage 1's full gradients of g) keep the old sums until the caller's
  // zero_group(g), which must come before the next reduce() into g (the overlapped step zeroes
  // each group in the backward that first adds into it, not all at once after the pass).
  // REQUIRES: zeroes_groups().
  void forget_group(std::uint32_t g);
  // The caller's compute stream (null: none). With one, reduce() reads the gradients after the
  // caller's work queued on it so far, and on a device that is not host-accessible returns
  // without waiting for the read: the caller's stream waits for it instead, so work queued there
  // after the call may overwrite the gradients. On a host-accessible device the host waits for
  // the caller's work before reading.
  void set_caller_stream(CallerStream* caller) { caller_ = caller; }

 private:
  GradReducer(const Partitioner& partitioner, int rank, Device& device, Communicator& comm,
              float* accumulator, const GradReducerOptions& options, ZeroCounters* counters);
  // Reduce-scatters group g, bucket by bucket (the one schedule: see grad_reducer.cpp);
  // `fill(dst, group_offset, count)` writes `count` f32 gradient elements of the group starting
  // at `group_offset` into `dst` (host code on a host_accessible() device, else work enqueued on
  // fill_stream_) and returns its Status.
  template <typename Fill>
  Status reduce_group(std::uint32_t g, Fill fill);
  // Adds bucket k's reduced chunk `recv` (`count` elements at accumulator offset `first`; recv_[k],
  // or the bucket itself on one rank) into the accumulator, in stream_'s order.
  Status accumulate(std::uint32_t g, int k, const float* recv, std::size_t first,
                    std::size_t count);

  // Not host_accessible() devices: DeviceOps, the fill stream and the staging buffers.
  Status create_device_side();
  Status reduce_on_device(std::span<const std::uint32_t> groups,
                          std::span<const GradSource> sources);
  // One rank, host memory accumulator: no bucket, no collective (see grad_reducer.cpp).
  Status reduce_in_place(std::span<const std::uint32_t> groups,
                         std::span<const GradSource> sources);
  // One more micro-batch reduced for each of the group's parameters (a whole-group reduction).
  void count_group(const GroupInfo& info);
  // Zeroes the frozen groups' slices of the accumulator (in memory or on the device), once.
  Status zero_frozen_groups();
  // Stage 1's full gradients, host-accessible: zeroed (a frozen group's empty buffer skipped).
  void clear_full();
  bool overwrites_first() const {
    return options_.accumulator_on_device || memory_accumulator_ != nullptr;
  }

  const Partitioner& partitioner_;
  const int rank_;
  const int world_;
  Device& device_;
  Communicator& comm_;
  std::unique_ptr<MemoryAccumulator> memory_accumulator_;  // when options have none
  GradAccumulator* accumulator_;         // null with options.accumulator_on_device
  float* device_accumulator_ = nullptr;  // options.accumulator_on_device: the device array
  GradReducerOptions options_;
  ZeroCounters* counters_;
  std::vector<std::size_t> offsets_;
  std::size_t partition_elements_ = 0;
  std::size_t chunk_elements_ = 1;
  std::vector<std::uint32_t> counts_;     // per parameter: micro-batches reduced
  std::vector<std::string> group_names_;  // "grads group <g> (module 'm')", the collectives' names
  // A reduced chunk bound for the accumulator, added by a host function on stream_: one record
  // per bucket, reused once the bucket's previous work has run, so a chunk allocates nothing.
  struct AddChunk {
    GradAccumulator* accumulator = nullptr;
    MemoryAccumulator* assign = nullptr;  // set: the group's first chunk, stored, not added
    std::size_t first = 0;
    const float* values = nullptr;
    std::size_t count = 0;
  };
  static Status add_chunk(void* chunk, const Status& upstream);
  AddChunk add_chunks_[2];
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> done_;
  DeviceBuffer buckets_[2];
  DeviceBuffer recv_[2];  // world > 1: one rank reduce-scatters its bucket in place
  std::unique_ptr<Event> bucket_free_[2];
  int next_bucket_ = 0;
  // Stage 1: per group, padded_element_count floats; empty for a frozen group.
  std::vector<DeviceBuffer> full_;
  std::vector<bool> frozen_groups_;  // per group: every parameter frozen (options.frozen)
  // Not host_accessible() devices only (ops_ set): see reduce_group.
  std::unique_ptr<DeviceOps> ops_;
  std::unique_ptr<Stream> fill_stream_;
  std::unique_ptr<Event> filled_[2];
  RegisteredBuffer recv_host_[2];
  // Per group: reduced since zero() (or zero_group()). An accumulator in memory (device or host)
  // is not cleared: a group's first reduction overwrites its slice (overwrites_first()).
  // (Also set, and unused, with options.accumulator: that one is cleared by its own zero().)
  std::vector<bool> group_reduced_;
  bool in_place_ = false;  // reduce() takes reduce_in_place(); no buckets allocated
  CallerStream* caller_ = nullptr;
};

}  // namespace zinf
