// Checkpoint files (checkpoint.hpp) through lib/io: durable writes and checksummed reads. The
// file's data moves through an IoEngine (io_uring, or the thread engine), so the faults a test
// injects there (EIO, ENOSPC, short transfers) reach every checkpoint byte; what lib/io does not
// do (open with the O_DIRECT fallback, fsync, rename, directory sync) is plain POSIX here. Rank
// files move with O_DIRECT in 8 MiB aligned blocks where the filesystem allows it, bypassing the
// page cache: buffered writes of gigabytes are throttled by dirty-page writeback, and a cached
// checkpoint would only evict other data. Small files (the manifest, `latest`, the client state)
// go through the page cache.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "base/assert.hpp"
#include "engine/checkpoint.hpp"
#include "io/fault.hpp"
#include "zinf/log.hpp"

namespace zinf {
namespace {

constexpr std::size_t kBlockBytes = std::size_t{8} << 20;
// A checkpoint write or read that does not complete in this long has met a drive that stopped
// answering; it is cancelled and the save or load fails naming the file.
constexpr std::chrono::seconds kIoWait{120};

std::string parent_dir(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Opens `path` with O_DIRECT when `direct` and the filesystem allows it (tmpfs and some others
// refuse it with EINVAL: buffered then). *is_direct says which.
int open_maybe_direct(const std::string& path, int flags, bool direct, bool* is_direct) {
  int fd = -1;
  if (direct) fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644);
  *is_direct = fd >= 0;
  if (fd < 0 && (!direct || errno == EINVAL)) fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  return fd;
}

// Waits for a checkpoint transfer; one that runs past kIoWait is cancelled and waited for again.
Status wait_io(IoEngine& io, Ticket ticket, const std::string& path) {
  Status st = io.wait(ticket, kIoWait);
  if (st.code() != Code::kTimeout) return st;
  (void)io.cancel(ticket);
  Status after = io.wait(ticket, kIoWait);
  // Still in flight after the cancel: the memory it uses must never be reused, so the process
  // cannot go on safely.
  ZINF_ASSERT_MSG(after.code() != Code::kTimeout,
                  "a checkpoint transfer did not finish after its cancel");
  return st.with_context(fmt::format("checkpoint: '{}'", path));
}

}  // namespace

std::string checkpoint_rank_path(const std::string& dir, int rank) {
  return fmt::format("{}/rank{}.zinfckpt", dir, rank);
}

Result<std::unique_ptr<IoEngine>> open_checkpoint_io(std::shared_ptr<FaultInjector> faults) {
  IoOptions options;
  options.block_bytes = std::size_t{1} << 20;
  options.queue_depth = 16;
  options.max_requests = 64;
  options.max_files = 64;
  options.faults = std::move(faults);
  return open_engine(options);
}

Status sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return status_from_errno(fmt::format("checkpoint: open directory '{}'", dir), errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return status_from_errno(fmt::format("checkpoint: fsync directory '{}'", dir), err);
  return Status::ok();
}

// --- CheckpointWriter ----------------------------------------------------------------------------

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::create(IoEngine& io, std::string path,
                                                                   bool direct) {
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter(io, std::move(path)));
  w->pad_ = direct;
  w->fd_ = open_maybe_direct(w->path_, O_CREAT | O_TRUNC | O_WRONLY, direct, &w->direct_);
  if (w->fd_ < 0) {
    return status_from_errno(fmt::format("checkpoint: create '{}'", w->path_), errno);
  }
  Result<FileHandle> file = io.adopt_fd(w->fd_, w->path_, w->direct_);
  if (!file.is_ok()) return file.status().with_context("checkpoint");
  w->file_ = *file;
  for (AlignedBuffer& b : w->blocks_) b = AlignedBuffer(kBlockBytes);
  w->hash_ = XXH3_createState();
  ZINF_ASSERT(w->hash_ != nullptr);
  XXH3_64bits_reset(w->hash_);
  return w;
}

CheckpointWriter::~CheckpointWriter() {
  // No write may still use a block when it is freed.
  for (int b = 0; b < 2; ++b) (void)wait_block(b);
  if (file_.valid()) (void)io_->close_file(file_);
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && fd_ >= 0) ::unlink(path_.c_str());
  if (hash_ != nullptr) XXH3_freeState(hash_);
}

Status CheckpointWriter::wait_block(int b) {
  if (!tickets_[b].valid()) return Status::ok();
  const Ticket t = std::exchange(tickets_[b], Ticket{});
  return wait_io(*io_, t, path_);
}

Status CheckpointWriter::submit_block(std::size_t bytes) {
  if (bytes > 0) {
    ZINF_ASSIGN_OR_RETURN(tickets_[current_],
                          io_->write(file_, written_, bytes, blocks_[current_].data()));
    written_ += bytes;
  }
  current_ ^= 1;
  used_ = 0;
  // The other block's write must be done before it is filled again.
  return wait_block(current_);
}

