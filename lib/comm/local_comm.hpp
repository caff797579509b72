// LocalComm: N ranks as N threads of one process, collectives through shared memory.
//
// Each collective is enqueued as a host function on the rank's stream. When the stream reaches
// it, the rank publishes its buffers in a slot shared by the group (keyed by the collective's
// sequence number, which issue order defines), waits for the other ranks, computes its own output
// by reading the other ranks' buffers directly, and leaves only once every rank has finished
// reading, so no rank reuses a buffer that another still reads. Reductions are computed in tiles
// of f32 accumulators in rank order (((x0 + x1) + x2) ...), so every rank gets the same bits as
// a serial loop over ranks, whatever the timing. all_reduce first reduces a 1/world share per
// rank into the slot, then every rank copies the whole result, which keeps in-place calls safe.
//
// Any failure (a rank's bad arguments, ranks that disagree on a collective, a wait past the
// timeout, abort()) sets the group's sticky error and wakes every waiting rank, so every rank's
// collective fails and no rank hangs.
//
// Allocation and bounds: every rank has kTasksPerRank records for its collectives in flight
// (issued, host function not yet finished), made with the group; issue() waits, up to the
// timeout, for one to come back when all are in flight, as a full stream queue makes its issuer
// wait. A slot exists for a collective while some rank is in it, so world * kTasksPerRank slots,
// also made with the group, are always enough. Issuing and running a collective therefore
// allocates nothing, except an all_reduce larger than kResultBytes, which grows its slot's result
// buffer the first time that slot carries one so large. Labels for messages are built only for
// errors; a collective's name is kept in its record, cut at kNameBytes - 1 bytes.
//
// Thread-safety: as Communicator.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "comm/collective_util.hpp"
#include "device/host_device.hpp"
#include "zinf/comm.hpp"

namespace zinf {

// One issued collective, from LocalComm::issue() to the end of its host function on the stream.
struct LocalCollectiveTask {
  static constexpr std::size_t kNameBytes = 96;
  std::shared_ptr<class LocalGroup> group;  // set while in flight; keeps the group alive
  int rank = 0;
  std::uint64_t sequence = 0;
  Collective op;               // host addresses; op.name points into name
  char name[kNameBytes] = {};  // the caller's name, cut to fit
};

// State shared by the ranks of one LocalComm group.
class LocalGroup {
 public:
  LocalGroup(int world_size, std::chrono::milliseconds timeout);
  ~LocalGroup();

  static constexpr std::size_t kTasksPerRank = 64;
  static constexpr std::size_t kResultBytes = 4096;

  // One of `rank`'s records, waiting up to the timeout for one when all are in flight (null
  // then); and its return.
  LocalCollectiveTask* take_task(int rank);
  void return_task(LocalCollectiveTask* task);

  int world_size() const { return world_size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Sets the group's sticky error (the first one wins) and wakes every waiting rank.
  void fail(Status reason);
  Status error() const;

  // Runs rank `rank`'s part of collective number `sequence` (called on the rank's stream).
  Status run(int rank, std::uint64_t sequence, const Collective& op);
  Status barrier(int rank, std::chrono::milliseconds timeout);

 private:
  struct Slot {
    std::uint64_t sequence = 0;
    std::vector<Collective> ops;          // per rank; names point into the ranks' tasks
    std::vector<const std::byte*> sends;  // per rank: ops[r].send
    std::vector<char> arrived;            // per rank
    int arrived_count = 0;
    int reduced_count = 0;  // all_reduce: ranks that wrote their share of `result`
    int done_count = 0;     // ranks that finished reading other ranks' buffers
    int readers = 0;        // ranks reading shared buffers right now
    int departed_count = 0;
    std::vector<std::byte> result;  // all_reduce
  };

  void fail_locked(Status reason);
  // The slot of collective `sequence`: the one in use for it, else a free one (lock held).
  Slot& slot_for(std::uint64_t sequence);
  // Frees a slot every rank has left (lock held).
  void free_slot(Slot& slot);
  // Checks that every rank issued the same collective; called by the last rank to arrive.
  Status check_agreement(const Slot& slot, std::uint64_t sequence) const;
  // Waits (lock held) until `pred` or the sticky error; a timeout fails the group with a message
  // built by `describe_missing`.
  template <typename Pred, typename Describe>
  bool wait_or_fail(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout,
                    Pred pred, Describe describe_missing);
  void compute(int rank, const Slot& slot, const Collective& op, int phase);
  // The group's error, as the failed collective `label` on `rank` reports it.
  Status error_for(std::string_view label, int rank) const;
  Status error_for(const Collective& op, std::uint64_t sequence, int rank) const;

  const int world_size_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Status error_;
  // world * kTasksPerRank slots, made with the group; used_slots_ and free_slots_ hold each one
  // once (their capacity is the count, so moving between them never allocates).
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<Slot*> used_slots_;
  std::vector<Slot*> free_slots_;
  std::mutex task_mu_;
  std::condition_variable task_cv_;
  std::vector<std::unique_ptr<LocalCollectiveTask>> tasks_;    // kTasksPerRank per rank
  std::vector<std::vector<LocalCollectiveTask*>> free_tasks_;  // per rank, capacity kTasksPerRank
  std::uint64_t barrier_generation_ = 0;
  int barrier_arrived_ = 0;
};

class LocalComm final : public Communicator {
 public:
  LocalComm(std::shared_ptr<LocalGroup> group, int rank, Device* device);

  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }
  Device& device() const override { return *device_; }
  std::string_view name() const override { return name_; }

  Status issue(const Collective& op, Stream& stream) override;
  Status group_start() override;
  Status group_end() override;
  Status barrier(std::chrono::milliseconds timeout) override;
  Status wait(Event& event, std::chrono::milliseconds timeout) override;
  void abort(Status reason) override;
  Status status() const override { return group_->error(); }
  std::chrono::milliseconds collective_timeout() const override { return group_->timeout(); }

 private:
  std::shared_ptr<LocalGroup> group_;
  const int rank_;
  Device* device_;
  HostDevice* host_device_;  // device_, whose host addresses the collectives use
  std::string name_;
  std::mutex issue_mu_;
  std::uint64_t next_sequence_ = 0;  // guarded by issue_mu_
  GroupDepth group_depth_;           // guarded by issue_mu_
};

}  // namespace zinf
