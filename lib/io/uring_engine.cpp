// UringEngine: IoEngine on liburing.
//
// Each ring has a mutex over its submission side and its piece table, and one thread that
// reaps its completions. A submitting thread takes the ring's mutex, queues its request, cuts
// pieces while fewer than queue_depth are in flight, and submits them itself with one
// io_uring_enter, as fio does; no hand-off to another thread and no wake-up on the way in. The
// ring's thread sleeps in io_uring_enter until completions arrive, then (under the mutex)
// checks them in a batch, resubmits short transfers and EINTR / EAGAIN at once, completes
// finished requests, and cuts the next pieces of queued requests into the room that freed.
//
// Files are registered in every ring (a sparse fixed-file table of max_files) and memory as
// fixed buffers (a sparse table of kMaxRegisteredBuffers), so a piece inside registered memory
// goes out as READ_FIXED / WRITE_FIXED on a fixed file: no per-request page pinning or fd
// lookup in the kernel.
//
// Submission entries: a ring has room for queue_depth pieces, one cancel for each, and the
// destructor's no-op. A piece holds at most one entry at a time, cancel_request() takes an entry
// only while queue_depth + 1 stay free, and nothing else takes one, so prep() always finds one
// and the destructor's no-op always fits, even when the kernel has taken nothing for a while
// (io_uring_submit answering EBUSY).
//
// Ring errors: a hard io_uring_submit error (not EAGAIN / EBUSY / EINTR) breaks the ring. The
// pieces whose entries the kernel did not take fail with it (their entries become no-ops), and
// so does every piece cut on that ring afterwards, so callers get the error from wait(), not a
// timeout. A failing io_uring_wait_cqe does not stop completions from arriving in the completion
// queue, which is shared memory: the ring's thread then polls it, backing off to kWaitRetryMax
// between looks, and logs once when the waits start failing and once when they recover.
//
// Ring memory is mapped and unmapped by liburing's own system calls, which the thread
// sanitizer does not see: a ring mapped where another thread's closed ring was looked like
// that thread's memory. g_ring_maps orders a ring's unmapping before any later ring's mapping
// (a release before io_uring_queue_exit, an acquire after io_uring_queue_init), as the kernel
// does.
#include <liburing.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "io/engine_core.hpp"
#include "io/fault.hpp"
#include "zinf/log.hpp"