Status CheckpointWriter::append(const void* data, std::size_t bytes) {
  ZINF_ASSERT(fd_ >= 0 && !committed_);
  XXH3_64bits_update(hash_, data, bytes);
  const auto* p = static_cast<const std::byte*>(data);
  std::size_t done = 0;
  while (done < bytes) {
    const std::size_t take = std::min(bytes - done, kBlockBytes - used_);
    std::memcpy(blocks_[current_].data() + used_, p + done, take);
    used_ += take;
    done += take;
    if (used_ == kBlockBytes) ZINF_RETURN_IF_ERROR(submit_block(used_));
  }
  bytes_ += bytes;
  return Status::ok();
}

Status CheckpointWriter::commit() {
  ZINF_ASSERT(fd_ >= 0 && !committed_);
  // Padded whenever O_DIRECT was asked for, so the file's size does not depend on whether this
  // filesystem allowed it (a checkpoint written on tmpfs loads from ext4 and back).
  if (pad_ && used_ % 4096 != 0) {
    // Zeros to the next multiple of 4096, hashed and counted as part of the file.
    const std::size_t pad = 4096 - used_ % 4096;
    std::memset(blocks_[current_].data() + used_, 0, pad);
    XXH3_64bits_update(hash_, blocks_[current_].data() + used_, pad);
    used_ += pad;
    bytes_ += pad;
  }
  ZINF_RETURN_IF_ERROR(submit_block(used_));
  ZINF_RETURN_IF_ERROR(wait_block(current_ ^ 1));
  ZINF_RETURN_IF_ERROR(wait_block(current_));
  if (::fsync(fd_) != 0) {
    return status_from_errno(fmt::format("checkpoint: fsync '{}'", path_), errno);
  }
  ZINF_RETURN_IF_ERROR(io_->close_file(file_));
  file_ = FileHandle{};
  const int rc = ::close(fd_);
  const int err = errno;
  fd_ = -1;
  if (rc != 0) {
    ::unlink(path_.c_str());
    return status_from_errno(fmt::format("checkpoint: close '{}'", path_), err);
  }
  committed_ = true;
  return Status::ok();
}

// --- CheckpointReader ----------------------------------------------------------------------------

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::open(IoEngine& io, std::string path,
                                                                 bool direct) {
  std::unique_ptr<CheckpointReader> r(new CheckpointReader(io, std::move(path)));
  struct stat st {};
  if (::stat(r->path_.c_str(), &st) != 0) {
    return status_from_errno(fmt::format("checkpoint: open '{}'", r->path_), errno);
  }
  r->file_bytes_ = static_cast<std::uint64_t>(st.st_size);
  // A direct read must end on a 4096 boundary; files that do not (never a rank file) are read
  // through the page cache.
  r->fd_ = open_maybe_direct(r->path_, O_RDONLY, direct && r->file_bytes_ % 4096 == 0, &r->direct_);
  if (r->fd_ < 0) return status_from_errno(fmt::format("checkpoint: open '{}'", r->path_), errno);
  Result<FileHandle> file = io.adopt_fd(r->fd_, r->path_, r->direct_);
  if (!file.is_ok()) return file.status().with_context("checkpoint");
  r->file_ = *file;
  r->block_ = AlignedBuffer(kBlockBytes);
  return r;
}

CheckpointReader::~CheckpointReader() {
  if (file_.valid()) (void)io_->close_file(file_);
  if (fd_ >= 0) ::close(fd_);
}

Status CheckpointReader::read_block(std::byte* buffer, std::size_t capacity, std::uint64_t at,
                                    std::size_t* got) {
  ZINF_ASSERT(at % 4096 == 0 && capacity % 4096 == 0);
  *got = 0;
  if (at >= file_bytes_) return Status::ok();
  const std::size_t bytes =
      static_cast<std::size_t>(std::min<std::uint64_t>(capacity, file_bytes_ - at));
  ZINF_ASSIGN_OR_RETURN(Ticket t, io_->read(file_, at, bytes, buffer));
  ZINF_RETURN_IF_ERROR(wait_io(*io_, t, path_));
  *got = bytes;
  return Status::ok();
}

Status CheckpointReader::read(void* out, std::size_t bytes) {
  auto* p = static_cast<std::byte*>(out);
  std::size_t done = 0;
  while (done < bytes) {
    if (offset_ < block_first_ || offset_ >= block_first_ + block_valid_) {
      block_first_ = offset_ / 4096 * 4096;
      ZINF_RETURN_IF_ERROR(read_block(block_.data(), block_.bytes(), block_first_, &block_valid_));
      if (offset_ >= block_first_ + block_valid_) {
        return Status::corruption(fmt::format("checkpoint: '{}' ends at offset {}, {} bytes short",
                                              path_, block_first_ + block_valid_, bytes - done));
      }
    }
    const std::size_t at = static_cast<std::size_t>(offset_ - block_first_);
    const std::size_t take = std::min(bytes - done, block_valid_ - at);
    std::memcpy(p + done, block_.data() + at, take);
    done += take;
    offset_ += take;
  }
  return Status::ok();
}

