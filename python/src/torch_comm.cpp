// TorchComm (see torch_comm.hpp).
#include "torch_comm.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "zinf/dtype.hpp"

namespace nb = nanobind;

namespace zinf_python {
namespace {

using Clock = std::chrono::steady_clock;
using zinf::Code;
using zinf::Collective;
using zinf::CollectiveKind;
using zinf::DType;
using zinf::ReduceOp;
using zinf::Status;

// How long one wait on a gloo operation lasts before the worker looks at the abort flags, the
// peers' notices and the deadline again.
constexpr double kWaitSliceSeconds = 0.05;
// How long wait() past its timeout waits for a collective's own, more telling, failure.
constexpr auto kWaitGrace = std::chrono::milliseconds(2000);
// Sleep between looks at a barrier's count.
constexpr auto kBarrierPoll = std::chrono::milliseconds(2);
// The transport's operations (torch_comm.hpp).
enum class Transfer : int { kAllGather = 0, kAllToAll = 1, kBroadcast = 2 };

std::string describe(const Collective& op, std::uint64_t sequence) {
  std::string text =
      std::string(zinf::collective_kind_name(op.kind)) + " #" + std::to_string(sequence);
  if (!op.name.empty()) text += " '" + std::string(op.name) + "'";
  return text;
}

// The Python exception as text: "<type>: <message>".
std::string python_error_text(const nb::python_error& e) {
  return std::string(nb::type_name(e.type()).c_str()) + ": " + nb::str(e.value()).c_str();
}

// One collective, from issue() to its completion.
struct Task {
  Collective op;
  std::string name;   // owns op.name
  std::string label;  // "all_gather #12 'layers.3'"
  std::uint64_t sequence = 0;

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status result;

  // The first call wins: the worker's result, or the communicator's failure.
  void finish(Status status) {
    std::lock_guard<std::mutex> lock(mu);
    if (done) return;
    result = std::move(status);
    done = true;
    cv.notify_all();
  }
  bool finished() {
    std::lock_guard<std::mutex> lock(mu);
    return done;
  }
  // Runs `write` (the result into the engine's memory) and finishes the task with OK, unless it
  // is finished already (the communicator failed: its caller may have freed op.recv since).
  // Under the task's lock, so a failure's finish() waits for a write under way and none starts
  // after it. Returns false when the task was finished already.
  template <typename Write>
  bool deliver(Write write) {
    std::lock_guard<std::mutex> lock(mu);
    if (done) return false;
    write();
    result = Status::ok();
    done = true;
    cv.notify_all();
    return true;
  }
  Status wait_done() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return result;
  }
};

class TorchComm final : public zinf::Communicator {
 public:
  TorchComm(zinf::Device& device, nb::object transport, std::chrono::milliseconds timeout)
      : device_(device), transport_(std::move(transport)), timeout_(timeout) {}
  ~TorchComm() override { close(); }

