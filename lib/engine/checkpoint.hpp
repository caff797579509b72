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
// stage or sub-group size too (re-sliced by parameter name). With the state on NVMe in the
// store's checkpoint layout the rank file is the swap file itself, hard-linked (as long as the
// layout or longer: the swap's other extents follow, and its size is whole aio blocks) with its
// block checksums in <tag>/rank<r>.blocks (ManifestFile::blocks; docs/ENGINE.md "NVMe state: saved
// by link"), and a load of the same store layout takes it in place
// (OptimizerState::adopt_checkpoint).
//
// Thread-safety: values and single-owner objects.
#pragma once

#include <xxhash.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/aligned.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/rank_exchange.hpp"
#include "io/buffer_pool.hpp"
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
// The format version a save writes (in the manifest and every rank file's header), and the
// oldest one a load reads. Version 2: every rank file copied, checked by the whole file's xxh3-64
// in the manifest. Version 3: a rank file may also be linked from the swap space (ManifestFile::
// blocks): as long as its layout or longer, its xxh3 in the manifest 0, checked block by block
// against <tag>/rank<r>.blocks. A build that reads only version 2 would take a linked file for a
// corrupt one; it refuses version 3 by its number instead.
inline constexpr std::uint32_t kCheckpointVersion = 3;
inline constexpr std::uint32_t kCheckpointOldestVersion = 2;
inline constexpr std::size_t kCheckpointHeaderBytes = 4096;
inline constexpr std::string_view kCheckpointManifest = "manifest.json";
inline constexpr std::string_view kCheckpointLatest = "latest";
// What a save writes `latest` through (write_file_atomically: "<path>.tmp").
inline constexpr std::string_view kCheckpointLatestTemp = "latest.tmp";
inline constexpr std::string_view kCheckpointClientState = "client_state.bin";
// The file a save holds an exclusive flock(2) on while it changes the directory (rank 0).
inline constexpr std::string_view kCheckpointSaveLock = ".zinf-save.lock";

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
// zero; kInvalidArgument naming its version and those this build reads when the version is not
// kCheckpointOldestVersion .. kCheckpointVersion.
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
  // ParameterSpec::trainable. Written as "trainable": false for a frozen parameter only, and read
  // as true where absent, so that a manifest without frozen parameters (and every earlier one)
  // reads as before; offline readers (zero_to_fp32.py --exclude_frozen_parameters) use it to tell
  // the frozen parameters the engine holds at stage 3.
  bool trainable = true;
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
  // A rank file linked from the swap space (StateStore::link_checkpoint) may be longer than
  // `bytes` (the swap file's other extents follow, and the file is whole aio blocks; a load reads
  // its first `bytes` only), and its checksums are per block, in the file `blocks`
  // (encode_block_sums) of `blocks_bytes` bytes whose xxh3-64 is `blocks_xxh3`; `xxh3` is then 0.
  // Empty for a copied file.
  std::string blocks;
  std::uint64_t blocks_bytes = 0;
  std::uint64_t blocks_xxh3 = 0;
};

// "rank<r>.blocks": per block of a linked rank file, in file order, its end offset and its
// xxh3-64, as two little-endian u64 each.
std::string encode_block_sums(const std::vector<FileBlockSum>& sums);
// Reads what encode_block_sums() wrote; kCorruption naming `path` when the bytes are not whole
// entries, the ends do not increase, or the last end is not `file_bytes`.
Result<std::vector<FileBlockSum>> decode_block_sums(std::string_view bytes, std::string_view path,
                                                    std::uint64_t file_bytes);

