// MpiComm (see mpi_comm.hpp).
//
// Longer than 800 lines on purpose: the five collectives share one progress engine (posting
// nonblocking sends and receives, polling them against the collective's deadline, naming the
// ranks that did not answer), and splitting the collectives from that engine would put the
// deadline and error rules in two files.
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/assert.hpp"
#include "base/hash.hpp"
#include "comm/collective_util.hpp"
#include "comm/mpi_comm.hpp"
#include "comm/tcp_bootstrap.hpp"
#include "device/host_device.hpp"
#include "device/staging_buffers.hpp"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;

// The largest piece one MPI message carries: MPI counts are ints, so longer buffers go as
// several messages with the same tag (MPI keeps messages between two ranks with one tag in order).
constexpr std::size_t kMaxMessageBytes = std::size_t{1} << 30;
// Abort notices: one byte of code, then the message, cut to this many bytes.
constexpr std::size_t kNoticeBytes = 1024;
constexpr int kNoticeTag = 1;
// How long a failed collective waits for its matched receives, and close() for its notices.
constexpr auto kCancelWait = std::chrono::seconds(2);
// How long wait() past its timeout waits for a collective's own, more telling, failure.
constexpr auto kWaitGrace = std::chrono::milliseconds(2000);
// How long the idle progress thread sleeps between looks at the abort notices.
constexpr auto kIdlePoll = std::chrono::milliseconds(10);

// --- What each rank asked for ------------------------------------------------------------------
//
// Before its data, every rank sends every other rank a descriptor of the collective it issued
// (kind, dtype, reduction, root, element count, and its name: a hash of it and its first
// kDescriptorNameBytes), on the same tag: MPI delivers messages between two ranks on one tag in
// the order they were sent, so the descriptor is the first message of the collective to arrive
// from each peer, and it is compared before any of that peer's data is let into a buffer. Ranks
// that issued different collectives (another kind, dtype, reduction or root, even with the same
// byte count; or the same shape under other names, as gathers of two modules whose shards pad
// to one size) thus fail on every rank with kCommError naming both calls, instead of returning
// each other's data. It costs one small message to each peer per collective, sent without
// waiting for an answer (no extra round trip).
constexpr std::size_t kDescriptorNameBytes = 40;
constexpr std::size_t kDescriptorBytes = 24 + kDescriptorNameBytes;
using Descriptor = std::array<std::byte, kDescriptorBytes>;

// A peer's call as its descriptor tells it, read from the raw bytes without allocating (the
// progress thread compares one per peer per collective): the shape, and name_hash the whole
// name's (0 for a call without a name). op.name stays empty; descriptor_name() reads the name's
// shown bytes, for a mismatch's message only.
struct PeerCall {
  Collective op;
  std::uint64_t name_hash = 0;
};

std::uint64_t name_hash(std::string_view name) {
  if (name.empty()) return 0;
  const std::uint64_t hash = xxh3_64(name.data(), name.size());
  return hash == 0 ? 1 : hash;
}

Descriptor encode_descriptor(const Collective& op) {
  Descriptor out{};
  out[0] = static_cast<std::byte>(op.kind);
  out[1] = static_cast<std::byte>(op.dtype);
  out[2] = static_cast<std::byte>(op.op);
  const std::size_t shown = std::min(op.name.size(), kDescriptorNameBytes);
  out[3] = static_cast<std::byte>(op.name.size() > kDescriptorNameBytes ? shown + 1 : shown);
  const auto root = static_cast<std::int32_t>(op.root);
  const auto count = static_cast<std::uint64_t>(op.element_count);
  const std::uint64_t hash = name_hash(op.name);
  std::memcpy(out.data() + 4, &root, sizeof(root));
  std::memcpy(out.data() + 8, &count, sizeof(count));
  std::memcpy(out.data() + 16, &hash, sizeof(hash));
  std::memcpy(out.data() + 24, op.name.data(), shown);
  return out;
}

PeerCall decode_descriptor(const Descriptor& in) {
  PeerCall call;
  Collective& op = call.op;
  op.kind = static_cast<CollectiveKind>(in[0]);
  op.dtype = static_cast<DType>(in[1]);
  op.op = static_cast<ReduceOp>(in[2]);
  std::int32_t root = 0;
  std::uint64_t count = 0;
  std::memcpy(&root, in.data() + 4, sizeof(root));
  std::memcpy(&count, in.data() + 8, sizeof(count));
  std::memcpy(&call.name_hash, in.data() + 16, sizeof(call.name_hash));
  op.root = root;
  op.element_count = static_cast<std::size_t>(count);
  return call;
}

// The name a descriptor shows: its first kDescriptorNameBytes, with "..." after them where the
// name was longer (byte 3 then holds kDescriptorNameBytes + 1).
std::string descriptor_name(const Descriptor& in) {
  const auto name_bytes = static_cast<std::size_t>(in[3]);
  std::string name(reinterpret_cast<const char*>(in.data()) + 24,
                   std::min(name_bytes, kDescriptorNameBytes));
  if (name_bytes > kDescriptorNameBytes) name += "...";
  return name;
}

// --- MPI's lifetime in this process ------------------------------------------------------------

std::mutex g_init_mu;
// Set when a collective failed in this process: MPI_Finalize at exit could then wait for a dead
// peer, so it is skipped.
std::atomic<bool> g_failed{false};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0 || g_failed.load()) return;
  MPI_Finalize();
}

// --- MPI_Finalize while communicators are open --------------------------------------------------
//
// MPI_Finalize deletes MPI_COMM_SELF's attributes before it tears down anything else, and MPI
// stays usable from every thread while their delete callbacks run (MPI-3.1 section 8.7.1: "the
// MPI_COMM_SELF attributes are deleted first at MPI_FINALIZE"; MPI_Finalized is still false
// then). The first communicator opened sets one such attribute; its callback stops every open
// MpiComm (MpiComm::stop_at_finalize): the communicator fails its collectives with kAborted naming
// MPI_Finalize, tells the other ranks, joins its progress thread and releases its requests, so
// that none of its MPI calls follows MPI_Finalize and its close() later makes none.

class MpiComm;

std::mutex g_open_mu;
std::vector<MpiComm*> g_open_comms;  // guarded by g_open_mu
// close() calls making their last MPI calls; the callback waits for them. Guarded by g_open_mu.
int g_closing_count = 0;
std::condition_variable g_closing_cv;
bool g_finalize_hook_set = false;  // guarded by g_open_mu

// MPI_Comm_delete_attr_function of the attribute (defined after MpiComm).
int stop_comms_at_finalize(MPI_Comm, int, void*, void*);

std::string mpi_error_text(int err) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(err, text, &length) != MPI_SUCCESS) return fmt::format("MPI error {}", err);
  return std::string(text, static_cast<std::size_t>(length));
}

// The one place an MPI error code becomes a Status: kCommError with sys_code() = the code.
Status status_from_mpi(std::string_view context, int err) {
  if (err == MPI_SUCCESS) return Status::ok();
  return Status::comm_error(fmt::format("{}: {}", context, mpi_error_text(err)), err);
}

