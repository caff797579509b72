#include "io/swap_space.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <unordered_map>

#include "base/aligned.hpp"
#include "base/arith.hpp"
#include "base/assert.hpp"
#include "base/hash.hpp"
#include "zinf/log.hpp"

namespace zinf {

namespace {

// Lets find() look a key up by string_view without building a std::string.
struct KeyHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view key) const { return std::hash<std::string_view>{}(key); }
};

// Generations of a swap file that may be open at once: the current one and those frozen by
// link_files() that still hold blocks not rewritten since.
constexpr std::size_t kMaxGenerations = 8;
constexpr std::uint8_t kNoGeneration = 0xff;  // a block never written

enum BlockState : std::uint8_t {
  kNeverWritten = 0,
  kWriting = 1,  // a write was submitted and not yet waited for
  kValid = 2,    // checksum holds what is on disk
  kLost = 3,     // the last write failed: the content on disk is unknown
};

}  // namespace

struct SwapSpace::Impl {
  // One generation of a directory's swap file. Generation `current` takes every write; an
  // earlier one, frozen by link_files() and replaced at the next write, is only read, for the
  // blocks not rewritten since, and closed once none is left in it.
  struct File {
    int fd = -1;
    FileHandle handle;
    std::string name;  // for messages: the swap path, or the name link_files() gave it
  };

  struct Dir {
    std::string dir;
    std::string path;
    std::array<File, kMaxGenerations> files;
    std::uint64_t file_bytes = 0;
    std::uint64_t used_bytes = 0;
  };

  struct Extent {
    ExtentInfo info;
    std::uint32_t first_dir = 0;
    std::vector<std::uint64_t> region_offset;  // per directory
    std::vector<std::uint64_t> checksums;      // per block
    std::vector<std::uint8_t> states;          // per block, BlockState
    std::vector<std::uint8_t> generation;      // per block: the file it was last written to
    bool released = false;  // release()d and not written since: a hole in every new generation
  };

  struct Op {
    std::atomic<std::uint32_t> generation{0};
    IoOp op = IoOp::kRead;
    std::uint32_t extent = 0;
    std::uint64_t offset = 0;  // in the extent
    std::uint64_t bytes = 0;
    std::byte* data = nullptr;
    std::uint32_t ticket_count = 0;
    std::uint32_t tickets_done = 0;  // redeemed by earlier waits that timed out
    Ticket* tickets = nullptr;       // into Impl::tickets
    bool abandoned = false;          // given up by abandon(): never redeemed, never reused
    Status status;                   // first engine error among redeemed tickets
  };

  IoEngine& engine;
  SwapOptions options;
  std::vector<Dir> dirs;

  mutable std::mutex mutex;  // create / find / used bytes
  std::unordered_map<std::string, std::uint32_t, KeyHash, std::equal_to<>> keys;
  std::vector<std::unique_ptr<Extent>> extents;  // reserved to max_extents: never reallocates
  std::atomic<std::uint32_t> extent_count{0};

  std::unique_ptr<Op[]> ops;
  std::vector<Ticket> tickets;  // max_ops * tickets_per_op
  std::uint32_t tickets_per_op = 1;
  // With several directories: the most units of one directory that one request moves.
  std::uint64_t chunk_units = 1;
  std::mutex free_mutex;
  std::vector<std::uint32_t> free_ops;
  std::atomic<std::uint32_t> next_generation{1};

  // The swap files' generations (file_mutex): the one written to, whether link_files() froze it
  // (the next write starts a new one), and per generation the blocks whose last write went there.
  std::mutex file_mutex;
  std::atomic<std::uint8_t> current{0};
  std::atomic<bool> frozen{false};
  std::array<std::int64_t, kMaxGenerations> live_blocks{};

  Impl(IoEngine& e, const SwapOptions& o) : engine(e), options(o) {}

  ~Impl() {
    // Redeem whatever is still in flight so no write lands after the files are gone.
    for (std::uint32_t i = 0; ops != nullptr && i < options.max_ops; ++i) {
      Op& op = ops[i];
      if (op.generation.load() == 0 || op.abandoned) continue;
      for (std::uint32_t t = op.tickets_done; t < op.ticket_count; ++t) {
        Status s = engine.wait(op.tickets[t], std::chrono::seconds(30));
        if (s.code() == Code::kTimeout) log_error("io: swap space closing: {}", s.to_string());
      }
    }
    for (Dir& d : dirs) {
      // Earlier generations lost this name when they were replaced; what a checkpoint linked
      // stays under its own name. The name goes only while it is still this space's: another
      // space of this process and rank may have taken it over since (open() does).
      const bool ours = !d.path.empty() && names_file(d.path, d.files[current.load()]);
      for (File& f : d.files) close_file(f);
      if (options.remove_files && ours) ::unlink(d.path.c_str());
    }
  }

  // Whether `path` names the file open as `f` (the same device and inode).
  static bool names_file(const std::string& path, const File& f) {
    struct stat by_name {};
    struct stat by_fd {};
    return f.fd >= 0 && ::stat(path.c_str(), &by_name) == 0 && ::fstat(f.fd, &by_fd) == 0 &&
           by_name.st_dev == by_fd.st_dev && by_name.st_ino == by_fd.st_ino;
  }

  void close_file(File& f) {
    if (f.handle.valid()) (void)engine.close_file(f.handle);
    if (f.fd >= 0) ::close(f.fd);
    f.handle = FileHandle{};
    f.fd = -1;
  }

