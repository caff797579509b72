// Checkpoints: the on-disk layout (a tag directory per checkpoint, DeepSpeed's), the format of
// one rank's state file and of the manifest, the file I/O that writes them durably through
// lib/io (so the fault injector reaches it) and reads them back with their xxh3-64 checksum, and
// the engine's save and load (save_checkpoint, load_checkpoint_state): what goes in, the checks
// against the manifest, the ranks' agreement at each phase, and resharding on load.
//
// Layout of a checkpoint directory <dir> (docs/ENGINE.md "Checkpoints"):
//   <dir>/latest                the tag of the newest complete checkpoint, one line
//   <dir>/<tag>/manifest.json   written last into the tag: its presence says the tag is complete
//   <dir>/<tag>/rank<r>.zinfckpt
//   <dir>/<tag>/client_state.bin  the user's opaque blob (Engine::set_client_state), if any
//   <dir>/.<tag>.tmp/           the tag being written; renamed to <dir>/<tag> once complete
//
// Layout of <tag>/rank<r>.zinfckpt (little-endian): a 4096-byte header (CheckpointHeader, zero
// padded), then for each saved piece in Piece order (the fp32 master, then the moments the
// optimizer has) partition_elements f32 values, then zeros up to a multiple of 4096 bytes (so
// the whole file moves with O_DIRECT). Nothing depends on where the state lived, so a checkpoint
// saved with the state on NVMe loads into an engine that keeps it in host memory; the manifest
// lists every parameter's place in the saved partition, so it loads into another world size,
// stage or sub-group size too (re-sliced by parameter name).
//
// Thread-safety: values and single-owner objects.
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/aligned.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/rank_exchange.hpp"
#include "io/io_engine.hpp"
#include "zero/loss_scaler.hpp"
#include "zero/partitioner.hpp"
#include "zinf/config.hpp"
#include "zinf/schedule.hpp"
#include "zinf/status.hpp"

namespace zinf {

class FaultInjector;
class ParameterLayout;

inline constexpr std::uint64_t kCheckpointMagic = 0x31544B43464E495AULL;  // "ZINFCKT1"
inline constexpr std::uint32_t kCheckpointVersion = 2;
inline constexpr std::size_t kCheckpointHeaderBytes = 4096;
inline constexpr std::string_view kCheckpointManifest = "manifest.json";
inline constexpr std::string_view kCheckpointLatest = "latest";
inline constexpr std::string_view kCheckpointClientState = "client_state.bin";

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

// The bytes of a rank file holding `pieces` pieces of `partition_elements` f32 values.
std::uint64_t checkpoint_rank_file_bytes(std::size_t pieces, std::uint64_t partition_elements);

// --- The manifest ------------------------------------------------------------------------------

// Where a parameter lay in the saved layout: its group, and its first element's place in it.
struct ManifestParam {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::kF32;
  std::uint32_t group = 0;
  std::uint64_t group_offset = 0;
};
// A saved group: each rank's slice of it, and where that slice starts in the rank's partition.
struct ManifestGroup {
  std::uint64_t shard_elements = 0;
  std::uint64_t partition_offset = 0;
};
struct ManifestFile {
  std::string file;  // relative to the tag directory
  std::uint64_t bytes = 0;
  std::uint64_t xxh3 = 0;
};

// manifest.json: everything a load needs besides the rank files. Every rank writes the same
// values, so rank 0's stand for all.
struct CheckpointManifest {
  std::string tag;
  std::uint64_t serial = 0;  // saves into this directory so far, this one included (pruning order)
  int world_size = 0;
  int stage = 0;
  std::string optimizer;  // optimizer_name()
  std::uint64_t fingerprint = 0;
  std::uint64_t partition_elements = 0;
  std::int64_t step = 0;
  // The learning rate: the optimizer's (or set_learning_rate()'s, when lr_override) and the
  // schedule's configuration; with the step they give every later step's lr.
  double lr = 0.0;
  bool lr_override = false;
  ScheduleConfig schedule;
  // The recorded gather order (module names; empty before the first step).
  std::vector<std::string> gather_order;
  std::vector<ManifestParam> params;
  std::vector<ManifestGroup> groups;
  std::vector<ManifestFile> ranks;         // world_size entries, rank r's at r
  std::vector<ManifestFile> client_state;  // zero or one entry
};

// The manifest as JSON text (keys sorted, 64-bit values as decimal or hex strings).
std::string encode_checkpoint_manifest(const CheckpointManifest& manifest);
// Parses what encode_checkpoint_manifest() wrote. kCorruption naming `path` and the key that is
// missing, of the wrong type or out of range; kInvalidArgument naming both versions for another
// format version. Never throws, whatever `text` holds.
Result<CheckpointManifest> parse_checkpoint_manifest(std::string_view text, std::string_view path);

// --- Files -------------------------------------------------------------------------------------

// "<dir>/rank<r>.zinfckpt".
std::string checkpoint_rank_path(const std::string& dir, int rank);

// The I/O engine a checkpoint's files go through: a small one of its own (so a save does not
// compete with the step's queue for slots), with the engine's fault injector when it has one.
Result<std::unique_ptr<IoEngine>> open_checkpoint_io(std::shared_ptr<FaultInjector> faults);

// Writes one file through `io`, hashing what it appends. Appends are gathered in 8 MiB aligned
// blocks, two of them: one fills while the other is written, so reading the state (from the
// device, host memory or NVMe) overlaps writing the file. With `direct` the file is opened
// O_DIRECT where the filesystem allows it and its end padded with zeros to a multiple of 4096
// bytes (the padding is hashed and counted; padded also where the filesystem refuses O_DIRECT);
// without it the file is exactly what was appended.
// commit() writes the rest and fsyncs the file; destroyed uncommitted, the writer removes it.
class CheckpointWriter {
 public:
  // REQUIRES: `io` outlives the writer.
  static Result<std::unique_ptr<CheckpointWriter>> create(IoEngine& io, std::string path,
                                                          bool direct);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  Status append(const void* data, std::size_t bytes);
  Status commit();
  std::uint64_t bytes() const { return bytes_; }
  std::uint64_t digest() const { return XXH3_64bits_digest(hash_); }
  const std::string& path() const { return path_; }