// Adds `comm` to the communicators MPI_Finalize stops, setting the attribute on MPI_COMM_SELF the
// first time.
Status watch_finalize(MpiComm* comm) {
  std::lock_guard<std::mutex> lock(g_open_mu);
  if (!g_finalize_hook_set) {
    int keyval = MPI_KEYVAL_INVALID;
    ZINF_RETURN_IF_ERROR(status_from_mpi(
        "make_mpi_comm: MPI_Comm_create_keyval",
        MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &stop_comms_at_finalize, &keyval, nullptr)));
    ZINF_RETURN_IF_ERROR(status_from_mpi("make_mpi_comm: MPI_Comm_set_attr on MPI_COMM_SELF",
                                         MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr)));
    g_finalize_hook_set = true;
  }
  g_open_comms.push_back(comm);
  return Status::ok();
}

Status ensure_mpi(std::string_view who) {
  std::lock_guard<std::mutex> lock(g_init_mu);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) {
    return Status::failed_precondition(fmt::format("{}: MPI was finalised already", who));
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (initialized == 0) {
    ZINF_RETURN_IF_ERROR(
        status_from_mpi(fmt::format("{}: MPI_Init_thread", who),
                        MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided)));
    std::atexit(&finalize_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    return Status::failed_precondition(fmt::format(
        "{}: MPI runs at thread level {} ({}); zinf's progress thread calls MPI beside the "
        "program's threads and needs MPI_THREAD_MULTIPLE (initialise with MPI_Init_thread)",
        who, provided, initialized == 0 ? "this MPI offers no more" : "as the program asked"));
  }
  return Status::ok();
}

// now + `timeout`; a timeout of a day or more (kWaitForever) is no deadline.
std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  return timeout >= std::chrono::hours(24) ? std::chrono::steady_clock::time_point::max()
                                           : std::chrono::steady_clock::now() + timeout;
}

// Polls `request` (a nonblocking collective every rank of the communicator must join) until it
// completes or `deadline` passes: kTimeout saying what did not finish, `world_size` ranks and
// `timeout` long. MPI cannot cancel a collective request: on a timeout it stays with MPI, and
// whatever it would write must stay alive (the callers leak it), and MPI_Finalize is skipped at
// exit (it could wait for the missing ranks).
Status poll_until(MPI_Request* request, std::chrono::steady_clock::time_point deadline,
                  std::string_view what, int world_size, std::chrono::milliseconds timeout);

std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

// A backoff for the progress loop while collectives are in flight: yields for a while (a large
// message moves in many fragments, each needing an MPI call to progress, so sleeping between
// calls would throttle it), then sleeps 50 us at a time, so that a rank waiting for a slow peer
// costs little CPU on a machine shared by several ranks.
class Backoff {
 public:
  void reset() { spins_ = 0; }
  void pause() {
    if (spins_ < 4096) {
      ++spins_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

 private:
  int spins_ = 0;
};

Status poll_until(MPI_Request* request, Clock::time_point deadline, std::string_view what,
                  int world_size, std::chrono::milliseconds timeout) {
  Backoff backoff;
  for (;;) {
    int flag = 0;
    const int tested = MPI_Test(request, &flag, MPI_STATUS_IGNORE);
    if (tested != MPI_SUCCESS) {
      // The request is left pending, so MPI_Finalize at exit could wait on it (as on a timeout).
      g_failed.store(true);
      return status_from_mpi(fmt::format("{}: MPI_Test", what), tested);
    }
    if (flag != 0) return Status::ok();
    if (Clock::now() >= deadline) {
      g_failed.store(true);
      return Status::timeout(fmt::format(
          "{}: not every rank of the {} joined within {} ms (a rank that is late, stalled or "
          "died; every rank must make the call)",
          what, world_size, timeout.count()));
    }
    backoff.pause();
  }
}

// --- One collective in flight --------------------------------------------------------------------

enum class TaskKind : std::uint8_t { kCollective, kBarrier };

struct Task {
  TaskKind kind = TaskKind::kCollective;
  Collective op;      // send/recv are host pointers (the caller's, or the staging buffers)
  std::string name;   // owns op.name
  std::string label;  // "all_gather #12 'layers.3'"
  std::uint64_t sequence = 0;
  std::chrono::milliseconds timeout{0};
  // Only on devices whose memory host code cannot touch: the device buffers and the host copies.
  const void* device_send = nullptr;
  void* device_recv = nullptr;
  RegisteredBuffer send_staging, recv_staging;  // from MpiComm's StagingBuffers
  // reduce_scatter and all_reduce: the other ranks' pieces, rank r's at r * piece bytes.
  std::vector<std::byte> pieces;
  // What this rank issued, sent to every peer before the data, and what each peer sent (rank r's
  // at r).
  Descriptor descriptor_out{};
  std::vector<Descriptor> descriptors_in;

  // Posted by the progress thread.
  // A receive is matched (MPI_Improbe, which tells its size) before its buffer is given
  // (MPI_Imrecv): a message of another size is drained and fails the collective, instead of
  // truncating into the buffer (a defence: the descriptors, compared first, already catch ranks
  // that issued different collectives).
  struct Message {
    MPI_Request request = MPI_REQUEST_NULL;
    void* data = nullptr;
    int peer = 0;
    bool receive = false;
    bool matched = false;  // receives: MPI_Imrecv posted
    bool done = false;
    // The peer's Descriptor (receives: compared when it completes; until then none of that
    // peer's data is matched) or this rank's (sends).
    bool descriptor = false;
    std::size_t bytes = 0;
  };
  std::vector<Message> messages;
  std::size_t open_count = 0;
  Clock::time_point deadline;

  // Set by the progress thread before finish() when a matched receive was still open after the
  // collective failed (MpiComm::abandoned_): MPI may yet write its buffer, so the task keeps its
  // staging buffers (give_back_staging) and lives on until the receive completes.
  bool abandoned = false;

  // Completion, waited for by the stream's thread.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status result;

  void finish(Status status) {
    std::lock_guard<std::mutex> lock(mu);
    result = std::move(status);
    done = true;
    cv.notify_all();
  }
  Status wait_done() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return result;
  }
};

class MpiComm final : public Communicator {
 public:
  MpiComm(Device& device, const MpiCommOptions& options) : device_(device), options_(options) {
    host_device_ = dynamic_cast<HostDevice*>(&device);
    staged_ = !device.host_accessible();
    if (staged_) staging_ = std::make_unique<StagingBuffers>(device);
  }
  ~MpiComm() override { close(); }

  std::chrono::milliseconds collective_timeout() const override { return options_.timeout; }