namespace zinf::io_detail {
namespace {

constexpr std::uint64_t kWakeTag = ~std::uint64_t{0};
constexpr unsigned kReapBatch = 64;
// Where each entry of a ring's piece table is.
constexpr std::uint8_t kPieceFree = 0;
constexpr std::uint8_t kPieceInKernel = 1;
constexpr std::uint8_t kPieceHung = 2;  // completion swallowed by the fault injector
// How long the destructor waits for a drive to finish what is in flight before giving up.
constexpr std::chrono::seconds kDrainLimit{30};
// The longest pause between looks at the completion queue while io_uring_wait_cqe fails.
constexpr std::chrono::milliseconds kWaitRetryMax{10};

std::atomic<std::uint64_t> g_ring_maps{0};

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
      if (!ring->thread.joinable()) continue;
      std::lock_guard lock(ring->mutex);
      ring->stop = true;
      // A no-op completion wakes the ring's thread, which then drains what is in flight. Its
      // entry is always free (see the file comment). It goes to the kernel directly, past the
      // fault injector: a ring broken only by injection must still wake its thread.
      io_uring_sqe* sqe = io_uring_get_sqe(&ring->ring);
      ZINF_ASSERT(sqe != nullptr);
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, kWakeTag);
      io_uring_submit(&ring->ring);
    }
    for (auto& ring : rings_) {
      if (ring->thread.joinable()) ring->thread.join();
    }
    g_ring_maps.fetch_add(1, std::memory_order_release);
    for (auto& ring : rings_) {
      if (ring->initialized) io_uring_queue_exit(&ring->ring);
    }
  }

  Status init() {
    rings_.reserve(options_.rings);
    for (std::uint32_t i = 0; i < options_.rings; ++i) {
      rings_.push_back(std::make_unique<Ring>());
      Ring& ring = *rings_.back();
      // Room for queue_depth pieces, a cancel for each, and the shutdown no-op.
      const unsigned entries = round_up_pow2(2 * options_.queue_depth + 2);
      io_uring_params params{};
      params.flags = IORING_SETUP_CQSIZE;
      params.cq_entries = entries * 2;
      const int rc = io_uring_queue_init_params(entries, &ring.ring, &params);
      g_ring_maps.fetch_add(1, std::memory_order_acquire);
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
      ring.active.reset(options_.max_requests);
      ring.pieces.resize(options_.queue_depth);
      ring.piece_state.assign(options_.queue_depth, kPieceFree);
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
    slot(slot_index).queue = n % static_cast<std::uint32_t>(rings_.size());
    std::lock_guard lock(ring.mutex);
    ring.active.push(slot_index);
    if (fill(ring) > 0) submit(ring);
  }

  void cancel_request(std::uint32_t slot_index) override {
    Ring& ring = *rings_[slot(slot_index).queue];
    std::lock_guard lock(ring.mutex);
    if (slot(slot_index).done.load(std::memory_order_acquire)) return;
    stop_cutting(slot_index);
    bool cancels = false;
    // Entries kept free for pieces and the shutdown no-op (see the file comment).
    const unsigned reserved = options_.queue_depth + 1;
    for (std::uint32_t p = 0; p < ring.pieces.size(); ++p) {
      if (ring.piece_state[p] == kPieceFree || ring.pieces[p].slot != slot_index) continue;
      if (ring.piece_state[p] == kPieceHung) {
        if (hung_cancellable()) finish(ring, p, cancelled_status(ring.pieces[p]));
        continue;
      }
      // In the kernel: it completes with -ECANCELED if the cancel reaches it, else as it would
      // have. The cancel's own completion carries kWakeTag and is ignored.
      if (!ring.broken.is_ok()) continue;  // nothing reaches the kernel any more
      if (io_uring_sq_space_left(&ring.ring) <= reserved) submit(ring);
      if (!ring.broken.is_ok()) continue;
      if (io_uring_sq_space_left(&ring.ring) <= reserved) {
        log_warn("io: no submission entry left to cancel a piece; it stays in flight");
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&ring.ring);
      ZINF_ASSERT(sqe != nullptr);
      io_uring_prep_cancel64(sqe, p, 0);
      io_uring_sqe_set_data64(sqe, kWakeTag);
      cancels = true;
    }
    // A request with no piece left in flight completes when the ring next looks at it.
    if (fill(ring) > 0 || cancels) submit(ring);
  }

 private:
  struct Ring {
    io_uring ring{};
    bool initialized = false;
    std::thread thread;
    // Guards the submission queue and everything below it. The completion queue is read only
    // by the ring's thread.
    std::mutex mutex;
    bool stop = false;
    BoundedQueue<std::uint32_t> active;  // requests with pieces left to cut, oldest first
    std::vector<Piece> pieces;
    std::vector<std::uint8_t> piece_state;  // kPieceFree / kPieceInKernel / kPieceHung
    std::vector<std::uint32_t> free_pieces;
    std::uint32_t in_flight = 0;
    std::uint32_t resubmits = 0;  // pieces handle() prepped again, not yet submitted
    // Set by a hard io_uring_submit error; every piece on this ring then fails with it.
    Status broken;
    int broken_errno = 0;
    std::uint32_t wait_errors = 0;  // io_uring_wait_cqe failures in a row (ring thread only)
  };

  // Hands the queued entries to the kernel. REQUIRES: ring.mutex held.
  void submit(Ring& ring) {
    if (!ring.broken.is_ok()) return;
    int rc = options_.faults ? options_.faults->on_submit() : 0;
    if (rc == 0) rc = io_uring_submit(&ring.ring);
    // Entries the kernel did not take stay queued and go with the next submit.
    if (rc >= 0 || rc == -EAGAIN || rc == -EBUSY || rc == -EINTR) return;
    // A hard error means the ring itself is broken, which no request on it can recover from.
    log_error("io: io_uring_submit failed: {}; failing the requests on this ring",
              std::strerror(-rc));
    ring.broken_errno = -rc;
    ring.broken = status_from_errno("io_uring_submit", -rc);
    fail_unsubmitted(ring);
    // The requests those pieces belonged to may have pieces left to cut: cutting them now fails
    // them too, and completes each request whose last piece this was.
    fill(ring);
  }

  // After a hard submit error: the entries between the kernel's head and our tail were not
  // taken. Each becomes a no-op (so a later submit that does reach the kernel does nothing with
  // it) and the piece it held fails. REQUIRES: ring.mutex held.
  void fail_unsubmitted(Ring& ring) {
    io_uring_sq& sq = ring.ring.sq;
    const unsigned head = io_uring_smp_load_acquire(sq.khead);
    for (unsigned i = head; i != sq.sqe_tail; ++i) {
      io_uring_sqe* sqe = &sq.sqes[i & sq.ring_mask];
      const std::uint64_t tag = sqe->user_data;
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, kWakeTag);
      if (tag == kWakeTag) continue;
      const auto piece_index = static_cast<std::uint32_t>(tag);
      ZINF_ASSERT(piece_index < ring.pieces.size() &&
                  ring.piece_state[piece_index] == kPieceInKernel);
      finish(ring, piece_index, broken_status(ring, ring.pieces[piece_index]));
    }
  }

  Status broken_status(const Ring& ring, const Piece& piece) const {
    return piece_error(piece, "io_uring_submit failed, the ring is broken", ring.broken_errno);
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
  // Returns how many were prepped. REQUIRES: ring.mutex held.
  std::uint32_t fill(Ring& ring) {
    std::uint32_t prepped = 0;
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
      ring.piece_state[piece_index] = kPieceInKernel;
      ++ring.in_flight;
      if (!ring.broken.is_ok()) {
        finish(ring, piece_index, broken_status(ring, ring.pieces[piece_index]));
        continue;
      }
      prep(ring, piece_index);
      ++prepped;
    }
    return prepped;
  }

  void handle(Ring& ring, std::uint32_t piece_index, int result) {
    Piece& piece = ring.pieces[piece_index];
    Status error;
    switch (check_piece(piece, result, &error)) {
      case PieceStep::kResubmit:
        if (!ring.broken.is_ok()) {
          error = broken_status(ring, piece);
          break;
        }
        prep(ring, piece_index);
        ++ring.resubmits;
        return;
      case PieceStep::kHung:
        // Stays in flight (holding its entry and its place in queue_depth) until cancelled.
        ring.piece_state[piece_index] = kPieceHung;
        return;
      case PieceStep::kDone:
      case PieceStep::kFailed:
        break;
    }
    finish(ring, piece_index, std::move(error));
  }

  // Frees a piece's entry and accounts it. REQUIRES: ring.mutex held.
  void finish(Ring& ring, std::uint32_t piece_index, Status error) {
    const std::uint32_t slot_index = ring.pieces[piece_index].slot;
    ring.piece_state[piece_index] = kPieceFree;
    ring.free_pieces.push_back(piece_index);
    --ring.in_flight;
    piece_finished(slot_index, std::move(error));
  }

  void run(Ring& ring) {
    io_uring_cqe* cqes[kReapBatch];
    bool stopping = false;
    std::chrono::steady_clock::time_point stop_deadline;
    for (;;) {
      io_uring_cqe* first = nullptr;
      int rc = options_.faults ? options_.faults->on_wait() : 0;
      if (rc == 0 && stopping) {
        // A drive that never answers must not hang the destructor: wait in slices.
        __kernel_timespec ts{0, 100 * 1000 * 1000};
        rc = io_uring_wait_cqe_timeout(&ring.ring, &first, &ts);
      } else if (rc == 0) {
        rc = io_uring_wait_cqe(&ring.ring, &first);
      }
      if (rc < 0 && rc != -EINTR && rc != -ETIME && rc != -EAGAIN) {
        // Completions still land in the completion queue: look at it after a pause that grows
        // to kWaitRetryMax, rather than spinning on the failing call.
        if (ring.wait_errors++ == 0) {
          log_error(
              "io: waiting for io_uring completions failed: {}; polling the completion "
              "queue every {} ms until it recovers",
              std::strerror(-rc), kWaitRetryMax.count());
        }
        std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
            kWaitRetryMax, std::chrono::milliseconds(1 << std::min(ring.wait_errors, 8u))));
      } else if (rc >= 0 && ring.wait_errors > 0) {
        log_warn("io: io_uring completions can be waited for again after {} failed waits",
                 ring.wait_errors);
        ring.wait_errors = 0;
      }
      std::lock_guard lock(ring.mutex);
      for (;;) {
        const unsigned count = io_uring_peek_batch_cqe(&ring.ring, cqes, kReapBatch);
        if (count == 0) break;
        for (unsigned i = 0; i < count; ++i) {
          const std::uint64_t tag = io_uring_cqe_get_data64(cqes[i]);
          if (tag != kWakeTag) handle(ring, static_cast<std::uint32_t>(tag), cqes[i]->res);
        }
        io_uring_cq_advance(&ring.ring, count);
      }
      const std::uint32_t resubmitted = ring.resubmits;
      ring.resubmits = 0;
      if (fill(ring) + resubmitted > 0) submit(ring);
      if (ring.stop && !stopping) {
        stopping = true;
        stop_deadline = std::chrono::steady_clock::now() + kDrainLimit;
        // A hung (fault-injected) piece lasts until the engine closes.
        for (std::uint32_t p = 0; p < ring.pieces.size(); ++p) {
          if (ring.piece_state[p] == kPieceHung) finish(ring, p, cancelled_status(ring.pieces[p]));
        }
      }
      if (stopping && ring.in_flight == 0 && ring.active.empty()) break;
      if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
        // Closing the ring cancels what the drive still holds; its memory is the caller's
        // problem only if the caller frees it before the process ends, which it was told not
        // to do while a wait returned timeout.
        log_error("io: closing a ring with {} pieces still in flight after {} s", ring.in_flight,
                  std::chrono::duration_cast<std::chrono::seconds>(kDrainLimit).count());
        break;
      }
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
