// Partitioner: how registered parameters are flattened into groups and sharded over ranks.
//
// Parameters (name, module, shape, dtype) are laid out in registration order, each starting at a
// multiple of `param_alignment_elements`, into contiguous groups: a new group starts when the
// dtype changes, when the next parameter would push the group past `group_max_elements`, and (with
// `group_by_module`) at each module boundary, so that stage 3 gathers exactly one module's groups.
// A parameter is never split across groups; one larger than group_max_elements gets a group of
// its own. Each group is padded to a multiple of world_size * alignment_elements and cut into
// world_size equal slices: rank r owns elements [r * shard, (r + 1) * shard). A parameter may
// straddle slices; param_pieces() says which part of it each rank owns.
//
// Why slices are multiples of alignment_elements (128 by default): with 128 elements a slice is
// 512 bytes in f32 (the sector size, so fp32 master, momentum and variance shards laid end to end
// in a swap file keep every shard O_DIRECT-aligned), 256 bytes in bf16/f16 (cudaMalloc's
// alignment, so the all-gather chunk of every rank starts where NCCL's vectorised path wants it),
// and always a whole number of 64-byte lines (AVX-512 loads in the CPU Adam never straddle two
// ranks' data). The cost is at most world_size * 128 - 1 padding elements a group.
//
// The layout depends only on the options and the registration order, never on the rank, so every
// rank computes the same one; check_layout_agreement() verifies that over a Communicator and names
// the first parameter registered differently.
//
// The stage records which kinds of state are partitioned (stage 1: optimizer state; stage 2:
// also gradients; stage 3: also parameters); the layout is the same for every stage.
//
// Thread-safety: add() and finalize() from one thread; after finalize() the object is immutable
// and every const method may be called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/comm.hpp"
#include "zinf/dtype.hpp"
#include "zinf/status.hpp"

namespace zinf {

enum class ZeroStage : std::uint8_t { kStage1 = 1, kStage2 = 2, kStage3 = 3 };
enum class StateKind : std::uint8_t {
  kOptimizerState = 0,  // fp32 master weights and moments
  kGradients = 1,
  kParameters = 2,  // the device copy the model computes with
};
// "optimizer_state", "gradients", "parameters".
std::string_view state_kind_name(StateKind kind);
// True when `stage` shards `kind` over ranks (each rank keeps only its slice).
constexpr bool stage_partitions(ZeroStage stage, StateKind kind) {
  return static_cast<int>(stage) > static_cast<int>(kind);
}

// The default alignment_elements, which the engine keeps (ParameterLayout::lay_out); the planner
// pads a group's slices with it too (plan::largest_frozen_group_shard_params).
inline constexpr std::size_t kShardAlignmentElements = 128;

struct PartitionerOptions {
  // Ranks the groups are sharded over. 1 .. 65536.
  int world_size = 1;
  ZeroStage stage = ZeroStage::kStage3;
  // Every rank's slice is a multiple of this many elements (see the file comment). Power of two.
  std::size_t alignment_elements = kShardAlignmentElements;
  // Every parameter starts at a multiple of this many elements inside its group, so a gathered
  // parameter handed to a kernel is 32-byte aligned in bf16 and 64-byte aligned in f32 (vector
  // loads). The gaps are padding. Power of two, at most alignment_elements.
  std::size_t param_alignment_elements = 16;
  // The largest group, in elements (the engine's zinf.group_max_elements): the unit of one
  // stage-3 gather. A larger parameter gets a group of its own. The optimizer's sub-groups are
  // cut from the partition by sub_group_size, not by these groups.
  std::size_t group_max_elements = std::size_t{1} << 28;
  // Start a new group at each change of module (stage 3 gathers whole groups, so a group must not
  // mix modules there). Off, modules share groups and padding is minimal.
  bool group_by_module = true;
};

// A shape as the library's messages write it: "[2, 3]".
std::string shape_text(const std::vector<std::int64_t>& shape);

struct ParamSpec {
  std::string name;                 // unique, for example "layers.3.attn.qkv.weight"
  std::string module;               // the module that uses it, for example "layers.3"; may be empty
  std::vector<std::int64_t> shape;  // {} is a scalar (1 element); every dimension > 0
  DType dtype = DType::kF32;        // the dtype of the device copy
};

using ParamId = std::uint32_t;

// Where a parameter lives in the flattened layout.
struct ParamLocation {
  std::uint32_t group = 0;
  std::size_t group_offset = 0;  // elements from the start of the group
  std::size_t element_count = 0;
};

struct GroupInfo {
  std::uint32_t index = 0;
  DType dtype = DType::kF32;
  std::string module;  // the module when grouped by module, else the first parameter's module
  ParamId first_param = 0;
  std::uint32_t param_count = 0;
  std::size_t param_element_count = 0;   // the elements of its parameters
  std::size_t used_element_count = 0;    // end of the last parameter (parameters + their gaps)
  std::size_t padded_element_count = 0;  // shard_element_count * world_size
  std::size_t shard_element_count = 0;   // each rank's slice
};

// The part of parameter `param` that lies in one rank's slice of its group.
struct ParamPiece {
  ParamId param = 0;
  std::size_t param_offset = 0;  // elements from the start of the parameter
  std::size_t shard_offset = 0;  // elements from the start of the rank's slice
  std::size_t element_count = 0;
};

class Partitioner {
 public:
  // Returns kInvalidArgument naming the option that is out of range.
  static Result<Partitioner> create(const PartitionerOptions& options);

