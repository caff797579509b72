// ParameterLayout: see layout.hpp.
#include "engine/layout.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "base/assert.hpp"
#include "base/heap.hpp"
#include "zero/grad_reducer.hpp"
#include "zinf/log.hpp"

namespace zinf {

Status ParameterLayout::add(const ParameterSpec& spec) {
  const std::string what = fmt::format("register_parameter('{}')", spec.name);
  if (spec.name.empty()) return Status::invalid_argument("register_parameter: empty name");
  if (by_name_.count(spec.name) != 0) {
    return Status::invalid_argument(fmt::format("{}: registered already", what));
  }
  if (spec.module.empty()) {
    return Status::invalid_argument(fmt::format("{}: empty module name", what));
  }
  if (spec.module.ends_with(kPersistentSuffix)) {
    return Status::invalid_argument(
        fmt::format("{}: module names may not end in '{}'", what, kPersistentSuffix));
  }
  // DType is an enum of three values, but a caller (a binding, a cast) can pass any byte; the
  // engine would size and convert such a parameter as some other dtype.
  if (!dtype_valid(spec.dtype)) {
    return Status::invalid_argument(
        fmt::format("{}: dtype {} is not f32, f16 or bf16", what, static_cast<int>(spec.dtype)));
  }
  std::size_t count = 1;
  for (std::int64_t d : spec.shape) {
    if (d <= 0) {
      return Status::invalid_argument(
          fmt::format("{}: shape {} has a dimension <= 0", what, shape_text(spec.shape)));
    }
    if (count > (std::size_t{1} << 48) / static_cast<std::size_t>(d)) {
      return Status::invalid_argument(
          fmt::format("{}: shape {} is too large", what, shape_text(spec.shape)));
    }
    count *= static_cast<std::size_t>(d);
  }
  if ((spec.initial_values == nullptr) == (spec.initializer == nullptr)) {
    return Status::invalid_argument(
        fmt::format("{}: {} of initial_values and initializer are set (exactly one must be)", what,
                    spec.initial_values == nullptr ? "neither" : "both"));
  }
  if (auto m = module_index_.find(spec.module); m != module_index_.end()) {
    // A module is reduced whole (reduce_gradients()), so it takes gradients or not as a whole.
    const ParameterSpec& other = regs_[module_params_[m->second].front()].spec;
    if (other.trainable != spec.trainable) {
      const ParameterSpec& frozen = spec.trainable ? other : spec;
      const ParameterSpec& trainable = spec.trainable ? spec : other;
      return Status::invalid_argument(fmt::format(
          "{}: module '{}' mixes frozen and trainable parameters ('{}' is frozen, '{}' is "
          "trainable); a module's parameters must be all trainable or all frozen (register the "
          "frozen ones under a module of their own)",
          what, spec.module, frozen.name, trainable.name));
    }
  }
  Registered r;
  r.spec = spec;
  r.spec.initial_values = nullptr;
  r.element_count = count;
  if (spec.initial_values != nullptr) {
    r.values.assign(spec.initial_values, spec.initial_values + count);
  }
  by_name_[spec.name] = regs_.size();
  if (module_index_.count(spec.module) == 0) {
    module_index_[spec.module] = module_names_.size();
    module_names_.push_back(spec.module);
    module_params_.emplace_back();
  }
  module_params_[module_index_[spec.module]].push_back(regs_.size());
  regs_.push_back(std::move(r));
  return Status::ok();
}

Status ParameterLayout::lay_out(const Config& config, int rank, int world, RankExchange& exchange) {
  if (regs_.empty()) return Status::failed_precondition("finalize: no parameters registered");
  const ZeroConfig& z = config.zero;
  PartitionerOptions po;
  po.world_size = world;
  po.stage = static_cast<ZeroStage>(z.stage);
  if (z.group_max_elements != 0) po.group_max_elements = z.group_max_elements;
  ZINF_ASSIGN_OR_RETURN(Partitioner p, Partitioner::create(po));
  part_.emplace(std::move(p));
  const bool stage3 = z.stage == 3;
  for (const Registered& r : regs_) {
    ParamSpec spec;
    spec.name = r.spec.name;
    spec.module = r.spec.module;
    if (stage3 && r.element_count <= z.stage3_param_persistence_threshold) {
      spec.module += kPersistentSuffix;
    }
    spec.shape = r.spec.shape;
    spec.dtype = r.spec.dtype;
    ZINF_ASSIGN_OR_RETURN(ParamId id, part_->add(std::move(spec)));
    ZINF_ASSERT(id + 1 == part_->param_count());
  }
  ZINF_RETURN_IF_ERROR(part_->finalize());
  ZINF_RETURN_IF_ERROR(check_ranks_agree(rank, world, exchange));
  ZINF_RETURN_IF_ERROR(check_trainable_agree(world, exchange));
  ZINF_RETURN_IF_ERROR(check_initial_values_agree(world, exchange));

  // Groups per module, and which stay gathered.
  const std::uint32_t groups = part_->group_count();
  persistent_.assign(groups, !stage3);
  for (const std::string& name : module_names_) {
    CoordinatorModule m;
    m.name = name;
    for (const std::string& key : {name, name + std::string(kPersistentSuffix)}) {
      Result<std::vector<std::uint32_t>> gs = part_->module_groups(key);
      if (!gs.is_ok()) continue;
      for (std::uint32_t g : *gs) {
        m.groups.push_back(g);
        if (key != name) persistent_[g] = true;
      }
    }
    module_groups_.push_back(m.groups);
    coord_modules_.push_back(std::move(m));
  }
  if (stage3 && rank == 0 &&
      std::all_of(persistent_.begin(), persistent_.end(), [](bool p) { return p; })) {
    std::size_t largest = 0;
    for (const Registered& r : regs_) largest = std::max(largest, r.element_count);
    log_warn(
        "zero_optimization.stage3_param_persistence_threshold: {} elements keeps every "
        "parameter of this stage-3 model gathered on every rank (the largest has {}), so nothing "
        "is sharded; set it below {} to shard the large ones",
        z.stage3_param_persistence_threshold, largest, largest);
  }
  frozen_groups_.assign(groups, false);
  for (std::uint32_t g = 0; g < groups; ++g) {
    const GroupInfo& info = part_->group(g);
    bool frozen = info.param_count > 0;
    for (ParamId id = info.first_param; id < info.first_param + info.param_count; ++id) {
      frozen = frozen && !regs_[id].spec.trainable;
    }
    frozen_groups_[g] = frozen;
  }
  partition_elements_ = GradReducer::partition_element_count(*part_);
  std::size_t offset = 0, byte_offset = 0;
  bool all_same_half = true;
  std::optional<DType> half;
  for (std::uint32_t g = 0; g < groups; ++g) {
    const GroupInfo& info = part_->group(g);
    offsets_.push_back(offset);
    byte_offsets_.push_back(byte_offset);
    offset += info.shard_element_count;
    byte_offset += info.shard_element_count * dtype_bytes(info.dtype);
    if (info.dtype == DType::kF32) {
      all_same_half = false;
    } else if (!half.has_value()) {
      half = info.dtype;
    } else if (*half != info.dtype) {
      all_same_half = false;
    }
  }
  all_one_half_ = all_same_half && half.has_value();
  half_dtype_ = half.value_or(DType::kBF16);
  device_copy_bytes_ = byte_offset;

  // The initial fp32 master of this rank's partition is never held whole in host memory: it is
  // built from the registered values or initializers one piece at a time (fill_master).
  for (std::uint32_t g = 0; g < groups; ++g) {
    for (const ParamPiece& piece : part_->shard_pieces(g, rank)) {
      master_pieces_.push_back(
          {offsets_[g] + piece.shard_offset, piece.param, piece.param_offset, piece.element_count});
    }
  }
  std::sort(master_pieces_.begin(), master_pieces_.end(),
            [](const MasterPiece& a, const MasterPiece& b) { return a.first < b.first; });
  return Status::ok();
}

Status ParameterLayout::check_ranks_agree(int rank, int world, RankExchange& exchange) const {
  const std::uint64_t fingerprint = part_->fingerprint();
  const std::uint64_t count = part_->param_count();
  std::uint64_t mine[2] = {count, fingerprint};
  ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> all, exchange.exchange(mine, 2));
  int differs = -1;
  for (int r = 0; r < world && differs < 0; ++r) {
    if (all[2 * r] != count || all[2 * r + 1] != fingerprint) differs = r;
  }
  if (differs < 0) return Status::ok();
  for (int r = 1; r < world; ++r) {
    if (all[2 * r] != all[0]) {
      return Status::invalid_argument(
          fmt::format("finalize: ranks registered different parameters: rank 0 registered {} "
                      "parameters, rank {} registered {}",
                      all[0], r, all[2 * r]));
    }
  }
  // An option the engine derives from each rank's config (it also orders the parameters, so it
  // is compared first). Every rank reached this exchange (each saw the same fingerprints), so it
  // is collective.
  const PartitionerOptions& o = part_->options();
  const std::pair<const char*, std::uint64_t> options[] = {
      {"world size", static_cast<std::uint64_t>(o.world_size)},
      {"zero_optimization.stage", static_cast<std::uint64_t>(o.stage)},
      {"alignment elements", o.alignment_elements},
      {"parameter alignment elements", o.param_alignment_elements},
      {"zinf.group_max_elements", o.group_max_elements},
      {"groups by module", o.group_by_module ? 1u : 0u},
  };
  constexpr std::size_t kOptions = std::size(options);
  std::uint64_t values[kOptions];
  for (std::size_t i = 0; i < kOptions; ++i) values[i] = options[i].second;
  ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> theirs, exchange.exchange(values, kOptions));
  for (int r = 1; r < world; ++r) {
    for (std::size_t i = 0; i < kOptions; ++i) {
      if (theirs[r * kOptions + i] != theirs[i]) {
        return Status::invalid_argument(fmt::format(
            "finalize: ranks configured the parameters differently: {} is {} on rank 0 and {} on "
            "rank {}",
            options[i].first, theirs[i], theirs[r * kOptions + i], r));
      }
    }
  }
  std::vector<std::uint64_t> hashes(count);
  for (ParamId id = 0; id < count; ++id) {
    const ParamSpec& s = part_->spec(id);
    std::string text =
        fmt::format("{}\n{}\n{}\n{}", s.name, s.module, shape_text(s.shape), dtype_name(s.dtype));
    hashes[id] = XXH3_64bits(text.data(), text.size());
  }
  ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> every, exchange.exchange(hashes.data(), count));
  for (ParamId id = 0; id < count; ++id) {
    for (int r = 1; r < world; ++r) {
      if (every[r * count + id] != every[id]) {
        const ParamSpec& s = part_->spec(id);
        return Status::invalid_argument(fmt::format(
            "finalize: ranks registered different parameters: parameter {} differs between "
            "rank 0 and rank {} (name, module, shape or dtype); this rank ({}) has '{}' in "
            "module '{}', shape {}, {}",
            id, r, rank, s.name, regs_[id].spec.module, shape_text(s.shape), dtype_name(s.dtype)));
      }
    }
  }
  return Status::invalid_argument(
      "finalize: ranks registered different partitioner options (world size, stage)");
}