  // REQUIRES: the GIL is held.
  Status open() {
    try {
      rank_ = nb::cast<int>(transport_.attr("rank"));
      world_size_ = nb::cast<int>(transport_.attr("world_size"));
    } catch (const nb::python_error& e) {
      return Status::comm_error("make_torch_comm: the transport: " + python_error_text(e));
    }
    if (world_size_ < 1 || rank_ < 0 || rank_ >= world_size_) {
      return Status::comm_error("make_torch_comm: the transport says rank " +
                                std::to_string(rank_) + " of " + std::to_string(world_size_));
    }
    name_ = "torch rank " + std::to_string(rank_) + " of " + std::to_string(world_size_);
    worker_ = std::thread([this] { work_loop(); });
    return Status::ok();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  zinf::Device& device() const override { return device_; }
  std::string_view name() const override { return name_; }
  std::chrono::milliseconds collective_timeout() const override { return timeout_; }

  Status issue(const Collective& op, zinf::Stream& stream) override;
  Status group_start() override {
    std::lock_guard<std::mutex> lock(issue_mu_);
    ++group_depth_;
    return Status::ok();
  }
  Status group_end() override {
    std::lock_guard<std::mutex> lock(issue_mu_);
    if (group_depth_ == 0) {
      return Status::failed_precondition(name_ + ": group_end() without a matching group_start()");
    }
    --group_depth_;
    return Status::ok();
  }
  Status barrier(std::chrono::milliseconds timeout) override;
  Status wait(zinf::Event& event, std::chrono::milliseconds timeout) override;
  void abort(Status reason) override {
    if (reason.is_ok()) reason = Status::aborted("abort() with an OK status");
    fail(std::move(reason), /*tell_peers=*/true);
  }
  Status status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  // On the stream: hands the collective to the worker and waits for it.
  Status run(const std::shared_ptr<Task>& task, const Status& upstream);

 private:
  // Sets the sticky error (the first wins), fails the collectives waiting and in flight, and
  // (when `tell_peers`) has the worker post the abort notice.
  void fail(Status reason, bool tell_peers);
  void work_loop();
  // Runs one collective on the worker; writes op.recv on success. *from_peer: the failure is a
  // peer's notice (not to be told again).
  Status execute(Task& task, bool* from_peer);
  // A notice a peer posted, as the Status this rank fails with; OK when there is none.
  // REQUIRES: the GIL is held.
  Status peer_notice(const Task* task);
  void close();

  zinf::Device& device_;
  nb::object transport_;  // touched with the GIL held only
  const std::chrono::milliseconds timeout_;
  int rank_ = 0;
  int world_size_ = 1;
  std::string name_;

  std::mutex issue_mu_;
  std::uint64_t next_sequence_ = 0;  // guarded by issue_mu_
  int group_depth_ = 0;              // guarded by issue_mu_
  std::uint64_t barrier_generation_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  Status error_;  // sticky
  bool notify_peers_ = false;
  bool stop_ = false;
  std::map<std::uint64_t, std::shared_ptr<Task>> ready_;  // reached by their streams
  std::uint64_t next_run_ = 0;                            // the worker's next sequence
  std::shared_ptr<Task> running_;
  std::thread worker_;

  // Owned by the worker: the last operation's Python objects, released at its next GIL hold
  // (its output is read after the GIL is given back).
  std::vector<nb::object> retired_;
};

void TorchComm::fail(Status reason, bool tell_peers) {
  std::vector<std::shared_ptr<Task>> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.is_ok()) return;
    error_ = std::move(reason);
    notify_peers_ = tell_peers;
    for (auto& [sequence, task] : ready_) failed.push_back(task);
    ready_.clear();
    if (running_ != nullptr) failed.push_back(running_);
    cv_.notify_all();
  }
  const Status error = status();
  for (const std::shared_ptr<Task>& task : failed) {
    task->finish(error.message().find(task->label) == std::string_view::npos
                     ? error.with_context(task->label + " on " + name_)
                     : error);
  }
}

Status TorchComm::peer_notice(const Task* task) {
  nb::object notice = transport_.attr("notice")();
  if (notice.is_none()) return Status::ok();
  // "<rank>\n<code>\n<message>"
  const std::string text = nb::cast<std::string>(notice);
  const std::size_t first = text.find('\n');
  const std::size_t second = first == std::string::npos ? first : text.find('\n', first + 1);
  std::string from = "?";
  Code code = Code::kAborted;
  std::string message = text;
  if (second != std::string::npos) {
    from = text.substr(0, first);
    const int value = std::atoi(text.substr(first + 1, second - first - 1).c_str());
    if (value > 0 && value <= static_cast<int>(Code::kInternal)) code = static_cast<Code>(value);
    message = text.substr(second + 1);
  }
  std::string where = name_;
  if (task != nullptr) where = task->label + " on " + name_;
  return Status(code, 0, where + ": rank " + from + " failed: " + message);
}

void TorchComm::work_loop() {
  for (;;) {
    std::shared_ptr<Task> task;
    bool notify = false;
    Status error;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || notify_peers_ || ready_.count(next_run_) != 0; });
      notify = std::exchange(notify_peers_, false);
      error = error_;
      if (!notify) {
        auto it = ready_.find(next_run_);
        if (it == ready_.end()) break;  // stop_
        task = it->second;
        ready_.erase(it);
        ++next_run_;
        running_ = task;
      }
    }
    if (notify) {
      // The peers learn of this rank's failure through the group's store.
      nb::gil_scoped_acquire gil;
      retired_.clear();
      try {
        transport_.attr("post_notice")(std::to_string(rank_) + "\n" +
                                       std::to_string(static_cast<int>(error.code())) + "\n" +
                                       std::string(error.message()).substr(0, 2000));
      } catch (const std::exception&) {
        // Best effort (nb::python_error is one): the peers then fail at their collective's
        // timeout.
      }
      continue;
    }
    bool from_peer = false;
    Status result = execute(*task, &from_peer);
    if (!result.is_ok()) fail(result, /*tell_peers=*/!from_peer);
    task->finish(std::move(result));
    std::lock_guard<std::mutex> lock(mu_);
    running_.reset();
  }
  nb::gil_scoped_acquire gil;
  retired_.clear();
}