// How the saving engine scaled its loss (the manifest's "loss_scaler"): no fp16 ("off", the scale
// always 1), fp16 with a static fp16.loss_scale ("static"), or fp16 with the dynamic scaler
// ("dynamic").
enum class LossScalerMode : std::uint8_t { kOff, kStatic, kDynamic };
std::string_view loss_scaler_mode_name(LossScalerMode mode);
// The mode of the scaler StepNumerics makes from `fp16`.
LossScalerMode loss_scaler_mode(const Fp16Config& fp16);
// Whether a load restores the saved scaler (scale, good steps, hysteresis left): only when this
// engine's scaler is dynamic (`dynamic`) and the checkpoint's was dynamic fp16. Unlike DeepSpeed,
// which takes the saved scaler, mode included (its ZeRO stage 1/2 load replaces loss_scaler and
// dynamic_loss_scale with the checkpoint's), zinf deliberately keeps the scaler this config asks
// for unless both are dynamic. Otherwise the engine keeps its own
// scaler as it started: 1 without fp16, its fp16.loss_scale when static, 2^initial_scale_power
// when dynamic. A scale carried from another mode would divide every later step's gradients by
// a factor that is not the one the program scaled its loss by.
bool restores_loss_scaler(bool dynamic, LossScalerMode saved);

// The state a resume needs beyond the optimizer's partition. A checkpoint keeps it in three
// places: the step, the learning rate's state and the loss scaler's mode in the manifest, the
// loss scaler's state in every rank file's header, the client state in client_state.bin.
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
  // The saved scaler's mode. On load, a manifest without it (written before it existed) reads
  // as kDynamic when the saved scale is not 1 and kOff when it is: an engine without fp16 always
  // saved 1, and a dynamic one reaches 1 only at fp16.min_loss_scale 1. An older static fp16
  // checkpoint (scale not 1) so reads as dynamic.
  LossScalerMode loss_scaler_mode = LossScalerMode::kOff;
  // The learning rate: the optimizer's (or set_learning_rate()'s, when lr_override) and the
  // schedule's configuration; with the step they give every later step's lr.
  double lr = 0.0;
  bool lr_override = false;
  ScheduleConfig schedule;
  // The recorded gather order (module names; empty before the first step).
  std::vector<std::string> gather_order;
  std::string client_state;
  // zinf.clip_from_previous_step: the clipping coefficient the next step applies (the manifest's
  // optional "previous_clip_coef"; absent: none, the next step clips by its own norm).
  std::optional<double> previous_clip_coef;
};

// manifest.json: everything a load needs besides the rank files. Every rank writes the same
// values, so rank 0's stand for all.
struct CheckpointManifest {
  // The format version (kCheckpointOldestVersion .. kCheckpointVersion); a save writes
  // kCheckpointVersion, and every rank file's header carries the manifest's.
  std::uint32_t version = kCheckpointVersion;
  std::string tag;
  std::uint64_t serial = 0;  // saves into this directory so far, this one included (pruning order)
  int world_size = 0;
  int stage = 0;
  std::string optimizer;  // optimizer_name()
  std::uint64_t fingerprint = 0;
  std::uint64_t partition_elements = 0;
  // The step, the learning rate (the optimizer's, or set_learning_rate()'s when lr_override),
  // the schedule's configuration and the recorded gather order. The manifest carries those; its
  // loss scaler fields and client_state stay empty (the rank files' headers and
  // client_state.bin hold them).
  ResumeState resume;
  // "loss_scaler": the saving engine's LossScalerMode; absent in manifests written before it
  // (ResumeState::loss_scaler_mode says how a load reads those).
  std::optional<LossScalerMode> loss_scaler;
  std::vector<ManifestParam> params;
  std::vector<ManifestGroup> groups;
  std::vector<ManifestFile> ranks;         // world_size entries, rank r's at r
  std::vector<ManifestFile> client_state;  // zero or one entry
};

// The manifest as JSON text (keys sorted, 64-bit values as decimal or hex strings).
std::string encode_checkpoint_manifest(const CheckpointManifest& manifest);
// Parses what encode_checkpoint_manifest() wrote. kCorruption naming `path` and the key that is
// missing, of the wrong type or out of range; kInvalidArgument naming `path`, its version and
// those this build reads for a version outside kCheckpointOldestVersion .. kCheckpointVersion.
// Never throws, whatever `text` holds.
Result<CheckpointManifest> parse_checkpoint_manifest(std::string_view text, std::string_view path);

// --- Files -------------------------------------------------------------------------------------

// "<dir>/rank<r>.zinfckpt".
std::string checkpoint_rank_path(const std::string& dir, int rank);