  // Starts a new generation of every swap file in place of the frozen one: the swap path is
  // unlinked (the checkpoint's link keeps the frozen file) and created again, preallocated, with
  // the holes of the released extents. REQUIRES: file_mutex held, frozen.
  Status start_generation();
  // Punches the extent's room out of generation `g` of every directory's file (see release()).
  // Each directory's units of an extent lie end to end in its region, so one hole per directory.
  // The directories are punched in order; on an error, *punched_dirs (when given) says how many
  // were punched before it: their part of the extent reads zeros now.
  Status punch(const Extent& e, std::uint8_t g, std::size_t* punched_dirs = nullptr) {
    const std::uint64_t units = e.info.block_count;
    for (std::size_t d = 0; d < dirs.size(); ++d) {
      if (punched_dirs != nullptr) *punched_dirs = d;
      std::uint64_t lo = UINT64_MAX, hi = 0;
      for (std::uint64_t u = 0; u < units; ++u) {
        if (unit_dir(e, u) != d) continue;
        lo = std::min(lo, unit_file_offset(e, u));
        hi = std::max(hi, unit_file_offset(e, u) + round_up(block_io_bytes(e, u), kPage));
      }
      if (lo >= hi || dirs[d].files[g].fd < 0) continue;
      if (::fallocate(dirs[d].files[g].fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      static_cast<off_t>(lo), static_cast<off_t>(hi - lo)) != 0) {
        const int err = errno;
        const std::string what =
            fmt::format("swap extent {}: giving back its room in {}", e.info.key, dirs[d].path);
        if (err == EOPNOTSUPP || err == ENOSYS) {
          return Status::unsupported(fmt::format("{}: the filesystem cannot punch holes", what),
                                     err);
        }
        return status_from_errno(what, err);
      }
    }
    if (punched_dirs != nullptr) *punched_dirs = dirs.size();
    return Status::ok();
  }
  // discard() with file_mutex held.
  void discard_locked(Extent& e) {
    for (std::uint64_t b = 0; b < e.info.block_count; ++b) {
      ZINF_ASSERT_MSG(e.states[b] != kWriting, "SwapSpace::discard: a write is in flight");
      const std::uint8_t was = e.generation[b];
      e.states[b] = kNeverWritten;
      e.generation[b] = kNoGeneration;
      if (was == kNoGeneration) continue;
      if (--live_blocks[was] == 0 && was != current.load(std::memory_order_relaxed)) {
        for (Dir& d : dirs) close_file(d.files[was]);
      }
    }
  }
  // Records that blocks [first, end) of `e` are being written to the current generation, and
  // closes an earlier generation that no longer holds any block. REQUIRES: file_mutex held.
  void move_blocks(Extent& e, std::uint64_t first, std::uint64_t end) {
    const std::uint8_t now = current.load(std::memory_order_relaxed);
    for (std::uint64_t b = first; b < end; ++b) {
      const std::uint8_t was = e.generation[b];
      if (was == now) continue;
      e.generation[b] = now;
      ++live_blocks[now];
      if (was == kNoGeneration) continue;
      // No read of this block is in flight (the caller orders a read and a write of one block),
      // and none of any other block of `was` either when it holds no block any more.
      if (--live_blocks[was] == 0) {
        for (Dir& d : dirs) close_file(d.files[was]);
      }
    }
  }

  Extent& extent(ExtentId id) {
    ZINF_ASSERT(id.index < extent_count.load(std::memory_order_acquire));
    return *extents[id.index];
  }

  std::uint64_t block_io_bytes(const Extent& e, std::uint64_t block) const {
    const std::uint64_t start = block * options.block_bytes;
    return std::min<std::uint64_t>(options.block_bytes, e.info.disk_bytes - start);
  }

  std::uint32_t unit_dir(const Extent& e, std::uint64_t unit) const {
    return static_cast<std::uint32_t>((e.first_dir + unit) % dirs.size());
  }
  std::uint64_t unit_file_offset(const Extent& e, std::uint64_t unit) const {
    return e.region_offset[unit_dir(e, unit)] + (unit / dirs.size()) * options.block_bytes;
  }

  Status check_range(const Extent& e, std::uint64_t offset, std::uint64_t bytes,
                     const void* data) const {
    const std::uint64_t end = offset + bytes;
    if (bytes == 0 || end > e.info.bytes || end < offset || offset % options.block_bytes != 0 ||
        (bytes % options.block_bytes != 0 && end != e.info.bytes)) {
      return Status::invalid_argument(fmt::format(
          "swap extent {} ({} bytes): range [{}, {}) must start on a {}-byte block and cover "
          "whole blocks or run to the end",
          e.info.key, e.info.bytes, offset, end, options.block_bytes));
    }
    if (reinterpret_cast<std::uintptr_t>(data) % kPage != 0) {
      return Status::invalid_argument(
          fmt::format("swap extent {}: memory must be 4096-aligned", e.info.key));
    }
    if (round_up(bytes, kPage) > options.max_op_bytes) {
      return Status::invalid_argument(
          fmt::format("swap extent {}: {} bytes in one op exceeds SwapOptions::max_op_bytes = {}",
                      e.info.key, bytes, options.max_op_bytes));
    }
    return Status::ok();
  }

  Result<std::uint32_t> take_op(const Extent& e) {
    std::lock_guard lock(free_mutex);
    if (free_ops.empty()) {
      return Status::resource_exhausted(
          fmt::format("swap extent {}: {} ops already in flight (SwapOptions::max_ops)", e.info.key,
                      options.max_ops));
    }
    const std::uint32_t index = free_ops.back();
    free_ops.pop_back();
    return index;
  }

  void give_op(std::uint32_t index) {
    ops[index].generation.store(0, std::memory_order_release);
    std::lock_guard lock(free_mutex);
    free_ops.push_back(index);
  }

