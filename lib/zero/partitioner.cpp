#include "zero/partitioner.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "base/arith.hpp"
#include "base/assert.hpp"

namespace zinf {

std::string shape_text(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

namespace {

constexpr bool is_power_of_two(std::size_t value) {
  return value != 0 && (value & (value - 1)) == 0;
}

// Element counts stay below 2^62 so that offsets times 4 bytes and sums of groups never overflow.
constexpr std::size_t kMaxElements = std::size_t{1} << 62;

void hash_bytes(XXH3_state_t* state, const void* data, std::size_t bytes) {
  XXH3_64bits_update(state, data, bytes);
}

void hash_string(XXH3_state_t* state, std::string_view text) {
  const std::uint64_t length = text.size();
  hash_bytes(state, &length, sizeof(length));
  hash_bytes(state, text.data(), text.size());
}

}  // namespace

std::string_view state_kind_name(StateKind kind) {
  switch (kind) {
    case StateKind::kOptimizerState:
      return "optimizer_state";
    case StateKind::kGradients:
      return "gradients";
    case StateKind::kParameters:
      return "parameters";
  }
  return "unknown";
}

Result<Partitioner> Partitioner::create(const PartitionerOptions& options) {
  if (options.world_size < 1 || options.world_size > 65536) {
    return Status::invalid_argument(
        fmt::format("partitioner: world_size {} is not in 1..65536", options.world_size));
  }
  const int stage = static_cast<int>(options.stage);
  if (stage < 1 || stage > 3) {
    return Status::invalid_argument(
        fmt::format("partitioner: zero stage {} is not one of 1, 2, 3", stage));
  }
  if (!is_power_of_two(options.alignment_elements) || options.alignment_elements > 65536) {
    return Status::invalid_argument(
        fmt::format("partitioner: alignment_elements {} is not a power of two up to 65536",
                    options.alignment_elements));
  }
  if (!is_power_of_two(options.param_alignment_elements) ||
      options.param_alignment_elements > options.alignment_elements) {
    return Status::invalid_argument(
        fmt::format("partitioner: param_alignment_elements {} is not a power of two up to "
                    "alignment_elements ({})",
                    options.param_alignment_elements, options.alignment_elements));
  }
  if (options.group_max_elements == 0 || options.group_max_elements >= kMaxElements) {
    return Status::invalid_argument(fmt::format(
        "partitioner: group_max_elements {} is not in 1..2^62", options.group_max_elements));
  }
  return Partitioner(options);
}

Result<ParamId> Partitioner::add(ParamSpec spec) {
  if (finalized_) {
    return Status::failed_precondition(fmt::format(
        "partitioner: parameter '{}' registered after the layout was finalized", spec.name));
  }
  if (spec.name.empty()) {
    return Status::invalid_argument(fmt::format(
        "partitioner: a parameter of shape {} has an empty name", shape_text(spec.shape)));
  }
  if (by_name_.count(spec.name) != 0) {
    return Status::invalid_argument(
        fmt::format("partitioner: parameter '{}' is registered twice", spec.name));
  }
  const int dtype = static_cast<int>(spec.dtype);
  if (dtype < 0 || dtype > static_cast<int>(DType::kBF16)) {
    return Status::invalid_argument(
        fmt::format("partitioner: parameter '{}' has an unknown dtype {}", spec.name, dtype));
  }
  std::size_t element_count = 1;
  for (std::int64_t dim : spec.shape) {
    if (dim <= 0) {
      return Status::invalid_argument(
          fmt::format("partitioner: parameter '{}' has shape {}: every dimension must be positive",
                      spec.name, shape_text(spec.shape)));
    }
    if (element_count > kMaxElements / static_cast<std::size_t>(dim)) {
      return Status::invalid_argument(
          fmt::format("partitioner: parameter '{}' of shape {} has too many elements", spec.name,
                      shape_text(spec.shape)));
    }
    element_count *= static_cast<std::size_t>(dim);
  }
  const auto id = static_cast<ParamId>(params_.size());
  by_name_.emplace(spec.name, id);
  ParamLocation location;
  location.element_count = element_count;
  locations_.push_back(location);
  params_.push_back(std::move(spec));
  return id;
}

Status Partitioner::finalize() {
  if (finalized_) return Status::failed_precondition("partitioner: finalize() called twice");
  if (params_.empty()) {
    return Status::failed_precondition("partitioner: finalize() with no parameters registered");
  }
  const std::size_t world = static_cast<std::size_t>(options_.world_size);
  const std::size_t slice_multiple = world * options_.alignment_elements;

  auto close_group = [&](GroupInfo& group) {
    group.padded_element_count =
        round_up(std::max<std::size_t>(group.used_element_count, 1), slice_multiple);
    group.shard_element_count = group.padded_element_count / world;
    groups_.push_back(group);
  };

  GroupInfo current;
  bool open = false;
  for (ParamId id = 0; id < params_.size(); ++id) {
    const ParamSpec& spec = params_[id];
    ParamLocation& location = locations_[id];
    if (open) {
      const std::size_t start =
          round_up(current.used_element_count, options_.param_alignment_elements);
      const bool new_module = options_.group_by_module && spec.module != current.module;
      const bool too_big = start + location.element_count > options_.group_max_elements;
      if (spec.dtype != current.dtype || new_module || too_big) {
        close_group(current);
        open = false;
      }
    }
    if (!open) {
      current = GroupInfo{};
      current.index = static_cast<std::uint32_t>(groups_.size());
      current.dtype = spec.dtype;
      current.module = spec.module;
      current.first_param = id;
      open = true;
    }
    const std::size_t start =
        round_up(current.used_element_count, options_.param_alignment_elements);
    location.group = current.index;
    location.group_offset = start;
    current.used_element_count = start + location.element_count;
    current.param_element_count += location.element_count;
    ++current.param_count;
    auto& module_list = module_groups_[spec.module];
    if (module_list.empty()) modules_.push_back(spec.module);
    if (module_list.empty() || module_list.back() != current.index) {
      module_list.push_back(current.index);
    }
  }
  close_group(current);

  XXH3_state_t* state = XXH3_createState();
  ZINF_ASSERT(state != nullptr);
  const std::uint64_t option_words[] = {static_cast<std::uint64_t>(options_.world_size),
                                        static_cast<std::uint64_t>(options_.stage),
                                        options_.alignment_elements,
                                        options_.param_alignment_elements,
                                        options_.group_max_elements,
                                        options_.group_by_module ? 1u : 0u};
  options_hash_ = XXH3_64bits(option_words, sizeof(option_words));
  param_hashes_.clear();
  for (const ParamSpec& spec : params_) {
    XXH3_64bits_reset(state);
    hash_string(state, spec.name);
    hash_string(state, spec.module);
    const std::uint64_t rank_and_dtype[] = {spec.shape.size(),
                                            static_cast<std::uint64_t>(spec.dtype)};
    hash_bytes(state, rank_and_dtype, sizeof(rank_and_dtype));
    hash_bytes(state, spec.shape.data(), spec.shape.size() * sizeof(std::int64_t));
    param_hashes_.push_back(XXH3_64bits_digest(state));
  }
  XXH3_64bits_reset(state);
  hash_bytes(state, &options_hash_, sizeof(options_hash_));
  hash_bytes(state, param_hashes_.data(), param_hashes_.size() * sizeof(std::uint64_t));
  fingerprint_ = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  finalized_ = true;
  return Status::ok();
}

std::uint64_t Partitioner::param_hash(ParamId id) const {
  ZINF_ASSERT(finalized_ && id < param_hashes_.size());
  return param_hashes_[id];
}

const ParamSpec& Partitioner::spec(ParamId id) const {
  ZINF_ASSERT(finalized_ && id < params_.size());
  return params_[id];
}

const ParamLocation& Partitioner::location(ParamId id) const {
  ZINF_ASSERT(finalized_ && id < locations_.size());
  return locations_[id];
}

Result<ParamId> Partitioner::find(std::string_view name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) {
    return Status::not_found(fmt::format("partitioner: no parameter named '{}'", name));
  }
  return it->second;
}

const GroupInfo& Partitioner::group(std::uint32_t index) const {
  ZINF_ASSERT(finalized_ && index < groups_.size());
  return groups_[index];
}

std::string group_label(const Partitioner& p, std::uint32_t index, std::string_view what) {
  const GroupInfo& info = p.group(index);
  // The user's module names: the layout's persistent suffix is no name the user gave.
  const auto user_module = [&](std::uint32_t param) {
    std::string_view module = p.spec(param).module;
    if (module.ends_with(kPersistentSuffix)) module.remove_suffix(kPersistentSuffix.size());
    return module;
  };
  const std::string_view first = user_module(info.first_param);
  const std::string_view last = user_module(info.first_param + info.param_count - 1);
  if (first == last) return fmt::format("{} group {} (module '{}')", what, index, first);
  return fmt::format("{} group {} (modules '{}' to '{}')", what, index, first, last);
}

Result<std::vector<std::uint32_t>> Partitioner::module_groups(std::string_view module) const {
  ZINF_ASSERT(finalized_);
  auto it = module_groups_.find(module);
  if (it == module_groups_.end()) {
    return Status::not_found(fmt::format("partitioner: no module named '{}'", module));
  }
  return it->second;
}

std::size_t Partitioner::shard_offset(std::uint32_t index, int rank) const {
  ZINF_ASSERT(rank >= 0 && rank < options_.world_size);
  return group(index).shard_element_count * static_cast<std::size_t>(rank);
}

std::optional<ParamPiece> Partitioner::param_piece(ParamId id, int rank) const {
  const ParamLocation& loc = location(id);
  const std::size_t shard_begin = shard_offset(loc.group, rank);
  const std::size_t shard_end = shard_begin + groups_[loc.group].shard_element_count;
  const std::size_t begin = std::max(loc.group_offset, shard_begin);
  const std::size_t end = std::min(loc.group_offset + loc.element_count, shard_end);
  if (begin >= end) return std::nullopt;
  ParamPiece piece;
  piece.param = id;
  piece.param_offset = begin - loc.group_offset;
  piece.shard_offset = begin - shard_begin;
  piece.element_count = end - begin;
  return piece;
}

std::pair<int, int> Partitioner::param_owners(ParamId id) const {
  const ParamLocation& loc = location(id);
  const std::size_t shard = groups_[loc.group].shard_element_count;
  const auto first = static_cast<int>(loc.group_offset / shard);
  const auto last = static_cast<int>((loc.group_offset + loc.element_count - 1) / shard);
  return {first, last};
}

std::vector<ParamPiece> Partitioner::shard_pieces(std::uint32_t index, int rank) const {
  const GroupInfo& info = group(index);
  std::vector<ParamPiece> pieces;
  for (ParamId id = info.first_param; id < info.first_param + info.param_count; ++id) {
    std::optional<ParamPiece> piece = param_piece(id, rank);
    if (piece) pieces.push_back(*piece);
  }
  return pieces;
}

void Partitioner::fill_shard(std::uint32_t index, int rank, std::span<const void* const> param_data,
                             void* shard) const {
  const GroupInfo& info = group(index);
  ZINF_ASSERT(param_data.size() >= params_.size());
  const std::size_t element_bytes = dtype_bytes(info.dtype);
  auto* out = static_cast<std::byte*>(shard);
  // Zero first: padding must read as zero (it joins sums and norms), and it is cheap next to
  // the copies.
  std::memset(out, 0, info.shard_element_count * element_bytes);
  for (const ParamPiece& piece : shard_pieces(index, rank)) {
    const auto* src = static_cast<const std::byte*>(param_data[piece.param]);
    ZINF_ASSERT_MSG(src != nullptr, "fill_shard: missing data of a parameter in the group");
    std::memcpy(out + piece.shard_offset * element_bytes, src + piece.param_offset * element_bytes,
                piece.element_count * element_bytes);
  }
}

std::size_t Partitioner::rank_element_count(StateKind kind) const {
  ZINF_ASSERT(finalized_);
  std::size_t total = 0;
  for (const GroupInfo& info : groups_) {
    total += partitions(kind) ? info.shard_element_count : info.padded_element_count;
  }
  return total;
}

namespace {

// All-gathers `words` 64-bit values from every rank through device memory. The collectives move
// bytes, so the values travel as pairs of f32 elements bit for bit (no arithmetic touches them).
Result<std::vector<std::uint64_t>> all_gather_words(Communicator& comm, Stream& stream, Event& done,
                                                    const std::vector<std::uint64_t>& words,
                                                    std::string_view name,
                                                    std::chrono::milliseconds timeout) {
  Device& device = comm.device();
  const std::size_t world = static_cast<std::size_t>(comm.world_size());
  const std::size_t bytes = words.size() * sizeof(std::uint64_t);
  std::vector<std::uint64_t> gathered(words.size() * world);
  if (words.empty()) return gathered;
  ZINF_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::allocate(device, bytes * world));
  std::byte* own = buffer.as<std::byte>() + static_cast<std::size_t>(comm.rank()) * bytes;
  ZINF_RETURN_IF_ERROR(device.copy_h2d(own, words.data(), bytes, stream));
  ZINF_RETURN_IF_ERROR(
      comm.all_gather(own, buffer.data(), words.size() * 2, DType::kF32, stream, name));
  ZINF_RETURN_IF_ERROR(device.copy_d2h(gathered.data(), buffer.data(), bytes * world, stream));
  ZINF_RETURN_IF_ERROR(device.record(done, stream));
  ZINF_RETURN_IF_ERROR(comm.wait(done, timeout));
  return gathered;
}

}  // namespace