Status ParameterLayout::check_trainable_agree(int world, RankExchange& exchange) const {
  if (world == 1) return Status::ok();
  const std::size_t count = regs_.size();
  std::vector<std::uint64_t> trainable(count);
  for (std::size_t id = 0; id < count; ++id) trainable[id] = regs_[id].spec.trainable ? 1 : 0;
  const std::uint64_t mine = XXH3_64bits(trainable.data(), count * sizeof(std::uint64_t));
  ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> hashes, exchange.exchange(&mine, 1));
  if (std::all_of(hashes.begin(), hashes.end(), [&](std::uint64_t h) { return h == hashes[0]; })) {
    return Status::ok();
  }
  // Some rank differs: which parameter, and which ranks.
  ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> every,
                        exchange.exchange(trainable.data(), count));
  for (std::size_t id = 0; id < count; ++id) {
    for (int r = 1; r < world; ++r) {
      if (every[static_cast<std::size_t>(r) * count + id] != every[id]) {
        return Status::invalid_argument(fmt::format(
            "finalize: ranks froze different parameters: '{}' is {} on rank 0 and {} on rank {} "
            "(ParameterSpec::trainable; every rank must freeze the same parameters)",
            regs_[id].spec.name, every[id] != 0 ? "trainable" : "frozen",
            every[static_cast<std::size_t>(r) * count + id] != 0 ? "trainable" : "frozen", r));
      }
    }
  }
  return Status::internal("finalize: the ranks' trainable flags differ but no parameter does");
}