  // Submits the engine requests of op `index` (fields filled). On failure, waits for those
  // already submitted and returns the error.
  Status submit_requests(std::uint32_t index) {
    Op& op = ops[index];
    Extent& e = *extents[op.extent];
    const std::uint64_t first_unit = op.offset / options.block_bytes;
    const std::uint64_t disk_end =
        std::min(e.info.disk_bytes, round_up(op.offset + op.bytes, kPage));
    op.ticket_count = 0;
    op.tickets_done = 0;
    Status status;
    // The file a unit moves to or from: its block's generation (a write set it to the current one).
    // With several directories `data` holds the unit and those after it that the request moves,
    // one every dirs.size() blocks in memory (IoRequest::memory_run_bytes).
    auto issue = [&](const Dir& dir, std::uint64_t unit, std::uint64_t file_offset,
                     std::uint64_t bytes, std::byte* data) {
      const FileHandle file = dir.files[e.generation[unit]].handle;
      ZINF_ASSERT(file.valid());
      IoRequest request{op.op, file, file_offset, static_cast<std::size_t>(bytes), data};
      if (dirs.size() > 1) {
        request.memory_run_bytes = options.block_bytes;
        request.memory_stride_bytes = options.block_bytes * dirs.size();
      }
      Result<Ticket> ticket = engine.submit(request);
      if (!ticket.is_ok()) {
        status = ticket.status();
        return false;
      }
      ZINF_ASSERT(op.ticket_count < tickets_per_op);
      op.tickets[op.ticket_count++] = *ticket;
      return true;
    };
    if (dirs.size() == 1) {
      // One request per run of blocks in one generation (a single one unless a checkpoint froze
      // the file since part of the range was last written).
      std::uint64_t start = op.offset;
      while (start < disk_end) {
        const std::uint64_t unit = start / options.block_bytes;
        std::uint64_t end_unit = unit + 1;
        while (end_unit * options.block_bytes < disk_end &&
               e.generation[end_unit] == e.generation[unit]) {
          ++end_unit;
        }
        const std::uint64_t end = std::min(disk_end, end_unit * options.block_bytes);
        if (!issue(dirs[0], unit, e.region_offset[0] + start, end - start,
                   op.data + (start - op.offset))) {
          break;
        }
        start = end;
      }
    } else {
      // A directory's units of an extent lie end to end in its region (unit u at
      // region_offset + (u / D) * block_bytes), and in the caller's memory one every D blocks:
      // one request moves a run of them that lie in one generation. The op is taken in rounds of
      // D * chunk_units units, each directory's share of a round one request (or one per
      // generation run), the directories in turn: the engine issues a request's pieces before
      // the next request's, and a request of chunk_units units leaves room in its queue for
      // every directory's.
      const std::uint64_t dir_count = dirs.size();
      const std::uint64_t end_unit = (disk_end + options.block_bytes - 1) / options.block_bytes;
      const std::uint64_t round_units = dir_count * chunk_units;
      bool failed = false;
      for (std::uint64_t round = first_unit; round < end_unit && !failed; round += round_units) {
        const std::uint64_t round_end = std::min(end_unit, round + round_units);
        for (std::uint64_t k = 0; k < dir_count && !failed; ++k) {
          std::uint64_t unit = round + k;
          while (unit < round_end) {
            const std::uint64_t first = unit;
            std::uint64_t bytes = 0;
            // Only the op's last unit may be short, and it is the last of its directory's.
            do {
              bytes += std::min<std::uint64_t>(options.block_bytes,
                                               disk_end - unit * options.block_bytes);
              unit += dir_count;
            } while (unit < round_end && e.generation[unit] == e.generation[first]);
            if (!issue(dirs[unit_dir(e, first)], first, unit_file_offset(e, first), bytes,
                       op.data + (first * options.block_bytes - op.offset))) {
              failed = true;
              break;
            }
          }
        }
      }
    }
    if (!status.is_ok()) {
      for (std::uint32_t t = 0; t < op.ticket_count; ++t) {
        (void)engine.wait(op.tickets[t], std::chrono::seconds(60));
      }
      op.ticket_count = 0;
      return status.with_context(fmt::format("swap extent {}", e.info.key));
    }
    return Status::ok();
  }

  Result<SwapTicket> start(IoOp kind, ExtentId id, std::uint64_t offset, std::uint64_t bytes,
                           std::byte* data) {
    Extent& e = extent(id);
    ZINF_RETURN_IF_ERROR(check_range(e, offset, bytes, data));
    const std::uint64_t first_block = offset / options.block_bytes;
    const std::uint64_t end_block =
        (offset + bytes + options.block_bytes - 1) / options.block_bytes;
    if (kind == IoOp::kRead) {
      for (std::uint64_t b = first_block; b < end_block; ++b) {
        const std::uint8_t state = e.states[b];
        if (state == kValid) continue;
        const std::uint64_t at = b * options.block_bytes;
        if (state == kLost) {
          return Status::io_error(fmt::format(
              "swap extent {} at offset {}: the last write of this block failed (or a release "
              "gave its room back part-way); its content is unknown",
              e.info.key, at));
        }
        return Status::failed_precondition(fmt::format(
            "swap extent {} at offset {}: {}", e.info.key, at,
            state == kWriting ? "read while a write of it is in flight" : "never written"));
      }
    }
    ZINF_ASSIGN_OR_RETURN(const std::uint32_t index, take_op(e));
    Op& op = ops[index];
    op.op = kind;
    op.extent = id.index;
    op.offset = offset;
    op.bytes = bytes;
    op.data = data;
    op.abandoned = false;
    op.status = Status();
    if (kind == IoOp::kWrite) {
      // A file link_files() froze is never written again: the write goes to a new generation.
      std::lock_guard lock(file_mutex);
      if (frozen.load(std::memory_order_relaxed)) {
        Status started = start_generation();
        if (!started.is_ok()) {
          give_op(index);
          return started.with_context(fmt::format("swap extent {}", e.info.key));
        }
      }
      move_blocks(e, first_block, end_block);
      e.released = false;
    }
    if (kind == IoOp::kWrite) {
      // Checksum before the write: what is recorded is what the caller handed over.
      for (std::uint64_t b = first_block; b < end_block; ++b) {
        const std::byte* block = data + (b - first_block) * options.block_bytes;
        e.checksums[b] = xxh3_64(block, static_cast<std::size_t>(block_io_bytes(e, b)));
        e.states[b] = kWriting;
      }
    }
    Status status = submit_requests(index);
    if (!status.is_ok()) {
      if (kind == IoOp::kWrite) {
        std::fill(e.states.begin() + static_cast<std::ptrdiff_t>(first_block),
                  e.states.begin() + static_cast<std::ptrdiff_t>(end_block), kLost);
      }
      give_op(index);
      return status;
    }
    std::uint32_t generation = next_generation.fetch_add(1, std::memory_order_relaxed);
    if (generation == 0) generation = next_generation.fetch_add(1, std::memory_order_relaxed);
    op.generation.store(generation, std::memory_order_release);
    return SwapTicket{index, generation};
  }

  Op& checked_op(SwapTicket ticket) {
    ZINF_ASSERT(ticket.slot < options.max_ops);
    Op& op = ops[ticket.slot];
    ZINF_ASSERT_MSG(op.generation.load(std::memory_order_acquire) == ticket.generation,
                    "SwapSpace: stale or redeemed ticket");
    return op;
  }

