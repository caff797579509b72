#include "comm/local_comm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "base/assert.hpp"
#include "base/wait.hpp"
#include "comm/collective_util.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

Status run_collective(void* user, const Status& upstream) {
  auto* task = static_cast<LocalCollectiveTask*>(user);
  // The task goes back to the pool before this returns; the group lives on in `group` until then.
  std::shared_ptr<LocalGroup> group = std::move(task->group);
  Status st;
  if (!upstream.is_ok()) {
    // This rank will not take part: tell the others now rather than let them time out.
    group->fail(upstream.with_context(
        fmt::format("{} on local rank {}: earlier work on the stream failed",
                    describe_collective(task->op, task->sequence), task->rank)));
  } else {
    st = group->run(task->rank, task->sequence, task->op);
  }
  group->return_task(task);
  return st;
}

}  // namespace

// --- LocalGroup ----------------------------------------------------------------------------------

LocalGroup::LocalGroup(int world_size, std::chrono::milliseconds timeout)
    : world_size_(world_size), timeout_(timeout) {
  const auto world = static_cast<std::size_t>(world_size);
  free_tasks_.resize(world);
  for (std::size_t r = 0; r < world; ++r) {
    free_tasks_[r].reserve(kTasksPerRank);
    for (std::size_t i = 0; i < kTasksPerRank; ++i) {
      tasks_.push_back(std::make_unique<LocalCollectiveTask>());
      tasks_.back()->rank = static_cast<int>(r);
      free_tasks_[r].push_back(tasks_.back().get());
    }
  }
  const std::size_t slot_count = world * kTasksPerRank;
  used_slots_.reserve(slot_count);
  free_slots_.reserve(slot_count);
  for (std::size_t i = 0; i < slot_count; ++i) {
    slots_.push_back(std::make_unique<Slot>());
    Slot& slot = *slots_.back();
    slot.ops.resize(world);
    slot.sends.resize(world);
    slot.arrived.resize(world);
    slot.result.reserve(kResultBytes);
    free_slots_.push_back(&slot);
  }
}

LocalGroup::~LocalGroup() = default;

LocalCollectiveTask* LocalGroup::take_task(int rank) {
  std::vector<LocalCollectiveTask*>& free = free_tasks_[static_cast<std::size_t>(rank)];
  std::unique_lock<std::mutex> lock(task_mu_);
  if (!wait_for_or_forever(task_cv_, lock, timeout_, [&] { return !free.empty(); })) {
    return nullptr;
  }
  LocalCollectiveTask* task = free.back();
  free.pop_back();
  return task;
}

void LocalGroup::return_task(LocalCollectiveTask* task) {
  {
    std::lock_guard<std::mutex> lock(task_mu_);
    std::vector<LocalCollectiveTask*>& free = free_tasks_[static_cast<std::size_t>(task->rank)];
    ZINF_ASSERT(free.size() < free.capacity());
    free.push_back(task);
  }
  task_cv_.notify_all();
}

LocalGroup::Slot& LocalGroup::slot_for(std::uint64_t sequence) {
  for (Slot* slot : used_slots_) {
    if (slot->sequence == sequence) return *slot;
  }
  // A slot is used while a rank holds a task for its collective: see the file comment.
  ZINF_ASSERT(!free_slots_.empty());
  Slot& slot = *free_slots_.back();
  free_slots_.pop_back();
  used_slots_.push_back(&slot);
  slot.sequence = sequence;
  std::fill(slot.arrived.begin(), slot.arrived.end(), 0);
  slot.arrived_count = 0;
  slot.reduced_count = 0;
  slot.done_count = 0;
  slot.readers = 0;
  slot.departed_count = 0;
  return slot;
}

void LocalGroup::free_slot(Slot& slot) {
  auto it = std::find(used_slots_.begin(), used_slots_.end(), &slot);
  ZINF_ASSERT(it != used_slots_.end());
  *it = used_slots_.back();
  used_slots_.pop_back();
  free_slots_.push_back(&slot);
}

void LocalGroup::fail(Status reason) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_locked(std::move(reason));
}

void LocalGroup::fail_locked(Status reason) {
  ZINF_ASSERT(!reason.is_ok());
  if (error_.is_ok()) error_ = std::move(reason);
  cv_.notify_all();
}

Status LocalGroup::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