  Status open(MPI_Comm parent) {
    ZINF_RETURN_IF_ERROR(
        status_from_mpi("make_mpi_comm: MPI_Comm_rank", MPI_Comm_rank(parent, &rank_)));
    ZINF_RETURN_IF_ERROR(
        status_from_mpi("make_mpi_comm: MPI_Comm_size", MPI_Comm_size(parent, &world_size_)));
    name_ = fmt::format("mpi rank {} of {}", rank_, world_size_);
    // MPI_Comm_dup is collective and would wait forever for a rank that never calls it: the
    // nonblocking MPI_Comm_idup is polled against options.timeout instead. The new handles are
    // written where MPI was told when the duplication completes, which after a timeout may still
    // happen: they live on the heap, and are leaked then.
    const auto deadline = deadline_after(options_.timeout);
    auto* duplicates = new MPI_Comm[2]{MPI_COMM_NULL, MPI_COMM_NULL};
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    for (int i = 0; i < 2; ++i) {
      Status started = status_from_mpi(fmt::format("make_mpi_comm on {}: MPI_Comm_idup", name_),
                                       MPI_Comm_idup(parent, &duplicates[i], &requests[i]));
      if (!started.is_ok()) {
        if (i == 0) {
          delete[] duplicates;
        } else {
          // The first duplication is pending for good: no MPI_Finalize at exit to wait on it.
          g_failed.store(true);
        }
        return started;
      }
    }
    for (MPI_Request& request : requests) {
      ZINF_RETURN_IF_ERROR(
          poll_until(&request, deadline,
                     fmt::format("make_mpi_comm on {}: duplicating the communicator", name_),
                     world_size_, options_.timeout));
    }
    data_comm_ = duplicates[0];
    control_comm_ = duplicates[1];
    delete[] duplicates;
    for (MPI_Comm comm : {data_comm_, control_comm_}) {
      // Errors come back as codes (and become Statuses) instead of ending the process.
      MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    }
    int* tag_ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &flag);
    // Tags are (sequence mod tag_space) * 2, even, so that they never meet the abort notices' odd
    // kNoticeTag on the control communicator; the standard guarantees tags up to 32767. The kind
    // is not in the tag: ranks that issued different kinds must meet to see it (the descriptor).
    tag_space_ = (flag != 0 && tag_ub != nullptr ? *tag_ub : 32767) / 2;
    notice_in_.resize(kNoticeBytes + 1);
    ZINF_RETURN_IF_ERROR(post_notice_receive());
    progress_ = std::thread([this] { progress_loop(); });
    return watch_finalize(this);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Device& device() const override { return device_; }
  std::string_view name() const override { return name_; }

  Status issue(const Collective& op, Stream& stream) override;
  Status group_start() override {
    std::lock_guard<std::mutex> lock(issue_mu_);
    return group_depth_.start();
  }
  Status group_end() override {
    std::lock_guard<std::mutex> lock(issue_mu_);
    return group_depth_.end(name_);
  }
  Status barrier(std::chrono::milliseconds timeout) override;
  Status wait(Event& event, std::chrono::milliseconds timeout) override;
  void abort(Status reason) override {
    ZINF_ASSERT(!reason.is_ok());
    fail(std::move(reason), /*tell_peers=*/true);
  }
  Status status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  // MPI_Finalize is running (the callback of its attribute on MPI_COMM_SELF, on the finalising
  // thread, with g_open_mu held): fails every collective in flight and to come with kAborted
  // naming MPI_Finalize, tells the other ranks, and makes the communicator's last MPI calls.
  void stop_at_finalize();
  // After stop_at_finalize: kAborted naming MPI_Finalize and how many of the communicator's
  // collectives failed, when any did; otherwise ok. Those that failed before this rank's
  // MPI_Finalize count too: another rank's MPI_Finalize reaches this one first as its abort notice.
  Status finalize_losses() const;

  // Runs on the stream: hands `task` to the progress thread, waits, then computes the result.
  Status run(const std::shared_ptr<Task>& task, const Status& upstream);
  // Runs on the stream after the upload of the result: the host copies go back for reuse.
  void give_back_staging(Task& task) {
    // An abandoned task's receive may still land in its recv_staging: not reused.
    if (staging_ == nullptr || task.abandoned) return;
    if (task.send_staging.bytes() != 0) staging_->give_back(std::move(task.send_staging));
    if (task.recv_staging.bytes() != 0) staging_->give_back(std::move(task.recv_staging));
  }

 private:
  void submit(std::shared_ptr<Task> task);
  // Sets the sticky error (the first wins), fails every collective in flight, and (when
  // `tell_peers`) sends the abort notice to every other rank.
  void fail(Status reason, bool tell_peers);
  void progress_loop();
  Status post(Task& task);
  Status post_message(Task& task, void* data, std::size_t bytes, int peer, bool receive,
                      bool descriptor = false);
  // Compares the descriptor `message` received from its peer with `task`'s own: kCommError
  // naming both calls when they disagree.
  Status compare_descriptor(const Task& task, const Task::Message& message) const;
  // Polls `task`'s messages; true when all have completed. Errors and the deadline set `failure`.
  bool poll(Task& task, Status* failure);
  Status post_notice_receive();
  void check_notice();
  void send_notices(const Status& reason);
  // `task` fails with the sticky `error` (counted in failed_).
  void fail_task(Task& task, const Status& error);
  // A collective or barrier refused for the sticky error: counted in failed_.
  void count_refused();
  // Drops the abandoned tasks whose receives have completed since.
  void reap_abandoned();
  void close();
  // Stops the progress thread and releases the communicator's MPI requests (and, when healthy,
  // its duplicates of the parent communicator).
  void shut_down();
  int tag_of(const Task& task) const {
    return static_cast<int>(task.sequence % static_cast<std::uint64_t>(tag_space_)) * 2;
  }
  MPI_Comm comm_of(const Task& task) const {
    return task.kind == TaskKind::kBarrier ? control_comm_ : data_comm_;
  }

  Device& device_;
  const MpiCommOptions options_;
  HostDevice* host_device_ = nullptr;
  bool staged_ = false;
  // The host copies of a staged collective: registered (page-locked on CUDA, so the copies down
  // and up stay asynchronous) and reused from one collective to the next.
  std::unique_ptr<StagingBuffers> staging_;
  int rank_ = 0;
  int world_size_ = 1;
  std::string name_;
  MPI_Comm data_comm_ = MPI_COMM_NULL;
  MPI_Comm control_comm_ = MPI_COMM_NULL;  // barriers and abort notices
  int tag_space_ = 16383;

  std::mutex issue_mu_;
  std::uint64_t next_sequence_ = 0;  // guarded by issue_mu_
  GroupDepth group_depth_;           // guarded by issue_mu_
  std::uint64_t barrier_generation_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  Status error_;               // sticky
  bool notify_peers_ = false;  // the progress thread owes the abort notices
  bool stop_ = false;
  // Set by stop_at_finalize: the progress thread is gone and MPI with it.
  bool finalized_ = false;
  // Collectives and barriers that failed or were refused for the sticky error, whatever set it.
  std::uint64_t failed_ = 0;
  std::deque<std::shared_ptr<Task>> submitted_;  // waiting for the progress thread
  std::thread progress_;

  // Owned by the progress thread.
  std::vector<std::shared_ptr<Task>> in_flight_;
  // Failed collectives with a matched receive (MPI_Imrecv) that did not complete within
  // kCancelWait. MPI cannot cancel a matched receive, and freeing its request does not stop it:
  // MPI may still write the message into the task's buffers (its descriptors_in, pieces or
  // recv_staging) later. So the request is kept and the task with it, until the receive
  // completes (reap_abandoned) or the communicator is destroyed (shut_down), which leaves what is
  // still open to the process's end.
  std::vector<std::shared_ptr<Task>> abandoned_;
  std::vector<std::byte> notice_in_;
  MPI_Request notice_request_ = MPI_REQUEST_NULL;
  std::string notice_out_;
  std::vector<MPI_Request> notice_sends_;
};

Status MpiComm::post_notice_receive() {
  return status_from_mpi(fmt::format("{}: posting the abort-notice receive", name_),
                         MPI_Irecv(notice_in_.data(), static_cast<int>(notice_in_.size()), MPI_BYTE,
                                   MPI_ANY_SOURCE, kNoticeTag, control_comm_, &notice_request_));
}

void MpiComm::fail(Status reason, bool tell_peers) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_.is_ok()) return;
  error_ = std::move(reason);
  notify_peers_ = tell_peers;
  g_failed.store(true);
  cv_.notify_all();
}