  Status verify(Op& op) {
    Extent& e = *extents[op.extent];
    const std::uint64_t first_block = op.offset / options.block_bytes;
    const std::uint64_t end_block =
        (op.offset + op.bytes + options.block_bytes - 1) / options.block_bytes;
    std::uint64_t bad = 0;
    std::uint64_t first_bad = 0;
    for (std::uint64_t b = first_block; b < end_block; ++b) {
      const std::byte* block = op.data + (b - first_block) * options.block_bytes;
      if (xxh3_64(block, static_cast<std::size_t>(block_io_bytes(e, b))) != e.checksums[b]) {
        if (bad++ == 0) first_bad = b;
      }
    }
    if (bad == 0) return Status::ok();
    const std::uint64_t unit = first_bad;
    return Status::corruption(fmt::format(
        "swap extent {}: checksum mismatch at extent offset {} (file {} offset {}); {} of {} "
        "blocks read differ from what was written",
        e.info.key, first_bad * options.block_bytes,
        dirs[unit_dir(e, unit)].files[e.generation[unit]].name,
        dirs.size() == 1 ? e.region_offset[0] + first_bad * options.block_bytes
                         : unit_file_offset(e, unit),
        bad, end_block - first_block));
  }

  Status wait(SwapTicket ticket, std::chrono::milliseconds timeout) {
    Op& op = checked_op(ticket);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (op.tickets_done < op.ticket_count) {
      const auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                                     deadline - std::chrono::steady_clock::now()),
                                 std::chrono::milliseconds(0));
      Status s = engine.wait(op.tickets[op.tickets_done], left);
      if (s.code() == Code::kTimeout) {
        return s.with_context(fmt::format("swap extent {}", extents[op.extent]->info.key));
      }
      ++op.tickets_done;
      if (!s.is_ok() && op.status.is_ok()) op.status = std::move(s);
    }
    Extent& e = *extents[op.extent];
    Status status = op.status.is_ok()
                        ? Status::ok()
                        : op.status.with_context(fmt::format("swap extent {}", e.info.key));
    const std::uint64_t first_block = op.offset / options.block_bytes;
    const std::uint64_t end_block =
        (op.offset + op.bytes + options.block_bytes - 1) / options.block_bytes;
    if (op.op == IoOp::kWrite) {
      std::fill(e.states.begin() + static_cast<std::ptrdiff_t>(first_block),
                e.states.begin() + static_cast<std::ptrdiff_t>(end_block),
                status.is_ok() ? kValid : kLost);
    } else if (status.is_ok()) {
      status = verify(op);
    }
    op.status = Status();
    give_op(ticket.slot);
    return status;
  }
};

namespace {

// Creates, checks and preallocates one swap file at `path` in directory `dir`, open in *fd. Every
// failure names the path.
Status prepare_file(const std::string& dir, const std::string& path, std::uint64_t bytes, int* fd) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    return status_from_errno(fmt::format("swap directory {}", dir), errno);
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status::invalid_argument(fmt::format("swap directory {}: not a directory", dir));
  }
  // A file already at `path` is never opened, let alone truncated: a process of the same pid
  // left it (killed before its destructor ran; a container restarted after a crash gives the job
  // the same pids), and a checkpoint may link its bytes (link_files()). Only its name goes; the
  // checkpoint's link keeps the bytes, and a file nothing links is freed.
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    *fd = -1;
  } else {
    *fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
    // A shared lock for as long as the file is open: another process that looks for swap files
    // left by killed processes (engine/nvme_dir.cpp) sees this one in use, whatever pid
    // namespace it runs in, and leaves it. (Advisory: nothing else depends on it.)
    if (*fd >= 0) (void)::flock(*fd, LOCK_SH | LOCK_NB);
  }
  if (*fd < 0) {
    const int err = errno;
    if (err == EINVAL) {
      return Status::unsupported(fmt::format("swap file {}: the filesystem refuses O_DIRECT", path),
                                 err);
    }
    if (err == EACCES || err == EROFS || err == EPERM) {
      return Status::io_error(
          fmt::format("swap directory {}: not writable ({})", dir, std::strerror(err)), err);
    }
    return status_from_errno(fmt::format("swap file {}", path), err);
  }
  // Refuse at once what cannot fit: ext4 keeps the blocks of a fallocate that fails part-way
  // until the file is removed, so asking it for more than the disk holds would fill the disk for
  // everyone else (other ranks' swap files, the user's checkpoints) while it runs.
  struct statvfs vfs {};
  if (::fstatvfs(*fd, &vfs) == 0) {
    const std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (bytes > free_bytes) {
      return Status::no_space(
          fmt::format("swap file {}: the filesystem has no room for {} bytes ({} free)", path,
                      bytes, free_bytes),
          ENOSPC);
    }
  }
  const int rc = ::fallocate(*fd, 0, 0, static_cast<off_t>(bytes));
  if (rc != 0) {
    const int err = errno;
    if (err == ENOSPC || err == EDQUOT) {
      return Status::no_space(
          fmt::format("swap file {}: the filesystem has no room for {} bytes", path, bytes), err);
    }
    if (err != EOPNOTSUPP) return status_from_errno(fmt::format("fallocate {}", path), err);
    log_warn("io: {} cannot preallocate (fallocate unsupported); a full disk will show on write",
             path);
    if (::ftruncate(*fd, static_cast<off_t>(bytes)) != 0) {
      return status_from_errno(fmt::format("ftruncate {}", path), errno);
    }
  }
  // Some filesystems accept O_DIRECT at open and refuse it on the first transfer.
  void* page = std::aligned_alloc(kPage, kPage);
  ZINF_ASSERT(page != nullptr);
  std::memset(page, 0x5a, kPage);
  Status status;
  if (::pwrite(*fd, page, kPage, 0) != static_cast<ssize_t>(kPage) ||
      ::pread(*fd, page, kPage, 0) != static_cast<ssize_t>(kPage)) {
    const int err = errno;
    status = err == EINVAL ? Status::unsupported(
                                 fmt::format("swap file {}: O_DIRECT transfers fail", path), err)
                           : status_from_errno(fmt::format("swap file {}", path), err);
  }
  std::free(page);
  return status;
}

}  // namespace

