// Checkpoint files (checkpoint.hpp): crash-safe writes and checksummed reads with plain POSIX
// I/O. A checkpoint is written once between steps, so it takes synchronous pwrite/pread calls and
// one fsync per file rather than the step's io_uring path. Both sides open the file with
// O_DIRECT where the filesystem allows it and move it in 8 MiB aligned blocks, bypassing the
// page cache (buffered writes of gigabytes are throttled by dirty-page writeback, and a cached
// checkpoint would only evict other data); only a write's last partial page, and everything on
// a filesystem that refuses O_DIRECT (tmpfs), go through the page cache.
#include "engine/checkpoint.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "base/assert.hpp"

namespace zinf {
namespace {

std::string parent_dir(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// The rename into place is durable only once the directory entry is.
Status sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return status_from_errno(fmt::format("checkpoint: open directory '{}'", dir), errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return status_from_errno(fmt::format("checkpoint: fsync directory '{}'", dir), err);
  return Status::ok();
}

}  // namespace

constexpr std::size_t kBlockBytes = std::size_t{8} << 20;

std::string checkpoint_rank_path(const std::string& dir, int rank) {
  return fmt::format("{}/rank{}.zinfckpt", dir, rank);
}

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::create(std::string path) {
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter(std::move(path)));
  w->temp_path_ = w->path_ + ".tmp";
  constexpr int kFlags = O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC;
  w->fd_ = ::open(w->temp_path_.c_str(), kFlags | O_DIRECT, 0644);
  w->direct_ = w->fd_ >= 0;
  // tmpfs and some others refuse O_DIRECT: buffered then.
  if (w->fd_ < 0 && errno == EINVAL) w->fd_ = ::open(w->temp_path_.c_str(), kFlags, 0644);
  if (w->fd_ < 0) {
    return status_from_errno(fmt::format("checkpoint: create '{}'", w->temp_path_), errno);
  }
  w->block_ = AlignedBuffer(kBlockBytes);
  w->hash_ = XXH3_createState();
  ZINF_ASSERT(w->hash_ != nullptr);
  XXH3_64bits_reset(w->hash_);
  return w;
}

CheckpointWriter::~CheckpointWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temp_path_.c_str());
  }
  if (hash_ != nullptr) XXH3_freeState(hash_);
}

Status CheckpointWriter::append(const void* data, std::size_t bytes) {
  ZINF_ASSERT(fd_ >= 0);
  XXH3_64bits_update(hash_, data, bytes);
  const auto* p = static_cast<const std::byte*>(data);
  std::size_t done = 0;
  while (done < bytes) {
    const std::size_t take = std::min(bytes - done, block_.bytes() - block_used_);
    std::memcpy(block_.data() + block_used_, p + done, take);
    block_used_ += take;
    done += take;
    if (block_used_ == block_.bytes()) ZINF_RETURN_IF_ERROR(flush(block_used_));
  }
  bytes_ += bytes;
  return Status::ok();
}

Status CheckpointWriter::flush(std::size_t bytes) {
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n =
        ::pwrite(fd_, block_.data() + done, bytes - done, static_cast<off_t>(written_ + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return status_from_errno(
          fmt::format("checkpoint: write '{}' at offset {}", temp_path_, written_ + done),
          n < 0 ? errno : EIO);
    }
    done += static_cast<std::size_t>(n);
  }
  written_ += bytes;
  // Keep what was not written (the partial page a direct flush leaves) at the block's start.
  std::memmove(block_.data(), block_.data() + bytes, block_used_ - bytes);
  block_used_ -= bytes;
  return Status::ok();
}

