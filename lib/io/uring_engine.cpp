// UringEngine: IoEngine on liburing.
//
// Each ring has its own thread, which owns the ring: it takes requests from the ring's inbox,
// cuts them into pieces, keeps at most queue_depth pieces in flight, submits them in one
// io_uring_enter per loop turn, reaps completions in batches and resubmits short transfers and
// EINTR / EAGAIN at once. Submitting threads never touch the ring; they push a slot index into
// the inbox and write the ring's eventfd only when its thread sleeps with room for more pieces
// (the thread keeps a read of that eventfd armed in the ring, so one io_uring_enter waits for
// both new work and completions).
//
// Files are registered in every ring (a sparse fixed-file table of max_files) and memory as
// fixed buffers (a sparse table of kMaxRegisteredBuffers), so a piece inside registered memory
// goes out as READ_FIXED / WRITE_FIXED on a fixed file: no per-request page pinning or fd
// lookup in the kernel.
#include <fmt/format.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "io/engine_core.hpp"
#include "zinf/log.hpp"

namespace zinf::io_detail {
namespace {

constexpr std::uint64_t kWakeTag = ~std::uint64_t{0};
constexpr unsigned kReapBatch = 64;

unsigned round_up_pow2(unsigned value) {
  unsigned out = 1;
  while (out < value) out <<= 1;
  return out;
}

class UringEngine final : public EngineCore {
 public:
  explicit UringEngine(const IoOptions& options) : EngineCore(options) {}

  ~UringEngine() override {
    begin_shutdown();
    for (auto& ring : rings_) {
      ring->stop.store(true, std::memory_order_release);
      wake(*ring);
    }
    for (auto& ring : rings_) {
      if (ring->thread.joinable()) ring->thread.join();
    }
    for (auto& ring : rings_) {
      if (ring->initialized) io_uring_queue_exit(&ring->ring);
      if (ring->wake_fd >= 0) ::close(ring->wake_fd);
    }
  }

  Status init() {
    rings_.reserve(options_.rings);
    for (std::uint32_t i = 0; i < options_.rings; ++i) {
      rings_.push_back(std::make_unique<Ring>());
      Ring& ring = *rings_.back();
      // Room for queue_depth pieces and the eventfd read.
      const unsigned entries = round_up_pow2(options_.queue_depth + 2);
      io_uring_params params{};
      params.flags = IORING_SETUP_CQSIZE;
      params.cq_entries = entries * 2;
      const int rc = io_uring_queue_init_params(entries, &ring.ring, &params);
      if (rc < 0) {
        const int err = -rc;
        if (err == EPERM || err == ENOSYS || err == EACCES) {
          return Status::unsupported(
              fmt::format("the kernel refuses io_uring ({})", std::strerror(err)), err);
        }
        return status_from_errno("io_uring_queue_init", err);
      }
      ring.initialized = true;
      if (io_uring_register_files_sparse(&ring.ring, options_.max_files) < 0) {
        fixed_files_ = false;  // older kernels: plain descriptors still work
      }
      const int brc = io_uring_register_buffers_sparse(&ring.ring, kMaxRegisteredBuffers);
      if (brc < 0) {
        fixed_buffers_ = false;
        log_warn("io: io_uring refused a fixed-buffer table ({}); using plain reads and writes",
                 std::strerror(-brc));
      }
      ring.wake_fd = eventfd(0, EFD_CLOEXEC);
      if (ring.wake_fd < 0) return status_from_errno("eventfd", errno);
      ring.inbox.reset(options_.max_requests);
      ring.active.reset(options_.max_requests);
      ring.pieces.resize(options_.queue_depth);
      ring.free_pieces.reserve(options_.queue_depth);
      for (std::uint32_t p = options_.queue_depth; p-- > 0;) ring.free_pieces.push_back(p);
    }
    for (auto& ring : rings_) {
      Ring* r = ring.get();
      r->thread = std::thread([this, r] { run(*r); });
    }
    return Status::ok();
  }

  EngineKind kind() const override { return EngineKind::kUring; }

 protected:
  Status file_opened(int index, int fd) override {
    if (!fixed_files_) return Status::ok();
    for (auto& ring : rings_) {
      const int rc = io_uring_register_files_update(&ring->ring, index, &fd, 1);
      if (rc < 0) return status_from_errno("io_uring_register_files_update", -rc);
    }
    return Status::ok();
  }

