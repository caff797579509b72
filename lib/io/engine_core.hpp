// EngineCore: what UringEngine and ThreadEngine share — the request slots and their tickets, the
// file table, the registered-memory table, cutting requests into pieces, and the check of every
// piece's result (short transfers, EINTR / EAGAIN, errors, injected faults).
//
// A backend owns the order in which pieces are issued. It calls next_piece() to cut the next
// piece of a queued request, issues it, and hands each completion to check_piece(), which says
// whether the piece is done, must be resubmitted (its fields already advanced past the bytes
// that moved) or failed; piece_finished() then accounts it and completes the request after its
// last piece. The backend guarantees that next_piece() and piece_finished() for one slot are
// never called concurrently (UringEngine: one ring thread per request; ThreadEngine: its queue
// mutex).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "base/assert.hpp"
#include "io/io_engine.hpp"

namespace zinf::io_detail {

// A fixed-capacity FIFO (capacity set once, before use); never allocates after reset().
template <typename T>
class BoundedQueue {
 public:
  void reset(std::size_t capacity) {
    items_.assign(capacity, T{});
    head_ = 0;
    count_ = 0;
  }
  bool empty() const { return count_ == 0; }
  std::size_t size() const { return count_; }
  void push(T value) {
    ZINF_ASSERT(count_ < items_.size());
    items_[(head_ + count_) % items_.size()] = value;
    ++count_;
  }
  T& front() {
    ZINF_DASSERT(count_ > 0);
    return items_[head_];
  }
  T pop() {
    ZINF_ASSERT(count_ > 0);
    T value = items_[head_];
    head_ = (head_ + 1) % items_.size();
    --count_;
    return value;
  }

 private:
  std::vector<T> items_;
  std::size_t head_ = 0;
  std::size_t count_ = 0;
};

// One piece of a request in flight: [offset, offset + bytes) of the file <-> data.
struct Piece {
  std::uint32_t slot = 0;
  std::uint32_t retries = 0;  // consecutive EINTR / EAGAIN / no-progress results
  std::int32_t file_index = -1;
  std::int32_t buf_index = -1;  // registered buffer containing data, or -1
  std::uint64_t offset = 0;
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  IoOp op = IoOp::kRead;
};

// kHung: the fault injector swallowed the completion (FaultInjector::kHang). The backend keeps the
// piece in flight, unfinished, until cancel_request() names its slot (when hung_cancellable())
// or the engine closes, and then finishes it with cancelled_status().
enum class PieceStep { kDone, kResubmit, kFailed, kHung };

struct FileEntry {
  bool used = false;
  bool owned = false;  // close the fd on close_file()
  bool direct = false;
  int fd = -1;
  std::string path;
};

struct Region {
  std::byte* base = nullptr;
  std::size_t bytes = 0;
  std::byte* owner = nullptr;  // the base passed to register_memory (several regions share it)
};

class EngineCore : public IoEngine {
 public:
  explicit EngineCore(const IoOptions& options);
  ~EngineCore() override;

  Result<FileHandle> open_file(const std::string& path, const OpenFileOptions& options) override;
  Result<FileHandle> adopt_fd(int fd, const std::string& path, bool direct) override;
  Status close_file(FileHandle file) override;
  std::string_view file_path(FileHandle file) const override;
  Status register_memory(void* base, std::size_t bytes) override;
  Status unregister_memory(void* base) override;
  Result<Ticket> submit(const IoRequest& request) override;
  bool poll(Ticket ticket) const override;
  Status wait(Ticket ticket, std::chrono::milliseconds timeout) override;
  Status cancel(Ticket ticket) override;
  const IoOptions& options() const override { return options_; }
  IoEngineStats stats() const override;

 protected:
  struct Slot {
    std::mutex mutex;  // with `done_cv`, for waiters
    std::condition_variable done_cv;
    std::atomic<std::uint32_t> generation{0};
    std::atomic<bool> done{false};
    IoRequest request;
    bool direct = false;
    // Owned by the backend while the request runs (see the file comment).
    bool queued = false;  // still has pieces to cut
    bool failed = false;
    std::uint64_t cut_bytes = 0;
    std::uint32_t pieces_in_flight = 0;
    std::uint32_t queue = 0;  // which of the backend's queues (rings) holds the request
    Status status;            // the first error
  };