// The I/O engine a checkpoint's files go through: a small one of its own (so a save does not
// compete with the step's queue for slots), with the engine's fault injector when it has one.
Result<std::unique_ptr<IoEngine>> open_checkpoint_io(std::shared_ptr<FaultInjector> faults);

// A writer's or a sequential reader's pipeline: kCheckpointPipelineBlocks blocks of
// kCheckpointBlockBytes (48 MiB a file at most: a shorter file gets only the blocks it fills, one
// shorter than a block one block of its size), from 2 MiB pages where the kernel gives them,
// registered with the I/O engine. `zinf io bench` keeps the same bytes in flight by default (6
// requests of 8 MiB, cut into 1 MiB pieces, 32 at the drive), so a checkpoint meets the drive as
// the raw benchmark does.
inline constexpr std::size_t kCheckpointBlockBytes = std::size_t{8} << 20;
inline constexpr std::size_t kCheckpointPipelineBlocks = 6;

// The xxh3-64 of a sequence of blocks, computed on a thread of its own in the order the blocks
// were pushed, so hashing a checkpoint's bytes overlaps moving them (a core hashes about as fast
// as a drive moves bytes); the thread starts with the first push(). The blocks are the caller's
// until wait() says they were hashed. Thread-safety: one caller thread.
class BlockHasher {
 public:
  BlockHasher();
  ~BlockHasher();
  BlockHasher(const BlockHasher&) = delete;
  BlockHasher& operator=(const BlockHasher&) = delete;

  // Queues [data, data + bytes) and returns its number (from 1), which wait() takes. At most
  // kMaxQueued blocks are queued and not yet hashed.
  std::uint64_t push(const std::byte* data, std::size_t bytes);
  // Returns once block `number` (and every block before it) is hashed.
  void wait(std::uint64_t number);
  // Waits for every queued block; the digest of all of them.
  std::uint64_t digest();
  // Starts a new sequence. REQUIRES: nothing queued is unhashed (digest() was called).
  void reset();
  // From the next sequence on (call it before push() or after reset()), checks the bytes against
  // `sums` too: they are cut at each sum's end offset and each run's xxh3-64 compared with it.
  void expect(std::vector<FileBlockSum> sums);
  // After digest(): the index of the first sum whose run differed (or that the bytes pushed did
  // not reach), or sums.size() when every one matched. REQUIRES: expect() was called.
  std::size_t first_mismatch();

  static constexpr std::size_t kMaxQueued = 16;

 private:
  struct Item {
    const std::byte* data = nullptr;
    std::size_t bytes = 0;
  };
  void run();

  std::mutex mutex_;
  std::condition_variable changed_;
  Item queue_[kMaxQueued];
  std::uint64_t pushed_ = 0;
  std::uint64_t hashed_ = 0;
  bool stop_ = false;
  XXH3_state_t* state_ = nullptr;
  // expect(): the runs, the one being hashed, the bytes hashed so far, the first that differed.
  // The hashing thread owns them between reset() and digest().
  std::vector<FileBlockSum> sums_;
  XXH3_state_t* run_state_ = nullptr;
  std::size_t next_sum_ = 0;
  std::uint64_t hashed_bytes_ = 0;
  std::size_t first_bad_ = SIZE_MAX;
  std::thread thread_;
};

// Writes one file through `io`, hashing what it appends. Appends are gathered in aligned blocks
// that are written as soon as they are full, up to one write in flight per block but the one
// filling (kCheckpointPipelineBlocks - 1 for a file of 48 MiB or more), so reading the state (from
// the device, host memory or NVMe) overlaps writing the file, at the drive's queue depth. With
// `direct` the file is opened O_DIRECT where the filesystem allows it and its end padded with zeros
// to a multiple of 4096 bytes (the padding is hashed and counted; padded also where the filesystem
// refuses O_DIRECT); without it the file is exactly what was appended (through at most two 1 MiB
// blocks: small files). commit() writes the rest and fsyncs the file; destroyed uncommitted, the
// writer removes it.
class CheckpointWriter {
 public:
  // REQUIRES: `io` outlives the writer. `expected_bytes` > 0: the file's size once committed,
  // allocated at once (where the filesystem can), so the writes do not extend the file.
  static Result<std::unique_ptr<CheckpointWriter>> create(IoEngine& io, std::string path,
                                                          bool direct,
                                                          std::uint64_t expected_bytes = 0);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  Status append(const void* data, std::size_t bytes);
  Status commit();
  std::uint64_t bytes() const { return bytes_; }
  // After commit(): the xxh3-64 of the file.
  std::uint64_t digest() const { return digest_; }
  const std::string& path() const { return path_; }