Status check_layout_agreement(const Partitioner& p, Communicator& comm,
                              std::chrono::milliseconds timeout) {
  ZINF_ASSERT(p.finalized());
  Device& device = comm.device();
  ZINF_ASSIGN_OR_RETURN(auto stream, device.create_stream("layout_check"));
  ZINF_ASSIGN_OR_RETURN(auto done, device.create_event());
  const int world = comm.world_size();
  const int rank = comm.rank();
  auto context = [&](const Status& s) {
    return s.with_context(fmt::format("checking the parameter layout on rank {}", rank));
  };

  // Round 1: every rank's fingerprint, options and parameter count.
  const std::vector<std::uint64_t> header = {p.fingerprint(), p.options_hash(), p.param_count()};
  Result<std::vector<std::uint64_t>> headers =
      all_gather_words(comm, *stream, *done, header, "layout.header", timeout);
  if (!headers.is_ok()) return context(headers.status());
  std::uint64_t min_count = header[2];
  bool all_equal = true;
  for (int r = 0; r < world; ++r) {
    const std::uint64_t* other = headers->data() + 3 * static_cast<std::size_t>(r);
    all_equal = all_equal && other[0] == header[0];
    min_count = std::min(min_count, other[2]);
  }
  if (all_equal) return Status::ok();
  if (p.world_size() != world) {
    return Status::invalid_argument(fmt::format(
        "parameter layout: rank {} partitions over {} ranks but the communicator has {}", rank,
        p.world_size(), world));
  }
  for (int r = 0; r < world; ++r) {
    if ((*headers)[3 * static_cast<std::size_t>(r) + 1] != header[1]) {
      return Status::invalid_argument(fmt::format(
          "parameter layout: partitioner options (stage, alignment, group size) differ between "
          "rank {} and rank {}",
          rank, r));
    }
  }

  // Round 2: the hash of each parameter both sides have, to name the first that differs.
  std::vector<std::uint64_t> hashes;
  for (ParamId id = 0; id < min_count; ++id) hashes.push_back(p.param_hash(id));
  Result<std::vector<std::uint64_t>> all_hashes =
      all_gather_words(comm, *stream, *done, hashes, "layout.params", timeout);
  if (!all_hashes.is_ok()) return context(all_hashes.status());
  for (ParamId id = 0; id < min_count; ++id) {
    for (int r = 0; r < world; ++r) {
      if ((*all_hashes)[static_cast<std::size_t>(r) * min_count + id] != hashes[id]) {
        const ParamSpec& spec = p.spec(id);
        return Status::invalid_argument(fmt::format(
            "parameter layout: parameter #{} is '{}' (module '{}', shape {}, {}) on rank {} but "
            "rank {} registered a different name, module, shape or dtype",
            id, spec.name, spec.module, shape_text(spec.shape), dtype_name(spec.dtype), rank, r));
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    const std::uint64_t count = (*headers)[3 * static_cast<std::size_t>(r) + 2];
    if (count != header[2]) {
      return Status::invalid_argument(fmt::format(
          "parameter layout: rank {} registered {} parameters, rank {} registered {} (the first "
          "{} agree)",
          rank, header[2], r, count, min_count));
    }
  }
  return Status::internal("parameter layout: fingerprints differ but every part agrees");
}

}  // namespace zinf