void MpiComm::submit(std::shared_ptr<Task> task) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) {
    // The progress thread is gone (MPI_Finalize stopped it): nothing would post the collective.
    Status error = error_.is_ok() ? Status::aborted(fmt::format("{}: closed", name_)) : error_;
    lock.unlock();
    fail_task(*task, error);
    return;
  }
  submitted_.push_back(std::move(task));
  cv_.notify_all();
}

void MpiComm::fail_task(Task& task, const Status& error) {
  count_refused();
  Status own = error;
  if (error.message().find(task.label) == std::string_view::npos) {
    own = error.with_context(fmt::format("{} on {}", task.label, name_));
  }
  task.finish(std::move(own));
}

void MpiComm::count_refused() {
  std::lock_guard<std::mutex> lock(mu_);
  ++failed_;
}

Status MpiComm::post_message(Task& task, void* data, std::size_t bytes, int peer, bool receive,
                             bool descriptor) {
  // Long buffers go as several messages of at most kMaxMessageBytes (ordered by MPI); a buffer
  // of no bytes (a barrier's, a collective of no elements) as one empty message.
  std::size_t offset = 0;
  do {
    const std::size_t piece = std::min(kMaxMessageBytes, bytes - offset);
    Task::Message message;
    message.peer = peer;
    message.receive = receive;
    message.descriptor = descriptor;
    message.bytes = piece;
    auto* at = static_cast<std::byte*>(data) + offset;
    message.data = at;
    if (!receive) {
      ZINF_RETURN_IF_ERROR(
          status_from_mpi(fmt::format("{} on {}: MPI_Isend to rank {}", task.label, name_, peer),
                          MPI_Isend(at, static_cast<int>(piece), MPI_BYTE, peer, tag_of(task),
                                    comm_of(task), &message.request)));
    }
    task.messages.push_back(message);
    ++task.open_count;
    offset += piece;
  } while (offset < bytes);
  return Status::ok();
}

Status MpiComm::post(Task& task) {
  task.deadline = deadline_after(task.timeout);
  if (task.kind == TaskKind::kBarrier) {
    for (int peer = 0; peer < world_size_; ++peer) {
      if (peer == rank_) continue;
      ZINF_RETURN_IF_ERROR(post_message(task, nullptr, 0, peer, /*receive=*/true));
      ZINF_RETURN_IF_ERROR(post_message(task, nullptr, 0, peer, /*receive=*/false));
    }
    return Status::ok();
  }
  const Collective& op = task.op;
  const std::size_t chunk_bytes = op.element_count * dtype_bytes(op.dtype);
  auto* send = static_cast<std::byte*>(const_cast<void*>(op.send));
  auto* recv = static_cast<std::byte*>(op.recv);
  task.descriptor_out = encode_descriptor(op);
  task.descriptors_in.assign(static_cast<std::size_t>(world_size_), Descriptor{});
  // Receives first, so that a peer's message finds its buffer posted. From each peer, its
  // descriptor comes before its data (poll() matches a peer's receives in this order).
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_) continue;
    const auto upeer = static_cast<std::size_t>(peer);
    ZINF_RETURN_IF_ERROR(post_message(task, task.descriptors_in[upeer].data(), kDescriptorBytes,
                                      peer, /*receive=*/true, /*descriptor=*/true));
    switch (op.kind) {
      case CollectiveKind::kAllGather:
        ZINF_RETURN_IF_ERROR(
            post_message(task, recv + upeer * chunk_bytes, chunk_bytes, peer, true));
        break;
      case CollectiveKind::kReduceScatter:
      case CollectiveKind::kAllReduce:
        ZINF_RETURN_IF_ERROR(
            post_message(task, task.pieces.data() + upeer * chunk_bytes, chunk_bytes, peer, true));
        break;
      case CollectiveKind::kBroadcast:
        if (peer == op.root)
          ZINF_RETURN_IF_ERROR(post_message(task, recv, chunk_bytes, peer, true));
        break;
    }
  }
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_) continue;
    const auto upeer = static_cast<std::size_t>(peer);
    // The descriptor first: the peer compares it before it takes any of this rank's data.
    ZINF_RETURN_IF_ERROR(post_message(task, task.descriptor_out.data(), kDescriptorBytes, peer,
                                      /*receive=*/false, /*descriptor=*/true));
    switch (op.kind) {
      case CollectiveKind::kAllGather:
        ZINF_RETURN_IF_ERROR(post_message(task, send, chunk_bytes, peer, false));
        break;
      case CollectiveKind::kReduceScatter:
        ZINF_RETURN_IF_ERROR(
            post_message(task, send + upeer * chunk_bytes, chunk_bytes, peer, false));
        break;
      case CollectiveKind::kAllReduce:
        ZINF_RETURN_IF_ERROR(post_message(task, send, chunk_bytes, peer, false));
        break;
      case CollectiveKind::kBroadcast:
        if (rank_ == op.root)
          ZINF_RETURN_IF_ERROR(post_message(task, send, chunk_bytes, peer, false));
        break;
    }
  }
  return Status::ok();
}