  void file_closed(int index) override {
    if (!fixed_files_) return;
    int none = -1;
    for (auto& ring : rings_) io_uring_register_files_update(&ring->ring, index, &none, 1);
  }

  Status region_registered(int index, const Region& region) override {
    if (!fixed_buffers_) return Status::ok();
    iovec vec{region.base, region.bytes};
    for (auto& ring : rings_) {
      const int rc = io_uring_register_buffers_update_tag(&ring->ring, index, &vec, nullptr, 1);
      if (rc < 0) {
        Status status = status_from_errno(
            fmt::format("registering {} bytes as an io_uring fixed buffer{}", region.bytes,
                        -rc == ENOMEM ? " (check ulimit -l: RLIMIT_MEMLOCK)" : ""),
            -rc);
        for (auto& undo : rings_) {
          if (undo.get() == ring.get()) break;
          iovec empty{nullptr, 0};
          io_uring_register_buffers_update_tag(&undo->ring, index, &empty, nullptr, 1);
        }
        return status;
      }
    }
    return Status::ok();
  }

  void region_unregistered(int index) override {
    if (!fixed_buffers_) return;
    iovec empty{nullptr, 0};
    for (auto& ring : rings_) {
      io_uring_register_buffers_update_tag(&ring->ring, index, &empty, nullptr, 1);
    }
  }

  void enqueue(std::uint32_t slot_index) override {
    const std::uint32_t n = next_ring_.fetch_add(1, std::memory_order_relaxed);
    Ring& ring = *rings_[n % rings_.size()];
    {
      std::lock_guard lock(ring.inbox_mutex);
      ring.inbox.push(slot_index);
      ring.inbox_count.store(ring.inbox.size(), std::memory_order_seq_cst);
    }
    if (ring.sleeping.load(std::memory_order_seq_cst)) wake(ring);
  }

 private:
  struct Ring {
    io_uring ring{};
    bool initialized = false;
    std::thread thread;
    int wake_fd = -1;
    std::uint64_t wake_value = 0;
    std::atomic<bool> sleeping{false};
    std::atomic<bool> stop{false};
    std::mutex inbox_mutex;
    BoundedQueue<std::uint32_t> inbox;  // guarded by inbox_mutex
    std::atomic<std::size_t> inbox_count{0};
    // Owned by the ring thread.
    BoundedQueue<std::uint32_t> active;
    std::vector<Piece> pieces;
    std::vector<std::uint32_t> free_pieces;
    std::uint32_t in_flight = 0;
  };

  void wake(Ring& ring) {
    const std::uint64_t one = 1;
    // An eventfd write only fails when the counter would overflow, which cannot happen here.
    [[maybe_unused]] const ssize_t rc = ::write(ring.wake_fd, &one, sizeof(one));
  }

  void arm_wake(Ring& ring) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring.ring);
    ZINF_ASSERT(sqe != nullptr);
    io_uring_prep_read(sqe, ring.wake_fd, &ring.wake_value, sizeof(ring.wake_value), 0);
    io_uring_sqe_set_data64(sqe, kWakeTag);
  }

