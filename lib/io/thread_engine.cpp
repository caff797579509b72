// ThreadEngine: IoEngine on pread / pwrite and a fixed pool of threads.
//
// rings * queue_depth threads (at most kMaxThreads) share one FIFO of requests. A thread takes
// the next piece of the request at the front (under the queue mutex), moves it with
// pread / pwrite outside the mutex, loops on short transfers and EINTR / EAGAIN through the
// same check as the uring backend, and accounts the piece under the mutex again. The pool
// keeps as many pieces in flight as it has threads, which is the queue depth.
//
// Unlike DeepSpeed's thread engine, which splits each request evenly over its threads, pieces
// are handed out one block at a time, so one slow piece never holds up a thread's whole share.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "io/engine_core.hpp"

namespace zinf::io_detail {
namespace {

class ThreadEngine final : public EngineCore {
 public:
  explicit ThreadEngine(const IoOptions& options) : EngineCore(options) {
    active_.reset(options_.max_requests);
    cancel_requested_.assign(options_.max_requests, 0);
  }

  ~ThreadEngine() override {
    begin_shutdown();
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_cv_.notify_all();
    hung_cv_.notify_all();
    for (std::thread& thread : threads_) thread.join();
  }

  void start() {
    const std::uint32_t count =
        std::min<std::uint32_t>(options_.rings * options_.queue_depth, kMaxThreads);
    threads_.reserve(count);
    hung_.assign(count, Hung{});
    for (std::uint32_t i = 0; i < count; ++i) threads_.emplace_back([this, i] { run(i); });
  }

  EngineKind kind() const override { return EngineKind::kThread; }

 protected:
  Status file_opened(int, int) override { return Status::ok(); }
  void file_closed(int) override {}
  Status region_registered(int, const Region&) override { return Status::ok(); }
  void region_unregistered(int) override {}

  void enqueue(std::uint32_t slot_index) override {
    {
      std::lock_guard lock(mutex_);
      cancel_requested_[slot_index] = 0;  // a new request in this slot
      active_.push(slot_index);
    }
    work_cv_.notify_one();
  }

  void cancel_request(std::uint32_t slot_index) override {
    {
      std::lock_guard lock(mutex_);
      if (slot(slot_index).done.load(std::memory_order_acquire)) return;
      stop_cutting(slot_index);
      if (hung_cancellable()) {
        // A piece of this request whose thread has not reached wait_hung() yet (the injector
        // may still be sleeping in it) sees the flag there.
        cancel_requested_[slot_index] = 1;
        for (Hung& h : hung_) {
          if (h.active && h.slot == slot_index) h.cancelled = true;
        }
      }
    }
    // A queued request with nothing in flight completes when a thread next looks at it.
    work_cv_.notify_one();
    hung_cv_.notify_all();
  }

 private:
  // A thread whose piece the fault injector hung waits here, as a thread stuck in pread would,
  // until the request is cancelled or the engine closes.
  struct Hung {
    bool active = false;
    bool cancelled = false;
    std::uint32_t slot = 0;
  };

  // Waits until the hung piece is released; returns the error it finishes with.
  Status wait_hung(std::uint32_t thread_index, const Piece& piece) {
    std::unique_lock lock(mutex_);
    Hung& h = hung_[thread_index];
    h = Hung{true, cancel_requested_[piece.slot] != 0, piece.slot};
    hung_cv_.wait(lock, [&] { return h.cancelled || stop_; });
    h.active = false;
    return cancelled_status(piece);
  }

  void run(std::uint32_t thread_index) {
    for (;;) {
      Piece piece;
      bool more = false;
      {
        std::unique_lock lock(mutex_);
        for (;;) {
          work_cv_.wait(lock, [&] { return stop_ || !active_.empty(); });
          if (active_.empty()) return;  // stop_ and nothing left: drained
          const std::uint32_t slot_index = active_.front();
          if (!next_piece(slot_index, &piece)) {
            active_.pop();
            continue;
          }
          if (!slot(slot_index).queued) active_.pop();
          more = !active_.empty();
          break;
        }
      }
      // More pieces may be waiting for another thread.
      if (more) work_cv_.notify_one();
      Status error;
      const int fd = fd_of(piece.file_index);
      for (;;) {
        const ssize_t moved =
            piece.op == IoOp::kRead
                ? ::pread(fd, piece.data, piece.bytes, static_cast<off_t>(piece.offset))
                : ::pwrite(fd, piece.data, piece.bytes, static_cast<off_t>(piece.offset));
        const long result = moved < 0 ? -static_cast<long>(errno) : static_cast<long>(moved);
        const PieceStep step = check_piece(piece, result, &error);
        if (step == PieceStep::kHung) error = wait_hung(thread_index, piece);
        if (step != PieceStep::kResubmit) break;
      }
      std::lock_guard lock(mutex_);
      piece_finished(piece.slot, std::move(error));
    }
  }

  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable hung_cv_;
  std::vector<Hung> hung_;  // one per thread, guarded by mutex_
  // Per slot: cancel() reached the request while it was in flight; guarded by mutex_.
  std::vector<std::uint8_t> cancel_requested_;
  bool stop_ = false;
  BoundedQueue<std::uint32_t> active_;  // guarded by mutex_
  std::vector<std::thread> threads_;
};

}  // namespace

Result<std::unique_ptr<IoEngine>> make_thread_engine(const IoOptions& options) {
  auto engine = std::make_unique<ThreadEngine>(options);
  engine->start();
  return std::unique_ptr<IoEngine>(std::move(engine));
}

}  // namespace zinf::io_detail