Status TorchComm::execute(Task& task, bool* from_peer) {
  const Collective& op = task.op;
  if (op.element_count == 0) return Status::ok();
  const std::size_t world = static_cast<std::size_t>(world_size_);
  const std::size_t chunk_bytes = op.element_count * zinf::dtype_bytes(op.dtype);
  const std::string where = task.label + " on " + name_;
  Transfer transfer = Transfer::kAllGather;
  std::size_t send_bytes = chunk_bytes;
  std::size_t out_bytes = chunk_bytes * world;
  switch (op.kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kAllReduce:
      break;
    case CollectiveKind::kReduceScatter:
      transfer = Transfer::kAllToAll;
      send_bytes = chunk_bytes * world;
      break;
    case CollectiveKind::kBroadcast:
      transfer = Transfer::kBroadcast;
      send_bytes = rank_ == op.root ? chunk_bytes : 0;
      out_bytes = chunk_bytes;
      break;
  }
  const std::byte* out = nullptr;
  {
    nb::gil_scoped_acquire gil;
    retired_.clear();
    nb::object work, result;
    try {
      nb::object send = nb::none();
      if (send_bytes != 0) {
        const std::size_t shape[1] = {send_bytes};
        // A view of the engine's memory, read (copied) during launch() only.
        send = nb::cast(nb::ndarray<nb::numpy, std::uint8_t, nb::c_contig>(
                            const_cast<void*>(op.send), 1, shape, nb::handle()),
                        nb::rv_policy::reference);
      }
      nb::tuple launched = nb::cast<nb::tuple>(
          transport_.attr("launch")(static_cast<int>(transfer), send, out_bytes,
                                    op.kind == CollectiveKind::kBroadcast ? op.root : 0));
      work = launched[0];
      result = launched[1];
      out = reinterpret_cast<const std::byte*>(
          static_cast<std::uintptr_t>(nb::cast<std::uint64_t>(result.attr("data_ptr")())));
    } catch (const nb::python_error& e) {
      return Status::comm_error(where + ": starting it: " + python_error_text(e));
    } catch (const std::exception& e) {
      // A transport's answer of the wrong type (nb::cast_error), memory.
      return Status::comm_error(where + ": starting it: " + e.what());
    }
    // gloo holds what it uses: these references only keep the output readable below.
    retired_.push_back(work);
    retired_.push_back(result);
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      try {
        if (nb::cast<bool>(transport_.attr("wait")(work, kWaitSliceSeconds))) break;
      } catch (const nb::python_error& e) {
        const std::string text = python_error_text(e);
        if (text.find("Timed out") != std::string::npos ||
            text.find("timed out") != std::string::npos) {
          return Status::timeout(where + ": " + text +
                                 " (a rank that died, stalled, or issued a different collective)");
        }
        // A peer that failed first says why; else gloo's error (a peer's process died).
        Status notice;
        try {
          notice = peer_notice(&task);
        } catch (const std::exception&) {
        }
        *from_peer = !notice.is_ok();
        if (!notice.is_ok()) return notice;
        return Status::comm_error(where + ": " + text);
      } catch (const std::exception& e) {
        return Status::comm_error(where + ": waiting for it: " + e.what());
      }
      // This rank failed meanwhile (abort()): the operation is left to gloo.
      if (task.finished()) {
        *from_peer = true;
        return status();
      }
      try {
        Status notice = peer_notice(&task);
        *from_peer = !notice.is_ok();
        if (!notice.is_ok()) return notice;
      } catch (const nb::python_error& e) {
        return Status::comm_error(where +
                                  ": reading the peers' abort notices: " + python_error_text(e));
      } catch (const std::exception& e) {
        return Status::comm_error(where + ": reading the peers' abort notices: " + e.what());
      }
      if (Clock::now() >= deadline) {
        return Status::timeout(where + ": not done within " + std::to_string(timeout_.count()) +
                               " ms (a rank that died, stalled, or issued a different collective)");
      }
    }
  }
  // The output is complete and torch holds it (retired_): now into the engine's memory, unless
  // the communicator failed meanwhile (the caller may have freed op.recv by then).
  auto* recv = static_cast<std::byte*>(op.recv);
  const bool delivered = task.deliver([&] {
    switch (op.kind) {
      case CollectiveKind::kAllGather:
        std::memmove(recv, out, chunk_bytes * world);
        break;
      case CollectiveKind::kBroadcast:
        std::memmove(recv, out, chunk_bytes);
        break;
      case CollectiveKind::kReduceScatter:
      case CollectiveKind::kAllReduce:
        // LocalComm's and MpiComm's arithmetic, so a run gives their bits.
        zinf::reduce_host_pieces(out, world_size_, op.element_count, op.dtype, op.op, recv);
        break;
    }
  });
  if (!delivered) {
    *from_peer = true;  // the failure that finished it was told already
    return status();
  }
  return Status::ok();
}