 private:
  CheckpointWriter(IoEngine& io, std::string path) : io_(&io), path_(std::move(path)) {}
  // Submits the current block's first `bytes` bytes and moves to the next block, once that
  // block's previous write is done.
  Status submit_block(std::size_t bytes);
  // Waits for block `b`'s write, if one is in flight, and for its hashing.
  Status wait_block(std::size_t b);

  IoEngine* io_;
  std::string path_;
  int fd_ = -1;
  FileHandle file_;
  bool direct_ = false;  // the file is open with O_DIRECT
  bool pad_ = false;     // pad to 4096 bytes (O_DIRECT asked for)
  bool committed_ = false;
  std::uint64_t allocated_ = 0;  // fallocate()d at create
  std::uint64_t bytes_ = 0;      // appended
  std::uint64_t written_ = 0;    // submitted to the file
  std::unique_ptr<BufferPool> pool_;
  bool registered_ = false;            // pool_ is registered with io_
  std::vector<Ticket> tickets_;        // one per block of pool_
  std::vector<std::uint64_t> hashes_;  // each block's number in hasher_ (0: none)
  std::size_t current_ = 0;
  std::size_t used_ = 0;  // bytes of block current_ filled
  BlockHasher hasher_;
  std::uint64_t digest_ = 0;
};

// Reads a file through `io`: front to back (read(), finish(), checksum()) through a read-ahead
// pipeline of up to kCheckpointPipelineBlocks aligned blocks (O_DIRECT where the filesystem allows
// it and the file is a multiple of 4096 bytes), hashing every block as it arrives, so one pass both
// delivers the bytes and checks them; or at any offset (read_at).
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
  // Reads the rest of the file and returns the xxh3-64 of all of it (what read() returned, and
  // the rest). The read position is then the end of the file.
  Result<std::uint64_t> finish();
  // The whole file's xxh3-64, read front to back in one pass; the read position starts over.
  Result<std::uint64_t> checksum();
  // `bytes` bytes from `offset`. REQUIRES: the reader was opened without `direct`.
  Status read_at(std::uint64_t offset, std::size_t bytes, void* out);
  // A linked rank file: for this reader the file ends at sums.back().end_offset, and every
  // front-to-back pass checks each block against its checksum, so that finish() and checksum()
  // return kCorruption naming the file and the first bad block's offsets, or else 0.
  // REQUIRES: no pass started; sums.back().end_offset <= file_bytes().
  void expect_block_sums(std::vector<FileBlockSum> sums);
  const std::vector<FileBlockSum>& block_sums() const { return block_sums_; }
  std::uint64_t file_bytes() const { return file_bytes_; }
  const std::string& path() const { return path_; }
  // The file open, as fstat of its descriptor saw it at open(). A file opened again by name is
  // the same file, not written since, when every field matches: a device and inode alone do not
  // say so, since a filesystem hands a freed inode number to the next file created (ext4 almost
  // always at once), so a file unlinked and created again, or written in place, keeps them. The
  // change time is left out: it moves with the link count too, as when the process that linked a
  // swap file into a checkpoint starts its next swap generation (unlinking the swap path).
  struct FileIdentity {
    std::uint64_t device = 0;
    std::uint64_t inode = 0;
    std::uint64_t bytes = 0;    // st_size
    std::int64_t mtime_ns = 0;  // st_mtim
    bool operator==(const FileIdentity&) const = default;
  };
  const FileIdentity& file_identity() const { return file_identity_; }

 private:
  CheckpointReader(IoEngine& io, std::string path) : io_(&io), path_(std::move(path)) {}
  // Allocates the pipeline and submits the first blocks' reads.
  Status start();
  // Hands the current block's slot to the next unread offset and makes the next block in file
  // order current (waiting for its read, hashing it). False in *more at the end of the file.
  Status next_block(bool* more);
  // Waits for every read in flight and frees the pipeline.
  Status stop();

  IoEngine* io_;
  std::string path_;
  int fd_ = -1;
  FileHandle file_;
  bool direct_ = false;
  std::uint64_t file_bytes_ = 0;
  FileIdentity file_identity_;
  // The pipeline (while a front-to-back pass runs): block k of the file is in slot k % blocks.
  std::unique_ptr<BufferPool> pool_;
  bool registered_ = false;
  std::vector<Ticket> tickets_;
  std::vector<std::uint64_t> hashes_;    // each slot's number in hasher_ (0: none)
  std::vector<std::size_t> slot_bytes_;  // bytes each slot's read asked for
  std::uint64_t submitted_ = 0;          // the file's bytes whose reads were submitted
  std::uint64_t block_index_ = 0;        // the current block (valid while current_valid_ > 0)
  bool has_current_ = false;
  std::size_t current_valid_ = 0;         // bytes in the current block
  std::size_t current_used_ = 0;          // of them, returned by read()
  std::uint64_t offset_ = 0;              // the next byte read() returns
  std::vector<FileBlockSum> block_sums_;  // expect_block_sums(), for messages
  BlockHasher hasher_;
};