 private:
  CheckpointWriter(IoEngine& io, std::string path) : io_(&io), path_(std::move(path)) {}
  // Submits the current block's first `bytes` bytes and moves to the other block.
  Status submit_block(std::size_t bytes);
  // Waits for block `b`'s write, if one is in flight.
  Status wait_block(int b);

  IoEngine* io_;
  std::string path_;
  int fd_ = -1;
  FileHandle file_;
  bool direct_ = false;  // the file is open with O_DIRECT
  bool pad_ = false;     // pad to 4096 bytes (O_DIRECT asked for)
  bool committed_ = false;
  std::uint64_t bytes_ = 0;    // appended
  std::uint64_t written_ = 0;  // submitted to the file
  AlignedBuffer blocks_[2];
  Ticket tickets_[2];
  int current_ = 0;
  std::size_t used_ = 0;  // bytes of blocks_[current_] filled
  XXH3_state_t* hash_ = nullptr;
};

// Reads a file through `io`: front to back through 8 MiB aligned blocks (O_DIRECT where the
// filesystem allows it and the file is a multiple of 4096 bytes), or at any offset (read_at).
class CheckpointReader {
 public:
  // REQUIRES: `io` outlives the reader.
  static Result<std::unique_ptr<CheckpointReader>> open(IoEngine& io, std::string path,
                                                        bool direct);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  // The next `bytes` bytes; kCorruption naming the file and offset when it ends first.
  Status read(void* out, std::size_t bytes);
  // `bytes` bytes from `offset`. REQUIRES: the reader was opened without `direct`.
  Status read_at(std::uint64_t offset, std::size_t bytes, void* out);
  std::uint64_t file_bytes() const { return file_bytes_; }
  // The whole file's xxh3-64, read in bounded chunks (the read position is left alone).
  Result<std::uint64_t> checksum();
  const std::string& path() const { return path_; }

 private:
  CheckpointReader(IoEngine& io, std::string path) : io_(&io), path_(std::move(path)) {}
  // buffer <- the file from `at` (4096-aligned), min(capacity, rest of the file) bytes.
  Status read_block(std::byte* buffer, std::size_t capacity, std::uint64_t at, std::size_t* got);

