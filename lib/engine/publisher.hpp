// Publisher: new parameters into the device copies / shards, from wherever the optimizer state
// produced them. Three ways, each used by one optimizer-state home (optimizer_state.hpp):
//   - a buffer of the partition's new device-dtype values, packed group after group
//     (buffer()): f32 groups narrowed from the fp32 master, half groups written by the step in
//     the same pass, then every group's shard written, or after a step every trainable one's
//     (write_shards());
//   - the half-precision stream: the new half values arrive in partition order, in ranges that
//     need not match the groups (sub-groups of the optimizer pass), and each group is assembled
//     in a one-group stage and written once its last element is in (stage());
//   - device memory: the device optimizer's buffers written straight into the shards.
// After the shards are written, publish() all-gathers what stays gathered. Outside a step
// (a checkpoint load, Engine::write_parameters) the shard writes are waited for first
// (wait_writes()) and the ranks agree that each rank's succeeded before any of them publishes.
//
// Frozen groups (ParameterLayout::frozen_group()) are published only after the master was
// written (finalize, a checkpoint load, write_parameters). A step leaves their master and their
// device-dtype values as they are, bit for bit (docs/ENGINE.md "Frozen parameters"), so after a
// step (`frozen_too` false) only the groups ParameterLayout::republished() says a step rewrites
// are published (publishes()): the frozen groups' shards are not written, their persistent
// groups not all-gathered again, and the stream drops their elements (the pass hands over only
// those that share a sub-group with trainable ones); a pass counts them as written from its start.
//
// The overlapped step (zinf.overlap_step, step_runner.hpp) writes the shards on the step
// runner's thread while the rank's thread gathers modules for the next forward pass. Both go
// through the coordinator, which is single-threaded, so each holds mutex() for its coordinator
// calls; the pass records the groups it has written (in index order, which is partition order;
// or from the last to the first when the pass runs from the last sub-group down, and then, if it
// turns, from the first up to where it turned), and a gather waits on written_cv() until its
// module's groups are in. A group that straddles the turn is written in two parts (its upper
// part at the turn, its lower part last) and counts as written after the second.
//
// Thread-safety: one thread at a time (the rank's, or the step runner's during an overlapped
// pass); mutex() and the written count may be used from both.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "base/aligned.hpp"
#include "base/assert.hpp"
#include "engine/function_ref.hpp"
#include "engine/layout.hpp"
#include "engine/narrow.hpp"
#include "zero/param_coordinator.hpp"
#include "zinf/dtype.hpp"
#include "zinf/status.hpp"

namespace zinf {

// The groups whose slices hold partition elements [begin, end), [first_group, end_group), and
// their slices' span of the partition, [begin, end) widened to whole groups
// (OptimizerState::update_master_range). REQUIRES: begin < end <= layout.partition_elements().
struct GroupSpan {
  std::uint32_t first_group = 0;
  std::uint32_t end_group = 0;
  std::size_t begin = 0;
  std::size_t end = 0;
};
GroupSpan groups_spanning(const ParameterLayout& layout, std::size_t begin, std::size_t end);
// Groups [first_group, end_group) and their slices' span of the partition.
// REQUIRES: first_group < end_group <= layout.group_count().
GroupSpan group_run(const ParameterLayout& layout, std::uint32_t first_group,
                    std::uint32_t end_group);
// What update_master_range() updates: [*begin, *end) widened to whole groups, `*span` those
// groups, unless it is the whole partition (then left as it is, and `*span` every group).
// Returns whether it is a part of the partition (a ranged update).
// REQUIRES: *begin < *end <= layout.partition_elements().
bool widen_to_groups(const ParameterLayout& layout, std::size_t* begin, std::size_t* end,
                     GroupSpan* span);
// Whether group g is chosen by `chosen`: the chosen groups' indices in increasing order, each
// once (empty: every group is). A list rather than a mask over every group, so that a caller
// choosing a few groups (Engine::write_parameters) costs those groups, not the model's.
inline bool chosen_group(std::span<const std::uint32_t> chosen, std::uint32_t g) {
  return chosen.empty() || std::binary_search(chosen.begin(), chosen.end(), g);
}

class Publisher {
 public:
  explicit Publisher(const ParameterLayout& layout) : layout_(layout) {}

