// Publisher: new parameters into the device copies / shards, from wherever the optimizer state
// produced them. Three ways, each used by one optimizer-state home (optimizer_state.hpp):
//   - a buffer of the partition's new device-dtype values, packed group after group
//     (buffer()): f32 groups narrowed from the fp32 master, half groups written by the step in
//     the same pass, then every group's shard written (write_shards());
//   - the half-precision stream: the new half values arrive in partition order, in ranges that
//     need not match the groups (sub-groups of the optimizer pass), and each group is assembled
//     in a one-group stage and written once its last element is in (stage());
//   - device memory: the device optimizer's buffers written straight into the shards.
// After the shards are written, publish() all-gathers what stays gathered.
//
// Thread-safety: one thread (the rank's; the pipeline calls stage() on it too).
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/aligned.hpp"
#include "engine/function_ref.hpp"
#include "engine/layout.hpp"
#include "zero/param_coordinator.hpp"
#include "zinf/dtype.hpp"
#include "zinf/status.hpp"

namespace zinf {

// dst (count elements of dtype) <- src floats, rounded to nearest even.
void narrow(const float* src, std::size_t count, DType dtype, void* dst);

class Publisher {
 public:
  explicit Publisher(const ParameterLayout& layout) : layout_(layout) {}

  // The coordinator that owns the shards. REQUIRES: before any write.
  void set_coordinator(ParamCoordinator* coord) { coord_ = coord; }
  ParamCoordinator& coordinator() { return *coord_; }

  // --- The buffer of new values ------------------------------------------------------------
  void allocate_buffer();
  void free_buffer() { buffer_ = AlignedBuffer(); }
  std::uint64_t buffer_bytes() const { return buffer_.bytes(); }
  // Group g's new values in the buffer.
  std::byte* buffer(std::uint32_t g) { return buffer_.data() + layout_.byte_offset(g); }

  // For each group overlapping partition elements [first, first + count) for which
  // want(dtype) holds: src rounded to the group's dtype into values(g) (group g's start).
  void narrow_groups(std::size_t first, std::size_t count, const float* src,
                     FunctionRef<bool(DType)> want, FunctionRef<std::byte*(std::uint32_t)> values);

  // Every group's shard from values(g), then publish().
  Status write_shards(FunctionRef<const std::byte*(std::uint32_t)> values);

  // --- The half-precision stream -----------------------------------------------------------
  // A group is written only when every one of its elements was filled in this pass, so no shard
  // is ever written from a half-filled stage; a pass that fails part way leaves the groups
  // before it new and the rest old (the engine is then sticky-failed).
  void allocate_stage();
  std::uint64_t stage_bytes() const { return stage_.bytes(); }
  void restart_stream();
  // Partition elements [first, first + count) in half_dtype(): fill(lo, hi, dst) writes
  // elements [lo, hi) at dst. REQUIRES: first is where the previous range ended (0 after
  // restart_stream()).
  Status stage(std::size_t first, std::size_t count,
               FunctionRef<void(std::size_t, std::size_t, std::byte*)> fill);
  // The stream since restart_stream() wrote every group.
  bool stream_complete() const { return stream_group_ == layout_.group_count(); }

  // All-gathers the groups that stay gathered from the shards just written.
  Status publish() { return coord_->publish(); }

 private:
  const ParameterLayout& layout_;
  ParamCoordinator* coord_ = nullptr;
  AlignedBuffer buffer_;
  AlignedBuffer stage_;             // one group's new shard, the largest group's size
  std::size_t stream_next_ = 0;     // the partition element the next range starts at
  std::uint32_t stream_group_ = 0;  // the group being assembled
  std::size_t stream_filled_ = 0;   // its elements filled so far
};

}  // namespace zinf