// Opens rank file `f` of `tag_dir` for one front-to-back pass (`direct`) or for reads at any
// offset, and checks its size against the manifest: f.bytes exactly, or at least f.bytes for a
// linked file, whose block checksums are read from f.blocks (checked against the manifest) and
// handed to the reader. kCorruption naming the file otherwise. Its content is checked by a pass
// (CheckpointReader::finish or checksum) and check_rank_digest.
Result<std::unique_ptr<CheckpointReader>> open_rank_reader(IoEngine& io, const std::string& tag_dir,
                                                           const ManifestFile& f, bool direct);
// Whether a pass's digest matches `f`: a copied file's xxh3 against the manifest's (kCorruption
// naming the file). A linked file's pass compared each block already.
Status check_rank_digest(const ManifestFile& f, const CheckpointReader& r, std::uint64_t digest);

// Each reader holds a descriptor and one of the engine's 64 file slots (and a hashing thread once
// it made a pass); a load or export of a checkpoint saved by more ranks than this reopens files,
// never runs out of them.
inline constexpr std::size_t kCheckpointOpenReaderCount = 32;

// The rank files of one tag, read at any offset (CheckpointReader::read_at) with at most
// kCheckpointOpenReaderCount of them open at once, so that a checkpoint of any world size reads
// through one open_checkpoint_io() engine (64 file slots) within any file descriptor limit. The
// caller verifies each file it will read (a pass over it: checksum() and check_rank_digest) and
// hands the reader over (verified()); a file that is not open when read is opened again and
// must be the file verified, unchanged (CheckpointReader::FileIdentity: the same device, inode,
// size and modification time; kCorruption naming it otherwise: the tag was replaced or written
// meanwhile); the least recently read file is closed to make room. A reopen reads nothing but the
// file: a linked file's block checksums, decoded when it was verified, are kept.
// Thread-safety: one caller thread.
class RankFileReaders {
 public:
  // REQUIRES: `io` and `manifest` outlive this object.
  RankFileReaders(IoEngine& io, std::string tag_dir, const CheckpointManifest& manifest)
      : io_(&io), tag_dir_(std::move(tag_dir)), manifest_(&manifest) {}
  // Rank `rank`'s file, verified through `r` (opened by open_rank_reader without `direct`); kept
  // open while fewer than kCheckpointOpenReaderCount are, closed otherwise.
  void verified(int rank, std::unique_ptr<CheckpointReader> r);
  // `bytes` bytes from `offset` of rank `rank`'s file. REQUIRES: verified(rank, ...) was called.
  Status read_at(int rank, std::uint64_t offset, std::size_t bytes, void* out);
  // Files open now (at most kCheckpointOpenReaderCount) and opened again so far.
  std::size_t open_count() const { return open_.size(); }
  std::uint64_t reopened_count() const { return reopened_count_; }