Status CheckpointWriter::commit() {
  ZINF_ASSERT(fd_ >= 0);
  // The whole pages directly, then the tail (not a page multiple) through the page cache.
  const std::size_t pages = direct_ ? block_used_ / 4096 * 4096 : block_used_;
  ZINF_RETURN_IF_ERROR(flush(pages));
  if (block_used_ > 0) {
    if (::fcntl(fd_, F_SETFL, O_WRONLY) != 0) {
      return status_from_errno(fmt::format("checkpoint: fcntl '{}'", temp_path_), errno);
    }
    direct_ = false;
    ZINF_RETURN_IF_ERROR(flush(block_used_));
  }
  if (::fsync(fd_) != 0) {
    return status_from_errno(fmt::format("checkpoint: fsync '{}'", temp_path_), errno);
  }
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) {
    const int err = errno;
    ::unlink(temp_path_.c_str());
    return status_from_errno(fmt::format("checkpoint: close '{}'", temp_path_), err);
  }
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp_path_.c_str());
    return status_from_errno(fmt::format("checkpoint: rename '{}' to '{}'", temp_path_, path_),
                             err);
  }
  return sync_dir(parent_dir(path_));
}

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::open(std::string path) {
  std::unique_ptr<CheckpointReader> r(new CheckpointReader(std::move(path)));
  r->fd_ = ::open(r->path_.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (r->fd_ < 0 && errno == EINVAL) r->fd_ = ::open(r->path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (r->fd_ < 0) return status_from_errno(fmt::format("checkpoint: open '{}'", r->path_), errno);
  struct stat st {};
  if (::fstat(r->fd_, &st) != 0) {
    return status_from_errno(fmt::format("checkpoint: stat '{}'", r->path_), errno);
  }
  r->file_bytes_ = static_cast<std::uint64_t>(st.st_size);
  r->block_ = AlignedBuffer(kBlockBytes);
  return r;
}

CheckpointReader::~CheckpointReader() {
  if (fd_ >= 0) ::close(fd_);
}

Status CheckpointReader::read_block(std::byte* buffer, std::size_t bytes, std::uint64_t at,
                                    std::size_t* got) const {
  ZINF_ASSERT(at % 4096 == 0 && bytes % 4096 == 0);
  std::size_t done = 0;
  // Stops at the end of the file: a direct read from the unaligned offset a short read leaves
  // there would be refused.
  while (done < bytes && at + done < file_bytes_) {
    const ssize_t n = ::pread(fd_, buffer + done, bytes - done, static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return status_from_errno(fmt::format("checkpoint: read '{}' at offset {}", path_, at + done),
                               errno);
    }
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  *got = done;
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

Result<std::uint64_t> CheckpointReader::checksum() const {
  AlignedBuffer chunk(kBlockBytes);
  XXH3_state_t* hash = XXH3_createState();
  ZINF_ASSERT(hash != nullptr);
  XXH3_64bits_reset(hash);
  std::uint64_t offset = 0;
  Status st;
  while (offset < file_bytes_) {
    std::size_t got = 0;
    st = read_block(chunk.data(), chunk.bytes(), offset, &got);
    if (st.is_ok() && got == 0) {
      st = Status::corruption(
          fmt::format("checkpoint: '{}' shrank to {} bytes while read", path_, offset));
    }
    if (!st.is_ok()) break;
    XXH3_64bits_update(hash, chunk.data(), got);
    offset += got;
  }
  const std::uint64_t digest = XXH3_64bits_digest(hash);
  XXH3_freeState(hash);
  if (!st.is_ok()) return st;
  return digest;
}

Status write_file_atomically(const std::string& path, const std::string& text) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> w, CheckpointWriter::create(path));
  ZINF_RETURN_IF_ERROR(w->append(text.data(), text.size()));
  return w->commit();
}

Result<std::string> read_text_file(const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> r, CheckpointReader::open(path));
  std::string text(r->file_bytes(), '\0');
  ZINF_RETURN_IF_ERROR(r->read(text.data(), text.size()));
  return text;
}

// --- The engine's save and load ---------------------------------------------------------------
namespace {

CheckpointHeader header_of(const CheckpointContext& ctx, std::int64_t step,
                           const LossScaler& scaler) {
  CheckpointHeader h;
  h.rank = static_cast<std::uint32_t>(ctx.rank);
  h.world_size = static_cast<std::uint32_t>(ctx.world_size);
  h.stage = static_cast<std::uint32_t>(ctx.config->zero.stage);
  h.optimizer = static_cast<std::uint32_t>(ctx.config->optimizer.kind);
  for (Piece p : state_pieces(ctx.config->optimizer.kind)) {
    h.piece_mask |= 1u << static_cast<unsigned>(p);
  }
  h.partition_elements = ctx.partition_elements;
  h.fingerprint = ctx.partitioner->fingerprint();
  h.step = step;
  h.loss_scale = scaler.scale();
  h.loss_scale_good_steps = scaler.good_steps();
  h.loss_scale_hysteresis_left = scaler.hysteresis_left();
  return h;
}

// Checks the manifest against this engine and this rank's file against the manifest; on
// success `reader` is positioned after the header.
Status check_checkpoint(const CheckpointContext& ctx, std::string_view call, const std::string& dir,
                        std::unique_ptr<CheckpointReader>* reader, CheckpointHeader* header) {
  const Config& config = *ctx.config;
  const std::string manifest_path = fmt::format("{}/{}", dir, kCheckpointManifest);
  Result<std::string> text = read_text_file(manifest_path);
  if (!text.is_ok()) {
    return text.status().with_context(
        fmt::format("{}: no complete checkpoint (the manifest is written last)", call));
  }
  Result<CheckpointManifest> parsed = parse_checkpoint_manifest(*text);
  if (!parsed.is_ok()) {
    return Status::corruption(
        fmt::format("{}: '{}': {}", call, manifest_path, parsed.status().message()));
  }
  const CheckpointManifest& m = *parsed;
  const auto differs = [&](std::string_view what, const auto& theirs, const auto& ours) {
    return Status::invalid_argument(
        fmt::format("{}: the checkpoint was saved with {} {}, this engine has {} {}", call, what,
                    theirs, what, ours));
  };
  if (m.world_size != ctx.world_size) return differs("world_size", m.world_size, ctx.world_size);
  if (m.stage != config.zero.stage) {
    return differs("zero_optimization.stage", m.stage, config.zero.stage);
  }
  if (m.optimizer != optimizer_name(config.optimizer.kind)) {
    return differs("optimizer.type", m.optimizer, optimizer_name(config.optimizer.kind));
  }
  const std::string ours = fmt::format("{:016x}", ctx.partitioner->fingerprint());
  if (m.fingerprint != ours) {
    return differs("parameter layout fingerprint (names, modules, shapes, dtypes)", m.fingerprint,
                   ours);
  }
  if (m.partition_elements != ctx.partition_elements) {
    return differs("partition element count", m.partition_elements, ctx.partition_elements);
  }
  const CheckpointManifestRank& entry = m.ranks[static_cast<std::size_t>(ctx.rank)];
  const std::string path = fmt::format("{}/{}", dir, entry.file);
  const std::uint64_t bytes = entry.bytes;
  const std::string& digest = entry.xxh3;
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> r, CheckpointReader::open(path));
  if (r->file_bytes() != bytes) {
    return Status::corruption(fmt::format("{}: '{}' has {} bytes; the manifest says {}", call, path,
                                          r->file_bytes(), bytes));
  }
  ZINF_ASSIGN_OR_RETURN(std::uint64_t sum, r->checksum());
  if (fmt::format("{:016x}", sum) != digest) {
    return Status::corruption(
        fmt::format("{}: '{}' does not match its checksum (xxh3 {:016x}, the manifest says {})",
                    call, path, sum, digest));
  }
  std::vector<std::byte> head(kCheckpointHeaderBytes);
  ZINF_RETURN_IF_ERROR(r->read(head.data(), head.size()));
  Result<CheckpointHeader> decoded = decode_checkpoint_header(head);
  if (!decoded.is_ok()) {
    return Status(decoded.status().code(), 0,
                  fmt::format("{}: '{}': {}", call, path, decoded.status().message()));
  }
  const CheckpointHeader h = *decoded;
  const CheckpointHeader want = header_of(ctx, 0, LossScaler());
  if (h.magic != kCheckpointMagic || h.version != kCheckpointVersion || h.rank != want.rank ||
      h.world_size != want.world_size || h.stage != want.stage || h.optimizer != want.optimizer ||
      h.piece_mask != want.piece_mask || h.partition_elements != want.partition_elements ||
      h.fingerprint != want.fingerprint) {
    return Status::corruption(
        fmt::format("{}: '{}': its header does not match the manifest or this rank", call, path));
  }
  const std::uint64_t expect = kCheckpointHeaderBytes + state_pieces(config.optimizer.kind).size() *
                                                            ctx.partition_elements * sizeof(float);
  if (bytes != expect) {
    return Status::corruption(
        fmt::format("{}: '{}' has {} bytes, the layout needs {}", call, path, bytes, expect));
  }
  *reader = std::move(r);
  *header = h;
  return Status::ok();
}

}  // namespace