  // Backend hooks.
  virtual Status file_opened(int index, int fd) = 0;
  virtual void file_closed(int index) = 0;
  virtual Status region_registered(int index, const Region& region) = 0;
  virtual void region_unregistered(int index) = 0;
  // Hands a new request (its slot is filled, queued = true) to the backend.
  virtual void enqueue(std::uint32_t slot) = 0;
  // Stops the request in `slot` (not done, ticket live): under the backend's lock over the slot,
  // calls stop_cutting(), cancels its pieces in flight where it can, and finishes its hung pieces
  // with cancelled_status() when hung_cancellable().
  virtual void cancel_request(std::uint32_t slot) = 0;
  // Called once by the destructor of the concrete engine before its threads are joined.
  void begin_shutdown() { shutting_down_.store(true, std::memory_order_release); }

  // Cuts the next piece of `slot`'s request. Returns false when there is none (all cut, or the
  // request failed); then, if no piece is in flight, the request is completed here. After a
  // true return, slot.queued is false when that was the last piece.
  bool next_piece(std::uint32_t slot, Piece* piece);
  // Judges a finished piece whose transfer returned `result` (bytes, or -errno). Applies the
  // fault injector first. On kResubmit the piece has been advanced (short) or counted (retry);
  // on kFailed `*error` holds the Status naming op, path and offset.
  PieceStep check_piece(Piece& piece, long result, Status* error);
  // Accounts a piece that is done or failed; completes the request after its last piece.
  void piece_finished(std::uint32_t slot, Status error);
  // When the request still has pieces to cut, marks it failed (ECANCELED) so that next_piece()
  // cuts nothing more of it; it completes once its pieces in flight have finished. REQUIRES: the
  // backend's lock over the slot.
  void stop_cutting(std::uint32_t slot);
  // The error a cancelled piece finishes with: io_error, ECANCELED, naming op, path and offset.
  Status cancelled_status(const Piece& piece) const;
  // The error a piece finishes with when the backend cannot issue it: `err` with `what` (e.g.
  // "io_uring_submit failed"), naming op, path and offset.
  Status piece_error(const Piece& piece, std::string_view what, int err) const;
  // Whether cancel() releases pieces the fault injector hung (FaultSpec::hang_ignores_cancel).
  bool hung_cancellable() const;

  Slot& slot(std::uint32_t index) { return slots_[index]; }
  int fd_of(int file_index) const { return files_[file_index].fd; }
  bool shutting_down() const { return shutting_down_.load(std::memory_order_acquire); }

  IoOptions options_;

 private:
  void complete(Slot& slot);
  int find_region(const std::byte* data, std::size_t bytes) const;
  Status timeout_status(const Slot& slot, std::chrono::milliseconds timeout) const;

  std::unique_ptr<Slot[]> slots_;
  std::mutex free_mutex_;
  std::vector<std::uint32_t> free_slots_;  // a stack, capacity max_requests
  std::atomic<std::uint32_t> next_generation_{1};

  mutable std::mutex files_mutex_;  // open / close only; lookups read entries of live files
  std::vector<FileEntry> files_;

  mutable std::shared_mutex regions_mutex_;
  std::vector<Region> regions_;  // kMaxRegisteredBuffers entries; bytes == 0 when unused

  std::atomic<bool> shutting_down_{false};
  std::atomic<std::uint64_t> stat_requests_{0}, stat_pieces_{0}, stat_fixed_pieces_{0},
      stat_retries_{0}, stat_short_{0}, stat_failed_{0};
};

// Factories used by open_engine(); they validate nothing that open_engine() already did.
Result<std::unique_ptr<IoEngine>> make_uring_engine(const IoOptions& options);
Result<std::unique_ptr<IoEngine>> make_thread_engine(const IoOptions& options);

}  // namespace zinf::io_detail