  // Registers a parameter. kInvalidArgument for an empty or duplicate name, a dimension <= 0 or
  // an element count that overflows; kFailedPrecondition after finalize(). Each names the
  // parameter.
  Result<ParamId> add(ParamSpec spec);
  // Lays out the groups. kFailedPrecondition when called twice or with no parameters.
  Status finalize();
  bool finalized() const { return finalized_; }

  const PartitionerOptions& options() const { return options_; }
  int world_size() const { return options_.world_size; }
  ZeroStage stage() const { return options_.stage; }
  bool partitions(StateKind kind) const { return stage_partitions(options_.stage, kind); }

  // --- After finalize() (REQUIRES: finalized()) ----------------------------------------------
  std::uint32_t param_count() const { return static_cast<std::uint32_t>(params_.size()); }
  const ParamSpec& spec(ParamId id) const;
  const ParamLocation& location(ParamId id) const;
  // kNotFound naming `name`.
  Result<ParamId> find(std::string_view name) const;

  std::uint32_t group_count() const { return static_cast<std::uint32_t>(groups_.size()); }
  const GroupInfo& group(std::uint32_t index) const;
  // The groups holding parameters of `module`, in order; kNotFound naming the module.
  Result<std::vector<std::uint32_t>> module_groups(std::string_view module) const;
  // Modules in order of first registration.
  const std::vector<std::string>& modules() const { return modules_; }

  // Rank `rank`'s slice of group `index` starts at this element of the group.
  std::size_t shard_offset(std::uint32_t index, int rank) const;
  // The parts of parameters that lie in `rank`'s slice of group `index`, in order. Elements of
  // the slice not covered by a piece are padding.
  std::vector<ParamPiece> shard_pieces(std::uint32_t index, int rank) const;
  // The part of parameter `id` that `rank` owns; nullopt when it owns none of it.
  std::optional<ParamPiece> param_piece(ParamId id, int rank) const;
  // The ranks that own some of parameter `id`: [first, last].
  std::pair<int, int> param_owners(ParamId id) const;

  // Writes rank `rank`'s slice of group `index` into `shard` (shard_element_count elements of the
  // group's dtype) from the full parameter values, `param_data[id]` for each parameter of the
  // group (other entries may be null); padding is set to zero.
  void fill_shard(std::uint32_t index, int rank, std::span<const void* const> param_data,
                  void* shard) const;

  // Elements one rank holds of each kind of state across all groups: its slices when the stage
  // partitions `kind`, the whole padded groups when it does not.
  std::size_t rank_element_count(StateKind kind) const;

  // A 64-bit hash of the options and every registered parameter (name, module, shape, dtype), in
  // order. Equal on every rank exactly when their layouts are equal.
  std::uint64_t fingerprint() const { return fingerprint_; }
  // A hash of the options alone, and of parameter `id`'s name, module, shape and dtype.
  std::uint64_t options_hash() const { return options_hash_; }
  std::uint64_t param_hash(ParamId id) const;

 private:
  explicit Partitioner(const PartitionerOptions& options) : options_(options) {}

  PartitionerOptions options_;
  bool finalized_ = false;
  std::vector<ParamSpec> params_;
  std::vector<ParamLocation> locations_;
  std::map<std::string, ParamId, std::less<>> by_name_;
  std::vector<GroupInfo> groups_;
  std::vector<std::string> modules_;
  std::map<std::string, std::vector<std::uint32_t>, std::less<>> module_groups_;
  std::uint64_t fingerprint_ = 0;
  std::uint64_t options_hash_ = 0;
  std::vector<std::uint64_t> param_hashes_;
};

// Stage 3 gives small parameters groups of their own under "<module>#persistent" (the engine's
// ParameterLayout appends it), which stay gathered; user modules may not end in it.
inline constexpr std::string_view kPersistentSuffix = "#persistent";

// The name of group `index`'s collectives, for errors and traces: "<what> group 3 (module
// 'layers.1')", or "(modules 'a' to 'c')" for a group whose parameters span several modules. Ranks
// whose calls name different groups then say which modules each rank was at. A persistent group
// names the user's module, without kPersistentSuffix.
// REQUIRES: p.finalized().
std::string group_label(const Partitioner& p, std::uint32_t index, std::string_view what);

// Checks with collectives over `comm` that every rank finalized the same layout: same options,
// same parameters (name, module, shape, dtype) in the same order. Returns OK on every rank, or
// kInvalidArgument on every rank naming the first parameter that differs (or the differing option
// set or parameter count), so that a job whose ranks disagree fails before any state is sharded.
// Collective errors come back as they are.
// REQUIRES: p.finalized(); every rank of `comm` calls it; not between group_start/group_end.
Status check_layout_agreement(const Partitioner& p, Communicator& comm,
                              std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace zinf
