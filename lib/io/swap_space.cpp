#include "io/swap_space.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <unordered_map>

#include "base/aligned.hpp"
#include "base/assert.hpp"
#include "zinf/log.hpp"

namespace zinf {

namespace {

constexpr std::uint64_t kPage = 4096;

std::uint64_t round_up(std::uint64_t value, std::uint64_t unit) {
  return (value + unit - 1) / unit * unit;
}

// Lets find() look a key up by string_view without building a std::string.
struct KeyHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view key) const { return std::hash<std::string_view>{}(key); }
};

enum BlockState : std::uint8_t {
  kNeverWritten = 0,
  kWriting = 1,  // a write was submitted and not yet waited for
  kValid = 2,    // checksum holds what is on disk
  kLost = 3,     // the last write failed: the content on disk is unknown
};

}  // namespace

struct SwapSpace::Impl {
  struct Dir {
    std::string dir;
    std::string path;
    int fd = -1;
    FileHandle file;
    std::uint64_t file_bytes = 0;
    std::uint64_t used_bytes = 0;
  };

  struct Extent {
    ExtentInfo info;
    std::uint32_t first_dir = 0;
    std::vector<std::uint64_t> region_offset;  // per directory
    std::vector<std::uint64_t> checksums;      // per block
    std::vector<std::uint8_t> states;          // per block, BlockState
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
  std::mutex free_mutex;
  std::vector<std::uint32_t> free_ops;
  std::atomic<std::uint32_t> next_generation{1};

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
      if (d.file.valid()) (void)engine.close_file(d.file);
      if (d.fd >= 0) ::close(d.fd);
      if (options.remove_files && !d.path.empty()) ::unlink(d.path.c_str());
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
    auto issue = [&](const Dir& dir, std::uint64_t file_offset, std::uint64_t bytes,
                     std::byte* data) {
      Result<Ticket> ticket = engine.submit(
          IoRequest{op.op, dir.file, file_offset, static_cast<std::size_t>(bytes), data});
      if (!ticket.is_ok()) {
        status = ticket.status();
        return false;
      }
      ZINF_ASSERT(op.ticket_count < tickets_per_op);
      op.tickets[op.ticket_count++] = *ticket;
      return true;
    };
    if (dirs.size() == 1) {
      issue(dirs[0], e.region_offset[0] + op.offset, disk_end - op.offset, op.data);
    } else {
      for (std::uint64_t unit = first_unit; unit * options.block_bytes < disk_end; ++unit) {
        const std::uint64_t start = unit * options.block_bytes;
        const std::uint64_t bytes = std::min<std::uint64_t>(options.block_bytes, disk_end - start);
        if (!issue(dirs[unit_dir(e, unit)], unit_file_offset(e, unit), bytes,
                   op.data + (start - op.offset))) {
          break;
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
              "swap extent {} at offset {}: the last write of this block failed; its content "
              "is unknown",
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
      // Checksum before the write: what is recorded is what the caller handed over.
      for (std::uint64_t b = first_block; b < end_block; ++b) {
        const std::byte* block = data + (b - first_block) * options.block_bytes;
        e.checksums[b] = XXH3_64bits(block, static_cast<std::size_t>(block_io_bytes(e, b)));
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
      if (XXH3_64bits(block, static_cast<std::size_t>(block_io_bytes(e, b))) != e.checksums[b]) {
        if (bad++ == 0) first_bad = b;
      }
    }
    if (bad == 0) return Status::ok();
    const std::uint64_t unit = first_bad;
    return Status::corruption(fmt::format(
        "swap extent {}: checksum mismatch at extent offset {} (file {} offset {}); {} of {} "
        "blocks read differ from what was written",
        e.info.key, first_bad * options.block_bytes, dirs[unit_dir(e, unit)].path,
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

// Creates, checks and preallocates one swap file. Every failure names the path.
Status prepare_file(SwapSpace::Impl::Dir& d, std::uint64_t bytes) {
  struct stat st {};
  if (::stat(d.dir.c_str(), &st) != 0) {
    return status_from_errno(fmt::format("swap directory {}", d.dir), errno);
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status::invalid_argument(fmt::format("swap directory {}: not a directory", d.dir));
  }
  d.fd = ::open(d.path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (d.fd < 0) {
    const int err = errno;
    if (err == EINVAL) {
      return Status::unsupported(
          fmt::format("swap file {}: the filesystem refuses O_DIRECT", d.path), err);
    }
    if (err == EACCES || err == EROFS || err == EPERM) {
      return Status::io_error(
          fmt::format("swap directory {}: not writable ({})", d.dir, std::strerror(err)), err);
    }
    return status_from_errno(fmt::format("swap file {}", d.path), err);
  }
  // Refuse at once what cannot fit: ext4 keeps the blocks of a fallocate that fails part-way
  // until the file is removed, so asking it for more than the disk holds would fill the disk for
  // everyone else (other ranks' swap files, the user's checkpoints) while it runs.
  struct statvfs vfs {};
  if (::fstatvfs(d.fd, &vfs) == 0) {
    const std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (bytes > free_bytes) {
      return Status::no_space(
          fmt::format("swap file {}: the filesystem has no room for {} bytes ({} free)", d.path,
                      bytes, free_bytes),
          ENOSPC);
    }
  }
  const int rc = ::fallocate(d.fd, 0, 0, static_cast<off_t>(bytes));
  if (rc != 0) {
    const int err = errno;
    if (err == ENOSPC || err == EDQUOT) {
      return Status::no_space(
          fmt::format("swap file {}: the filesystem has no room for {} bytes", d.path, bytes), err);
    }
    if (err != EOPNOTSUPP) return status_from_errno(fmt::format("fallocate {}", d.path), err);
    log_warn("io: {} cannot preallocate (fallocate unsupported); a full disk will show on write",
             d.path);
    if (::ftruncate(d.fd, static_cast<off_t>(bytes)) != 0) {
      return status_from_errno(fmt::format("ftruncate {}", d.path), errno);
    }
  }
  // Some filesystems accept O_DIRECT at open and refuse it on the first transfer.
  void* page = std::aligned_alloc(kPage, kPage);
  ZINF_ASSERT(page != nullptr);
  std::memset(page, 0x5a, kPage);
  Status status;
  if (::pwrite(d.fd, page, kPage, 0) != static_cast<ssize_t>(kPage) ||
      ::pread(d.fd, page, kPage, 0) != static_cast<ssize_t>(kPage)) {
    const int err = errno;
    status = err == EINVAL ? Status::unsupported(
                                 fmt::format("swap file {}: O_DIRECT transfers fail", d.path), err)
                           : status_from_errno(fmt::format("swap file {}", d.path), err);
  }
  std::free(page);
  d.file_bytes = bytes;
  return status;
}

}  // namespace

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
    for (std::size_t j = 0; j < i; ++j) {
      if (impl->dirs[j].path == d.path) {
        impl->dirs.resize(i);  // do not delete the other entry's file twice
        return Status::invalid_argument(
            fmt::format("SwapOptions: directory {} is listed twice", d.dir));
      }
    }
    Status status = prepare_file(d, per_dir);
    if (!status.is_ok()) return status;
    ZINF_ASSIGN_OR_RETURN(d.file, engine.adopt_fd(d.fd, d.path, /*direct=*/true));
  }
  impl->extents.reserve(options.max_extents);
  impl->tickets_per_op =
      dir_count == 1
          ? 1
          : static_cast<std::uint32_t>(
                (options.max_op_bytes + options.block_bytes - 1) / options.block_bytes + 1);
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
  ZINF_ASSIGN_OR_RETURN(SwapTicket ticket, read(id, dst));
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
