// StateStore: where each piece of one rank's optimizer state lives, sub-group by sub-group.
//
// A partition of `param_count` parameters is cut into sub-groups of sub_group_params()
// consecutive parameters (the last one may be shorter), and also at each of the options' cuts
// (a sub-group then ends there: shorter ones, never longer). Each sub-group has up to five
// pieces:
//
//   piece          dtype                 read by the step   written by the step
//   params         f32 (master)          yes                yes
//   exp_avg        f32 (Adam/AdamW/Lion) yes                yes
//   exp_avg_sq     f32 (Adam/AdamW/Adagrad) yes             yes
//   grads          f32, bf16 or f16      yes                no
//   params_half    bf16 or f16, optional no                 yes (produced by the same pass)
//
// Each kind of piece sits on one tier, a StoreMedium chosen by StateStoreOptions::tiers (where
// this store keeps the piece's bytes; plan::MemoryTier, the planner's device / host / NVMe, is
// where a kind of state lives in a whole job, the device included):
//   kHost  one DRAM array for the whole partition, allocated at open(); the step updates it in
//          place and the caller reads/writes it directly through host_data();
//   kNvme  one SwapSpace extent per sub-group and piece, keyed "<prefix>/group<i>/<piece>"
//          (for example "rank0/group3/exp_avg"), moved through the pool blocks by the step.
//   kBlock only for params_half: a slot in the pool block and nothing else, no host array and
//          no extent. The step writes the sub-group's half output there and hands it to
//          PipelineOptions::half_done before the block is reused; the store never keeps it
//          (the engine streams it into the parameter shards). Its residency stays kAbsent.
//
// sub_group_bytes, the knob that sizes everything: the bytes of *all* the pieces of one
// sub-group, whatever their tier, i.e. sub_group_params = sub_group_bytes / bytes_per_param()
// (rounded down to a multiple of 2048 parameters, so every piece fills whole 4 KiB pages). One
// pool block holds the NVMe-resident (and kBlock) pieces of one sub-group, each at a 4 KiB-aligned
// slot:
// block_bytes() <= sub_group_bytes + 4 KiB per piece. With everything on NVMe, block_bytes() is
// sub_group_bytes (rounded to pages).
//
// Residency: every (sub-group, piece) has a state (Residency below) that says where its current
// value is and what is in flight; the pipeline moves it through begin_/end_ calls that assert the
// legal transitions, so a read of a piece being written, or a block released with a write still
// in flight, is an assertion failure, not silent corruption.
//
// Versions: every sub-group records the step its stored state belongs to, and whether it is
// torn (an update was applied but its write failed or was cut short, so the stored pieces mix
// steps or are unknown). After a failed step each sub-group is exactly one of: the old step, the
// new step, or torn.
//
// Settled: a sub-group whose stored state a step leaves exactly as it is (the caller's frozen
// sub-group, PipelineOptions::frozen_sub_groups, whose moments are zero) may be passed over by the
// pipeline: no read, no update, no write. The flag is the caller's and the pipeline's to set; the
// store clears it whenever it cannot vouch that the stored state is what a step left (write_piece
// of the master or a moment, a checkpoint linked or adopted: see settled()).
//
// Thread-safety: one thread at a time (the pipeline's driver); the SwapSpace it uses is
// thread-safe on its own.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/aligned.hpp"
#include "io/swap_space.hpp"
#include "zinf/dtype.hpp"
#include "zinf/optim.hpp"
#include "zinf/status.hpp"