bool same_directory(const std::string& a, const std::string& b) {
  struct stat sa {};
  struct stat sb {};
  if (::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0) return a == b;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

std::vector<std::string> unique_directories(const std::vector<std::string>& dirs) {
  std::vector<std::string> out;
  out.reserve(dirs.size());
  for (const std::string& dir : dirs) {
    const bool seen = std::any_of(
        out.begin(), out.end(), [&](const std::string& kept) { return same_directory(kept, dir); });
    if (!seen) out.push_back(dir);
  }
  return out;
}

Status SwapSpace::Impl::start_generation() {
  std::uint8_t next = kNoGeneration;
  for (std::size_t g = 0; g < kMaxGenerations; ++g) {
    if (dirs[0].files[g].fd < 0) {
      next = static_cast<std::uint8_t>(g);
      break;
    }
  }
  // link_files() freezes a file only while a generation is free for the next write.
  ZINF_ASSERT(next != kNoGeneration);
  // On failure the new files made so far go, names and all (each holds a preallocated swap
  // file's room); the frozen ones stay open and current.
  auto undo = [&](std::size_t made) {
    for (std::size_t j = 0; j < made; ++j) {
      close_file(dirs[j].files[next]);
      ::unlink(dirs[j].path.c_str());
    }
  };
  for (std::size_t i = 0; i < dirs.size(); ++i) {
    Dir& d = dirs[i];
    File& f = d.files[next];
    if (::unlink(d.path.c_str()) != 0 && errno != ENOENT) {
      const int err = errno;
      undo(i);
      return status_from_errno(fmt::format("swap file {}: unlink", d.path), err);
    }
    Status status = prepare_file(d.dir, d.path, d.file_bytes, &f.fd);
    Result<FileHandle> handle = status.is_ok() ? engine.adopt_fd(f.fd, d.path, /*direct=*/true)
                                               : Result<FileHandle>(status);
    if (!handle.is_ok()) {
      undo(i + 1);
      return handle.status();
    }
    f.handle = *handle;
    f.name = d.path;
  }
  // The released extents take no room in the new files either (as far as the filesystem lets:
  // one that cannot punch holes keeps the room, which only costs disk).
  const std::uint32_t extent_total = extent_count.load(std::memory_order_acquire);
  for (std::uint32_t x = 0; x < extent_total; ++x) {
    if (!extents[x]->released) continue;
    Status punched = punch(*extents[x], next);
    if (!punched.is_ok()) log_warn("io: {}", punched.to_string());
  }
  const std::uint8_t was = current.load(std::memory_order_relaxed);
  current.store(next, std::memory_order_release);
  frozen.store(false, std::memory_order_release);
  // The frozen generation holds blocks until they are written again; one that holds none (a
  // space nothing was written to) is closed now.
  if (live_blocks[was] == 0) {
    for (Dir& d : dirs) close_file(d.files[was]);
  }
  return Status::ok();
}

SwapSpace::SwapSpace(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SwapSpace::~SwapSpace() = default;

Result<std::unique_ptr<SwapSpace>> SwapSpace::open(IoEngine& engine, const SwapOptions& options) {
  if (options.dirs.empty() || options.capacity_bytes == 0) {
    return Status::invalid_argument("SwapOptions: at least one directory and capacity_bytes > 0");
  }
  if (options.block_bytes == 0 || options.block_bytes % kPage != 0 ||
      options.max_op_bytes < options.block_bytes || options.max_ops == 0 ||
      options.max_extents == 0) {
    return Status::invalid_argument(
        "SwapOptions: block_bytes a positive multiple of 4096, max_op_bytes >= block_bytes, "
        "max_ops and max_extents > 0");
  }
  // Two entries that name one directory (the same string, or two spellings of it: "/nvme" and
  // "/nvme/", a symlink) would put two swap files at one path: the second's preparation unlinks
  // the first's name, and link_files() then names the wrong file.
  for (std::size_t i = 0; i < options.dirs.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (!same_directory(options.dirs[j], options.dirs[i])) continue;
      if (options.dirs[j] == options.dirs[i]) {
        return Status::invalid_argument(
            fmt::format("SwapOptions: directory {} is listed twice", options.dirs[i]));
      }
      return Status::invalid_argument(
          fmt::format("SwapOptions: directories {} and {} are the same directory", options.dirs[j],
                      options.dirs[i]));
    }
  }
  auto impl = std::make_unique<Impl>(engine, options);
  const std::uint64_t dir_count = options.dirs.size();
  const std::uint64_t per_dir =
      round_up((options.capacity_bytes + dir_count - 1) / dir_count, options.block_bytes);
  std::string name = options.file_name;
  if (const std::size_t at = name.find("{pid}"); at != std::string::npos) {
    name.replace(at, 5, std::to_string(::getpid()));
  }
  impl->dirs.resize(dir_count);
  for (std::size_t i = 0; i < dir_count; ++i) {
    Impl::Dir& d = impl->dirs[i];
    d.dir = options.dirs[i];
    d.path = d.dir + "/" + name;
    Impl::File& f = d.files[0];
    Status status = prepare_file(d.dir, d.path, per_dir, &f.fd);
    if (!status.is_ok()) return status;
    d.file_bytes = per_dir;
    f.name = d.path;
    ZINF_ASSIGN_OR_RETURN(f.handle, engine.adopt_fd(f.fd, d.path, /*direct=*/true));
  }
  impl->extents.reserve(options.max_extents);
  // With several directories, requests of up to chunk_units units each: D of them fill the
  // engine's queue (queue_depth pieces of its block_bytes; a unit is at least one piece).
  const std::uint64_t unit_pieces =
      (options.block_bytes + engine.options().block_bytes - 1) / engine.options().block_bytes;
  impl->chunk_units =
      std::max<std::uint64_t>(1, engine.options().queue_depth / (unit_pieces * dir_count));
  // At most one request per unit (blocks of alternate generations), plus one. An op moves part
  // of one extent, which fits in the files: a space smaller than max_op_bytes needs tickets for
  // its files' blocks only (the default 1 GiB of 64 KiB blocks was 33 MiB of tickets otherwise).
  const std::uint64_t op_bound = std::min(options.max_op_bytes, per_dir * dir_count);
  impl->tickets_per_op =
      static_cast<std::uint32_t>((op_bound + options.block_bytes - 1) / options.block_bytes + 1);
  impl->tickets.resize(static_cast<std::size_t>(options.max_ops) * impl->tickets_per_op);
  impl->ops = std::make_unique<Impl::Op[]>(options.max_ops);
  for (std::uint32_t i = 0; i < options.max_ops; ++i) {
    impl->ops[i].tickets =
        impl->tickets.data() + static_cast<std::size_t>(i) * impl->tickets_per_op;
  }
  impl->free_ops.reserve(options.max_ops);
  for (std::uint32_t i = options.max_ops; i-- > 0;) impl->free_ops.push_back(i);
  return std::unique_ptr<SwapSpace>(new SwapSpace(std::move(impl)));
}

Result<ExtentId> SwapSpace::create(std::string_view key, std::uint64_t bytes) {
  Impl& m = *impl_;
  if (key.empty() || bytes == 0) {
    return Status::invalid_argument("SwapSpace::create: empty key or zero bytes");
  }
  std::lock_guard lock(m.mutex);
  if (m.keys.find(key) != m.keys.end()) {
    return Status::invalid_argument(fmt::format("swap extent {} already exists", key));
  }
  const std::uint32_t count = m.extent_count.load(std::memory_order_relaxed);
  if (count >= m.options.max_extents) {
    return Status::resource_exhausted(
        fmt::format("swap extent {}: all {} extents are in use (SwapOptions::max_extents)", key,
                    m.options.max_extents));
  }
  auto e = std::make_unique<Impl::Extent>();
  e->info.key = std::string(key);
  e->info.bytes = bytes;
  e->info.disk_bytes = round_up(bytes, kPage);
  const std::uint64_t block = m.options.block_bytes;
  const std::uint64_t units = (e->info.disk_bytes + block - 1) / block;
  e->info.block_count = static_cast<std::uint32_t>(units);
  const std::size_t dir_count = m.dirs.size();
  e->first_dir = count % static_cast<std::uint32_t>(dir_count);
  e->region_offset.resize(dir_count);
  // Units of directory d are those u with (first_dir + u) % D == d; count them per directory.
  std::vector<std::uint64_t> need(dir_count, 0);
  for (std::size_t d = 0; d < dir_count; ++d) {
    const std::uint64_t r = (d + dir_count - e->first_dir) % dir_count;  // first unit in d
    need[d] = r < units ? ((units - r + dir_count - 1) / dir_count) * block : 0;
    if (dir_count == 1) need[d] = e->info.disk_bytes;
    if (m.dirs[d].used_bytes + need[d] > m.dirs[d].file_bytes) {
      std::string where;
      for (const auto& dd : m.dirs) where += (where.empty() ? "" : ", ") + dd.dir;
      return Status::no_space(fmt::format(
          "swap extent {} ({} bytes): the swap space in {} is full ({} of {} bytes used in {})",
          key, bytes, where, m.dirs[d].used_bytes, m.dirs[d].file_bytes, m.dirs[d].path));
    }
  }
  for (std::size_t d = 0; d < dir_count; ++d) {
    e->region_offset[d] = m.dirs[d].used_bytes;
    // Keep regions block-aligned so a stripe unit never straddles two regions' pages.
    m.dirs[d].used_bytes += round_up(need[d], kPage);
  }
  e->checksums.assign(units, 0);
  e->states.assign(units, kNeverWritten);
  e->generation.assign(units, kNoGeneration);
  m.extents.push_back(std::move(e));
  m.keys.emplace(std::string(key), count);
  m.extent_count.store(count + 1, std::memory_order_release);
  return ExtentId{count};
}

Result<ExtentId> SwapSpace::find(std::string_view key) const {
  std::lock_guard lock(impl_->mutex);
  auto it = impl_->keys.find(key);
  if (it == impl_->keys.end()) {
    return Status::not_found(fmt::format("swap extent {} does not exist", key));
  }
  return ExtentId{it->second};
}

const ExtentInfo& SwapSpace::info(ExtentId id) const { return impl_->extent(id).info; }

Result<SwapTicket> SwapSpace::write(ExtentId id, std::uint64_t offset, std::uint64_t bytes,
                                    const void* src) {
  return impl_->start(IoOp::kWrite, id, offset, bytes,
                      static_cast<std::byte*>(const_cast<void*>(src)));
}

Result<SwapTicket> SwapSpace::read(ExtentId id, std::uint64_t offset, std::uint64_t bytes,
                                   void* dst) {
  return impl_->start(IoOp::kRead, id, offset, bytes, static_cast<std::byte*>(dst));
}

bool SwapSpace::poll(SwapTicket ticket) const {
  Impl::Op& op = impl_->checked_op(ticket);
  for (std::uint32_t t = op.tickets_done; t < op.ticket_count; ++t) {
    if (!impl_->engine.poll(op.tickets[t])) return false;
  }
  return true;
}

Status SwapSpace::wait(SwapTicket ticket, std::chrono::milliseconds timeout) {
  return impl_->wait(ticket, timeout);
}

void SwapSpace::cancel(SwapTicket ticket) {
  Impl::Op& op = impl_->checked_op(ticket);
  for (std::uint32_t t = op.tickets_done; t < op.ticket_count; ++t) {
    (void)impl_->engine.cancel(op.tickets[t]);
  }
}

void SwapSpace::abandon(SwapTicket ticket) {
  Impl::Op& op = impl_->checked_op(ticket);
  Impl::Extent& e = *impl_->extents[op.extent];
  if (op.op == IoOp::kWrite) {
    const std::uint64_t block_bytes = impl_->options.block_bytes;
    const std::uint64_t first_block = op.offset / block_bytes;
    const std::uint64_t end_block = (op.offset + op.bytes + block_bytes - 1) / block_bytes;
    std::fill(e.states.begin() + static_cast<std::ptrdiff_t>(first_block),
              e.states.begin() + static_cast<std::ptrdiff_t>(end_block), kLost);
  }
  log_error(
      "io: swap extent {}: giving up on a {} of {} bytes at extent offset {} that never "
      "completed; its memory stays off limits",
      e.info.key, io_op_name(op.op), op.bytes, op.offset);
  op.abandoned = true;
  // The generation changes so that the ticket is no longer valid; the entry is not given back.
  op.generation.store(UINT32_MAX, std::memory_order_release);
}

// A synchronous op returns with its ticket redeemed whatever happens, so the caller may reuse
// its memory: past the timeout it cancels the op and waits once more; an op not even the cancel
// ends is abandoned (a write's blocks are lost) and the error says so.
Status SwapSpace::finish_sync(SwapTicket ticket, std::chrono::milliseconds timeout) {
  Status st = wait(ticket, timeout);
  if (st.code() != Code::kTimeout) return st;
  cancel(ticket);
  Status again = wait(ticket, timeout);
  if (again.is_ok()) return again;  // it landed just after the timeout
  if (again.code() != Code::kTimeout) {
    return Status::timeout(fmt::format("{}; it was cancelled", st.message()));
  }
  abandon(ticket);
  return Status::timeout(
      fmt::format("{}; cancelling it did not end it either, so it was abandoned", st.message()));
}

Status SwapSpace::write_sync(ExtentId id, const void* src, std::chrono::milliseconds timeout) {
  ZINF_ASSIGN_OR_RETURN(SwapTicket ticket, write(id, src));
  return finish_sync(ticket, timeout);
}

Status SwapSpace::read_sync(ExtentId id, void* dst, std::chrono::milliseconds timeout) {
  return read_sync(id, 0, info(id).bytes, dst, timeout);
}

Status SwapSpace::read_sync(ExtentId id, std::uint64_t offset, std::uint64_t bytes, void* dst,
                            std::chrono::milliseconds timeout) {
  ZINF_ASSIGN_OR_RETURN(SwapTicket ticket, read(id, offset, bytes, dst));
  return finish_sync(ticket, timeout);
}

Result<SwapVerifyReport> SwapSpace::verify(std::chrono::milliseconds timeout) {
  SwapVerifyReport report;
  const std::uint64_t block_bytes = impl_->options.block_bytes;
  AlignedBuffer buffer(static_cast<std::size_t>(block_bytes));
  const std::uint32_t count = impl_->extent_count.load(std::memory_order_acquire);
  for (std::uint32_t i = 0; i < count; ++i) {
    const ExtentId id{i};
    const Impl::Extent& e = impl_->extent(id);
    bool any = false;
    for (std::uint64_t b = 0; b < e.info.block_count; ++b) {
      if (e.states[b] != kValid) {
        ++report.skipped_blocks;
        continue;
      }
      const std::uint64_t offset = b * block_bytes;
      const std::uint64_t bytes = std::min(block_bytes, e.info.bytes - offset);
      ZINF_ASSIGN_OR_RETURN(SwapTicket ticket, read(id, offset, bytes, buffer.data()));
      ZINF_RETURN_IF_ERROR(finish_sync(ticket, timeout));
      ++report.blocks;
      report.bytes += bytes;
      any = true;
    }
    if (any) ++report.extents;
  }
  return report;
}

Status SwapSpace::link_files(const std::vector<std::string>& dest_paths,
                             const std::vector<std::string>& later_names) {
  Impl& m = *impl_;
  ZINF_ASSERT(dest_paths.size() == m.dirs.size() && later_names.size() == m.dirs.size());
  std::lock_guard lock(m.file_mutex);
  for (std::uint32_t i = 0; i < m.options.max_ops; ++i) {
    const Impl::Op& op = m.ops[i];
    if (op.generation.load(std::memory_order_acquire) != 0 && !op.abandoned &&
        op.op == IoOp::kWrite) {
      return Status::failed_precondition(fmt::format(
          "swap space: a write of extent {} is in flight; its files cannot be linked now",
          m.extents[op.extent]->info.key));
    }
  }
  const std::uint8_t now = m.current.load(std::memory_order_relaxed);
  std::size_t free_generations = 0;
  for (std::size_t g = 0; g < kMaxGenerations; ++g) {
    if (g != now && m.dirs[0].files[g].fd < 0) ++free_generations;
  }
  if (free_generations == 0) {
    return Status::resource_exhausted(fmt::format(
        "swap space: {} generations of its files are still read (blocks not rewritten since "
        "earlier links); no file can be frozen now",
        kMaxGenerations));
  }
  // link(2) names what the swap path names, which must still be the file this space wrote:
  // another space of this process and rank, opened since, replaced that name with its own file
  // (open() never reuses a file left at the path). Then nothing is linked: ESTALE, and the
  // caller copies instead.
  for (const Impl::Dir& d : m.dirs) {
    if (!Impl::names_file(d.path, d.files[now])) {
      return Status(Code::kFailedPrecondition, ESTALE,
                    fmt::format("swap file {}: the path no longer names this swap space's file "
                                "(another swap space of this process took the name); not linked",
                                d.path));
    }
  }
  // What the links name must be on the drive: the data (O_DIRECT wrote it past the page cache)
  // and the metadata that makes it readable (fallocated extents become written ones).
  for (Impl::Dir& d : m.dirs) {
    if (::fdatasync(d.files[now].fd) != 0) {
      return status_from_errno(fmt::format("swap file {}: fdatasync", d.path), errno);
    }
  }
  for (std::size_t i = 0; i < m.dirs.size(); ++i) {
    if (::link(m.dirs[i].path.c_str(), dest_paths[i].c_str()) != 0) {
      const int err = errno;
      for (std::size_t j = 0; j < i; ++j) ::unlink(dest_paths[j].c_str());
      return Status(err == ENOSPC || err == EDQUOT ? Code::kNoSpace : Code::kIoError, err,
                    fmt::format("link swap file {} as {}: {}", m.dirs[i].path, dest_paths[i],
                                std::strerror(err)));
    }
  }
  for (std::size_t i = 0; i < m.dirs.size(); ++i) m.dirs[i].files[now].name = later_names[i];
  m.frozen.store(true, std::memory_order_release);
  return Status::ok();
}

Status SwapSpace::adopt_file(const std::string& path, const std::string& name,
                             const std::vector<ExtentId>& extents,
                             const std::vector<std::uint64_t>& checksums) {
  Impl& m = *impl_;
  ZINF_ASSERT(m.dirs.size() == 1);
  std::lock_guard lock(m.file_mutex);
  const std::uint8_t now = m.current.load(std::memory_order_relaxed);
  std::uint8_t g = kNoGeneration;
  // One generation is kept free for the next write of a frozen file.
  std::size_t free_generations = 0;
  for (std::size_t k = 0; k < kMaxGenerations; ++k) {
    if (k == now || m.dirs[0].files[k].fd >= 0) continue;
    if (g == kNoGeneration) g = static_cast<std::uint8_t>(k);
    ++free_generations;
  }
  if (free_generations < 2) {
    return Status::resource_exhausted(
        fmt::format("swap space: {} generations of its files are still read; {} cannot join them",
                    kMaxGenerations, path));
  }
  std::uint64_t end = 0;
  std::size_t blocks = 0;
  for (ExtentId id : extents) {
    const Impl::Extent& e = m.extent(id);
    end = std::max(end, e.region_offset[0] + e.info.disk_bytes);
    blocks += e.info.block_count;
    for (std::uint8_t state : e.states) {
      ZINF_ASSERT_MSG(state != kWriting, "SwapSpace::adopt_file: a write is in flight");
    }
  }
  ZINF_ASSERT(blocks == checksums.size());
  Impl::File& f = m.dirs[0].files[g];
  // A copy of the file on a filesystem that refuses O_DIRECT (tmpfs) is read through the cache.
  bool direct = true;
  f.fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (f.fd < 0 && errno == EINVAL) {
    direct = false;
    f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  }
  if (f.fd < 0) return status_from_errno(fmt::format("swap space: open {}", path), errno);
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) {
    const int err = errno;
    m.close_file(f);
    return status_from_errno(fmt::format("swap space: stat {}", path), err);
  }
  if (static_cast<std::uint64_t>(st.st_size) < end) {
    m.close_file(f);
    return Status::corruption(
        fmt::format("swap space: {} has {} bytes, shorter than the {} its extents need", path,
                    st.st_size, end));
  }
  Result<FileHandle> handle = m.engine.adopt_fd(f.fd, path, direct);
  if (!handle.is_ok()) {
    m.close_file(f);
    return handle.status();
  }
  f.handle = *handle;
  f.name = name;
  std::size_t k = 0;
  for (ExtentId id : extents) {
    Impl::Extent& e = m.extent(id);
    for (std::uint64_t b = 0; b < e.info.block_count; ++b) {
      const std::uint8_t was = e.generation[b];
      e.generation[b] = g;
      ++m.live_blocks[g];
      e.checksums[b] = checksums[k++];
      e.states[b] = kValid;
      if (was == kNoGeneration) continue;
      if (--m.live_blocks[was] == 0 && was != now) {
        for (Impl::Dir& d : m.dirs) m.close_file(d.files[was]);
      }
    }
  }
  return Status::ok();
}

