// IoEngine: asynchronous reads and writes of [offset, offset + bytes) of open files, into and out
// of caller memory, with every completion checked.
//
// A request is cut into `block_bytes` pieces, and at most `queue_depth` pieces per ring are in
// flight at once. Each piece is checked on completion: a short transfer resubmits the rest,
// EINTR / EAGAIN are retried at most `retry_max` times, and any other error ends the request
// with a Status whose message names the file, the offset and the operation (the errno is in
// sys_code()). The caller gets a Ticket for each request and waits on it with a timeout; a wait
// that runs out returns Status::timeout naming the file and offset, and never hangs.
//
// Two backends:
//   UringEngine   liburing: files opened with O_DIRECT and registered (fixed files); memory
//                 registered with register_memory() is used through READ_FIXED / WRITE_FIXED;
//                 submissions batched; `rings` rings, each driven by its own thread.
//   ThreadEngine  pread / pwrite on a pool of threads; chosen by EngineKind::kAuto, with one log
//                 line, when the kernel refuses io_uring (EPERM / ENOSYS, as in some containers).
//
// On UringEngine the thread that calls submit() issues the first pieces itself, and the kernel
// delivers their completions through that thread (io_uring task work, an interrupt of it when
// it runs, a wake-up when it sleeps); pieces that the ring's own thread issues complete through
// it. A submitting thread that blocks uninterruptibly for long (not in wait()) delays its
// pieces' completions by as much.
//
// Everything a request needs (request slots, piece records, ring entries, the file table) is
// allocated at open_engine(); submit() and wait() allocate nothing unless they return an error.
//
// Faults for tests come from IoOptions::faults (lib/io/fault.hpp): the injector is consulted on
// every piece's completion inside the backend, so injected short transfers, EINTR and EAGAIN go
// through the engine's real retry loop, not around it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "zinf/status.hpp"

namespace zinf {

class FaultInjector;

enum class EngineKind : std::uint8_t {
  kAuto = 0,    // io_uring if the kernel allows it, else ThreadEngine (one log line says so)
  kUring = 1,   // io_uring or an error (Status::unsupported) from open_engine()
  kThread = 2,  // pread / pwrite on a thread pool
};
std::string_view engine_kind_name(EngineKind kind);  // "auto", "uring", "thread"
// Parses "auto", "uring", "thread"; returns false on anything else.
bool parse_engine_kind(std::string_view text, EngineKind* kind);

enum class IoOp : std::uint8_t { kRead = 0, kWrite = 1 };
std::string_view io_op_name(IoOp op);  // "read", "write"

struct IoOptions {
  // Which backend. kAuto falls back to kThread when io_uring_queue_init() fails with EPERM,
  // ENOSYS or EACCES, or when the environment variable ZINF_IO_DISABLE_URING=1 is set (which
  // lets tests exercise the fallback on kernels that do allow io_uring).
  EngineKind kind = EngineKind::kAuto;

  // Size of the pieces a request is cut into. A multiple of 4096. 1 MiB is the knee of most
  // NVMe drives and of the virtual disks measured here (docs/IO.md).
  std::size_t block_bytes = std::size_t{1} << 20;

  // Pieces in flight per ring. The uring backend sizes its submission queue from this; the
  // thread backend runs rings * queue_depth threads (at most kMaxThreads).
  std::uint32_t queue_depth = 32;

  // io_uring instances, each with its own submission thread. Requests are spread round-robin
  // over rings; a request's pieces all go to one ring. More than one ring helps only when one
  // thread cannot keep the drive busy (small blocks, several drives).
  std::uint32_t rings = 1;

  // Requests that may be submitted and not yet waited for, over the whole engine. submit()
  // returns Status::resource_exhausted beyond this: the bound is the caller's to respect,
  // because blocking there could deadlock a caller that waits on its tickets in order.
  std::uint32_t max_requests = 1024;

  // Files open at once (the size of the registered-file table).
  std::uint32_t max_files = 64;

