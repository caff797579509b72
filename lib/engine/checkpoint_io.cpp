// Checkpoint files (checkpoint.hpp) through lib/io: durable writes and checksummed reads. The
// file's data moves through an IoEngine (io_uring, or the thread engine), so the faults a test
// injects there (EIO, ENOSPC, short transfers) reach every checkpoint byte; what lib/io does not
// do (open with the O_DIRECT fallback, fsync, rename, directory sync) is plain POSIX here. Rank
// files move with O_DIRECT in 8 MiB aligned blocks, several in flight (kCheckpointPipelineBlocks),
// where the filesystem allows it, bypassing the
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

#include "base/arith.hpp"
#include "base/assert.hpp"
#include "engine/checkpoint.hpp"
#include "io/fault.hpp"
#include "zinf/log.hpp"

namespace zinf {
namespace {

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
  // As `zinf io bench` by default: 1 MiB pieces, 32 at the drive.
  options.queue_depth = 32;
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

// --- BlockHasher ---------------------------------------------------------------------------------

BlockHasher::BlockHasher() : state_(XXH3_createState()), run_state_(XXH3_createState()) {
  ZINF_ASSERT(state_ != nullptr && run_state_ != nullptr);
  XXH3_64bits_reset(run_state_);
  XXH3_64bits_reset(state_);
}

BlockHasher::~BlockHasher() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
  XXH3_freeState(state_);
  XXH3_freeState(run_state_);
}

std::uint64_t BlockHasher::push(const std::byte* data, std::size_t bytes) {
  // The thread starts with the first block: a reader only read at offsets (a rank file reopened
  // by RankFileReaders, a small file) never starts one.
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  std::unique_lock lock(mutex_);
  ZINF_ASSERT_MSG(pushed_ - hashed_ < kMaxQueued, "BlockHasher: more blocks queued than it holds");
  queue_[pushed_ % kMaxQueued] = Item{data, bytes};
  const std::uint64_t number = ++pushed_;
  lock.unlock();
  changed_.notify_all();
  return number;
}

void BlockHasher::wait(std::uint64_t number) {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return hashed_ >= number; });
}

std::uint64_t BlockHasher::digest() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return hashed_ == pushed_; });
  return XXH3_64bits_digest(state_);
}

void BlockHasher::reset() {
  std::lock_guard lock(mutex_);
  ZINF_ASSERT(hashed_ == pushed_);
  XXH3_64bits_reset(state_);
  XXH3_64bits_reset(run_state_);
  next_sum_ = 0;
  hashed_bytes_ = 0;
  first_bad_ = SIZE_MAX;
}

void BlockHasher::expect(std::vector<FileBlockSum> sums) {
  std::lock_guard lock(mutex_);
  ZINF_ASSERT(hashed_ == pushed_);
  sums_ = std::move(sums);
}

std::size_t BlockHasher::first_mismatch() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return hashed_ == pushed_; });
  // A run the bytes did not reach the end of was not checked: it counts as differing.
  if (first_bad_ == SIZE_MAX && next_sum_ < sums_.size()) return next_sum_;
  return std::min(first_bad_, sums_.size());
}

void BlockHasher::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stop_ || hashed_ < pushed_; });
    if (hashed_ == pushed_) return;  // stopping, nothing left
    const Item item = queue_[hashed_ % kMaxQueued];
    lock.unlock();
    XXH3_64bits_update(state_, item.data, item.bytes);
    // expect(): the same bytes, cut at the runs' ends.
    for (std::size_t done = 0; done < item.bytes && next_sum_ < sums_.size();) {
      const std::uint64_t left = sums_[next_sum_].end_offset - hashed_bytes_;
      const std::size_t take =
          static_cast<std::size_t>(std::min<std::uint64_t>(left, item.bytes - done));
      XXH3_64bits_update(run_state_, item.data + done, take);
      done += take;
      hashed_bytes_ += take;
      if (hashed_bytes_ == sums_[next_sum_].end_offset) {
        if (XXH3_64bits_digest(run_state_) != sums_[next_sum_].xxh3 && first_bad_ == SIZE_MAX) {
          first_bad_ = next_sum_;
        }
        XXH3_64bits_reset(run_state_);
        ++next_sum_;
      }
    }
    lock.lock();
    ++hashed_;
    changed_.notify_all();
  }
}

// --- Pipelines ---------------------------------------------------------------------------------