bool MpiComm::poll(Task& task, Status* failure) {
  // Match the next receive from each peer whose message has arrived (a peer's pieces arrive in
  // order, so only its first unmatched one is probed).
  std::vector<char> blocked(static_cast<std::size_t>(world_size_), 0);
  for (Task::Message& message : task.messages) {
    if (!message.receive) continue;
    const auto peer = static_cast<std::size_t>(message.peer);
    if (message.matched) {
      // A peer's descriptor still arriving, or not yet compared, holds back its data: none of it
      // is let into a buffer before the descriptor agrees.
      if (message.descriptor && !message.done) blocked[peer] = 1;
      continue;
    }
    if (blocked[peer] != 0) continue;
    int flag = 0;
    MPI_Message matched = MPI_MESSAGE_NULL;
    MPI_Status st;
    const int err = MPI_Improbe(message.peer, tag_of(task), comm_of(task), &flag, &matched, &st);
    if (err != MPI_SUCCESS) {
      *failure = status_from_mpi(
          fmt::format("{} on {}: MPI_Improbe from rank {}", task.label, name_, message.peer), err);
      return false;
    }
    if (flag == 0) {
      blocked[peer] = 1;
      continue;
    }
    int received = 0;
    MPI_Get_count(&st, MPI_BYTE, &received);
    if (static_cast<std::size_t>(received) != message.bytes) {
      // Kept as a defence, but not reached while every rank sends its descriptor first on the
      // collective's tag: the first message from a peer is its kDescriptorBytes descriptor, and a
      // peer whose data sizes differ from this rank's issued another element count or dtype,
      // which its descriptor shows (compare_descriptor's kCommError) before any of its data is
      // matched.
      // Drained into a scratch buffer, so that it does not linger in MPI's queues; the blocking
      // MPI_Mrecv could stall this thread on a peer that dies mid-message, acceptable on a path not
      // taken.
      std::vector<std::byte> scratch(static_cast<std::size_t>(std::max(received, 1)));
      MPI_Mrecv(scratch.data(), received, MPI_BYTE, &matched, MPI_STATUS_IGNORE);
      *failure = Status::comm_error(fmt::format(
          "{} on {}: ranks disagree: rank {} sent {} bytes where this rank expected {} (the "
          "ranks issued different collectives)",
          task.label, name_, message.peer, received, message.bytes));
      return false;
    }
    const int posted = MPI_Imrecv(message.data, received, MPI_BYTE, &matched, &message.request);
    if (posted != MPI_SUCCESS) {
      *failure = status_from_mpi(
          fmt::format("{} on {}: MPI_Imrecv from rank {}", task.label, name_, message.peer),
          posted);
      return false;
    }
    message.matched = true;
    // Receiving, not yet compared: the peer's data waits (the next messages of this peer).
    if (message.descriptor) blocked[peer] = 1;
  }
  if (task.open_count > 0) {
    std::vector<MPI_Request> requests;
    std::vector<std::size_t> index;
    for (std::size_t i = 0; i < task.messages.size(); ++i) {
      if (task.messages[i].request != MPI_REQUEST_NULL) {
        requests.push_back(task.messages[i].request);
        index.push_back(i);
      }
    }
    std::vector<int> completed(requests.size());
    std::vector<MPI_Status> statuses(requests.size());
    int completed_count = 0;
    const int err = MPI_Testsome(static_cast<int>(requests.size()), requests.data(),
                                 &completed_count, completed.data(), statuses.data());
    if (err != MPI_SUCCESS && err != MPI_ERR_IN_STATUS) {
      *failure = status_from_mpi(fmt::format("{} on {}: MPI_Testsome", task.label, name_), err);
      return false;
    }
    // Every completed request is recorded before a failure returns: MPI has freed them, and the
    // failure path must not touch their handles again.
    Status first_failure;
    for (int c = 0; c < completed_count && completed_count != MPI_UNDEFINED; ++c) {
      Task::Message& message = task.messages[index[static_cast<std::size_t>(completed[c])]];
      const MPI_Status& st = statuses[static_cast<std::size_t>(c)];
      message.request = MPI_REQUEST_NULL;
      message.done = true;
      --task.open_count;
      if (!first_failure.is_ok()) continue;
      if (err == MPI_ERR_IN_STATUS && st.MPI_ERROR != MPI_SUCCESS) {
        first_failure =
            status_from_mpi(fmt::format("{} on {}: message {} rank {}", task.label, name_,
                                        message.receive ? "from" : "to", message.peer),
                            st.MPI_ERROR);
      } else if (message.receive && message.descriptor) {
        first_failure = compare_descriptor(task, message);
      }
    }
    if (!first_failure.is_ok()) {
      *failure = std::move(first_failure);
      return false;
    }
  }
  if (task.open_count == 0) return true;
  if (Clock::now() >= task.deadline) {
    std::vector<int> silent, not_taking;
    for (const Task::Message& message : task.messages) {
      if (message.done) continue;
      std::vector<int>& list = message.receive ? silent : not_taking;
      if (std::find(list.begin(), list.end(), message.peer) == list.end())
        list.push_back(message.peer);
    }
    std::string what = silent.empty() ? fmt::format("rank(s) {} did not take this rank's data",
                                                    rank_list(not_taking))
                                      : fmt::format("no data from rank(s) {}", rank_list(silent));
    *failure = Status::timeout(fmt::format(
        "{} on {}: {} within {} ms (a rank that died, stalled, or issued a different collective)",
        task.label, name_, what, task.timeout.count()));
    return false;
  }
  return false;
}

Status MpiComm::compare_descriptor(const Task& task, const Task::Message& message) const {
  // Received with MPI_Imrecv after MPI_Improbe found it kDescriptorBytes long (poll), so it is
  // whole; a peer that dies while it is in flight leaves the receive open until the deadline,
  // with the progress thread free.
  const Descriptor& in = task.descriptors_in[static_cast<std::size_t>(message.peer)];
  PeerCall peer = decode_descriptor(in);
  Collective own = task.op;
  Collective& theirs = peer.op;
  // The shapes by collectives_agree(), the names by their hashes (a peer's name may be cut).
  own.name = {};
  // This rank's name hash, as encode_descriptor() wrote it once for every peer.
  const std::uint64_t own_hash = decode_descriptor(task.descriptor_out).name_hash;
  const bool names_agree = own_hash == 0 || peer.name_hash == 0 || own_hash == peer.name_hash;
  if (collectives_agree(own, theirs) && names_agree) return Status::ok();
  // Only a mismatch reads the peer's name, into a string for the message.
  const std::string peer_name = descriptor_name(in);
  own.name = task.op.name;
  theirs.name = peer_name;
  return Status::comm_error(
      fmt::format("{} on {}: ranks disagree: rank {} issued {}, this rank issued {}", task.label,
                  name_, message.peer, describe_call(theirs), describe_call(own)));
}

void MpiComm::check_notice() {
  if (notice_request_ == MPI_REQUEST_NULL) return;
  int flag = 0;
  MPI_Status st;
  if (MPI_Test(&notice_request_, &flag, &st) != MPI_SUCCESS || flag == 0) return;
  notice_request_ = MPI_REQUEST_NULL;
  int received = 0;
  MPI_Get_count(&st, MPI_BYTE, &received);
  Code code = Code::kAborted;
  std::string text;
  if (received >= 1) {
    code = static_cast<Code>(static_cast<std::uint8_t>(notice_in_[0]));
    text.assign(reinterpret_cast<const char*>(notice_in_.data()) + 1,
                static_cast<std::size_t>(received - 1));
  }
  fail(Status(code, 0, fmt::format("{}: rank {} failed: {}", name_, st.MPI_SOURCE, text)),
       /*tell_peers=*/false);
}

void MpiComm::send_notices(const Status& reason) {
  notice_out_.assign(1, static_cast<char>(reason.code()));
  notice_out_ += std::string(reason.message()).substr(0, kNoticeBytes);
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    // Best effort: a dead peer never takes it; the request is left to MPI at close().
    if (MPI_Isend(notice_out_.data(), static_cast<int>(notice_out_.size()), MPI_BYTE, peer,
                  kNoticeTag, control_comm_, &request) == MPI_SUCCESS) {
      notice_sends_.push_back(request);
    }
  }
}