 private:
  // A verified file: what it was when verified, and a linked file's block checksums.
  struct Verified {
    CheckpointReader::FileIdentity identity;
    std::vector<FileBlockSum> block_sums;
  };
  struct Open {
    int rank = 0;
    std::uint64_t last_use = 0;
    std::unique_ptr<CheckpointReader> reader;
  };
  // Keeps `r` open, closing the least recently read file when kCheckpointOpenReaderCount are.
  void keep(int rank, std::unique_ptr<CheckpointReader> r);

  IoEngine* io_;
  std::string tag_dir_;
  const CheckpointManifest* manifest_;
  std::map<int, Verified> verified_;
  std::vector<Open> open_;
  std::uint64_t use_count_ = 0;
  std::uint64_t reopened_count_ = 0;
};

// Writes `text` to `path` durably through `io`: "<path>.tmp", fsync, rename, fsync of the
// directory. A crash leaves the old file or the new one, never a mix.
Status write_file_atomically(IoEngine& io, const std::string& path, std::string_view text);
// The whole file through `io`.
Result<std::string> read_text_file(IoEngine& io, const std::string& path);
// The whole file through `io`, checked against the size and xxh3-64 the manifest gives for it (a
// client state, ManifestFile::bytes and xxh3; a rank file's block checksums, blocks_bytes and
// blocks_xxh3): kCorruption naming `path` when either differs, read_text_file()'s error when it
// does not read.
Result<std::string> read_checked_file(IoEngine& io, const std::string& path,
                                      std::uint64_t expected_bytes, std::uint64_t expected_xxh3);
// fsync of a directory (a rename or a new entry in it is durable only then).
Status sync_dir(const std::string& dir);

// A tag names a directory under the checkpoint directory: not empty, at most 200 characters of
// [A-Za-z0-9._-], not starting with '.', not "latest" nor "latest.tmp". kInvalidArgument naming
// it otherwise.
Status check_checkpoint_tag(std::string_view tag);
// The tag <dir>/latest names; kNotFound naming <dir>/latest when there is none.
Result<std::string> read_latest_tag(IoEngine& io, const std::string& dir);
// What list_checkpoint_tags() passes over in the checkpoint directory that `zinf ckpt inspect`
// reports, each list in directory order.
struct RefusedCheckpointTags {
  struct Tag {
    std::string tag;
    // Why it is not a complete checkpoint: the manifest's read or parse error, or "its manifest
    // names tag '<other>'".
    std::string reason;
  };
  // Tag directories that look like a checkpoint (a manifest, or rank0.zinfckpt) but are not a
  // complete one. A directory with neither may be the program's (logs, say) and is not listed.
  std::vector<Tag> tags;
  // "<dir>/.<tag>.tmp" directories: saves in progress or cut short.
  std::vector<std::string> temp_dirs;
  // "<dir>/.<tag>.old" directories: tags a save was replacing when it was cut short (or, left
  // by an earlier version of the engine, pruning).
  std::vector<std::string> old_dirs;
  // "<dir>/.<tag>.pruned" directories: tags keep_last was removing when a save was cut short.
  std::vector<std::string> pruned_dirs;
};

// The complete tags under `dir` (a subdirectory with a manifest that parses and names it), oldest
// first (by serial), with their manifests. With `refused`, what it passed over too (cleared first).
std::vector<CheckpointManifest> list_checkpoint_tags(IoEngine& io, const std::string& dir,
                                                     RefusedCheckpointTags* refused = nullptr);

// What a save needs of a complete tag: its name, its serial (the pruning order, and the next
// save's serial) and its step (keep_last counts only tags of the saved step or an earlier one).
struct CheckpointTagSummary {
  std::string tag;
  std::uint64_t serial = 0;
  std::int64_t step = 0;
};
// parse_checkpoint_manifest()'s checks of the whole text's checksum, its format and version, and
// of "tag", "serial" and "step", with the same errors, passing over the rest (the parameters,
// groups and file lists, most of a manifest) without building it.
Result<CheckpointTagSummary> parse_checkpoint_manifest_summary(std::string_view text,
                                                               std::string_view path);