  // The coordinator that owns the shards. REQUIRES: before any write.
  void set_coordinator(ParamCoordinator* coord) { coord_ = coord; }
  // REQUIRES: set_coordinator() was given one.
  ParamCoordinator& coordinator() {
    ZINF_ASSERT(coord_ != nullptr);
    return *coord_;
  }

  // --- The buffer of new values ------------------------------------------------------------
  void allocate_buffer();
  void free_buffer() { buffer_ = AlignedBuffer(); }
  std::uint64_t buffer_bytes() const { return buffer_.bytes(); }
  // Group g's new values in the buffer.
  std::byte* buffer(std::uint32_t g) { return buffer_.data() + layout_.byte_offset(g); }

  // For each group g overlapping partition elements [first, first + count) for which want(g)
  // holds: src rounded to the group's dtype into values(g) (group g's start).
  void narrow_groups(std::size_t first, std::size_t count, const float* src,
                     FunctionRef<bool(std::uint32_t)> want,
                     FunctionRef<std::byte*(std::uint32_t)> values);

  // Every group's shard from values(g), then publish() when `gather_persistent` (the
  // overlapped step publishes persistent groups module by module from the rank's thread).
  // `frozen_too` false (after a step): the frozen groups are left as they are, values(g) not
  // asked for.
  Status write_shards(FunctionRef<const std::byte*(std::uint32_t)> values,
                      bool gather_persistent = true, bool frozen_too = true);
  // The shards of groups [first_group, end_group) that `chosen` chooses (chosen_group(): empty
  // chooses every group) from values(g), not all-gathered (after a write of those groups' master
  // alone: Engine::write_parameters). REQUIRES: `chosen` ascending, each group once.
  Status write_group_shards(FunctionRef<const std::byte*(std::uint32_t)> values,
                            std::uint32_t first_group, std::uint32_t end_group,
                            std::span<const std::uint32_t> chosen = {});

  // --- The half-precision stream -----------------------------------------------------------
  // A group is written only when every one of its elements was filled in this pass, so no shard
  // is ever written from a half-filled stage; the one exception is a group straddling a turn
  // (below), written in two parts. A pass that fails part way leaves the groups before it new
  // and the rest old, and a straddling group possibly half new (the engine is then
  // sticky-failed).
  void allocate_stage();
  std::uint64_t stage_bytes() const { return stage_.bytes(); }
  // `descending`: the ranges come from the end of the partition to its start (a pass from the
  // last sub-group to the first), and the groups are written from the last to the first.
  // `frozen_too` false (a step's stream): the ranges still cover the whole partition, but the
  // elements of frozen groups are neither filled nor written (fill is not called for them).
  void restart_stream(bool descending = false, bool frozen_too = true);
  // An ascending stream of groups [first_group, end_group) only: the ranges start at the first
  // one's slice and end at the last one's end (a write of those groups' master alone). Of those,
  // the groups `chosen` does not choose (chosen_group()) are counted through, never filled or
  // written, as a step's stream passes over the frozen ones.
  void restart_stream_groups(std::uint32_t first_group, std::uint32_t end_group,
                             std::span<const std::uint32_t> chosen = {});
  // Partition elements [first, first + count) in half_dtype(): fill(lo, hi, dst) writes
  // elements [lo, hi) at dst. REQUIRES: first is where the previous range ended (0 after
  // restart_stream()); descending, first + count is where the previous range began (the
  // partition's end after restart_stream(true)), or the stream turns: first is 0, and from here
  // on the ranges go up from 0 to where the descending ranges ended. REQUIRES for a turn:
  // can_turn_at(where the descending ranges ended).
  Status stage(std::size_t first, std::size_t count,
               FunctionRef<void(std::size_t, std::size_t, std::byte*)> fill);
  // Whether a descending stream may turn at partition element `element`: at a group's start, or
  // inside a group whose shard can be written in parts (ParamCoordinator::writes_shard_parts(),
  // not on NVMe): the stage holds one group, so the straddling group's upper part goes into its
  // shard at the turn; or inside a frozen group that the stream does not write.
  bool can_turn_at(std::size_t element) const;
  // The stream since restart_stream() wrote every group.
  bool stream_complete() const {
    return stream_descending_ ? stream_group_ == 0 : stream_group_ == stream_end_group_;
  }