namespace {

// `blocks` aligned blocks of `block_bytes` for a writer's or reader's pipeline, registered with
// `io` where it can be (*registered says so; plain reads and writes work either way). Rank files
// get 2 MiB pages: O_DIRECT transfers from 4 KiB pages are split by the block layer on the
// virtual disks measured here (buffer_pool.hpp); small files get plain pages.
//
// A pipeline is no larger than the file it moves (`file_bytes`, 0 when unknown): a file shorter
// than the whole pipeline gets only the blocks it fills, and one shorter than a block one block of
// its own size. A small model's rank file then costs a few pages, not 48 MiB of locked memory
// zeroed by the kernel at every save and load (and a reshard keeps many readers open at once).
Result<std::unique_ptr<BufferPool>> pipeline_pool(IoEngine& io, std::size_t block_bytes,
                                                  std::size_t blocks, std::uint64_t file_bytes,
                                                  bool large, bool* registered) {
  if (file_bytes > 0 && file_bytes < std::uint64_t{block_bytes} * blocks) {
    blocks = static_cast<std::size_t>(ceil_div(file_bytes, block_bytes));
    if (blocks == 1) block_bytes = static_cast<std::size_t>(round_page(file_bytes));
  }
  BufferPoolOptions options;
  options.block_bytes = block_bytes;
  options.block_count = blocks;
  options.huge_pages = large ? HugePages::kAuto : HugePages::kNone;
  options.lock = large;
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<BufferPool> pool, BufferPool::create(options));
  *registered = large && pool->register_with(io).is_ok();
  return pool;
}

void release_pool(IoEngine& io, std::unique_ptr<BufferPool>& pool, bool* registered) {
  if (pool != nullptr && *registered) (void)io.unregister_memory(pool->data());
  *registered = false;
  pool.reset();
}

// Small files (the manifest, `latest`, the client state) go through two 1 MiB blocks.
constexpr std::size_t kSmallBlockBytes = std::size_t{1} << 20;

}  // namespace

// --- CheckpointWriter ----------------------------------------------------------------------------

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::create(IoEngine& io, std::string path,
                                                                   bool direct,
                                                                   std::uint64_t expected_bytes) {
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter(io, std::move(path)));
  w->pad_ = direct;
  w->fd_ = open_maybe_direct(w->path_, O_CREAT | O_TRUNC | O_WRONLY, direct, &w->direct_);
  if (w->fd_ < 0) {
    return status_from_errno(fmt::format("checkpoint: create '{}'", w->path_), errno);
  }
  if (expected_bytes > 0) {
    // The blocks allocated up front: a write past the end of the file (extending it) holds the
    // inode exclusively, and io_uring then runs a file's writes one at a time.
    const int rc = ::fallocate(w->fd_, 0, 0, static_cast<off_t>(expected_bytes));
    if (rc != 0 && errno != EOPNOTSUPP) {
      return status_from_errno(
          fmt::format("checkpoint: allocate {} bytes for '{}'", expected_bytes, w->path_), errno);
    }
    w->allocated_ = rc == 0 ? expected_bytes : 0;
  }
  Result<FileHandle> file = io.adopt_fd(w->fd_, w->path_, w->direct_);
  if (!file.is_ok()) return file.status().with_context("checkpoint");
  w->file_ = *file;
  ZINF_ASSIGN_OR_RETURN(
      w->pool_, pipeline_pool(io, direct ? kCheckpointBlockBytes : kSmallBlockBytes,
                              direct ? kCheckpointPipelineBlocks : 2, expected_bytes, direct,
                              &w->registered_));
  w->tickets_.assign(w->pool_->block_count(), Ticket{});
  w->hashes_.assign(w->pool_->block_count(), 0);
  return w;
}

CheckpointWriter::~CheckpointWriter() {
  // No write may still use a block when it is freed.
  for (std::size_t b = 0; b < tickets_.size(); ++b) (void)wait_block(b);
  if (pool_ != nullptr) release_pool(*io_, pool_, &registered_);
  if (file_.valid()) (void)io_->close_file(file_);
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && fd_ >= 0) ::unlink(path_.c_str());
}

Status CheckpointWriter::wait_block(std::size_t b) {
  if (hashes_[b] != 0) hasher_.wait(std::exchange(hashes_[b], 0));
  if (!tickets_[b].valid()) return Status::ok();
  const Ticket t = std::exchange(tickets_[b], Ticket{});
  return wait_io(*io_, t, path_);
}