void MpiComm::progress_loop() {
  Backoff backoff;
  for (;;) {
    std::vector<std::shared_ptr<Task>> fresh;
    Status error;
    bool notify = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (in_flight_.empty() && submitted_.empty() && !notify_peers_) {
        if (stop_) return;
        cv_.wait_for(lock, kIdlePoll,
                     [&] { return stop_ || !submitted_.empty() || notify_peers_; });
      }
      fresh.assign(submitted_.begin(), submitted_.end());
      submitted_.clear();
      error = error_;
      notify = std::exchange(notify_peers_, false);
    }
    if (notify) send_notices(error);
    bool progressed = !fresh.empty();
    for (std::shared_ptr<Task>& task : fresh) {
      if (!error.is_ok()) {
        fail_task(*task, error);
        continue;
      }
      Status posted = post(*task);
      in_flight_.push_back(std::move(task));
      if (!posted.is_ok()) {
        fail(posted, /*tell_peers=*/true);
        break;
      }
    }
    check_notice();
    reap_abandoned();
    {
      std::lock_guard<std::mutex> lock(mu_);
      error = error_;
    }
    if (!error.is_ok()) {
      // Every collective in flight fails with the sticky error. Its matched receives complete
      // first (their data is on its way), so that nothing lands in a buffer after its collective
      // returned; a task with one that does not within kCancelWait is abandoned (abandoned_):
      // the request stays open and the task alive, so that MPI never writes into memory the
      // communicator freed. A receive straight into the caller's buffer (an unstaged all-gather
      // or broadcast) can still land there after the call returned: on a HostDevice, whose
      // allocations the engine's buffers are, the device keeps that memory past its free while
      // the task lives (HostDevice::keep_while). Unmatched receives have no buffer posted. Sends
      // only read their buffers.
      for (std::shared_ptr<Task>& task : in_flight_) {
        bool receiving = false;
        for (Task::Message& message : task->messages) {
          if (message.request == MPI_REQUEST_NULL) continue;
          if (message.receive) {
            const auto give_up = Clock::now() + kCancelWait;
            int flag = 0;
            while (flag == 0 && Clock::now() < give_up) {
              if (MPI_Test(&message.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
              if (flag == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
            }
            if (message.request != MPI_REQUEST_NULL) {
              receiving = true;
              if (!staged_ && host_device_ != nullptr) {
                host_device_->keep_while(message.data, message.bytes, task);
              }
            }
          } else {
            MPI_Request_free(&message.request);
          }
        }
        // Before finish(): the stream's thread reads it after wait_done().
        task->abandoned = receiving;
        fail_task(*task, error);
        if (receiving) abandoned_.push_back(std::move(task));
      }
      in_flight_.clear();
      backoff.reset();
      continue;
    }
    for (std::size_t i = 0; i < in_flight_.size();) {
      Status failure;
      const std::size_t open_before = in_flight_[i]->open_count;
      const bool complete = poll(*in_flight_[i], &failure);
      if (!failure.is_ok()) {
        fail(failure, /*tell_peers=*/true);
        break;
      }
      if (in_flight_[i]->open_count != open_before) progressed = true;
      if (complete) {
        in_flight_[i]->finish(Status::ok());
        in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
        progressed = true;
      } else {
        ++i;
      }
    }
    if (progressed) {
      backoff.reset();
    } else if (!in_flight_.empty()) {
      backoff.pause();
    }
  }
}

void MpiComm::reap_abandoned() {
  std::erase_if(abandoned_, [](const std::shared_ptr<Task>& task) {
    bool open = false;
    for (Task::Message& message : task->messages) {
      if (message.request == MPI_REQUEST_NULL) continue;
      int flag = 0;
      // A failed test leaves the request open: the task stays.
      if (MPI_Test(&message.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag == 0) {
        open = true;
      }
    }
    return !open;
  });
}

void MpiComm::close() {
  {
    std::lock_guard<std::mutex> lock(g_open_mu);
    std::erase(g_open_comms, this);
    std::lock_guard<std::mutex> state(mu_);
    // MPI_Finalize stopped the communicator and released its requests; MPI is gone.
    if (finalized_) return;
    ++g_closing_count;
  }
  shut_down();
  {
    std::lock_guard<std::mutex> lock(g_open_mu);
    --g_closing_count;
  }
  g_closing_cv.notify_all();
}

void MpiComm::stop_at_finalize() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    finalized_ = true;
  }
  fail(Status::aborted(fmt::format(
           "{}: MPI_Finalize was called while the communicator was open (close the engine and "
           "destroy the communicator before MPI_Finalize); its collectives fail from here on",
           name_)),
       /*tell_peers=*/true);
  shut_down();
}

Status MpiComm::finalize_losses() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!finalized_ || failed_ == 0) return Status::ok();
  return Status::aborted(
      fmt::format("{}: {} collective(s) failed, and MPI_Finalize stopped the communicator: {}",
                  name_, failed_, error_.to_string()));
}

int stop_comms_at_finalize(MPI_Comm, int, void*, void*) {
  std::unique_lock<std::mutex> lock(g_open_mu);
  // A close() on another thread finishes its MPI calls first.
  g_closing_cv.wait(lock, [] { return g_closing_count == 0; });
  for (MpiComm* comm : g_open_comms) comm->stop_at_finalize();
  g_open_comms.clear();
  return MPI_SUCCESS;
}