namespace zinf {

enum class StoreMedium : std::uint8_t { kHost = 0, kNvme = 1, kBlock = 2 };
std::string_view store_medium_name(StoreMedium medium);  // "host", "nvme", "block"
bool parse_store_medium(std::string_view text, StoreMedium* medium);

enum class Piece : std::uint8_t {
  kParams = 0,
  kExpAvg = 1,
  kExpAvgSq = 2,
  kGrads = 3,
  kParamsHalf = 4,
};
inline constexpr std::size_t kPieceCount = 5;

// Sub-groups sized from sub_group_bytes hold a multiple of this many parameters, so that every
// piece, f32 or 16-bit, is whole 4 KiB pages. The planner sizes them with it (plan::time_model).
inline constexpr std::size_t kSubGroupParamQuantum = 2048;
// "params", "exp_avg", "exp_avg_sq", "grads", "params_half": the last part of extent keys.
std::string_view piece_name(Piece piece);

// Where a (sub-group, piece)'s current value is.
enum class Residency : std::uint8_t {
  kAbsent = 0,   // NVMe piece never written (or a piece this store does not have)
  kHost = 1,     // in the host array (host tier; always)
  kDisk = 2,     // on NVMe, and the SwapSpace holds its checksums
  kReading = 3,  // a read into a pool block is in flight
  kInBlock = 4,  // in a pool block (the disk copy is still the previous value)
  kWriting = 5,  // a write from a pool block is in flight
  kLost = 6,     // the last write failed: the disk content is unknown
  kZero = 7,     // NVMe piece known to be zeros and not stored: its extent's room is given back
};
std::string_view residency_name(Residency residency);

// What a sub-group's stored state is, relative to a step t that was attempted.
enum class Version : std::uint8_t { kOld = 0, kNew = 1, kTorn = 2 };
std::string_view version_name(Version version);  // "old", "new", "torn"

struct StateStoreOptions {
  // Parameters in this rank's partition (> 0).
  std::size_t param_count = 0;
  // Bytes of all the pieces of one sub-group (see the file comment). Ignored when
  // sub_group_params is set.
  std::size_t sub_group_bytes = std::size_t{64} << 20;
  // Parameters per sub-group, any positive number (tests use sizes that do not divide the
  // partition); overrides sub_group_bytes when > 0.
  std::size_t sub_group_params = 0;
  // Parameters at which a sub-group must end besides every sub_group_params (the engine's
  // frozen/trainable transitions, so that no sub-group mixes them): increasing, each in
  // (0, param_count). Not with gradients on NVMe (whose spill assumes sub-groups of one size).
  // Cuts at multiples of 1024 keep every f32 piece whole pages (the checkpoint layout).
  std::vector<std::size_t> cuts;
  // Decides which moments exist: Adam/AdamW both, Adagrad exp_avg_sq only, Lion exp_avg only.
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  DType grad_dtype = DType::kF32;  // f32, bf16 or f16
  // Whether the step produces half-precision parameters, and in which dtype (bf16 or f16).
  bool with_half = true;
  DType half_dtype = DType::kBF16;
  // StoreMedium of each piece, indexed by Piece. kBlock is allowed for kParamsHalf only.
  std::array<StoreMedium, kPieceCount> tiers = {StoreMedium::kNvme, StoreMedium::kNvme,
                                                StoreMedium::kNvme, StoreMedium::kNvme,
                                                StoreMedium::kNvme};
  // First part of extent keys: one rank's store per prefix.
  std::string key_prefix = "rank0";
};

// The sizes StateStore::open() will use, computable before any swap space exists (to size it).
struct StoreLayout {
  std::size_t sub_group_params = 0;  // at least any sub-group's parameters (cuts make some fewer)
  std::size_t sub_group_count = 0;
  std::size_t block_bytes = 0;            // StateStore::block_bytes()
  std::uint64_t nvme_bytes = 0;           // swap capacity the NVMe pieces take, pages rounded
  std::size_t nvme_extents = 0;           // extents they take
  std::uint64_t largest_piece_bytes = 0;  // the swap space's max_op_bytes must be at least this
  // The master and moments on NVMe, each sub-group's pieces whole 4 KiB pages and the partition's
  // too: the extents then lie in a checkpoint rank file's layout (see StateStore::linkable()),
  // after a header page, which nvme_bytes and nvme_extents count.
  bool checkpoint_layout = false;
};

// A checksummed run of a file: the bytes up to end_offset from the previous run's end (or 0), and
// their xxh3-64.
struct FileBlockSum {
  std::uint64_t end_offset = 0;
  std::uint64_t xxh3 = 0;
};

// Every one of `bytes` bytes at `data` is zero: the zeros a settled or released piece holds
// (+0.0f, not -0.0f, for floats).
bool all_zero_bytes(const void* data, std::size_t bytes);

class StateStore {
 public:
  // The layout open() would give `options`; invalid_argument as open() for bad options.
  static Result<StoreLayout> layout(const StateStoreOptions& options);