Status LocalGroup::error_for(const Collective& op, std::uint64_t sequence, int rank) const {
  return error_for(describe_collective(op, sequence), rank);
}

Status LocalGroup::error_for(std::string_view label, int rank) const {
  // The first error usually names this collective already; only add it when it does not.
  if (error_.message().find(label) != std::string_view::npos) return error_;
  return error_.with_context(fmt::format("{} on local rank {} of {}", label, rank, world_size_));
}

Status LocalGroup::check_agreement(const Slot& slot, std::uint64_t sequence) const {
  const Collective& first = slot.ops[0];
  for (int r = 1; r < world_size_; ++r) {
    const Collective& other = slot.ops[static_cast<std::size_t>(r)];
    if (!collectives_agree(first, other)) {
      return Status::comm_error(
          fmt::format("collective #{}: ranks disagree: rank 0 issued {}, rank {} issued {}",
                      sequence, describe_call(first), r, describe_call(other)));
    }
  }
  return Status::ok();
}

template <typename Pred, typename Describe>
bool LocalGroup::wait_or_fail(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout,
                              Pred pred, Describe describe_missing) {
  const bool ready =
      wait_for_or_forever(cv_, lock, timeout, [&] { return pred() || !error_.is_ok(); });
  if (!ready) fail_locked(Status::timeout(describe_missing()));
  return error_.is_ok();
}

void LocalGroup::compute(int rank, const Slot& slot, const Collective& op, int phase) {
  const std::size_t element_bytes = dtype_bytes(op.dtype);
  const std::size_t chunk_bytes = op.element_count * element_bytes;
  auto* recv = static_cast<std::byte*>(op.recv);
  const std::vector<const std::byte*>& sends = slot.sends;
  switch (op.kind) {
    case CollectiveKind::kAllGather:
      for (int r = 0; r < world_size_; ++r) {
        std::byte* dst = recv + static_cast<std::size_t>(r) * chunk_bytes;
        const std::byte* src = sends[static_cast<std::size_t>(r)];
        if (dst != src && chunk_bytes != 0) std::memcpy(dst, src, chunk_bytes);
      }
      return;
    case CollectiveKind::kReduceScatter:
      reduce_range(sends, static_cast<std::size_t>(rank) * op.element_count, recv, 0,
                   op.element_count, op.dtype, op.op);
      return;
    case CollectiveKind::kBroadcast: {
      const std::byte* src = sends[static_cast<std::size_t>(op.root)];
      if (src != recv && chunk_bytes != 0) std::memcpy(recv, src, chunk_bytes);
      return;
    }
    case CollectiveKind::kAllReduce: {
      auto* result = const_cast<std::byte*>(slot.result.data());
      if (phase == 0) {
        // This rank's share of the result: elements [first, first + count).
        const std::size_t share = (op.element_count + static_cast<std::size_t>(world_size_) - 1) /
                                  static_cast<std::size_t>(world_size_);
        const std::size_t first =
            std::min(op.element_count, static_cast<std::size_t>(rank) * share);
        const std::size_t count = std::min(share, op.element_count - first);
        reduce_range(sends, first, result, first, count, op.dtype, op.op);
      } else if (chunk_bytes != 0) {
        std::memcpy(recv, result, chunk_bytes);
      }
      return;
    }
  }
}

