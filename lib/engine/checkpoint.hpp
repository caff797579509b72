// Checkpoints: the format of one rank's state file and the manifest, the plain-file I/O that
// writes them crash-safely (a temporary name, fsync, rename, fsync of the directory) and reads
// them back with their xxh3-64 checksum, and the engine's save and load (save_checkpoint,
// load_checkpoint_state): what goes in, the checks against the manifest and the ranks'
// agreement at each phase.
//
// Layout of <dir>/rank<r>.zinfckpt (little-endian): a 4096-byte header (CheckpointHeader, zero
// padded), then for each saved piece in Piece order (the fp32 master, then the moments the
// optimizer has) partition_elements f32 values. Nothing depends on where the state lived, so a
// checkpoint saved with the state on NVMe loads into an engine that keeps it in host memory.
//
// Thread-safety: values and single-owner objects.
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/aligned.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/rank_exchange.hpp"
#include "zero/loss_scaler.hpp"
#include "zero/partitioner.hpp"
#include "zinf/config.hpp"
#include "zinf/status.hpp"

namespace zinf {

inline constexpr std::uint64_t kCheckpointMagic = 0x31544B43464E495AULL;  // "ZINFCKT1"
inline constexpr std::uint32_t kCheckpointVersion = 1;
inline constexpr std::size_t kCheckpointHeaderBytes = 4096;
inline constexpr std::string_view kCheckpointManifest = "manifest.json";

struct CheckpointHeader {
  std::uint64_t magic = kCheckpointMagic;
  std::uint32_t version = kCheckpointVersion;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  std::uint32_t stage = 0;
  std::uint32_t optimizer = 0;   // OptimizerKind
  std::uint32_t piece_mask = 0;  // bit p: Piece p saved
  std::uint64_t partition_elements = 0;
  std::uint64_t fingerprint = 0;  // Partitioner::fingerprint()
  std::int64_t step = 0;          // optimizer steps applied
  double loss_scale = 1.0;
  std::int64_t loss_scale_good_steps = 0;
  std::int32_t loss_scale_hysteresis_left = 0;
  std::uint32_t reserved = 0;
};
static_assert(sizeof(CheckpointHeader) <= kCheckpointHeaderBytes);

// The header's bytes, written field by field in little-endian order whatever the host (no struct
// copy): magic u64 at 0, version u32 at 8, rank 12, world_size 16, stage 20, optimizer 24,
// piece_mask 28 (u32 each), partition_elements u64 at 32, fingerprint u64 at 40, step i64 at 48,
// loss_scale as the IEEE-754 bits of an f64 at 56, loss_scale_good_steps i64 at 64,
// loss_scale_hysteresis_left i32 at 72, reserved u32 at 76, zeros to kCheckpointHeaderBytes.
void encode_checkpoint_header(const CheckpointHeader& header,
                              std::span<std::byte, kCheckpointHeaderBytes> out);
// Reads what encode_checkpoint_header() wrote. kCorruption naming what is wrong when `bytes` is
// not kCheckpointHeaderBytes long, the magic is not a zinf checkpoint's, or the padding is not
// zero; kInvalidArgument naming both versions when the version is not kCheckpointVersion.
Result<CheckpointHeader> decode_checkpoint_header(std::span<const std::byte> bytes);

// What manifest.json says (written by save_checkpoint, rank 0, last). Its text is JSON:
// {"format": "zinf-checkpoint", "version": kCheckpointVersion, "world_size", "stage",
//  "optimizer", "fingerprint" (16 hex digits), "partition_elements", "step",
//  "ranks": [{"file", "bytes", "xxh3"}, one per rank]}.
struct CheckpointManifestRank {
  std::string file;  // a plain file name inside the checkpoint directory
  std::uint64_t bytes = 0;
  std::string xxh3;  // the file's xxh3-64 as 16 hex digits
};
struct CheckpointManifest {
  int world_size = 0;
  int stage = 0;
  std::string optimizer;
  std::string fingerprint;
  std::uint64_t partition_elements = 0;
  std::int64_t step = 0;
  std::vector<CheckpointManifestRank> ranks;  // world_size entries
};
// Parses a manifest's text. kCorruption naming the key when the text is not a JSON object, a key
// is missing or of the wrong type (integers must be JSON integers in their field's range), the
// format or version is not this build's, 'ranks' does not hold world_size entries, or a rank's
// file is not a plain name in the directory.
Result<CheckpointManifest> parse_checkpoint_manifest(std::string_view text);

// "<dir>/rank<r>.zinfckpt".
std::string checkpoint_rank_path(const std::string& dir, int rank);

// Writes one file under a temporary name ("<path>.tmp"), hashing what it appends; commit()
// syncs it, renames it to `path` and syncs the directory. Destroyed uncommitted, it removes the
// temporary file, so a crash or an error never leaves a file under the final name.
// Appends are gathered in an 8 MiB aligned block written with O_DIRECT where the filesystem
// allows it (the last partial page through the page cache): buffered writes of gigabytes get
// throttled by dirty-page writeback to a fraction of the drive's rate.
class CheckpointWriter {
 public:
  static Result<std::unique_ptr<CheckpointWriter>> create(std::string path);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  Status append(const void* data, std::size_t bytes);
  Status commit();
  std::uint64_t bytes() const { return bytes_; }
  std::uint64_t digest() const { return XXH3_64bits_digest(hash_); }

