#include "io/engine_core.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "io/fault.hpp"

namespace zinf::io_detail {

namespace {
// The kernel caps one registered buffer at 1 GiB.
constexpr std::size_t kMaxRegionBytes = std::size_t{1} << 30;

// The error a cancelled request or piece finishes with: the same words for both.
Status cancelled(IoOp op, std::string_view path, std::uint64_t offset, std::uint64_t bytes) {
  return status_from_errno(fmt::format("{} of {} at offset {} ({} bytes): cancelled",
                                       io_op_name(op), path, offset, bytes),
                           ECANCELED);
}
}  // namespace

EngineCore::EngineCore(const IoOptions& options) : options_(options) {
  slots_ = std::make_unique<Slot[]>(options_.max_requests);
  free_slots_.reserve(options_.max_requests);
  for (std::uint32_t i = options_.max_requests; i-- > 0;) free_slots_.push_back(i);
  files_.resize(options_.max_files);
  regions_.resize(kMaxRegisteredBuffers);
}

EngineCore::~EngineCore() {
  for (FileEntry& file : files_) {
    if (file.used && file.owned) ::close(file.fd);
  }
}

Result<FileHandle> EngineCore::open_file(const std::string& path, const OpenFileOptions& options) {
  int flags = (options.write ? O_RDWR : O_RDONLY) | O_CLOEXEC;
  if (options.create) flags |= O_CREAT;
  if (options.direct) flags |= O_DIRECT;
  const int fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0) {
    const int err = errno;
    if (err == EINVAL && options.direct) {
      return Status::unsupported(
          fmt::format("open {}: the filesystem refuses O_DIRECT (EINVAL)", path), err);
    }
    return status_from_errno(fmt::format("open {}", path), err);
  }
  Result<FileHandle> handle = adopt_fd(fd, path, options.direct);
  if (!handle.is_ok()) {
    ::close(fd);
    return handle;
  }
  std::lock_guard lock(files_mutex_);
  files_[handle->index].owned = true;
  return handle;
}

Result<FileHandle> EngineCore::adopt_fd(int fd, const std::string& path, bool direct) {
  if (fd < 0) return Status::invalid_argument(fmt::format("adopt_fd {}: bad descriptor", path));
  std::lock_guard lock(files_mutex_);
  auto it = std::find_if(files_.begin(), files_.end(), [](const FileEntry& f) { return !f.used; });
  if (it == files_.end()) {
    return Status::resource_exhausted(fmt::format(
        "open {}: all {} file slots are in use (IoOptions::max_files)", path, options_.max_files));
  }
  const int index = static_cast<int>(it - files_.begin());
  ZINF_RETURN_IF_ERROR(file_opened(index, fd).with_context(fmt::format("register {}", path)));
  *it = FileEntry{true, false, direct, fd, path};
  return FileHandle{index};
}

Status EngineCore::close_file(FileHandle file) {
  std::lock_guard lock(files_mutex_);
  if (!file.valid() || file.index >= static_cast<int>(files_.size()) || !files_[file.index].used) {
    return Status::invalid_argument("close_file: not an open file handle");
  }
  FileEntry& entry = files_[file.index];
  file_closed(file.index);
  Status status;
  if (entry.owned && ::close(entry.fd) != 0) {
    status = status_from_errno(fmt::format("close {}", entry.path), errno);
  }
  entry = FileEntry{};
  return status;
}

std::string_view EngineCore::file_path(FileHandle file) const {
  if (!file.valid() || file.index >= static_cast<int>(files_.size())) return "";
  return files_[file.index].path;
}

Status EngineCore::register_memory(void* base, std::size_t bytes) {
  auto* begin = static_cast<std::byte*>(base);
  if (begin == nullptr || bytes == 0 || reinterpret_cast<std::uintptr_t>(begin) % 4096 != 0) {
    return Status::invalid_argument("register_memory: base must be non-null and 4096-aligned");
  }
  std::unique_lock lock(regions_mutex_);
  std::vector<int> taken;
  for (std::size_t done = 0; done < bytes; done += kMaxRegionBytes) {
    auto it = std::find_if(regions_.begin(), regions_.end(),
                           [](const Region& r) { return r.bytes == 0; });
    Status status;
    if (it == regions_.end()) {
      status = Status::resource_exhausted(fmt::format(
          "register_memory: all {} registered buffers are in use", kMaxRegisteredBuffers));
    } else {
      const int index = static_cast<int>(it - regions_.begin());
      Region region{begin + done, std::min(kMaxRegionBytes, bytes - done), begin};
      status = region_registered(index, region);
      if (status.is_ok()) {
        *it = region;
        taken.push_back(index);
      }
    }
    if (!status.is_ok()) {
      for (int index : taken) {
        region_unregistered(index);
        regions_[index] = Region{};
      }
      return status;
    }
  }
  return Status::ok();
}