  // All-gathers the groups that stay gathered from the shards just written; `frozen_too` false
  // (after a step), not the frozen ones. Collective.
  Status publish(bool frozen_too = true);
  // The same for the persistent groups `chosen` lists only (ParamCoordinator::publish(groups)):
  // every rank passes the same groups. Collective. Unlike write_group_shards(), an empty list
  // does not mean every group (publish() is that). REQUIRES: `chosen` not empty, ascending, each
  // group once.
  Status publish_groups(std::span<const std::uint32_t> chosen);
  // Waits until every shard write so far is done (ParamCoordinator::wait_writes()): a write that
  // failed shows here, before publish(). Local.
  Status wait_writes() {
    std::lock_guard<std::mutex> lock(mu_);
    return coord_->wait_writes();
  }
  // The wait alone (ParamCoordinator::drain_writes()): ok when no write so far can still read its
  // memory, even after an earlier failure. Local.
  Status drain_writes() {
    std::lock_guard<std::mutex> lock(mu_);
    return coord_->drain_writes();
  }

  // --- The overlapped step -------------------------------------------------------------------
  // Held around every coordinator call while a pass may be running on another thread.
  std::mutex& mutex() { return mu_; }
  std::condition_variable& written_cv() { return written_cv_; }
  // A pass starts: no group of it is written yet but the frozen ones, which no pass writes.
  // REQUIRES: mutex() not held.
  void begin_pass();
  // The pass is over, every group written when `outcome` is OK: nobody waits for it any more.
  void end_pass(Status outcome);
  // REQUIRES: mutex() held. The last pass's error (OK while one runs, or after one that ended
  // well): what a gather or a reduction that found its groups unwritten reports as the cause.
  const Status& pass_error() const { return pass_error_; }
  // REQUIRES: mutex() held. Group g of the current pass is written, or the last pass ended well.
  bool written(std::uint32_t g) const {
    return (g < written_.size() && written_[g] != 0) || (!in_pass_ && pass_ok_);
  }
  // REQUIRES: mutex() held. A pass began and has not ended.
  bool in_pass() const { return in_pass_; }

 private:
  // Whether a publish with `frozen_too` writes group g's shard (and all-gathers it when it stays
  // gathered): every group after the master was written, after a step (`frozen_too` false) only
  // those the step rewrote.
  bool publishes(std::uint32_t g, bool frozen_too) const {
    return frozen_too || layout_.republished(g);
  }
  // Group g's shard, under mutex(); g counts as written once it returns ok.
  Status write_group(std::uint32_t g, const std::byte* values, bool wait);
  // Elements [first, first + count) of group g's shard, waited for (the stage is reused); g
  // counts as written after the `last` part.
  Status write_group_part(std::uint32_t g, std::size_t first, std::size_t count,
                          const std::byte* values, bool last);

  const ParameterLayout& layout_;
  ParamCoordinator* coord_ = nullptr;
  AlignedBuffer buffer_;
  AlignedBuffer stage_;  // one group's new shard, the largest group's size
  bool stream_descending_ = false;
  bool stream_frozen_too_ = true;  // restart_stream()'s `frozen_too`
  // restart_stream_groups()'s `chosen` (empty: every group), copied for the stream's length.
  std::vector<std::uint32_t> stream_chosen_;
  // Ascending: the partition element the next range starts at, and the group being assembled.
  // Descending: the element the next range ends at, and one past the group being assembled.
  std::size_t stream_next_ = 0;
  std::uint32_t stream_group_ = 0;
  std::uint32_t stream_end_group_ = 0;  // ascending: where the stream ends (after a turn, one
                                        // past the group where the descending ranges ended)
  std::size_t stream_stop_ = 0;         // ascending: the element the stream ends at (after a
                                        // turn, where the descending ranges ended)
  std::size_t stream_filled_ = 0;       // the assembled group's elements filled so far
  std::mutex mu_;
  std::condition_variable written_cv_;
  bool in_pass_ = false;  // guarded by mu_
  bool pass_ok_ = true;   // the last pass wrote every group, guarded by mu_
  Status pass_error_;     // its error, guarded by mu_
  // Per group, 1 once the pass wrote it, guarded by mu_.
  std::vector<std::uint8_t> written_;
};

}  // namespace zinf