void SwapSpace::discard(ExtentId id) {
  Impl& m = *impl_;
  std::lock_guard lock(m.file_mutex);
  m.discard_locked(m.extent(id));
}

Status SwapSpace::release(ExtentId id) {
  Impl& m = *impl_;
  // One critical section: no write can start a generation, or move a block, between the hole and
  // the blocks' new state.
  std::lock_guard lock(m.file_mutex);
  Impl::Extent& e = m.extent(id);
  for (std::uint64_t b = 0; b < e.info.block_count; ++b) {
    ZINF_ASSERT_MSG(e.states[b] != kWriting, "SwapSpace::release: a write is in flight");
  }
  // A frozen file is a checkpoint's: its hole comes with the next generation.
  if (!m.frozen.load(std::memory_order_relaxed)) {
    const std::uint8_t now = m.current.load(std::memory_order_relaxed);
    std::size_t punched_dirs = 0;
    Status punched = m.punch(e, now, &punched_dirs);
    if (!punched.is_ok()) {
      // The directories before the one that failed gave their part back and read zeros there:
      // the blocks of the current file there no longer hold what their checksums say, so they
      // are lost (a read answers io_error) until the extent is written again; the others (in
      // the other directories, or still read from an earlier generation) keep their content.
      std::vector<bool> gave_back(punched_dirs, false);
      for (std::uint64_t u = 0; u < e.info.block_count; ++u) {
        const std::uint32_t d = m.unit_dir(e, u);
        if (d >= punched_dirs) continue;
        gave_back[d] = true;
        if (e.states[u] == kValid && e.generation[u] == now) e.states[u] = kLost;
      }
      std::string where;
      for (std::size_t d = 0; d < punched_dirs; ++d) {
        if (gave_back[d]) where += fmt::format("{}{}", where.empty() ? "" : ", ", m.dirs[d].path);
      }
      if (where.empty()) return punched;  // nothing given back, nothing discarded
      return Status(punched.code(), punched.sys_code(),
                    fmt::format("{}; its room in {} was given back already: the blocks there read "
                                "zeros and are marked lost until the extent is written again",
                                punched.message(), where));
    }
  }
  e.released = true;
  m.discard_locked(e);
  return Status::ok();
}