Status CheckpointWriter::submit_block(std::size_t bytes) {
  if (bytes > 0) {
    // Written and hashed at once; both only read the block.
    hashes_[current_] = hasher_.push(pool_->block(current_), bytes);
    ZINF_ASSIGN_OR_RETURN(tickets_[current_],
                          io_->write(file_, written_, bytes, pool_->block(current_)));
    written_ += bytes;
  }
  current_ = (current_ + 1) % tickets_.size();
  used_ = 0;
  // The next block's previous write must be done before it is filled again; the others stay in
  // flight.
  return wait_block(current_);
}

Status CheckpointWriter::append(const void* data, std::size_t bytes) {
  ZINF_ASSERT(fd_ >= 0 && !committed_);
  const auto* p = static_cast<const std::byte*>(data);
  const std::size_t block_bytes = pool_->block_bytes();
  std::size_t done = 0;
  while (done < bytes) {
    const std::size_t take = std::min(bytes - done, block_bytes - used_);
    std::memcpy(pool_->block(current_) + used_, p + done, take);
    used_ += take;
    done += take;
    if (used_ == block_bytes) ZINF_RETURN_IF_ERROR(submit_block(used_));
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
    std::memset(pool_->block(current_) + used_, 0, pad);
    used_ += pad;
    bytes_ += pad;
  }
  ZINF_RETURN_IF_ERROR(submit_block(used_));
  // Every write in flight, oldest first.
  for (std::size_t k = 0; k < tickets_.size(); ++k) {
    ZINF_RETURN_IF_ERROR(wait_block((current_ + k) % tickets_.size()));
  }
  digest_ = hasher_.digest();
  if (allocated_ != 0 && allocated_ != bytes_ &&
      ::ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) {
    return status_from_errno(fmt::format("checkpoint: truncate '{}' to {} bytes", path_, bytes_),
                             errno);
  }
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
  if (::fstat(r->fd_, &st) != 0) {
    return status_from_errno(fmt::format("checkpoint: fstat '{}'", r->path_), errno);
  }
  // The size of the file opened (a stat by name may have seen another one).
  r->file_bytes_ = static_cast<std::uint64_t>(st.st_size);
  r->file_identity_ = FileIdentity{
      static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino),
      static_cast<std::uint64_t>(st.st_size),
      static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec};
  Result<FileHandle> file = io.adopt_fd(r->fd_, r->path_, r->direct_);
  if (!file.is_ok()) return file.status().with_context("checkpoint");
  r->file_ = *file;
  return r;
}

CheckpointReader::~CheckpointReader() {
  (void)stop();
  if (file_.valid()) (void)io_->close_file(file_);
  if (fd_ >= 0) ::close(fd_);
}

Status CheckpointReader::start() {
  ZINF_ASSERT(pool_ == nullptr);
  ZINF_ASSIGN_OR_RETURN(pool_, pipeline_pool(*io_, kCheckpointBlockBytes, kCheckpointPipelineBlocks,
                                             file_bytes_, /*large=*/true, &registered_));
  tickets_.assign(pool_->block_count(), Ticket{});
  hashes_.assign(pool_->block_count(), 0);
  slot_bytes_.assign(pool_->block_count(), 0);
  submitted_ = 0;
  block_index_ = 0;
  has_current_ = false;
  current_valid_ = 0;
  current_used_ = 0;
  offset_ = 0;
  hasher_.reset();
  // Every slot's first read: blocks 0 .. blocks - 1 of the file.
  for (std::size_t slot = 0; slot < tickets_.size() && submitted_ < file_bytes_; ++slot) {
    const std::size_t bytes = static_cast<std::size_t>(
        std::min<std::uint64_t>(pool_->block_bytes(), file_bytes_ - submitted_));
    ZINF_ASSIGN_OR_RETURN(tickets_[slot], io_->read(file_, submitted_, bytes, pool_->block(slot)));
    slot_bytes_[slot] = bytes;
    submitted_ += bytes;
  }
  return Status::ok();
}

Status CheckpointReader::stop() {
  Status first;
  for (Ticket& t : tickets_) {
    if (!t.valid()) continue;
    Status st = wait_io(*io_, std::exchange(t, Ticket{}), path_);
    if (first.is_ok()) first = std::move(st);
  }
  // And no block may be hashed after its pool is gone.
  (void)hasher_.digest();
  if (pool_ != nullptr) release_pool(*io_, pool_, &registered_);
  tickets_.clear();
  hashes_.clear();
  slot_bytes_.clear();
  return first;
}