Status CheckpointReader::read_at(std::uint64_t offset, std::size_t bytes, void* out) {
  ZINF_ASSERT(!direct_);
  if (offset > file_bytes_ || bytes > file_bytes_ - offset) {
    return Status::corruption(
        fmt::format("checkpoint: '{}' has {} bytes, a read of {} at {} is past its end", path_,
                    file_bytes_, bytes, offset));
  }
  if (bytes == 0) return Status::ok();
  ZINF_ASSIGN_OR_RETURN(Ticket t, io_->read(file_, offset, bytes, out));
  return wait_io(*io_, t, path_);
}

Result<std::uint64_t> CheckpointReader::checksum() {
  XXH3_state_t* hash = XXH3_createState();
  ZINF_ASSERT(hash != nullptr);
  XXH3_64bits_reset(hash);
  std::uint64_t offset = 0;
  Status st;
  // block_ is reused; the sequential position starts over after this.
  block_valid_ = 0;
  while (offset < file_bytes_) {
    std::size_t got = 0;
    st = read_block(block_.data(), block_.bytes(), offset, &got);
    if (!st.is_ok()) break;
    XXH3_64bits_update(hash, block_.data(), got);
    offset += got;
  }
  const std::uint64_t digest = XXH3_64bits_digest(hash);
  XXH3_freeState(hash);
  if (!st.is_ok()) return st;
  return digest;
}

// --- Small files, tags ---------------------------------------------------------------------------

Status write_file_atomically(IoEngine& io, const std::string& path, std::string_view text) {
  const std::string temp = path + ".tmp";
  {
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> w,
                          CheckpointWriter::create(io, temp, /*direct=*/false));
    ZINF_RETURN_IF_ERROR(w->append(text.data(), text.size()));
    ZINF_RETURN_IF_ERROR(w->commit());
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    return status_from_errno(fmt::format("checkpoint: rename '{}' to '{}'", temp, path), err);
  }
  return sync_dir(parent_dir(path));
}

Result<std::string> read_text_file(IoEngine& io, const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> r,
                        CheckpointReader::open(io, path, /*direct=*/false));
  std::string text(r->file_bytes(), '\0');
  ZINF_RETURN_IF_ERROR(r->read_at(0, text.size(), text.data()));
  return text;
}

Status check_checkpoint_tag(std::string_view tag) {
  const bool chars_ok = std::all_of(tag.begin(), tag.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
  if (tag.empty() || tag.size() > 200 || !chars_ok || tag[0] == '.' || tag == kCheckpointLatest) {
    return Status::invalid_argument(fmt::format(
        "checkpoint tag '{}': a tag is 1-200 characters of [A-Za-z0-9._-], does not start with "
        "'.' and is not 'latest'",
        tag));
  }
  return Status::ok();
}

Result<std::string> read_latest_tag(IoEngine& io, const std::string& dir) {
  const std::string path = fmt::format("{}/{}", dir, kCheckpointLatest);
  Result<std::string> text = read_text_file(io, path);
  if (!text.is_ok()) {
    return text.status().with_context(
        fmt::format("no checkpoint in '{}' ('{}' names the newest one)", dir, path));
  }
  std::string tag = *text;
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == '\r' || tag.back() == ' ')) {
    tag.pop_back();
  }
  Status ok = check_checkpoint_tag(tag);
  if (!ok.is_ok()) {
    return Status::corruption(fmt::format("'{}': {}", path, ok.message()));
  }
  return tag;
}

std::vector<CheckpointManifest> list_checkpoint_tags(IoEngine& io, const std::string& dir) {
  std::vector<CheckpointManifest> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!check_checkpoint_tag(name).is_ok() || !entry.is_directory(ec)) continue;
    const std::string path = fmt::format("{}/{}/{}", dir, name, kCheckpointManifest);
    if (!std::filesystem::exists(path, ec)) continue;
    Result<std::string> text = read_text_file(io, path);
    if (!text.is_ok()) continue;
    Result<CheckpointManifest> m = parse_checkpoint_manifest(*text, path);
    if (!m.is_ok() || m->tag != name) continue;
    out.push_back(std::move(*m));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointManifest& a, const CheckpointManifest& b) {
    return a.serial != b.serial ? a.serial < b.serial : a.tag < b.tag;
  });
  return out;
}

}  // namespace zinf