Status ParameterLayout::check_initial_values_agree(int world, RankExchange& exchange) const {
  if (world == 1) return Status::ok();
  // Each word: 0, not compared (an initializer without a hash); else the hash with its low two
  // bits saying whose it is (1: the engine's of initial_values; 2: the caller's of an
  // initializer), since only hashes of one kind can be compared.
  const std::size_t count = regs_.size();
  std::vector<std::uint64_t> hashes(count, 0);
  for (std::size_t id = 0; id < count; ++id) {
    const std::vector<float>& v = regs_[id].values;
    if (!v.empty()) {
      hashes[id] = (XXH3_64bits(v.data(), v.size() * sizeof(float)) & ~std::uint64_t{3}) | 1;
    } else if (const std::uint64_t h = regs_[id].spec.initializer_values_hash; h != 0) {
      hashes[id] = (h & ~std::uint64_t{3}) | 2;
    }
  }
  ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> every, exchange.exchange(hashes.data(), count));
  for (std::size_t id = 0; id < count; ++id) {
    // Each rank against the first rank with a hash of the same kind (by kind: 1 and 2).
    std::uint64_t first_hash[3] = {};
    int first_rank[3] = {};
    for (int r = 0; r < world; ++r) {
      const std::uint64_t h = every[static_cast<std::size_t>(r) * count + id];
      if (h == 0) continue;
      const std::size_t kind = h & 3;
      if (first_hash[kind] == 0) {
        first_hash[kind] = h;
        first_rank[kind] = r;
      } else if (h != first_hash[kind]) {
        return Status::invalid_argument(fmt::format(
            "finalize: parameter '{}' has different initial values on rank {} and rank {}: "
            "every rank keeps its own part of the values it registers, so they must be the same "
            "on every rank (build the model with the same seed on every rank, or load the same "
            "weights; DeepSpeed copies rank 0's to the others)",
            regs_[id].spec.name, first_rank[kind], r));
      }
    }
  }
  return Status::ok();
}