void MpiComm::shut_down() {
  if (progress_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!in_flight_.empty() || !submitted_.empty()) {
        // Nothing should be in flight when a communicator is destroyed; fail it rather than
        // wait for it.
      }
      stop_ = true;
      cv_.notify_all();
    }
    // In-flight collectives finish by completing or at their deadline.
    progress_.join();
  }
  const bool healthy = status().is_ok();
  // The notice receive is cancelled and the notices sent are given a moment to complete, so that
  // no request of this communicator is left when MPI finalises (a dead peer's never complete:
  // those are left to MPI).
  const auto give_up = Clock::now() + kCancelWait;
  if (notice_request_ != MPI_REQUEST_NULL) MPI_Cancel(&notice_request_);
  std::vector<MPI_Request> pending = notice_sends_;
  pending.push_back(notice_request_);
  int flag = 0;
  while (flag == 0 && Clock::now() < give_up) {
    if (MPI_Testall(static_cast<int>(pending.size()), pending.data(), &flag, MPI_STATUSES_IGNORE) !=
        MPI_SUCCESS) {
      break;
    }
    if (flag == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  for (MPI_Request& request : pending) {
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
  }
  notice_request_ = MPI_REQUEST_NULL;
  notice_sends_.clear();
  // The abandoned tasks' receives had their kCancelWait when their collectives failed; the
  // requests still open are freed (MPI_Finalize is skipped at exit: a collective failed), but MPI
  // may still write their buffers, so the tasks are kept to the process's end, reachable, so that
  // no leak checker reports them.
  reap_abandoned();
  if (!abandoned_.empty()) {
    // Never destroyed, the mutex too: a communicator may shut down during static destruction.
    static auto* kept_mu = new std::mutex();
    static auto* kept = new std::vector<std::shared_ptr<Task>>();
    std::lock_guard<std::mutex> lock(*kept_mu);
    for (std::shared_ptr<Task>& task : abandoned_) {
      for (Task::Message& message : task->messages) {
        if (message.request != MPI_REQUEST_NULL) MPI_Request_free(&message.request);
      }
      kept->push_back(std::move(task));
    }
    abandoned_.clear();
  }
  // After a failure the duplicates are left to the process's end: freeing them might wait for a
  // peer that is gone.
  if (healthy) {
    if (data_comm_ != MPI_COMM_NULL) MPI_Comm_free(&data_comm_);
    if (control_comm_ != MPI_COMM_NULL) MPI_Comm_free(&control_comm_);
  }
}

// The stream's part of one collective: what its host functions get.
struct StreamTask {
  MpiComm* comm;
  std::shared_ptr<Task> task;
};

Status run_stream_task(void* user, const Status& upstream) {
  auto* stream_task = static_cast<StreamTask*>(user);
  return stream_task->comm->run(stream_task->task, upstream);
}

// Runs after the collective (and its upload, when staged), even when it failed.
Status release_stream_task(void* user, const Status&) {
  auto* stream_task = static_cast<StreamTask*>(user);
  stream_task->comm->give_back_staging(*stream_task->task);
  delete stream_task;
  return Status::ok();
}

Status MpiComm::run(const std::shared_ptr<Task>& task, const Status& upstream) {
  if (!upstream.is_ok()) {
    // This rank will not take part: tell the others now rather than let them time out.
    fail(upstream.with_context(
             fmt::format("{} on {}: earlier work on the stream failed", task->label, name_)),
         /*tell_peers=*/true);
    return Status::ok();
  }
  // A collective of no elements still takes part: its descriptor goes to every peer (with one
  // message of no bytes where data would go), so a rank that issued 0 elements against a peer's 4
  // fails on both ranks with kCommError instead of returning at once while the peer times out.
  // Its buffers may be null; nothing below touches them when chunk_bytes is 0.
  const Collective& op = task->op;
  const std::size_t chunk_bytes = op.element_count * dtype_bytes(op.dtype);
  const auto urank = static_cast<std::size_t>(rank_);
  const auto world = static_cast<std::size_t>(world_size_);
  auto* send = static_cast<const std::byte*>(op.send);
  auto* recv = static_cast<std::byte*>(op.recv);
  const bool reduces =
      op.kind == CollectiveKind::kReduceScatter || op.kind == CollectiveKind::kAllReduce;
  if (reduces) task->pieces.resize(chunk_bytes * world);
  // This rank's own part needs no message.
  if (op.kind == CollectiveKind::kAllGather && chunk_bytes != 0 &&
      recv + urank * chunk_bytes != send) {
    std::memmove(recv + urank * chunk_bytes, send, chunk_bytes);
  }
  if (op.kind == CollectiveKind::kBroadcast && chunk_bytes != 0 && rank_ == op.root &&
      recv != send) {
    std::memmove(recv, send, chunk_bytes);
  }
  submit(task);
  ZINF_RETURN_IF_ERROR(task->wait_done());
  if (!reduces || chunk_bytes == 0) return Status::ok();
  // Rank order, from this rank's own buffer and the pieces the others sent.
  std::vector<const std::byte*> sources(world);
  for (std::size_t r = 0; r < world; ++r) {
    if (r == urank) {
      sources[r] = op.kind == CollectiveKind::kReduceScatter ? send + urank * chunk_bytes : send;
    } else {
      sources[r] = task->pieces.data() + r * chunk_bytes;
    }
  }
  reduce_range(sources, 0, recv, 0, op.element_count, op.dtype, op.op);
  return Status::ok();
}

Status MpiComm::issue(const Collective& op, Stream& stream) {
  // Held across numbering and enqueueing: the sequence numbers are the matching between ranks.
  std::lock_guard<std::mutex> lock(issue_mu_);
  const std::uint64_t sequence = next_sequence_;
  const std::string label = describe_collective(op, sequence);
  Status error = status();
  if (!error.is_ok()) {
    count_refused();
    return Status::aborted(
        fmt::format("{} on {}: the communicator was aborted: {}", label, name_, error.to_string()));
  }
  Status valid = validate_collective(op, sequence, rank_, world_size_, name_);
  if (!valid.is_ok()) {
    fail(valid, /*tell_peers=*/true);
    return valid;
  }
  ++next_sequence_;
  auto task = std::make_shared<Task>();
  task->op = op;
  task->name = std::string(op.name);
  task->op.name = task->name;
  task->label = label;
  task->sequence = sequence;
  task->timeout = options_.timeout;
  const std::size_t world = static_cast<std::size_t>(world_size_);
  const std::size_t chunk_bytes = op.element_count * dtype_bytes(op.dtype);
  const std::size_t send_bytes =
      op.kind == CollectiveKind::kReduceScatter ? chunk_bytes * world : chunk_bytes;
  const std::size_t recv_bytes =
      op.kind == CollectiveKind::kAllGather ? chunk_bytes * world : chunk_bytes;
  const bool needs_send = op.kind != CollectiveKind::kBroadcast || op.root == rank_;
  auto enqueue_failed = [&](Status failure) {
    failure = failure.with_context(fmt::format("{} on {}", label, name_));
    fail(failure, /*tell_peers=*/true);
    return failure;
  };
  if (staged_ && chunk_bytes != 0) {
    // Device memory host code cannot touch: down into host buffers, and the result back up.
    if (needs_send) {
      Result<RegisteredBuffer> buffer = staging_->take(send_bytes);
      if (!buffer.is_ok()) return enqueue_failed(buffer.status());
      task->send_staging = std::move(buffer).value();
    }
    Result<RegisteredBuffer> buffer = staging_->take(recv_bytes);
    if (!buffer.is_ok()) return enqueue_failed(buffer.status());
    task->recv_staging = std::move(buffer).value();
    task->op.send = needs_send ? task->send_staging.data() : nullptr;
    task->op.recv = task->recv_staging.data();
    if (needs_send) {
      Status copied = device_.copy_d2h(task->send_staging.data(), op.send, send_bytes, stream);
      if (!copied.is_ok()) return enqueue_failed(copied);
    }
  } else if (staged_) {
    // No elements: no staging copies, and no device address reaches MPI (its messages carry no
    // bytes).
    task->op.send = nullptr;
    task->op.recv = nullptr;
  } else if (host_device_ != nullptr) {
    task->op.send = op.send == nullptr ? nullptr : host_device_->host_address(op.send);
    task->op.recv = op.recv == nullptr ? nullptr : host_device_->host_address(op.recv);
  }
  auto* stream_task = new StreamTask{this, task};
  Status launched = device_.launch_host_func(stream, &run_stream_task, stream_task);
  if (!launched.is_ok()) {
    delete stream_task;
    return enqueue_failed(launched);
  }
  if (staged_ && chunk_bytes != 0) {
    Status copied = device_.copy_h2d(op.recv, task->recv_staging.data(), recv_bytes, stream);
    if (!copied.is_ok()) return enqueue_failed(copied);
  }
  // The task outlives the upload of its staging buffer: released after it on the stream.
  Status released = device_.launch_host_func(stream, &release_stream_task, stream_task);
  if (!released.is_ok()) return enqueue_failed(released);
  return Status::ok();
}

Status MpiComm::barrier(std::chrono::milliseconds timeout) {
  Status error = status();
  if (!error.is_ok()) {
    count_refused();
    if (error.message().find("barrier") != std::string_view::npos) return error;
    return error.with_context(fmt::format("barrier on {}", name_));
  }
  if (world_size_ == 1) return Status::ok();
  auto task = std::make_shared<Task>();
  task->kind = TaskKind::kBarrier;
  {
    std::lock_guard<std::mutex> lock(issue_mu_);
    task->sequence = barrier_generation_++;
  }
  task->label = fmt::format("barrier #{}", task->sequence);
  task->timeout = timeout;
  submit(task);
  return task->wait_done();
}

Status MpiComm::wait(Event& event, std::chrono::milliseconds timeout) {
  Status synced = device_.synchronize(event, timeout);
  // A kTimeout may also be the error of a collective before the event (a rank that never
  // arrived); only an event still not reached means that this wait ran out.
  Result<bool> reached = device_.query(event);
  if (synced.code() == Code::kTimeout && reached.is_ok() && !*reached) {
    // The collectives before the event have deadlines of their own, at about the same time when
    // `timeout` is the communicator's: give them a moment to fail with the message that names the
    // collective and the silent ranks, which says more than this wait can.
    const auto grace_end = Clock::now() + std::min<std::chrono::milliseconds>(timeout, kWaitGrace);
    while (status().is_ok() && Clock::now() < grace_end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (!status().is_ok()) {
      Status stream = device_.synchronize(event, kWaitGrace);
      return stream.is_ok() || stream.code() == Code::kTimeout ? status() : stream;
    }
    Status failure = Status::timeout(
        fmt::format("{}: wait for collectives: not done after {} ms", name_, timeout.count()));
    fail(failure, /*tell_peers=*/true);
    return failure;
  }
  return synced;
}

Result<std::unique_ptr<Communicator>> open_mpi_comm(MPI_Comm parent, Device& device,
                                                    const MpiCommOptions& options) {
  if (options.timeout <= std::chrono::milliseconds(0)) {
    return Status::invalid_argument("MpiCommOptions.timeout must be positive");
  }
  auto comm = std::make_unique<MpiComm>(device, options);
  ZINF_RETURN_IF_ERROR(comm->open(parent));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace

Result<std::unique_ptr<Communicator>> make_mpi_comm(Device& device, const MpiCommOptions& options) {
  ZINF_RETURN_IF_ERROR(ensure_mpi("make_mpi_comm"));
  return open_mpi_comm(MPI_COMM_WORLD, device, options);
}

Result<std::unique_ptr<Communicator>> make_mpi_comm(const void* mpi_comm, Device& device,
                                                    const MpiCommOptions& options) {
  if (mpi_comm == nullptr) {
    return Status::invalid_argument("make_mpi_comm: null MPI_Comm pointer (pass &comm)");
  }
  ZINF_RETURN_IF_ERROR(ensure_mpi("make_mpi_comm"));
  const MPI_Comm parent = *static_cast<const MPI_Comm*>(mpi_comm);
  if (parent == MPI_COMM_NULL) {
    return Status::invalid_argument("make_mpi_comm: the communicator is MPI_COMM_NULL");
  }
  return open_mpi_comm(parent, device, options);
}

Status mpi_finalize_losses(const Communicator& comm) {
  const auto* mpi = dynamic_cast<const MpiComm*>(&comm);
  return mpi == nullptr ? Status::ok() : mpi->finalize_losses();
}

Result<MpiWorld> mpi_world_of_process(std::chrono::milliseconds timeout) {
  ZINF_RETURN_IF_ERROR(ensure_mpi("mpi_world_of_process"));
  MpiWorld world;
  MPI_Comm_rank(MPI_COMM_WORLD, &world.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world.world_size);
  // The launcher's own figure when it gives one (Open MPI's mpirun, MPICH's Hydra): no collective
  // needed, so no rank waits for another here.
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') {
      ZINF_ASSIGN_OR_RETURN(world.local_rank,
                            parse_env_int(name, std::string(value), 0, world.world_size - 1));
      return world;
    }
  }
  // Otherwise the ranks before this one on the same host, from every rank's host name gathered by
  // a nonblocking MPI_Iallgather polled against `timeout` (MPI_Comm_split_type would wait forever
  // for a rank that never calls). The buffers are leaked when it times out: MPI may still write
  // them.
  const auto deadline = deadline_after(timeout);
  const auto world_count = static_cast<std::size_t>(world.world_size);
  auto* names = new char[world_count * (MPI_MAX_PROCESSOR_NAME + 1) + MPI_MAX_PROCESSOR_NAME + 1]();
  char* mine = names + world_count * (MPI_MAX_PROCESSOR_NAME + 1);
  int host_name_char_count = 0;
  Status named = status_from_mpi("mpi_world_of_process: MPI_Get_processor_name",
                                 MPI_Get_processor_name(mine, &host_name_char_count));
  if (!named.is_ok()) {
    delete[] names;
    return named;
  }
  MPI_Request request = MPI_REQUEST_NULL;
  Status started = status_from_mpi(
      "mpi_world_of_process: MPI_Iallgather of the host names",
      MPI_Iallgather(mine, MPI_MAX_PROCESSOR_NAME + 1, MPI_CHAR, names, MPI_MAX_PROCESSOR_NAME + 1,
                     MPI_CHAR, MPI_COMM_WORLD, &request));
  if (!started.is_ok()) {
    delete[] names;
    return started;
  }
  ZINF_RETURN_IF_ERROR(poll_until(
      &request, deadline,
      fmt::format("mpi_world_of_process on rank {}: gathering the host names", world.rank),
      world.world_size, timeout));
  world.local_rank = 0;
  for (int r = 0; r < world.rank; ++r) {
    const char* theirs = names + static_cast<std::size_t>(r) * (MPI_MAX_PROCESSOR_NAME + 1);
    if (std::strncmp(theirs, mine, MPI_MAX_PROCESSOR_NAME) == 0) ++world.local_rank;
  }
  delete[] names;
  return world;
}

Result<std::vector<std::byte>> mpi_broadcast_blob(std::span<const std::byte> blob,
                                                  std::chrono::milliseconds timeout) {
  ZINF_RETURN_IF_ERROR(ensure_mpi("mpi_broadcast_blob"));
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const auto deadline = Clock::now() + timeout;
  // Polls one nonblocking broadcast against the deadline.
  auto broadcast = [&](void* data, int bytes, const char* what) -> Status {
    MPI_Request request = MPI_REQUEST_NULL;
    ZINF_RETURN_IF_ERROR(
        status_from_mpi(fmt::format("mpi_broadcast_blob: MPI_Ibcast of {}", what),
                        MPI_Ibcast(data, bytes, MPI_BYTE, 0, MPI_COMM_WORLD, &request)));
    Backoff backoff;
    for (;;) {
      int flag = 0;
      ZINF_RETURN_IF_ERROR(status_from_mpi("mpi_broadcast_blob: MPI_Test",
                                           MPI_Test(&request, &flag, MPI_STATUS_IGNORE)));
      if (flag != 0) return Status::ok();
      if (Clock::now() >= deadline) {
        g_failed.store(true);
        return Status::timeout(fmt::format(
            "mpi_broadcast_blob: rank {}: the broadcast of {} from rank 0 did not finish within {} "
            "ms",
            rank, what, timeout.count()));
      }
      backoff.pause();
    }
  };
  std::uint64_t bytes = blob.size();
  ZINF_RETURN_IF_ERROR(broadcast(&bytes, sizeof(bytes), "the size"));
  if (bytes > (std::size_t{1} << 20)) {
    return Status::comm_error(
        fmt::format("mpi_broadcast_blob: rank 0 announced {} bytes, over the 1 MiB limit", bytes));
  }
  std::vector<std::byte> out(static_cast<std::size_t>(bytes));
  if (rank == 0) std::copy(blob.begin(), blob.end(), out.begin());
  if (!out.empty()) {
    ZINF_RETURN_IF_ERROR(broadcast(out.data(), static_cast<int>(out.size()), "the blob"));
  }
  return out;
}

}  // namespace zinf