Status CheckpointReader::next_block(bool* more) {
  const std::size_t blocks = tickets_.size();
  if (has_current_) {
    // The current block is used up: its slot reads the next unread block of the file.
    const std::size_t slot = static_cast<std::size_t>(block_index_ % blocks);
    if (submitted_ < file_bytes_) {
      hasher_.wait(std::exchange(hashes_[slot], 0));
      const std::size_t bytes = static_cast<std::size_t>(
          std::min<std::uint64_t>(pool_->block_bytes(), file_bytes_ - submitted_));
      ZINF_ASSIGN_OR_RETURN(tickets_[slot],
                            io_->read(file_, submitted_, bytes, pool_->block(slot)));
      slot_bytes_[slot] = bytes;
      submitted_ += bytes;
    }
    ++block_index_;
  }
  const std::uint64_t first = block_index_ * pool_->block_bytes();
  if (first >= file_bytes_) {
    *more = false;
    has_current_ = false;
    current_valid_ = 0;
    current_used_ = 0;
    return Status::ok();
  }
  const std::size_t slot = static_cast<std::size_t>(block_index_ % blocks);
  ZINF_ASSERT(tickets_[slot].valid());
  ZINF_RETURN_IF_ERROR(wait_io(*io_, std::exchange(tickets_[slot], Ticket{}), path_));
  // Hashed as it arrives, in file order: the checksum costs no second read.
  hashes_[slot] = hasher_.push(pool_->block(slot), slot_bytes_[slot]);
  has_current_ = true;
  current_valid_ = slot_bytes_[slot];
  current_used_ = 0;
  *more = true;
  return Status::ok();
}

Status CheckpointReader::read(void* out, std::size_t bytes) {
  if (pool_ == nullptr) ZINF_RETURN_IF_ERROR(start());
  auto* p = static_cast<std::byte*>(out);
  std::size_t done = 0;
  while (done < bytes) {
    if (current_used_ == current_valid_) {
      bool more = false;
      ZINF_RETURN_IF_ERROR(next_block(&more));
      if (!more) {
        return Status::corruption(fmt::format("checkpoint: '{}' ends at offset {}, {} bytes short",
                                              path_, file_bytes_, bytes - done));
      }
    }
    const std::size_t slot = static_cast<std::size_t>(block_index_ % tickets_.size());
    const std::size_t take = std::min(bytes - done, current_valid_ - current_used_);
    std::memcpy(p + done, pool_->block(slot) + current_used_, take);
    current_used_ += take;
    done += take;
    offset_ += take;
  }
  return Status::ok();
}

Result<std::uint64_t> CheckpointReader::finish() {
  if (pool_ == nullptr) ZINF_RETURN_IF_ERROR(start());
  for (bool more = true; more;) {
    current_used_ = current_valid_;
    Status st = next_block(&more);
    if (!st.is_ok()) {
      (void)stop();
      return st;
    }
  }
  offset_ = file_bytes_;
  const std::uint64_t digest = hasher_.digest();
  ZINF_RETURN_IF_ERROR(stop());
  if (block_sums_.empty()) return digest;
  const std::size_t bad = hasher_.first_mismatch();
  if (bad < block_sums_.size()) {
    const std::uint64_t start = bad == 0 ? 0 : block_sums_[bad - 1].end_offset;
    return Status::corruption(fmt::format(
        "'{}' does not match its block checksums: bytes [{}, {}) differ (block {} of {})", path_,
        start, block_sums_[bad].end_offset, bad, block_sums_.size()));
  }
  return std::uint64_t{0};
}

void CheckpointReader::expect_block_sums(std::vector<FileBlockSum> sums) {
  ZINF_ASSERT(pool_ == nullptr && !sums.empty() && sums.back().end_offset <= file_bytes_);
  file_bytes_ = sums.back().end_offset;
  block_sums_ = sums;
  hasher_.expect(std::move(sums));
}

Result<std::unique_ptr<CheckpointReader>> open_rank_reader(IoEngine& io, const std::string& tag_dir,
                                                           const ManifestFile& f, bool direct) {
  const std::string path = fmt::format("{}/{}", tag_dir, f.file);
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> r,
                        CheckpointReader::open(io, path, direct));
  const bool linked = !f.blocks.empty();
  if (linked ? r->file_bytes() < f.bytes : r->file_bytes() != f.bytes) {
    return Status::corruption(fmt::format("'{}' has {} bytes; the manifest says {}{}", path,
                                          r->file_bytes(), f.bytes, linked ? " or more" : ""));
  }
  if (linked) {
    const std::string blocks_path = fmt::format("{}/{}", tag_dir, f.blocks);
    ZINF_ASSIGN_OR_RETURN(std::string bytes,
                          read_checked_file(io, blocks_path, f.blocks_bytes, f.blocks_xxh3));
    ZINF_ASSIGN_OR_RETURN(std::vector<FileBlockSum> sums,
                          decode_block_sums(bytes, blocks_path, f.bytes));
    r->expect_block_sums(std::move(sums));
  }
  return r;
}