Status ParameterLayout::fill_master(std::size_t first, std::size_t count, float* out) const {
  std::memset(out, 0, count * sizeof(float));
  const std::size_t end = first + count;
  auto it =
      std::upper_bound(master_pieces_.begin(), master_pieces_.end(), first,
                       [](std::size_t value, const MasterPiece& p) { return value < p.first; });
  if (it != master_pieces_.begin()) --it;
  for (; it != master_pieces_.end() && it->first < end; ++it) {
    const std::size_t lo = std::max(first, it->first);
    const std::size_t hi = std::min(end, it->first + it->element_count);
    if (lo >= hi) continue;
    const Registered& r = regs_[it->param];
    const std::size_t param_first = it->param_offset + (lo - it->first);
    ZINF_ASSERT(param_first + (hi - lo) <= r.element_count);
    if (r.spec.initializer == nullptr) {
      std::memcpy(out + (lo - first), r.values.data() + param_first, (hi - lo) * sizeof(float));
      continue;
    }
    Status st = r.spec.initializer(param_first, hi - lo, out + (lo - first));
    if (!st.is_ok()) {
      return st.with_context(
          fmt::format("finalize: the initializer of parameter '{}' failed for elements [{}, {})",
                      r.spec.name, param_first, param_first + (hi - lo)));
    }
  }
  return Status::ok();
}

void ParameterLayout::drop_initial_values() {
  for (Registered& r : regs_) {
    std::vector<float>().swap(r.values);
    r.spec.initializer = nullptr;
  }
  std::vector<MasterPiece>().swap(master_pieces_);
  // The copies are 4 bytes a registered element; which of them came from malloc's heap rather
  // than a mapping of their own depends on what the process did before (base/heap.hpp), so their
  // pages are handed back here either way.
  release_freed_memory();
}

Result<std::size_t> ParameterLayout::find_module(std::string_view call,
                                                 std::string_view module) const {
  auto it = module_index_.find(module);
  if (it == module_index_.end()) {
    return Status::not_found(fmt::format("{}('{}'): unknown module (registered: {})", call, module,
                                         fmt::join(module_names_, ", ")));
  }
  return it->second;
}

std::optional<std::size_t> ParameterLayout::find_param(std::string_view name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

std::size_t ParameterLayout::module_of(std::size_t param) const {
  return module_index_.find(regs_[param].spec.module)->second;
}

std::size_t ParameterLayout::largest_half_shard_bytes() const {
  std::size_t largest = 0;
  for (std::uint32_t g = 0; g < part_->group_count(); ++g) {
    largest = std::max(largest, part_->group(g).shard_element_count * dtype_bytes(half_dtype_));
  }
  return largest;
}

std::uint32_t ParameterLayout::first_group_ending_after(std::size_t element) const {
  // Offsets increase with the group index.
  std::uint32_t lo = 0, hi = group_count();
  while (lo < hi) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    if (offset(mid) + group(mid).shard_element_count <= element) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace zinf