// list_checkpoint_tags() with each tag's summary (parse_checkpoint_manifest_summary): what a save
// lists, reading each manifest once and holding one at a time, so that a save into a directory of
// many tags costs a read of each manifest and no more.
std::vector<CheckpointTagSummary> list_checkpoint_tag_summaries(
    IoEngine& io, const std::string& dir, RefusedCheckpointTags* refused = nullptr);

// The order the lists above are in, for tags gathered from elsewhere too (.<tag>.old directories):
// oldest first by serial, then by name, so that tags of one serial come in one order everywhere.
template <class Tag>
void sort_tags_oldest_first(std::vector<Tag>& tags) {
  std::sort(tags.begin(), tags.end(), [](const Tag& a, const Tag& b) {
    return a.serial != b.serial ? a.serial < b.serial : a.tag < b.tag;
  });
}

// "<dir>/.<tag>.old" when it holds the complete tag `tag` (a manifest that parses and names it,
// and every file the manifest lists) and "<dir>/<tag>" does not exist: a save that replaced the
// tag by two renames (a filesystem without RENAME_EXCHANGE) was cut short between them. A load
// of the tag reads it there, the next save renames it back, `zinf ckpt inspect` notes it. Empty
// otherwise. A tag directory is removed manifest first, so a half-removed one never qualifies.
std::string moved_aside_tag_dir(IoEngine& io, const std::string& dir, const std::string& tag);

// Whether complete tag `m`, one of `tags` (list_checkpoint_tags(): oldest first by serial), is
// the leftover of a save cut short between its rename and the rename of `latest`: of a later step
// than the tag `latest` names (by step, as keep_last prunes and train_lm's --resume check judges:
// where a run resumed from `latest` is going, whatever its save interval), or, with no `latest`
// file at all, the newest. A save of that tag replaces it; `zinf ckpt inspect` notes it.
// `latest`: read_latest_tag()'s result, read when `has_latest`.
bool is_leftover_tag(const std::vector<CheckpointManifest>& tags, bool has_latest,
                     const Result<std::string>& latest, const CheckpointManifest& m);

// Seams for tests of a save that replaces a tag (checkpoint_replace_test.cpp); process-wide,
// default-constructed in production.
struct CheckpointSaveSeams {
  // false: replace a tag by two renames, as on a filesystem without renameat2(RENAME_EXCHANGE).
  bool exchange = true;
  // Called by rank 0 at each point of a save's commit, by name: "written" (the new tag complete
  // in .<tag>.tmp), "exchanged" (the old tag swapped into .<tag>.tmp), "moved-aside" and
  // "renamed" (the two renames without an exchange), "committed" (the new tag under its name),
  // "latest" (`latest` names it), "pruning" (a tag keep_last removes renamed to .<tag>.pruned). A
  // test ends the process there to leave what a crash would.
  std::function<void(std::string_view point)> at;
  // Nonzero: the save's rename of a complete .<tag>.old back to <tag> fails with this errno, as
  // on a full or read-only filesystem.
  int restore_error = 0;
};
void set_checkpoint_save_seams(CheckpointSaveSeams seams);

// --- Outside the engine (zinf ckpt) -----------------------------------------------------------

// export_checkpoint_safetensors() is public (include/zinf/engine.hpp), in checkpoint_export.cpp.
// {"dir", "latest", "tags": [{tag, step, world_size, stage, optimizer, parameters,
// parameter_elements, bytes, disk_bytes, dir (the directory holding the tag's files), checksums
// ("ok", "not verified", or the error: the rank files and the client state)}], "problems":
// [text], "notes": [text]}, tags oldest first. A tag a replacing save left at .<tag>.old
// (moved_aside_tag_dir) is listed and verified there, as a load reads it. The problems: a
// `latest` that does not read or names no complete tag, a tag directory (one with a manifest or
// rank files) whose manifest does not read. The notes, each saying what the next save or resume
// does with it: saves in progress or cut short (.<tag>.tmp), tags being replaced (.<tag>.old) or
// pruned (.<tag>.pruned) when a save was cut short, a latest.tmp left by a save cut short, and
// complete tags newer than the one `latest` names (or any, when there is no `latest`): a save cut
// short before `latest` moved to them. kNotFound naming `dir` when it is not a directory, or holds
// neither `latest` nor a tag.
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