bool SwapSpace::in_current_file(ExtentId id) const {
  Impl& m = *impl_;
  std::lock_guard lock(m.file_mutex);
  const Impl::Extent& e = m.extent(id);
  if (m.frozen.load(std::memory_order_relaxed)) return false;
  const std::uint8_t now = m.current.load(std::memory_order_relaxed);
  for (std::uint64_t b = 0; b < e.info.block_count; ++b) {
    if (e.states[b] != kValid || e.generation[b] != now) return false;
  }
  return true;
}

std::uint64_t SwapSpace::file_offset(ExtentId id) const {
  ZINF_ASSERT(impl_->dirs.size() == 1);
  return impl_->extent(id).region_offset[0];
}

std::uint64_t SwapSpace::block_checksum(ExtentId id, std::uint32_t block) const {
  const Impl::Extent& e = impl_->extent(id);
  ZINF_ASSERT(block < e.info.block_count && e.states[block] == kValid);
  return e.checksums[block];
}

std::uint32_t SwapSpace::op_requests(std::uint64_t bytes) const {
  const Impl& m = *impl_;
  const std::uint64_t dir_count = m.dirs.size();
  if (bytes == 0) return 0;
  if (dir_count == 1) return 1;
  const std::uint64_t units =
      (round_up(bytes, kPage) + m.options.block_bytes - 1) / m.options.block_bytes;
  const std::uint64_t round_units = dir_count * m.chunk_units;
  const std::uint64_t full_rounds = units / round_units;
  const std::uint64_t rest = units % round_units;
  return static_cast<std::uint32_t>(full_rounds * dir_count + std::min(rest, dir_count));
}

IoEngine& SwapSpace::engine() const { return impl_->engine; }

const SwapOptions& SwapSpace::options() const { return impl_->options; }

std::vector<std::string> SwapSpace::file_paths() const {
  std::vector<std::string> out;
  for (const auto& d : impl_->dirs) out.push_back(d.path);
  return out;
}

std::uint64_t SwapSpace::used_bytes() const {
  std::lock_guard lock(impl_->mutex);
  std::uint64_t total = 0;
  for (const auto& d : impl_->dirs) total += d.used_bytes;
  return total;
}

}  // namespace zinf