  // Allocates the host arrays and creates one extent per NVMe piece and sub-group in `swap`
  // (which must outlive the store; it may be null when no piece is on NVMe). Nothing is written:
  // NVMe pieces start kAbsent, host arrays hold unspecified bytes. Errors: invalid_argument (bad
  // options, NVMe pieces with no swap space, a sub-group too large for the swap space's
  // max_op_bytes), and swap.create()'s (no_space, resource_exhausted) naming the key.
  static Result<std::unique_ptr<StateStore>> open(const StateStoreOptions& options,
                                                  SwapSpace* swap);
  ~StateStore();
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  const StateStoreOptions& options() const { return options_; }
  std::size_t param_count() const { return options_.param_count; }
  std::size_t sub_group_count() const { return sub_group_count_; }
  // Parameters per sub-group (all but the last and those that end at a cut; none has more).
  std::size_t sub_group_params() const { return sub_group_params_; }
  // REQUIRES: i < sub_group_count().
  std::size_t sub_group_first(std::size_t i) const;  // index of its first parameter
  std::size_t sub_group_size(std::size_t i) const;   // its parameter count
  // Bytes per parameter over every piece this store has, whatever its tier.
  std::size_t bytes_per_param() const;

  bool has(Piece piece) const { return has_[static_cast<std::size_t>(piece)]; }
  StoreMedium tier(Piece piece) const { return options_.tiers[static_cast<std::size_t>(piece)]; }
  bool on_nvme(Piece piece) const { return has(piece) && tier(piece) == StoreMedium::kNvme; }
  // Whether `piece` has a slot in the pool block (on NVMe, or kBlock).
  bool in_block(Piece piece) const { return has(piece) && tier(piece) != StoreMedium::kHost; }
  // Whether the half output is handed over per sub-group (kBlock) rather than kept.
  bool streams_half() const {
    return has(Piece::kParamsHalf) && tier(Piece::kParamsHalf) == StoreMedium::kBlock;
  }
  DType dtype(Piece piece) const;
  // Bytes of `piece` in sub-group i (elements times dtype bytes).
  std::size_t piece_bytes(Piece piece, std::size_t i) const;

  // The pool block layout: bytes one block needs for the NVMe and kBlock pieces of the largest
  // sub-group (0 when every piece is on the host), and where each such piece starts in it
  // (4 KiB-aligned). REQUIRES (slot_offset): in_block(piece).
  std::size_t block_bytes() const { return block_bytes_; }
  std::size_t slot_offset(Piece piece) const;

  // Host tier: the partition-wide array of `piece` (element 0 is parameter 0), and the part of
  // sub-group i. REQUIRES: has(piece) && tier(piece) == kHost.
  std::byte* host_data(Piece piece) const;
  std::byte* host_data(Piece piece, std::size_t i) const;
  // Advises the host arrays of the moments and the gradients over sub-groups [first_sub_group,
  // first_sub_group + count) off transparent huge pages (AlignedBuffer::advise_no_huge_pages):
  // sub-groups that stay zero (frozen ones), so that with THP "always" the first write into a
  // neighbour does not fault in 2 MiB pages over their zeros. The master and the half copy,
  // written everywhere, are left alone, and so are pieces not on the host tier. Advice only:
  // nothing fails. Each call splits each advised array's mapping in up to three, so the caller
  // merges neighbouring sub-groups into one call and bounds the calls
  // (AlignedBuffer::kMaxAdvisedStretches). REQUIRES: count > 0, first_sub_group + count <=
  // sub_group_count().
  void advise_cold(std::size_t first_sub_group, std::size_t count);
  // The same for the master's host array alone: for sub-groups whose master the caller never
  // writes (StoreState keeps a frozen sub-group's master as its half copy alone where that holds
  // it exactly), advised before any neighbour's master is written.
  void advise_master_cold(std::size_t first_sub_group, std::size_t count);

  // NVMe tier: the extent of (i, piece). REQUIRES: on_nvme(piece).
  ExtentId extent(Piece piece, std::size_t i) const;
  SwapSpace* swap() const { return swap_; }