// The stream's part of one collective.
struct StreamTask {
  TorchComm* comm;
  std::shared_ptr<Task> task;
};

zinf::Status run_stream_task(void* user, const Status& upstream) {
  auto* stream_task = static_cast<StreamTask*>(user);
  Status result = stream_task->comm->run(stream_task->task, upstream);
  delete stream_task;
  return result;
}

Status TorchComm::run(const std::shared_ptr<Task>& task, const Status& upstream) {
  if (!upstream.is_ok()) {
    // This rank will not take part: tell the others now rather than let them time out.
    fail(
        upstream.with_context(task->label + " on " + name_ + ": earlier work on the stream failed"),
        /*tell_peers=*/true);
    return Status::ok();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.is_ok()) {
      ready_.emplace(task->sequence, task);
      cv_.notify_all();
    }
  }
  if (!status().is_ok()) {
    Status error = status();
    task->finish(error.message().find(task->label) == std::string_view::npos
                     ? error.with_context(task->label + " on " + name_)
                     : error);
  }
  return task->wait_done();
}

Status TorchComm::issue(const Collective& op, zinf::Stream& stream) {
  // Held across numbering and enqueueing: the sequence numbers are the matching between ranks.
  std::lock_guard<std::mutex> lock(issue_mu_);
  const std::uint64_t sequence = next_sequence_;
  const std::string label = describe(op, sequence);
  Status error = status();
  if (!error.is_ok()) {
    return Status::aborted(label + " on " + name_ +
                           ": the communicator was aborted: " + error.to_string());
  }
  auto invalid = [&](const std::string& why) {
    Status bad = Status::invalid_argument(label + " on " + name_ + ": " + why);
    fail(bad, /*tell_peers=*/true);
    return bad;
  };
  const std::size_t world = static_cast<std::size_t>(world_size_);
  const std::size_t element_bytes = zinf::dtype_bytes(op.dtype);
  if (op.element_count > (std::size_t{1} << 62) / element_bytes / world) {
    return invalid("element_count " + std::to_string(op.element_count) + " overflows");
  }
  if (op.kind == CollectiveKind::kBroadcast && (op.root < 0 || op.root >= world_size_)) {
    return invalid("root " + std::to_string(op.root) + " is not a rank of " +
                   std::to_string(world_size_));
  }
  const bool needs_send = op.kind != CollectiveKind::kBroadcast || op.root == rank_;
  if (op.element_count != 0 && (op.recv == nullptr || (needs_send && op.send == nullptr))) {
    return invalid("null buffer");
  }
  ++next_sequence_;
  auto task = std::make_shared<Task>();
  task->op = op;
  task->name = std::string(op.name);
  task->op.name = task->name;
  task->label = label;
  task->sequence = sequence;
  auto* stream_task = new StreamTask{this, task};
  Status launched = device_.launch_host_func(stream, &run_stream_task, stream_task);
  if (!launched.is_ok()) {
    delete stream_task;
    // The sequence number is taken: the peers cannot match this rank's later collectives.
    launched = launched.with_context(label + " on " + name_);
    fail(launched, /*tell_peers=*/true);
    return launched;
  }
  return Status::ok();
}