 private:
  explicit CheckpointWriter(std::string path) : path_(std::move(path)) {}
  // Writes the first `bytes` of block_ (a multiple of 4096 with O_DIRECT).
  Status flush(std::size_t bytes);

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  bool direct_ = false;
  std::uint64_t bytes_ = 0;    // appended
  std::uint64_t written_ = 0;  // written to the file
  AlignedBuffer block_;
  std::size_t block_used_ = 0;
  XXH3_state_t* hash_ = nullptr;
};

// Reads a file front to back, through an 8 MiB aligned block read with O_DIRECT where the
// filesystem allows it (a checkpoint is read once; caching it would only evict other data).
class CheckpointReader {
 public:
  static Result<std::unique_ptr<CheckpointReader>> open(std::string path);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  // The next `bytes` bytes; kCorruption naming the file and offset when it ends first.
  Status read(void* out, std::size_t bytes);
  std::uint64_t file_bytes() const { return file_bytes_; }
  // The whole file's xxh3-64, read in bounded chunks (the read position is left alone).
  Result<std::uint64_t> checksum() const;
  const std::string& path() const { return path_; }

 private:
  explicit CheckpointReader(std::string path) : path_(std::move(path)) {}
  // buffer[0, *got) <- the file from `at` (4096-aligned), up to `bytes` (a 4096 multiple) or
  // the end of the file.
  Status read_block(std::byte* buffer, std::size_t bytes, std::uint64_t at, std::size_t* got) const;

  std::string path_;
  int fd_ = -1;
  std::uint64_t file_bytes_ = 0;
  std::uint64_t offset_ = 0;  // the next byte read() returns
  AlignedBuffer block_;       // the file from block_first_, block_valid_ bytes
  std::uint64_t block_first_ = 0;
  std::size_t block_valid_ = 0;
};

// Writes `text` to `path` crash-safely (as CheckpointWriter).
Status write_file_atomically(const std::string& path, const std::string& text);
Result<std::string> read_text_file(const std::string& path);

// --- The engine's save and load ---------------------------------------------------------------

// What a checkpoint reads from and writes into; everything outlives the call.
struct CheckpointContext {
  int rank = 0;
  int world_size = 1;
  const Config* config = nullptr;
  const Partitioner* partitioner = nullptr;
  std::size_t partition_elements = 0;
  OptimizerState* state = nullptr;
  RankExchange* exchange = nullptr;
  StickyError* sticky = nullptr;
};

// Writes this rank's file and (rank 0, last) the manifest (include/zinf/engine.hpp
// save_checkpoint). `precondition` is this rank's verdict on taking a checkpoint now; every rank
// learns every rank's. Collective.
Status save_checkpoint(const CheckpointContext& ctx, std::string_view call, const std::string& dir,
                       Status precondition, std::int64_t step, const LossScaler& scaler);

// Checks the manifest against this engine and this rank's file against the manifest (every rank
// agreeing), then writes the file's state into ctx.state; on success *header holds the step and
// the loss scaler's state. Errors before the state is touched leave it as it was; an error
// while it is written is sticky. Collective.
Status load_checkpoint_state(const CheckpointContext& ctx, std::string_view call,
                             const std::string& dir, Status precondition, CheckpointHeader* header);

}  // namespace zinf