  // Writes / reads one piece of sub-group i synchronously, whatever its tier (for loading the
  // initial state, putting gradients in place, checkpoints and tests; not the step's path; not
  // for kBlock pieces, which the store does not keep: failed_precondition). For
  // NVMe pieces `data` must be 4096-aligned and hold piece_bytes rounded up to 4096. A write
  // makes the piece kDisk and leaves the sub-group's version alone. Errors: the swap space's,
  // naming the key; failed_precondition when the piece is in flight.
  Status write_piece(Piece piece, std::size_t i, const void* data);
  Status read_piece(Piece piece, std::size_t i, void* data) const;
  // Part of a piece: the elements of sub-group i that a read of its elements [begin, end)
  // (counted from the sub-group's first) moves. On NVMe that is every swap block that holds one
  // of them, whole (the block is what is checksummed: SwapSpace's block_bytes), so the range
  // grows to block bounds, capped at the sub-group's end; on the host tier it is [begin, end).
  // REQUIRES: begin < end <= sub_group_size(i).
  struct ElementRange {
    std::size_t begin = 0;
    std::size_t end = 0;
  };
  ElementRange read_range(Piece piece, std::size_t i, std::size_t begin, std::size_t end) const;
  // Reads elements [range.begin, range.end) of piece i into `data`: the same errors as the whole
  // read_piece() above (which is this one over the whole sub-group), every block's checksum
  // checked, a kZero piece read as zeros without I/O. For NVMe pieces `data` must be
  // 4096-aligned and hold the range's bytes rounded up to 4096. The range is not grown here: the
  // caller needs the grown one before the read, to size `data` and to know which elements it
  // will hold (and, reading several ranges of one sub-group, to read a block they share once).
  // REQUIRES: `range` is what read_range() gave for piece i.
  Status read_piece(Piece piece, std::size_t i, ElementRange range, void* data) const;
  // Makes NVMe piece (i, piece) zeros without storing them: kZero, its extent's room given back
  // to the filesystem (SwapSpace::release), so it takes no disk blocks. A read (read_piece(), a
  // step's) gives zeros without I/O; a write stores it again; a checkpoint linked meanwhile has
  // zeros there (a hole). Meant for moments known to be zero (a frozen sub-group's): the step
  // still treats the piece as any other; a step writes it again only when its new value is not
  // all zero. Errors: unsupported where the filesystem cannot punch holes (the piece is left as it
  // was: write zeros instead), the swap space's others; with several swap directories a release
  // that fails part-way leaves the piece reading io_error until it is written again
  // (SwapSpace::release), so the caller writes zeros instead here too.
  // REQUIRES: on_nvme(piece); the piece is not in flight (kReading, kWriting).
  Status release_piece(Piece piece, std::size_t i);

  // Checkpoint layout (StoreLayout::checkpoint_layout): open() creates a 4096-byte header extent
  // first ("<prefix>/checkpoint_header"), then the saved pieces (params, exp_avg, exp_avg_sq, those
  // the store has) piece by piece, each sub-group after the previous one, and only then the other
  // NVMe pieces. In a swap space of one directory that held nothing before, the swap file's
  // first 4096 + pieces * param_count * 4 bytes are then laid out as a checkpoint rank file
  // (lib/engine/checkpoint.hpp): linkable() says whether they are.
  bool linkable() const { return linkable_; }
  // Writes `header` (4096 bytes, 4096-aligned) into the header page, then, when every saved
  // piece's latest value is on disk in the swap file's current generation, hard-links the swap
  // file as `path` (SwapSpace::link_files; `later_name` names it in later messages) and appends
  // to *sums the checksums of the linked file's first 4096 + pieces * param_count * 4 bytes, one
  // per swap block in file order (a kZero piece's blocks are a hole: zeros, checksummed so). False,
  // with nothing linked, when the state is not there as a whole (a piece in flight or lost, a block
  // written since an earlier link and not by a step) or the link crosses filesystems (EXDEV) or is
  // refused (EPERM, EMLINK): the caller copies. Errors: the header's write, fdatasync's, link(2)'s
  // other errors. REQUIRES: linkable().
  Result<bool> link_checkpoint(const void* header, const std::string& path,
                               const std::string& later_name, std::vector<FileBlockSum>* sums);