Status check_rank_digest(const ManifestFile& f, const CheckpointReader& r, std::uint64_t digest) {
  if (!f.blocks.empty()) return Status::ok();
  if (digest != f.xxh3) {
    return Status::corruption(
        fmt::format("'{}' does not match its checksum (xxh3 {:016x}, the manifest says {:016x})",
                    r.path(), digest, f.xxh3));
  }
  return Status::ok();
}

void RankFileReaders::verified(int rank, std::unique_ptr<CheckpointReader> r) {
  verified_[rank] = Verified{r->file_identity(), r->block_sums()};
  if (open_.size() < kCheckpointOpenReaderCount) {
    keep(rank, std::move(r));
  }
}

void RankFileReaders::keep(int rank, std::unique_ptr<CheckpointReader> r) {
  if (open_.size() == kCheckpointOpenReaderCount) {
    const auto lru = std::min_element(open_.begin(), open_.end(), [](const Open& a, const Open& b) {
      return a.last_use < b.last_use;
    });
    *lru = std::move(open_.back());
    open_.pop_back();
  }
  open_.push_back(Open{rank, ++use_count_, std::move(r)});
}

Status RankFileReaders::read_at(int rank, std::uint64_t offset, std::size_t bytes, void* out) {
  auto it = std::find_if(open_.begin(), open_.end(), [&](const Open& o) { return o.rank == rank; });
  if (it == open_.end()) {
    const auto v = verified_.find(rank);
    ZINF_ASSERT_MSG(v != verified_.end(), "RankFileReaders: a file read before verified()");
    const ManifestFile& f = manifest_->ranks[static_cast<std::size_t>(rank)];
    // The file verified, unchanged, had the manifest's size and (linked) block checksums: only
    // that it is still that file is checked here.
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> r,
                          CheckpointReader::open(*io_, fmt::format("{}/{}", tag_dir_, f.file),
                                                 /*direct=*/false));
    if (!(r->file_identity() == v->second.identity)) {
      return Status::corruption(fmt::format(
          "'{}' is no longer the file whose checksum was verified (the tag was replaced or "
          "written while it was read)",
          r->path()));
    }
    if (!v->second.block_sums.empty()) r->expect_block_sums(v->second.block_sums);
    ++reopened_count_;
    keep(rank, std::move(r));
    it = open_.end() - 1;
  }
  it->last_use = ++use_count_;
  return it->reader->read_at(offset, bytes, out);
}