Status LocalGroup::run(int rank, std::uint64_t sequence, const Collective& op) {
  // The collective's label is built only for an error: a collective allocates nothing.
  const auto label = [&] { return describe_collective(op, sequence); };
  const auto urank = static_cast<std::size_t>(rank);
  std::unique_lock<std::mutex> lock(mu_);
  if (!error_.is_ok()) return error_for(op, sequence, rank);
  Slot& slot = slot_for(sequence);
  slot.ops[urank] = op;  // op.name lives in the rank's task until this returns
  slot.sends[urank] = static_cast<const std::byte*>(op.send);
  slot.arrived[urank] = 1;
  if (++slot.arrived_count == world_size_) {
    Status agreement = check_agreement(slot, sequence);
    if (!agreement.is_ok()) {
      fail_locked(std::move(agreement));
    } else if (op.kind == CollectiveKind::kAllReduce) {
      // Within kResultBytes this stays in the capacity reserved with the slot.
      slot.result.resize(op.element_count * dtype_bytes(op.dtype));
    }
    cv_.notify_all();
  }

  // Leaves the slot once nobody reads shared buffers any more (reading is plain computation,
  // so this wait is short and bounded), and frees it for reuse when the last rank leaves.
  auto leave = [&]() {
    cv_.wait(lock, [&] { return slot.readers == 0; });
    if (++slot.departed_count == world_size_) free_slot(slot);
  };
  auto missing = [&](auto&& counted, std::string_view what) {
    return [&, counted, what]() {
      std::vector<int> ranks;
      for (int r = 0; r < world_size_; ++r) {
        if (!counted(r)) ranks.push_back(r);
      }
      return fmt::format("{}: local rank {} of {} waited {} ms for rank(s) {} to {}", label(), rank,
                         world_size_, timeout_.count(), rank_list(ranks), what);
    };
  };

  if (!wait_or_fail(
          lock, timeout_, [&] { return slot.arrived_count == world_size_; },
          missing([&](int r) { return slot.arrived[static_cast<std::size_t>(r)] != 0; },
                  "arrive"))) {
    leave();
    return error_for(op, sequence, rank);
  }

  ++slot.readers;
  lock.unlock();
  compute(rank, slot, op, 0);
  lock.lock();
  --slot.readers;
  cv_.notify_all();

  if (op.kind == CollectiveKind::kAllReduce) {
    ++slot.reduced_count;
    cv_.notify_all();
    if (!wait_or_fail(
            lock, timeout_, [&] { return slot.reduced_count == world_size_; },
            [&] {
              return fmt::format("{}: local rank {} of {} waited {} ms for the others' reductions",
                                 label(), rank, world_size_, timeout_.count());
            })) {
      leave();
      return error_for(op, sequence, rank);
    }
    ++slot.readers;
    lock.unlock();
    compute(rank, slot, op, 1);
    lock.lock();
    --slot.readers;
    cv_.notify_all();
  }

  ++slot.done_count;
  cv_.notify_all();
  const bool ok = wait_or_fail(
      lock, timeout_, [&] { return slot.done_count == world_size_; },
      [&] {
        return fmt::format("{}: local rank {} of {} waited {} ms for the others to finish", label(),
                           rank, world_size_, timeout_.count());
      });
  // Once every rank finished, this collective succeeded everywhere: an error raised since then
  // (a rank that went on and aborted before this one woke) belongs to a later call.
  const bool finished = slot.done_count == world_size_;
  leave();
  return ok || finished ? Status::ok() : error_for(op, sequence, rank);
}

Status LocalGroup::barrier(int rank, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!error_.is_ok()) return error_for("barrier", rank);
  const std::uint64_t generation = barrier_generation_;
  if (++barrier_arrived_ == world_size_) {
    barrier_arrived_ = 0;
    ++barrier_generation_;
    cv_.notify_all();
    return Status::ok();
  }
  const int arrived = barrier_arrived_;
  if (!wait_or_fail(
          lock, timeout, [&] { return barrier_generation_ != generation; },
          [&] {
            return fmt::format("barrier: local rank {} of {} waited {} ms; {} of {} ranks arrived",
                               rank, world_size_, timeout.count(), arrived, world_size_);
          })) {
    return error_for("barrier", rank);
  }
  return Status::ok();
}

// --- LocalComm -----------------------------------------------------------------------------------

LocalComm::LocalComm(std::shared_ptr<LocalGroup> group, int rank, Device* device)
    : group_(std::move(group)),
      rank_(rank),
      device_(device),
      host_device_(dynamic_cast<HostDevice*>(device)),
      name_(fmt::format("local rank {} of {}", rank, group_->world_size())) {}