  // Consecutive EINTR / EAGAIN results, or short transfers that move no bytes, that a piece may
  // see before its request fails with the last errno.
  std::uint32_t retry_max = 8;

  // Injects faults on every piece when set (tests only). Shared so the test can read its
  // counters while the engine runs.
  std::shared_ptr<FaultInjector> faults = nullptr;
};

// A file opened through the engine. A small value; valid until close_file().
struct FileHandle {
  std::int32_t index = -1;
  bool valid() const { return index >= 0; }
};

struct OpenFileOptions {
  bool write = true;    // open read-write (else read-only)
  bool create = false;  // create the file if it does not exist (mode 0644)
  // O_DIRECT: bypass the page cache. REQUIRES of every request on such a file: offset, bytes
  // and the memory address are multiples of kDirectAlignment. Without it any values work.
  bool direct = true;
};

// Alignment that O_DIRECT requests must respect (offsets, lengths and memory addresses).
inline constexpr std::size_t kDirectAlignment = 4096;

// One submitted request. A small value; redeem it exactly once with wait() (or poll() until it
// returns true, then wait()). Its slot is reused after that.
struct Ticket {
  std::uint32_t slot = 0;
  std::uint32_t generation = 0;  // 0 never names a live request
  bool valid() const { return generation != 0; }
};

struct IoRequest {
  IoOp op = IoOp::kRead;
  FileHandle file;
  std::uint64_t offset = 0;  // byte offset in the file
  std::size_t bytes = 0;     // > 0
  void* data = nullptr;      // read into / write from; must stay valid until the wait returns
  // Memory in runs (0: one contiguous range at `data`). With memory_run_bytes > 0 the request's
  // bytes lie in memory as runs of memory_run_bytes, run k starting at data + k *
  // memory_stride_bytes (the last run may be shorter), while the file range stays
  // [offset, offset + bytes): one request moves a striped swap space's blocks of one directory
  // that lie every D blocks in the caller's memory. Pieces never straddle a run. REQUIRES:
  // memory_stride_bytes >= memory_run_bytes; on an O_DIRECT file both multiples of
  // kDirectAlignment.
  std::size_t memory_run_bytes = 0;
  std::size_t memory_stride_bytes = 0;
};

struct IoEngineStats {
  std::uint64_t requests = 0;         // requests completed (ok or not)
  std::uint64_t pieces = 0;           // pieces completed
  std::uint64_t fixed_pieces = 0;     // pieces that used a registered (fixed) buffer
  std::uint64_t retries = 0;          // EINTR / EAGAIN resubmissions
  std::uint64_t short_resubmits = 0;  // short transfers whose rest was resubmitted
  std::uint64_t failed_requests = 0;
};

// Thread-safety: every method may be called from any thread, concurrently, except that one
// Ticket must be waited for by one thread at a time, and close_file() / unregister_memory()
// REQUIRE that no request using that file / memory is in flight.
class IoEngine {
 public:
  virtual ~IoEngine() = default;

  // Opens `path` and enters it in the file table (registered with io_uring on UringEngine).
  // Errors: not_found, io_error (EACCES, ...), unsupported when the filesystem refuses O_DIRECT
  // (EINVAL on open), resource_exhausted when max_files are open. Messages name the path.
  virtual Result<FileHandle> open_file(const std::string& path, const OpenFileOptions& options) = 0;
  // Enters an already open descriptor (the engine does not close it). `path` is for messages.
  virtual Result<FileHandle> adopt_fd(int fd, const std::string& path, bool direct) = 0;
  // Closes (or forgets, for adopt_fd) the file. REQUIRES: no request on it is in flight.
  virtual Status close_file(FileHandle file) = 0;
  virtual std::string_view file_path(FileHandle file) const = 0;