// A checkpoint is taken between steps: kFailedPrecondition naming `call` when module `in_use`
// (>= 0) is gathered or gradients were reduced since the last step.
Status checkpoint_precondition(std::string_view call, const ParameterLayout& layout, long in_use,
                               bool grads_pending);
// The recorded gather order as module names, and back (empty when a name is not a module).
std::vector<std::string> gather_order_names(const ParameterLayout& layout,
                                            const std::vector<std::size_t>& order);
std::vector<std::size_t> gather_order_indices(const ParameterLayout& layout,
                                              const std::vector<std::string>& names);

// The schedule and optimizer lr a resumed run goes on with, from the engine's own (`own`, `own_lr`:
// its config's "scheduler" section or set_lr_schedule(), and its optimizer lr) and the
// checkpoint's (`saved`). A rate set by set_learning_rate() before the save (saved.lr_override),
// or an engine without a schedule of its own, takes the checkpoint's schedule and lr. Otherwise
// the engine keeps its schedule and lr, at the checkpoint's last_batch_iteration (`own_kept`): as
// with DeepSpeed, whose checkpoint keeps only the scheduler's last_batch_iteration, the resumed
// run's config gives the curve. The load checks this schedule before it touches the state, and
// the engine runs it after the load; both ask here, so they cannot choose differently.
struct ResumedSchedule {
  ScheduleConfig schedule;
  double lr = 0.0;
  bool own_kept = false;
};
ResumedSchedule resumed_schedule(const ScheduleConfig& own, double own_lr,
                                 const ResumeState& saved);

// Writes <dir>/<tag> (include/zinf/engine.hpp save_checkpoint): every rank's file into
// <dir>/.<tag>.tmp, then rank 0's client state and manifest, the rename to <dir>/<tag>,
// <dir>/latest, and the pruning of tags beyond config.keep_last (never a tag of a later step
// than resume.step). A complete <dir>/<tag> is refused (kFailedPrecondition naming it) unless it
// is the leftover of a save cut short before `latest` moved to it (newer than the tag `latest`
// names, or any when there is no `latest`), which the save replaces. Rank 0 holds an exclusive
// lock on <dir>/.zinf-save.lock for the whole save; another save holding it is
// kFailedPrecondition naming <dir> and its holder. `precondition` is this rank's verdict on
// taking a checkpoint now; every rank learns every rank's. Collective.
Status save_checkpoint(const CheckpointContext& ctx, std::string_view call, const std::string& dir,
                       const std::string& tag, Status precondition, const ResumeState& resume);

// Reads <dir>/<tag> (`tag` empty: the one <dir>/latest names), checks it against this engine
// (every rank agreeing), then writes the state into ctx.state, re-sliced by parameter name when
// the checkpoint's world size or layout differs from this engine's. On success *resume holds the
// rest. The same layout reads each rank file once: its blocks stream into the state and are
// hashed as they arrive, and the checksum is compared once the last one is in. Resharded, each
// file a rank reads from is checksummed first and then read where its segments lie. Errors
// before the state is touched (the manifest, the files' sizes and headers, and resharded, their
// checksums) leave it as it was; an error while it is written, a checksum found wrong at the end
// of the pass included, is returned by every rank (kCorruption naming the file on the rank that
// read it, kAborted naming that rank on the others) and is sticky: the partition is then part
// old, part new, and the engine refuses every later call instead of training on it. The step,
// loss scaler, schedule and client state are taken only once every rank's checksum matched.
// Before that last agreement each rank writes its new shards from the loaded master
// (OptimizerState::write_loaded()), so a shard write that fails, or a master block of a file taken
// in place that fails its checksum when first read there, fails every rank the same way; the
// caller all-gathers the persistent groups (Publisher::publish()) only after a success.
// Collective.
Status load_checkpoint_state(const CheckpointContext& ctx, std::string_view call,
                             const std::string& dir, const std::string& tag, Status precondition,
                             ResumeState* resume);

}  // namespace zinf