  void prep(Ring& ring, std::uint32_t piece_index) {
    const Piece& p = ring.pieces[piece_index];
    io_uring_sqe* sqe = io_uring_get_sqe(&ring.ring);
    ZINF_ASSERT(sqe != nullptr);  // in_flight <= queue_depth < ring entries
    const int fd = fixed_files_ ? p.file_index : fd_of(p.file_index);
    const unsigned bytes = static_cast<unsigned>(p.bytes);
    if (p.op == IoOp::kRead) {
      if (p.buf_index >= 0 && fixed_buffers_) {
        io_uring_prep_read_fixed(sqe, fd, p.data, bytes, p.offset, p.buf_index);
      } else {
        io_uring_prep_read(sqe, fd, p.data, bytes, p.offset);
      }
    } else {
      if (p.buf_index >= 0 && fixed_buffers_) {
        io_uring_prep_write_fixed(sqe, fd, p.data, bytes, p.offset, p.buf_index);
      } else {
        io_uring_prep_write(sqe, fd, p.data, bytes, p.offset);
      }
    }
    if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, piece_index);
  }

  // Cuts and preps pieces until queue_depth are in flight or no request has pieces left.
  void fill(Ring& ring) {
    while (ring.in_flight < options_.queue_depth && !ring.active.empty()) {
      const std::uint32_t slot_index = ring.active.front();
      Piece piece;
      if (!next_piece(slot_index, &piece)) {
        ring.active.pop();
        continue;
      }
      if (!slot(slot_index).queued) ring.active.pop();
      ZINF_ASSERT(!ring.free_pieces.empty());
      const std::uint32_t piece_index = ring.free_pieces.back();
      ring.free_pieces.pop_back();
      ring.pieces[piece_index] = piece;
      prep(ring, piece_index);
      ++ring.in_flight;
    }
  }

  void take_inbox(Ring& ring) {
    if (ring.inbox_count.load(std::memory_order_seq_cst) == 0) return;
    std::lock_guard lock(ring.inbox_mutex);
    while (!ring.inbox.empty()) ring.active.push(ring.inbox.pop());
    ring.inbox_count.store(0, std::memory_order_seq_cst);
  }

  void handle(Ring& ring, std::uint32_t piece_index, int result) {
    Piece& piece = ring.pieces[piece_index];
    Status error;
    switch (check_piece(piece, result, &error)) {
      case PieceStep::kResubmit:
        prep(ring, piece_index);
        return;
      case PieceStep::kDone:
      case PieceStep::kFailed:
        break;
    }
    const std::uint32_t slot_index = piece.slot;
    ring.free_pieces.push_back(piece_index);
    --ring.in_flight;
    piece_finished(slot_index, std::move(error));
  }

  void run(Ring& ring) {
    arm_wake(ring);
    io_uring_cqe* cqes[kReapBatch];
    for (;;) {
      take_inbox(ring);
      fill(ring);
      const bool stopping = ring.stop.load(std::memory_order_acquire);
      if (stopping && ring.in_flight == 0 && ring.active.empty() &&
          ring.inbox_count.load(std::memory_order_seq_cst) == 0) {
        break;
      }
      // Sleep until a completion or, when there is room for more pieces, new work.
      const bool room = ring.in_flight < options_.queue_depth;
      if (room) {
        ring.sleeping.store(true, std::memory_order_seq_cst);
        if (ring.inbox_count.load(std::memory_order_seq_cst) != 0) {
          ring.sleeping.store(false, std::memory_order_relaxed);
          io_uring_submit(&ring.ring);
          continue;
        }
      }
      int rc;
      if (stopping) {
        // A drive that never answers must not hang the destructor forever: wait in slices.
        __kernel_timespec ts{0, 100 * 1000 * 1000};
        io_uring_cqe* cqe = nullptr;
        rc = io_uring_submit_and_wait_timeout(&ring.ring, &cqe, 1, &ts, nullptr);
      } else {
        rc = io_uring_submit_and_wait(&ring.ring, 1);
      }
      ring.sleeping.store(false, std::memory_order_relaxed);
      if (rc < 0 && rc != -EINTR && rc != -ETIME && rc != -EAGAIN && rc != -EBUSY) {
        log_error("io: io_uring_enter failed: {}", std::strerror(-rc));
      }
      bool rearm = false;
      for (;;) {
        const unsigned count = io_uring_peek_batch_cqe(&ring.ring, cqes, kReapBatch);
        if (count == 0) break;
        for (unsigned i = 0; i < count; ++i) {
          const std::uint64_t tag = io_uring_cqe_get_data64(cqes[i]);
          if (tag == kWakeTag) {
            rearm = true;
          } else {
            handle(ring, static_cast<std::uint32_t>(tag), cqes[i]->res);
          }
        }
        io_uring_cq_advance(&ring.ring, count);
      }
      if (rearm) arm_wake(ring);
    }
  }

  std::vector<std::unique_ptr<Ring>> rings_;
  std::atomic<std::uint32_t> next_ring_{0};
  bool fixed_files_ = true;
  bool fixed_buffers_ = true;
};

}  // namespace

Result<std::unique_ptr<IoEngine>> make_uring_engine(const IoOptions& options) {
  auto engine = std::make_unique<UringEngine>(options);
  ZINF_RETURN_IF_ERROR(engine->init());
  return std::unique_ptr<IoEngine>(std::move(engine));
}

}  // namespace zinf::io_detail