Status TorchComm::barrier(std::chrono::milliseconds timeout) {
  Status error = status();
  if (!error.is_ok()) {
    if (error.message().find("barrier") != std::string_view::npos) return error;
    return error.with_context("barrier on " + name_);
  }
  if (world_size_ == 1) return Status::ok();
  std::uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(issue_mu_);
    generation = barrier_generation_++;
  }
  const std::string label = "barrier #" + std::to_string(generation) + " on " + name_;
  const bool forever = timeout >= std::chrono::hours(24);
  const auto deadline = forever ? Clock::time_point::max() : Clock::now() + timeout;
  bool arrived = false;
  for (;;) {
    {
      nb::gil_scoped_acquire gil;
      try {
        const int count = arrived ? nb::cast<int>(transport_.attr("barrier_count")(generation))
                                  : nb::cast<int>(transport_.attr("barrier_arrive")(generation));
        arrived = true;
        if (count >= world_size_) return Status::ok();
        Status notice = peer_notice(nullptr);
        if (!notice.is_ok()) {
          fail(notice, /*tell_peers=*/false);
          return notice.with_context("barrier #" + std::to_string(generation));
        }
      } catch (const std::exception& e) {
        const auto* python = dynamic_cast<const nb::python_error*>(&e);
        Status broken =
            Status::comm_error(label + ": " + (python ? python_error_text(*python) : e.what()));
        fail(broken, /*tell_peers=*/true);
        return broken;
      }
    }
    error = status();
    if (!error.is_ok()) return error.with_context(label);
    if (Clock::now() >= deadline) {
      Status late = Status::timeout(label + ": not every rank arrived within " +
                                    std::to_string(timeout.count()) + " ms");
      fail(late, /*tell_peers=*/true);
      return late;
    }
    std::this_thread::sleep_for(kBarrierPoll);
  }
}

Status TorchComm::wait(zinf::Event& event, std::chrono::milliseconds timeout) {
  Status synced = device_.synchronize(event, timeout);
  // A kTimeout may also be the error of a collective before the event; only an event still not
  // reached means that this wait ran out.
  zinf::Result<bool> reached = device_.query(event);
  if (synced.code() == Code::kTimeout && reached.is_ok() && !*reached) {
    // The collectives before the event have deadlines of their own, at about the same time when
    // `timeout` is the communicator's: give them a moment to fail with their own message.
    const auto grace_end = Clock::now() + std::min<std::chrono::milliseconds>(timeout, kWaitGrace);
    while (status().is_ok() && Clock::now() < grace_end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (!status().is_ok()) {
      Status stream = device_.synchronize(event, kWaitGrace);
      return stream.is_ok() || stream.code() == Code::kTimeout ? status() : stream;
    }
    Status failure = Status::timeout(name_ + ": wait for collectives: not done after " +
                                     std::to_string(timeout.count()) + " ms");
    fail(failure, /*tell_peers=*/true);
    return failure;
  }
  return synced;
}

void TorchComm::close() {
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    // The worker posts a notice it owes before it stops; a collective in flight ends by
    // completing, failing, or at its deadline.
    worker_.join();
  }
  nb::gil_scoped_acquire gil;
  try {
    transport_.attr("close")(status().is_ok());
  } catch (const std::exception&) {
    // Closing is best effort: the process group goes with the process.
  }
  transport_ = nb::object();
}

}  // namespace

zinf::Result<std::unique_ptr<zinf::Communicator>> make_torch_comm(
    zinf::Device& device, nb::object transport, std::chrono::milliseconds timeout) {
  if (!device.host_accessible()) {
    return Status::invalid_argument(
        "make_torch_comm: the device's memory is not host memory; the torch communicator runs "
        "on a HostDevice");
  }
  if (timeout <= std::chrono::milliseconds(0)) {
    return Status::invalid_argument("make_torch_comm: the timeout must be positive");
  }
  auto comm = std::make_unique<TorchComm>(device, std::move(transport), timeout);
  Status opened = comm->open();
  if (!opened.is_ok()) return opened;
  return std::unique_ptr<zinf::Communicator>(std::move(comm));
}

}  // namespace zinf_python