Result<std::uint64_t> CheckpointReader::checksum() {
  ZINF_RETURN_IF_ERROR(stop());
  return finish();
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

Result<std::string> read_checked_file(IoEngine& io, const std::string& path,
                                      std::uint64_t expected_bytes, std::uint64_t expected_xxh3) {
  ZINF_ASSIGN_OR_RETURN(std::string bytes, read_text_file(io, path));
  if (bytes.size() != expected_bytes || XXH3_64bits(bytes.data(), bytes.size()) != expected_xxh3) {
    return Status::corruption(
        fmt::format("'{}' does not match its size and checksum in the manifest", path));
  }
  return bytes;
}

Status check_checkpoint_tag(std::string_view tag) {
  const bool chars_ok = std::all_of(tag.begin(), tag.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
  // <dir>/latest names the newest tag, and a save replaces it through <dir>/latest.tmp
  // (write_file_atomically): a tag of either name would be a directory where the save writes
  // that file.
  const bool reserved = tag == kCheckpointLatest || tag == kCheckpointLatestTemp;
  if (tag.empty() || tag.size() > 200 || !chars_ok || tag[0] == '.' || reserved) {
    return Status::invalid_argument(fmt::format(
        "checkpoint tag '{}': a tag is 1-200 characters of [A-Za-z0-9._-], does not start with "
        "'.' and is neither 'latest' nor 'latest.tmp' (the file naming the newest tag, and the "
        "one a save writes it through)",
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

std::string moved_aside_tag_dir(IoEngine& io, const std::string& dir, const std::string& tag) {
  const std::string final_dir = fmt::format("{}/{}", dir, tag);
  const std::string aside = fmt::format("{}/.{}.old", dir, tag);
  const std::string manifest_path = fmt::format("{}/{}", aside, kCheckpointManifest);
  std::error_code ec;
  if (std::filesystem::exists(final_dir, ec) || std::filesystem::is_symlink(final_dir, ec) ||
      !std::filesystem::exists(manifest_path, ec)) {
    return {};
  }
  Result<std::string> text = read_text_file(io, manifest_path);
  if (!text.is_ok()) return {};
  Result<CheckpointManifest> m = parse_checkpoint_manifest(*text, manifest_path);
  if (!m.is_ok() || m->tag != tag) return {};
  auto has = [&](const std::string& file) {
    return file.empty() || std::filesystem::exists(fmt::format("{}/{}", aside, file), ec);
  };
  for (const ManifestFile& f : m->ranks) {
    if (!has(f.file) || !has(f.blocks)) return {};
  }
  for (const ManifestFile& f : m->client_state) {
    if (!has(f.file)) return {};
  }
  return aside;
}

bool is_leftover_tag(const std::vector<CheckpointManifest>& tags, bool has_latest,
                     const Result<std::string>& latest, const CheckpointManifest& m) {
  // Only the newest can be the first save's: the others were complete before it began.
  if (!has_latest) return !tags.empty() && m.serial == tags.back().serial;
  if (!latest.is_ok() || *latest == m.tag) return false;
  const auto named = std::find_if(tags.begin(), tags.end(),
                                  [&](const CheckpointManifest& t) { return t.tag == *latest; });
  return named != tags.end() && m.resume.step > named->resume.step;
}

namespace {

// The complete tags under `dir`, each read by parse(text, path) (a manifest or its summary), one
// manifest at a time; list_checkpoint_tags() says which.
template <typename Entry, typename Parse>
std::vector<Entry> list_tags(IoEngine& io, const std::string& dir, RefusedCheckpointTags* refused,
                             Parse parse) {
  if (refused != nullptr) *refused = {};
  std::vector<Entry> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory(ec)) continue;
    if (!check_checkpoint_tag(name).is_ok()) {
      // ".<tag>.tmp": a save in progress, or one cut short; ".<tag>.old": a tag a save was
      // replacing; ".<tag>.pruned": a tag keep_last was removing. The next save removes them
      // (all but a complete ".<tag>.old" with no "<tag>", which it renames back).
      if (refused != nullptr && name.size() > 5 && name[0] == '.') {
        if (name.ends_with(".tmp")) refused->temp_dirs.push_back(entry.path().string());
        if (name.ends_with(".old")) refused->old_dirs.push_back(entry.path().string());
        if (name.size() > 8 && name.ends_with(".pruned")) {
          refused->pruned_dirs.push_back(entry.path().string());
        }
      }
      continue;
    }
    // No manifest: no tag, unless the caller asks what was refused and the directory has rank
    // files (a tag that failed; a directory with neither may be the program's, logs say).
    const std::string path = fmt::format("{}/{}/{}", dir, name, kCheckpointManifest);
    if (!std::filesystem::exists(path, ec) &&
        (refused == nullptr ||
         !std::filesystem::exists(checkpoint_rank_path(fmt::format("{}/{}", dir, name), 0), ec))) {
      continue;
    }
    Result<std::string> text = read_text_file(io, path);
    Result<Entry> m = text.is_ok() ? parse(*text, path) : Result<Entry>(text.status());
    if (m.is_ok() && m->tag == name) {
      out.push_back(std::move(*m));
    } else if (refused != nullptr) {
      refused->tags.push_back({name, m.is_ok() ? fmt::format("its manifest names tag '{}'", m->tag)
                                               : std::string(m.status().message())});
    }
  }
  sort_tags_oldest_first(out);
  return out;
}

}  // namespace

std::vector<CheckpointManifest> list_checkpoint_tags(IoEngine& io, const std::string& dir,
                                                     RefusedCheckpointTags* refused) {
  return list_tags<CheckpointManifest>(io, dir, refused, parse_checkpoint_manifest);
}

std::vector<CheckpointTagSummary> list_checkpoint_tag_summaries(IoEngine& io,
                                                                const std::string& dir,
                                                                RefusedCheckpointTags* refused) {
  return list_tags<CheckpointTagSummary>(io, dir, refused, parse_checkpoint_manifest_summary);
}

}  // namespace zinf