  // The other way: whether a rank file linked by a store of this layout, whose block checksums
  // are `sums` (those link_checkpoint() gave), can become this store's state in place: its saved
  // extents at the same offsets, cut into the same blocks (the same partition, sub-group size and
  // swap block size). adopt_checkpoint() then makes the file the saved pieces' home
  // (SwapSpace::adopt_file): nothing is read or copied, the file is never written, and each block
  // is checked against its checksum when a step (or a read) first reads it, a mismatch naming
  // `later_name`. REQUIRES (adopt): adoptable(sums); no piece in flight.
  bool adoptable(const std::vector<FileBlockSum>& sums) const;
  Status adopt_checkpoint(const std::string& path, const std::string& later_name,
                          const std::vector<FileBlockSum>& sums);

  Residency residency(Piece piece, std::size_t i) const;
  // The step whose state sub-group i holds (0 before any step), and whether it is torn.
  std::int64_t stored_step(std::size_t i) const { return records_[i].step; }
  bool torn(std::size_t i) const { return records_[i].torn; }
  // Version of sub-group i relative to attempted step t: kTorn, kNew when it holds step t,
  // kOld when it holds step t - 1. REQUIRES: it holds one of those.
  Version version(std::size_t i, std::int64_t step) const;

  // --- Transitions, for OptimizerPipeline (each asserts the state it leaves). -----------------
  void begin_read(Piece piece, std::size_t i);         // kDisk -> kReading
  void end_read(Piece piece, std::size_t i, bool ok);  // -> kInBlock, or back to kDisk
  // kInBlock / kAbsent / kDisk / kLost / kZero -> kWriting
  void begin_write(Piece piece, std::size_t i);
  void end_write(Piece piece, std::size_t i, bool ok);  // -> kDisk, or kLost
  void drop_block(Piece piece, std::size_t i);          // kInBlock -> kDisk (read-only piece)
  // Records that sub-group i now holds `step` (all its writes landed), or that it is torn.
  void set_stored(std::size_t i, std::int64_t step);
  void set_torn(std::size_t i);

  // Whether a step may pass over sub-group i (see "Settled" above). False after open(); cleared
  // by write_piece() or release_piece() of the master or a moment, and for every sub-group by a
  // successful link_checkpoint() (the next step's writes start a new generation of the swap file,
  // and a sub-group passed over would keep the linked file open and in use: streaming it once more
  // moves it into the new one) and by adopt_checkpoint() (the adopted moments are not known to be
  // zero). REQUIRES (set_settled true): a step would leave sub-group i's stored pieces as they are,
  // the half piece (when the store keeps it) included, which must then hold the master's rounding.
  bool settled(std::size_t i) const { return records_[i].settled; }
  void set_settled(std::size_t i, bool settled);
  void clear_settled();

 private:
  // advise_cold() and advise_master_cold(): the host arrays of `pieces` over the sub-groups.
  void advise_off_huge_pages(std::size_t first_sub_group, std::size_t count,
                             std::initializer_list<Piece> pieces);

  struct Record {
    std::int64_t step = 0;
    bool torn = false;
    bool settled = false;
  };
  StateStore() = default;
  std::uint8_t& state(Piece piece, std::size_t i);
  std::uint8_t state(Piece piece, std::size_t i) const;

  StateStoreOptions options_;
  SwapSpace* swap_ = nullptr;
  std::size_t sub_group_count_ = 0;
  std::size_t sub_group_params_ = 0;
  // Sub-group i is parameters [firsts_[i], firsts_[i + 1]); firsts_.back() is param_count.
  std::vector<std::size_t> firsts_;
  std::array<bool, kPieceCount> has_{};
  std::array<std::size_t, kPieceCount> slot_offset_{};
  std::size_t block_bytes_ = 0;
  std::array<AlignedBuffer, kPieceCount> host_{};
  // Per sub-group: extents (kPieceCount each, unused entries invalid), residency states, records.
  std::vector<ExtentId> extents_;
  std::vector<std::uint8_t> states_;
  std::vector<Record> records_;
  // The header and the saved pieces' extents, in file order (checkpoint layout).
  std::vector<ExtentId> saved_extents() const;
  ExtentId header_extent_;
  bool linkable_ = false;
};

}  // namespace zinf