Status LocalComm::issue(const Collective& op, Stream& stream) {
  // Held across numbering and enqueueing, so that calls from several threads cannot corrupt the
  // numbering. Their order is still the callers' race, which the other ranks do not share: the
  // contract asks for one issuing thread, and a breach shows up as "ranks disagree".
  std::lock_guard<std::mutex> lock(issue_mu_);
  const std::uint64_t sequence = next_sequence_;
  Status error = group_->error();
  if (!error.is_ok()) {
    return Status::aborted(fmt::format("{} on {}: the communicator was aborted: {}",
                                       describe_collective(op, sequence), name_,
                                       error.to_string()));
  }
  Status valid = validate_collective(op, sequence, rank_, group_->world_size(), name_);
  if (!valid.is_ok()) {
    group_->fail(valid);
    return valid;
  }
  LocalCollectiveTask* task = group_->take_task(rank_);
  if (task == nullptr) {
    Status failure = Status::timeout(fmt::format(
        "{} on {}: all {} of this rank's collectives still in flight after {} ms (the other ranks "
        "did not reach them)",
        describe_collective(op, sequence), name_, LocalGroup::kTasksPerRank,
        group_->timeout().count()));
    group_->fail(failure);
    return failure;
  }
  ++next_sequence_;
  task->group = group_;
  task->sequence = sequence;
  task->op = op;
  // The collective runs as host code: it reads and writes the buffers at their host addresses
  // (an opaque HostDevice's pointers are not dereferenceable as given).
  task->op.send = host_device_->host_address(op.send);
  task->op.recv = host_device_->host_address(op.recv);
  const std::size_t name_bytes = std::min(op.name.size(), LocalCollectiveTask::kNameBytes - 1);
  // An unnamed collective's name has no data pointer (memcpy may not be given null).
  if (name_bytes != 0) std::memcpy(task->name, op.name.data(), name_bytes);
  task->op.name = std::string_view(task->name, name_bytes);
  Status launched = device_->launch_host_func(stream, &run_collective, task);
  if (!launched.is_ok()) {
    Status failure =
        launched.with_context(fmt::format("{} on {}", describe_collective(op, sequence), name_));
    task->group.reset();
    group_->return_task(task);
    group_->fail(failure);
    return failure;
  }
  return Status::ok();  // run_collective returns the task
}

Status LocalComm::group_start() {
  std::lock_guard<std::mutex> lock(issue_mu_);
  return group_depth_.start();
}

Status LocalComm::group_end() {
  std::lock_guard<std::mutex> lock(issue_mu_);
  return group_depth_.end(name_);
}

Status LocalComm::barrier(std::chrono::milliseconds timeout) {
  return group_->barrier(rank_, timeout);
}

Status LocalComm::wait(Event& event, std::chrono::milliseconds timeout) {
  Status status = device_->synchronize(event, timeout);
  // A kTimeout may also be the error of a collective before the event (a rank that never
  // arrived); only an event still not reached means that this wait ran out.
  Result<bool> reached = device_->query(event);
  if (status.code() == Code::kTimeout && reached.is_ok() && !*reached) {
    Status failure = Status::timeout(
        fmt::format("{}: wait for collectives: not done after {} ms", name_, timeout.count()));
    group_->fail(failure);
    return failure;
  }
  return status;
}

void LocalComm::abort(Status reason) {
  ZINF_ASSERT(!reason.is_ok());
  group_->fail(std::move(reason));
}

Result<std::vector<std::unique_ptr<Communicator>>> make_local_comm_group(
    const std::vector<Device*>& devices, const LocalCommOptions& options) {
  if (devices.empty()) {
    return Status::invalid_argument("make_local_comm_group: no devices (world size 0)");
  }
  if (options.timeout <= std::chrono::milliseconds(0)) {
    return Status::invalid_argument("LocalCommOptions.timeout must be positive");
  }
  for (std::size_t r = 0; r < devices.size(); ++r) {
    if (devices[r] == nullptr || dynamic_cast<HostDevice*>(devices[r]) == nullptr) {
      return Status::invalid_argument(fmt::format(
          "make_local_comm_group: device of rank {} is {}; LocalComm needs device memory that is "
          "host memory (HostDevice, opaque or not)",
          r, devices[r] == nullptr ? "null" : std::string(devices[r]->name())));
    }
    // A rank's collectives queue on its device's streams, which another rank on the same device
    // would share.
    for (std::size_t q = 0; q < r; ++q) {
      if (devices[q] == devices[r]) {
        return Status::invalid_argument(fmt::format(
            "make_local_comm_group: ranks {} and {} were given the same device; each rank needs "
            "a HostDevice of its own",
            q, r));
      }
    }
  }
  auto group = std::make_shared<LocalGroup>(static_cast<int>(devices.size()), options.timeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(devices.size());
  for (std::size_t r = 0; r < devices.size(); ++r) {
    comms.push_back(std::make_unique<LocalComm>(group, static_cast<int>(r), devices[r]));
  }
  return comms;
}

}  // namespace zinf