  IoEngine* io_;
  std::string path_;
  int fd_ = -1;
  FileHandle file_;
  bool direct_ = false;
  std::uint64_t file_bytes_ = 0;
  std::uint64_t offset_ = 0;  // the next byte read() returns
  AlignedBuffer block_;       // the file from block_first_, block_valid_ bytes
  std::uint64_t block_first_ = 0;
  std::size_t block_valid_ = 0;
};

// Writes `text` to `path` durably through `io`: "<path>.tmp", fsync, rename, fsync of the
// directory. A crash leaves the old file or the new one, never a mix.
Status write_file_atomically(IoEngine& io, const std::string& path, std::string_view text);
// The whole file through `io`.
Result<std::string> read_text_file(IoEngine& io, const std::string& path);
// fsync of a directory (a rename or a new entry in it is durable only then).
Status sync_dir(const std::string& dir);

// A tag names a directory under the checkpoint directory: not empty, at most 200 characters of
// [A-Za-z0-9._-], not starting with '.', not "latest". kInvalidArgument naming it otherwise.
Status check_checkpoint_tag(std::string_view tag);
// The tag <dir>/latest names; kNotFound naming <dir>/latest when there is none.
Result<std::string> read_latest_tag(IoEngine& io, const std::string& dir);
// The complete tags under `dir` (a subdirectory with a manifest that parses), oldest first
// (by serial), with their manifests.
std::vector<CheckpointManifest> list_checkpoint_tags(IoEngine& io, const std::string& dir);

// --- Outside the engine (zinf ckpt) -----------------------------------------------------------

// export_checkpoint_safetensors() is public (include/zinf/engine.hpp), in checkpoint_export.cpp.
// {"dir", "latest", "tags": [{tag, step, world_size, stage, optimizer, parameters,
// parameter_elements, bytes, checksums ("ok", "not verified", or the error)}]}, oldest first.
Result<nlohmann::json> inspect_checkpoints(const std::string& dir, bool verify);

// --- The engine's save and load ----------------------------------------------------------------

// What a checkpoint reads from and writes into; everything outlives the call.
struct CheckpointContext {
  int rank = 0;
  int world_size = 1;
  const Config* config = nullptr;
  const ParameterLayout* layout = nullptr;
  OptimizerState* state = nullptr;
  RankExchange* exchange = nullptr;
  StickyError* sticky = nullptr;
  std::shared_ptr<FaultInjector> io_faults;
};

// The state a resume needs beyond the optimizer's partition.
struct ResumeState {
  ResumeState() = default;
  ResumeState(std::int64_t step_in, const LossScaler& scaler, double lr_in, bool lr_override_in,
              const ScheduleConfig& schedule_in)
      : step(step_in),
        loss_scale(scaler.scale()),
        loss_scale_good_steps(scaler.good_steps()),
        loss_scale_hysteresis_left(scaler.hysteresis_left()),
        lr(lr_in),
        lr_override(lr_override_in),
        schedule(schedule_in) {}

  std::int64_t step = 0;
  double loss_scale = 1.0;
  std::int64_t loss_scale_good_steps = 0;
  std::int32_t loss_scale_hysteresis_left = 0;
  double lr = 0.0;
  bool lr_override = false;
  ScheduleConfig schedule;
  std::vector<std::string> gather_order;
  std::string client_state;
};

// A checkpoint is taken between steps: kFailedPrecondition naming `call` when module `in_use`
// (>= 0) is gathered or gradients were reduced since the last step.
Status checkpoint_precondition(std::string_view call, const ParameterLayout& layout, long in_use,
                               bool grads_pending);
// The recorded gather order as module names, and back (empty when a name is not a module).
std::vector<std::string> gather_order_names(const ParameterLayout& layout,
                                            const std::vector<std::size_t>& order);
std::vector<std::size_t> gather_order_indices(const ParameterLayout& layout,
                                              const std::vector<std::string>& names);

// Writes <dir>/<tag> (include/zinf/engine.hpp save_checkpoint): every rank's file into
// <dir>/.<tag>.tmp, then rank 0's client state and manifest, the rename to <dir>/<tag>,
// <dir>/latest, and the pruning of tags beyond config.keep_last. `precondition` is this rank's
// verdict on taking a checkpoint now; every rank learns every rank's. Collective.
Status save_checkpoint(const CheckpointContext& ctx, std::string_view call, const std::string& dir,
                       const std::string& tag, Status precondition, const ResumeState& resume);

// Reads <dir>/<tag> (`tag` empty: the one <dir>/latest names), checks it against this engine
// (every rank agreeing), then writes the state into ctx.state, re-sliced by parameter name when
// the checkpoint's world size or layout differs from this engine's. On success *resume holds the
// rest. Errors before the state is touched leave it as it was; an error while it is written is
// sticky. Collective.
Status load_checkpoint_state(const CheckpointContext& ctx, std::string_view call,
                             const std::string& dir, const std::string& tag, Status precondition,
                             ResumeState* resume);

}  // namespace zinf