Status EngineCore::unregister_memory(void* base) {
  std::unique_lock lock(regions_mutex_);
  bool found = false;
  for (std::size_t i = 0; i < regions_.size(); ++i) {
    if (regions_[i].bytes != 0 && regions_[i].owner == base) {
      region_unregistered(static_cast<int>(i));
      regions_[i] = Region{};
      found = true;
    }
  }
  return found ? Status::ok()
               : Status::invalid_argument("unregister_memory: that memory is not registered");
}

int EngineCore::find_region(const std::byte* data, std::size_t bytes) const {
  std::shared_lock lock(regions_mutex_);
  for (std::size_t i = 0; i < regions_.size(); ++i) {
    const Region& r = regions_[i];
    if (r.bytes != 0 && data >= r.base && data + bytes <= r.base + r.bytes) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

Result<Ticket> EngineCore::submit(const IoRequest& request) {
  if (shutting_down()) return Status::aborted("submit: the I/O engine is shutting down");
  const FileHandle file = request.file;
  if (!file.valid() || file.index >= static_cast<int>(files_.size()) || !files_[file.index].used) {
    return Status::invalid_argument("submit: not an open file handle");
  }
  const FileEntry& entry = files_[file.index];
  if (request.bytes == 0 || request.data == nullptr) {
    return Status::invalid_argument(fmt::format("{} of {} at offset {}: no bytes or no memory",
                                                io_op_name(request.op), entry.path,
                                                request.offset));
  }
  if (request.memory_run_bytes > 0 && request.memory_stride_bytes < request.memory_run_bytes) {
    return Status::invalid_argument(
        fmt::format("{} of {} at offset {}: memory runs of {} bytes every {} bytes overlap",
                    io_op_name(request.op), entry.path, request.offset, request.memory_run_bytes,
                    request.memory_stride_bytes));
  }
  const auto address = reinterpret_cast<std::uintptr_t>(request.data);
  if (entry.direct &&
      (request.offset % kDirectAlignment != 0 || request.bytes % kDirectAlignment != 0 ||
       address % kDirectAlignment != 0 || request.memory_run_bytes % kDirectAlignment != 0 ||
       request.memory_stride_bytes % kDirectAlignment != 0)) {
    // Name each value that is off: a misaligned run or stride is refused just as a misaligned
    // offset is, and a message naming only offset, length and address would send the caller
    // looking at values that are fine.
    std::vector<std::string> misaligned;
    if (request.offset % kDirectAlignment != 0) {
      misaligned.push_back(fmt::format("offset {}", request.offset));
    }
    if (request.bytes % kDirectAlignment != 0) {
      misaligned.push_back(fmt::format("length {}", request.bytes));
    }
    if (address % kDirectAlignment != 0) {
      misaligned.push_back(fmt::format("memory address {:#x}", address));
    }
    if (request.memory_run_bytes % kDirectAlignment != 0) {
      misaligned.push_back(fmt::format("memory_run_bytes {}", request.memory_run_bytes));
    }
    if (request.memory_stride_bytes % kDirectAlignment != 0) {
      misaligned.push_back(fmt::format("memory_stride_bytes {}", request.memory_stride_bytes));
    }
    return Status::invalid_argument(fmt::format(
        "{} of {} at offset {} ({} bytes): O_DIRECT needs offset, length, memory address, memory "
        "run and memory stride aligned to {}; not aligned: {}",
        io_op_name(request.op), entry.path, request.offset, request.bytes, kDirectAlignment,
        fmt::join(misaligned, ", ")));
  }
  std::uint32_t index = 0;
  {
    std::lock_guard lock(free_mutex_);
    if (free_slots_.empty()) {
      return Status::resource_exhausted(
          fmt::format("{} of {} at offset {}: {} requests are already submitted and not waited for "
                      "(IoOptions::max_requests)",
                      io_op_name(request.op), entry.path, request.offset, options_.max_requests));
    }
    index = free_slots_.back();
    free_slots_.pop_back();
  }
  Slot& s = slots_[index];
  s.request = request;
  s.direct = entry.direct;
  s.queued = true;
  s.failed = false;
  s.cut_bytes = 0;
  s.pieces_in_flight = 0;
  s.status = Status();
  s.done.store(false, std::memory_order_relaxed);
  std::uint32_t generation = next_generation_.fetch_add(1, std::memory_order_relaxed);
  if (generation == 0) generation = next_generation_.fetch_add(1, std::memory_order_relaxed);
  s.generation.store(generation, std::memory_order_release);
  enqueue(index);
  return Ticket{index, generation};
}

bool EngineCore::poll(Ticket ticket) const {
  ZINF_ASSERT(ticket.slot < options_.max_requests);
  const Slot& s = slots_[ticket.slot];
  ZINF_ASSERT_MSG(s.generation.load(std::memory_order_acquire) == ticket.generation,
                  "poll: stale or redeemed ticket");
  return s.done.load(std::memory_order_acquire);
}

Status EngineCore::timeout_status(const Slot& s, std::chrono::milliseconds timeout) const {
  return Status::timeout(fmt::format(
      "{} of {} at offset {} ({} bytes) did not finish within {} ms; it is still in flight",
      io_op_name(s.request.op), files_[s.request.file.index].path, s.request.offset,
      s.request.bytes, timeout.count()));
}

Status EngineCore::wait(Ticket ticket, std::chrono::milliseconds timeout) {
  ZINF_ASSERT(ticket.slot < options_.max_requests);
  Slot& s = slots_[ticket.slot];
  ZINF_ASSERT_MSG(s.generation.load(std::memory_order_acquire) == ticket.generation,
                  "wait: stale or redeemed ticket");
  if (!s.done.load(std::memory_order_acquire)) {
    std::unique_lock lock(s.mutex);
    if (!s.done_cv.wait_for(lock, timeout,
                            [&] { return s.done.load(std::memory_order_acquire); })) {
      return timeout_status(s, timeout);
    }
  }
  Status status = std::move(s.status);
  s.status = Status();
  s.generation.store(0, std::memory_order_release);
  std::lock_guard lock(free_mutex_);
  free_slots_.push_back(ticket.slot);
  return status;
}

Status EngineCore::cancel(Ticket ticket) {
  ZINF_ASSERT(ticket.slot < options_.max_requests);
  Slot& s = slots_[ticket.slot];
  ZINF_ASSERT_MSG(s.generation.load(std::memory_order_acquire) == ticket.generation,
                  "cancel: stale or redeemed ticket");
  if (!s.done.load(std::memory_order_acquire)) cancel_request(ticket.slot);
  return Status::ok();
}

void EngineCore::stop_cutting(std::uint32_t index) {
  Slot& s = slots_[index];
  // Pieces already cut report their own result (ECANCELED when the cancel reached them), so a
  // request whose bytes all moved still succeeds.
  if (s.failed || !s.queued) return;
  s.failed = true;
  s.status =
      cancelled(s.request.op, files_[s.request.file.index].path, s.request.offset, s.request.bytes);
}

Status EngineCore::cancelled_status(const Piece& piece) const {
  return cancelled(piece.op, files_[piece.file_index].path, piece.offset, piece.bytes);
}

Status EngineCore::piece_error(const Piece& piece, std::string_view what, int err) const {
  return status_from_errno(
      fmt::format("{} of {} at offset {} ({} bytes): {}", io_op_name(piece.op),
                  files_[piece.file_index].path, piece.offset, piece.bytes, what),
      err);
}

bool EngineCore::hung_cancellable() const {
  return options_.faults == nullptr || !options_.faults->spec().hang_ignores_cancel;
}

bool EngineCore::next_piece(std::uint32_t index, Piece* piece) {
  Slot& s = slots_[index];
  if (!s.queued) return false;
  if (s.failed || s.cut_bytes == s.request.bytes) {
    s.queued = false;
    if (s.pieces_in_flight == 0) complete(s);
    return false;
  }
  std::uint64_t bytes =
      std::min<std::uint64_t>(options_.block_bytes, s.request.bytes - s.cut_bytes);
  std::byte* data = static_cast<std::byte*>(s.request.data) + s.cut_bytes;
  if (const std::uint64_t run = s.request.memory_run_bytes; run > 0) {
    // Memory in runs: the piece ends with its run, and starts where its run lies.
    const std::uint64_t within = s.cut_bytes % run;
    bytes = std::min(bytes, run - within);
    data = static_cast<std::byte*>(s.request.data) +
           (s.cut_bytes / run) * s.request.memory_stride_bytes + within;
  }
  piece->slot = index;
  piece->retries = 0;
  piece->file_index = s.request.file.index;
  piece->offset = s.request.offset + s.cut_bytes;
  piece->data = data;
  piece->bytes = bytes;
  piece->op = s.request.op;
  piece->buf_index = find_region(piece->data, bytes);
  if (piece->buf_index >= 0) stat_fixed_pieces_.fetch_add(1, std::memory_order_relaxed);
  s.cut_bytes += bytes;
  ++s.pieces_in_flight;
  if (s.cut_bytes == s.request.bytes) s.queued = false;
  return true;
}

PieceStep EngineCore::check_piece(Piece& piece, long result, Status* error) {
  if (options_.faults) {
    result = options_.faults->on_complete(piece.op, piece.offset, piece.bytes, piece.data, result);
  }
  if (result == FaultInjector::kHang) return PieceStep::kHung;
  auto fail = [&](int err, std::string_view what) {
    const std::string context =
        fmt::format("{} of {} at offset {} ({} bytes)", io_op_name(piece.op),
                    files_[piece.file_index].path, piece.offset, piece.bytes);
    *error = err != 0 ? status_from_errno(context, err)
                      : Status::io_error(fmt::format("{}: {}", context, what));
    return PieceStep::kFailed;
  };
  if (result == static_cast<long>(piece.bytes)) return PieceStep::kDone;
  if (result > 0 && result < static_cast<long>(piece.bytes)) {
    // A short transfer: the rest is resubmitted from where this one stopped. It made progress,
    // so it does not count against retry_max; the loop is bounded by the bytes left.
    piece.offset += static_cast<std::uint64_t>(result);
    piece.data += result;
    piece.bytes -= static_cast<std::size_t>(result);
    piece.retries = 0;
    stat_short_.fetch_add(1, std::memory_order_relaxed);
    return PieceStep::kResubmit;
  }
  if (result > static_cast<long>(piece.bytes)) {
    return fail(0, fmt::format("the kernel reported {} bytes moved", result));
  }
  if (result == 0 && piece.op == IoOp::kRead) return fail(0, "unexpected end of file");
  const int err = result == 0 ? EAGAIN : static_cast<int>(-result);
  if (err == EINTR || err == EAGAIN) {
    if (++piece.retries > options_.retry_max) {
      return fail(err, "");
    }
    stat_retries_.fetch_add(1, std::memory_order_relaxed);
    return PieceStep::kResubmit;
  }
  return fail(err, "");
}

void EngineCore::piece_finished(std::uint32_t index, Status error) {
  Slot& s = slots_[index];
  stat_pieces_.fetch_add(1, std::memory_order_relaxed);
  ZINF_ASSERT(s.pieces_in_flight > 0);
  --s.pieces_in_flight;
  if (!error.is_ok() && !s.failed) {
    s.failed = true;
    s.status = std::move(error);
  }
  // A request still queued completes when the backend next looks at it (next_piece), so a
  // slot is never completed, redeemed and reused while a backend queue still names it.
  if (!s.queued && s.pieces_in_flight == 0) complete(s);
}

void EngineCore::complete(Slot& s) {
  stat_requests_.fetch_add(1, std::memory_order_relaxed);
  if (s.failed) stat_failed_.fetch_add(1, std::memory_order_relaxed);
  {
    std::lock_guard lock(s.mutex);
    s.done.store(true, std::memory_order_release);
  }
  s.done_cv.notify_all();
}

IoEngineStats EngineCore::stats() const {
  IoEngineStats out;
  out.requests = stat_requests_.load(std::memory_order_relaxed);
  out.pieces = stat_pieces_.load(std::memory_order_relaxed);
  out.fixed_pieces = stat_fixed_pieces_.load(std::memory_order_relaxed);
  out.retries = stat_retries_.load(std::memory_order_relaxed);
  out.short_resubmits = stat_short_.load(std::memory_order_relaxed);
  out.failed_requests = stat_failed_.load(std::memory_order_relaxed);
  return out;
}

}  // namespace zinf::io_detail