  // Registers [base, base + bytes) for fixed-buffer I/O (READ_FIXED / WRITE_FIXED on uring; a
  // no-op bookkeeping entry on the thread engine). Pieces whose memory lies inside one
  // registered region use it; others use plain READ / WRITE, which work but cost a page-table
  // walk and pin per request. REQUIRES: base is 4096-aligned; the memory outlives the
  // registration. Regions over 1 GiB are registered as several fixed buffers. Errors:
  // resource_exhausted when the table (kMaxRegisteredBuffers fixed buffers) is full, io_error
  // when the kernel refuses (often RLIMIT_MEMLOCK; the message says so).
  virtual Status register_memory(void* base, std::size_t bytes) = 0;
  // REQUIRES: no request using this memory is in flight.
  virtual Status unregister_memory(void* base) = 0;

  // Queues a request. Returns a Ticket, or: invalid_argument (bad file, zero bytes, memory runs
  // that overlap, misaligned for an O_DIRECT file: the message names the file and offset, and
  // which of offset, length, address, memory_run_bytes and memory_stride_bytes is off),
  // resource_exhausted (more than max_requests unredeemed tickets), aborted (the engine is
  // shutting down).
  virtual Result<Ticket> submit(const IoRequest& request) = 0;
  Result<Ticket> read(FileHandle file, std::uint64_t offset, std::size_t bytes, void* dst) {
    return submit(IoRequest{IoOp::kRead, file, offset, bytes, dst});
  }
  Result<Ticket> write(FileHandle file, std::uint64_t offset, std::size_t bytes, const void* src) {
    return submit(IoRequest{IoOp::kWrite, file, offset, bytes, const_cast<void*>(src)});
  }

  // True once the request has finished (successfully or not); wait() then returns at once.
  // REQUIRES: `ticket` came from submit() and was not yet redeemed by wait().
  virtual bool poll(Ticket ticket) const = 0;

  // Waits for the request and redeems the ticket: OK when every byte moved, else the request's
  // Status (io_error / no_space with errno, path and offset; corruption never comes from here).
  // When `timeout` runs out first, returns Status::timeout naming the operation, file, offset
  // and bytes, and the ticket stays unredeemed: the request is still in flight and its memory
  // must not be reused until a later wait() returns something other than timeout.
  virtual Status wait(Ticket ticket, std::chrono::milliseconds timeout) = 0;

  // Asks the engine to stop a request that has not finished (typically after wait() timed out
  // on it): pieces not yet issued are dropped, and pieces in flight are cancelled where the
  // backend can (UringEngine: IORING_OP_ASYNC_CANCEL; ThreadEngine: a pread / pwrite already
  // running cannot be stopped). A cancelled request fails with ECANCELED (io_error) naming the
  // file and offset, unless all its bytes had already moved. Does not redeem the ticket: wait()
  // on it as before. Best effort: a piece the device never completes, and the kernel cannot
  // cancel, stays in flight, and its memory must stay unused until a wait() returns something
  // other than timeout, or the engine is destroyed. Returns OK (also when the request already
  // finished). REQUIRES: `ticket` came from submit() and was not yet redeemed.
  virtual Status cancel(Ticket ticket) = 0;

  // Submits and waits (timeout per request), for code off the hot path.
  Status read_sync(FileHandle file, std::uint64_t offset, std::size_t bytes, void* dst,
                   std::chrono::milliseconds timeout = std::chrono::seconds(60));
  Status write_sync(FileHandle file, std::uint64_t offset, std::size_t bytes, const void* src,
                    std::chrono::milliseconds timeout = std::chrono::seconds(60));

  virtual EngineKind kind() const = 0;  // kUring or kThread, never kAuto
  virtual const IoOptions& options() const = 0;
  virtual IoEngineStats stats() const = 0;
};

// Upper bounds on the fixed tables.
inline constexpr std::uint32_t kMaxRegisteredBuffers = 1024;
inline constexpr std::uint32_t kMaxThreads = 256;

// Creates the engine `options.kind` names. Errors: invalid_argument for options out of range
// (block_bytes not a multiple of 4096, zero depth, rings outside 1..16, ...), unsupported when
// kind == kUring and the kernel refuses io_uring.
Result<std::unique_ptr<IoEngine>> open_engine(const IoOptions& options);

}  // namespace zinf