Status save_checkpoint(const CheckpointContext& ctx, std::string_view call, const std::string& dir,
                       Status precondition, std::int64_t step, const LossScaler& scaler) {
  RankExchange& ex = *ctx.exchange;
  Status local = std::move(precondition);
  if (local.is_ok() && ctx.rank == 0) {
    // The directory, and no manifest in it until every rank file of this save is in place.
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      local = status_from_errno(fmt::format("{}: cannot create the directory", call), ec.value());
    } else if (::unlink(fmt::format("{}/{}", dir, kCheckpointManifest).c_str()) != 0 &&
               errno != ENOENT) {
      local = status_from_errno(fmt::format("{}: cannot remove the old manifest", call), errno);
    }
  }
  ZINF_RETURN_IF_ERROR(ex.agree(call, local));

  // This rank's file.
  std::uint64_t file[2] = {0, 0};
  local = [&]() -> Status {
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> w,
                          CheckpointWriter::create(checkpoint_rank_path(dir, ctx.rank)));
    std::vector<std::byte> head(kCheckpointHeaderBytes);
    encode_checkpoint_header(header_of(ctx, step, scaler),
                             std::span<std::byte, kCheckpointHeaderBytes>(head.data(), head.size()));
    ZINF_RETURN_IF_ERROR(w->append(head.data(), head.size()));
    for (Piece piece : state_pieces(ctx.config->optimizer.kind)) {
      ZINF_RETURN_IF_ERROR(
          ctx.state->read_state(piece, [&](std::size_t, std::size_t count, const float* values) {
            return w->append(values, count * sizeof(float));
          }));
    }
    ZINF_RETURN_IF_ERROR(w->commit());
    file[0] = w->bytes();
    file[1] = w->digest();
    return Status::ok();
  }();
  ZINF_RETURN_IF_ERROR(ex.agree(call, local));
  Result<std::vector<std::uint64_t>> files = ex.exchange(file, 2);
  if (!files.is_ok()) return ctx.sticky->fail(files.status());

  // Rank 0's manifest, written last: its presence says the checkpoint is complete.
  local = Status::ok();
  if (ctx.rank == 0) {
    nlohmann::json m;
    m["format"] = "zinf-checkpoint";
    m["version"] = kCheckpointVersion;
    m["world_size"] = ctx.world_size;
    m["stage"] = ctx.config->zero.stage;
    m["optimizer"] = std::string(optimizer_name(ctx.config->optimizer.kind));
    m["fingerprint"] = fmt::format("{:016x}", ctx.partitioner->fingerprint());
    m["partition_elements"] = ctx.partition_elements;
    m["step"] = step;
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < ctx.world_size; ++r) {
      ranks.push_back({{"file", fmt::format("rank{}.zinfckpt", r)},
                       {"bytes", (*files)[2 * r]},
                       {"xxh3", fmt::format("{:016x}", (*files)[2 * r + 1])}});
    }
    m["ranks"] = ranks;
    local = write_file_atomically(fmt::format("{}/{}", dir, kCheckpointManifest), m.dump(2));
  }
  return ex.agree(call, local);
}

Status load_checkpoint_state(const CheckpointContext& ctx, std::string_view call,
                             const std::string& dir, Status precondition,
                             CheckpointHeader* header) {
  std::unique_ptr<CheckpointReader> reader;
  Status local = std::move(precondition);
  if (local.is_ok()) local = check_checkpoint(ctx, call, dir, &reader, header);
  ZINF_RETURN_IF_ERROR(ctx.exchange->agree(call, local));
  // From here on the state is being replaced: an error leaves it mixed, so it is sticky.
  for (Piece piece : state_pieces(ctx.config->optimizer.kind)) {
    ZINF_RETURN_IF_ERROR(ctx.sticky->fail(
        ctx.state->write_state(piece, [&](std::size_t, std::size_t count, float* out) {
          return reader->read(out, count * sizeof(float));
        })));
  }
  return Status::ok();
}

}  // namespace zinf
