#include "tier/state_store.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/arith.hpp"
#include "base/assert.hpp"
#include "base/hash.hpp"

namespace zinf {

namespace {

Piece piece_at(std::size_t index) { return static_cast<Piece>(index); }

// Where each sub-group starts, and param_count last: every sub_group_params parameters from the
// previous start, or at the next cut when that comes first.
std::vector<std::size_t> sub_group_firsts(std::size_t param_count, std::size_t sub_group_params,
                                          const std::vector<std::size_t>& cuts) {
  std::vector<std::size_t> firsts = {0};
  std::size_t next_cut = 0;
  while (firsts.back() < param_count) {
    const std::size_t first = firsts.back();
    while (next_cut < cuts.size() && cuts[next_cut] <= first) ++next_cut;
    std::size_t end = std::min(first + sub_group_params, param_count);
    if (next_cut < cuts.size()) end = std::min(end, cuts[next_cut]);
    firsts.push_back(end);
  }
  return firsts;
}

}  // namespace

std::string_view store_medium_name(StoreMedium medium) {
  switch (medium) {
    case StoreMedium::kHost:
      return "host";
    case StoreMedium::kNvme:
      return "nvme";
    case StoreMedium::kBlock:
      return "block";
  }
  return "unknown";
}

bool parse_store_medium(std::string_view text, StoreMedium* medium) {
  if (text == "host") {
    *medium = StoreMedium::kHost;
  } else if (text == "nvme") {
    *medium = StoreMedium::kNvme;
  } else {
    return false;
  }
  return true;
}

std::string_view piece_name(Piece piece) {
  switch (piece) {
    case Piece::kParams:
      return "params";
    case Piece::kExpAvg:
      return "exp_avg";
    case Piece::kExpAvgSq:
      return "exp_avg_sq";
    case Piece::kGrads:
      return "grads";
    case Piece::kParamsHalf:
      return "params_half";
  }
  return "unknown";
}

std::string_view residency_name(Residency residency) {
  switch (residency) {
    case Residency::kAbsent:
      return "absent";
    case Residency::kHost:
      return "host";
    case Residency::kDisk:
      return "disk";
    case Residency::kReading:
      return "reading";
    case Residency::kInBlock:
      return "in_block";
    case Residency::kWriting:
      return "writing";
    case Residency::kLost:
      return "lost";
    case Residency::kZero:
      return "zero";
  }
  return "unknown";
}

std::string_view version_name(Version version) {
  switch (version) {
    case Version::kOld:
      return "old";
    case Version::kNew:
      return "new";
    case Version::kTorn:
      return "torn";
  }
  return "unknown";
}

StateStore::~StateStore() = default;

namespace {

// What write_piece() and read_piece() answer for a piece on the block tier, which only ever
// lives in the pipeline's block.
Status not_kept(std::string_view key_prefix, std::size_t i, Piece piece) {
  return Status::failed_precondition(
      fmt::format("{}/group{}/{}: on the block tier, the store does not keep it", key_prefix, i,
                  piece_name(piece)));
}

std::array<bool, kPieceCount> pieces_of(const StateStoreOptions& options) {
  std::array<bool, kPieceCount> has{};
  has[static_cast<std::size_t>(Piece::kParams)] = true;
  has[static_cast<std::size_t>(Piece::kExpAvg)] = options.optimizer != OptimizerKind::kAdagrad;
  has[static_cast<std::size_t>(Piece::kExpAvgSq)] = options.optimizer != OptimizerKind::kLion;
  has[static_cast<std::size_t>(Piece::kGrads)] = true;
  has[static_cast<std::size_t>(Piece::kParamsHalf)] = options.with_half;
  return has;
}

DType dtype_of(const StateStoreOptions& options, Piece piece) {
  switch (piece) {
    case Piece::kGrads:
      return options.grad_dtype;
    case Piece::kParamsHalf:
      return options.half_dtype;
    default:
      return DType::kF32;
  }
}

}  // namespace

Result<StoreLayout> StateStore::layout(const StateStoreOptions& options) {
  if (options.param_count == 0) {
    return Status::invalid_argument("StateStoreOptions: param_count must be > 0");
  }
  if (options.grad_dtype != DType::kF32 && options.grad_dtype != DType::kBF16 &&
      options.grad_dtype != DType::kF16) {
    return Status::invalid_argument("StateStoreOptions: grad_dtype must be f32, bf16 or f16");
  }
  if (options.with_half && options.half_dtype != DType::kBF16 &&
      options.half_dtype != DType::kF16) {
    return Status::invalid_argument("StateStoreOptions: half_dtype must be bf16 or f16");
  }
  for (std::size_t p = 0; p < kPieceCount; ++p) {
    if (options.tiers[p] == StoreMedium::kBlock && piece_at(p) != Piece::kParamsHalf) {
      return Status::invalid_argument(
          fmt::format("StateStoreOptions: {} cannot be on the block tier (only params_half)",
                      piece_name(piece_at(p))));
    }
  }
  for (std::size_t c = 0; c < options.cuts.size(); ++c) {
    if (options.cuts[c] == 0 || options.cuts[c] >= options.param_count ||
        (c > 0 && options.cuts[c] <= options.cuts[c - 1])) {
      return Status::invalid_argument(
          fmt::format("StateStoreOptions: cut {} (parameter {}) is not above the previous one and "
                      "inside the partition's {} parameters",
                      c, options.cuts[c], options.param_count));
    }
  }
  if (!options.cuts.empty() &&
      options.tiers[static_cast<std::size_t>(Piece::kGrads)] == StoreMedium::kNvme) {
    return Status::invalid_argument(
        "StateStoreOptions: cuts with the gradients on nvme (sub-groups of one size only)");
  }
  const std::array<bool, kPieceCount> has = pieces_of(options);
  std::size_t bytes_per_param = 0;
  for (std::size_t p = 0; p < kPieceCount; ++p) {
    if (has[p]) bytes_per_param += dtype_bytes(dtype_of(options, piece_at(p)));
  }
  StoreLayout out;
  if (options.sub_group_params > 0) {
    out.sub_group_params = options.sub_group_params;
  } else {
    const std::size_t quantum_bytes = kSubGroupParamQuantum * bytes_per_param;
    if (options.sub_group_bytes < quantum_bytes) {
      return Status::invalid_argument(fmt::format(
          "StateStoreOptions: sub_group_bytes {} is below the smallest sub-group ({} parameters, "
          "{} bytes)",
          options.sub_group_bytes, kSubGroupParamQuantum, quantum_bytes));
    }
    out.sub_group_params = options.sub_group_bytes / quantum_bytes * kSubGroupParamQuantum;
  }
  out.sub_group_params = std::min(out.sub_group_params, options.param_count);
  const std::vector<std::size_t> firsts =
      sub_group_firsts(options.param_count, out.sub_group_params, options.cuts);
  out.sub_group_count = firsts.size() - 1;
  // The saved pieces (the master and the moments) all on NVMe, every sub-group's in whole pages.
  out.checkpoint_layout = true;
  for (std::size_t i = 1; i < firsts.size(); ++i) {
    if ((firsts[i] * sizeof(float)) % kPage != 0) out.checkpoint_layout = false;
  }
  for (Piece piece : {Piece::kParams, Piece::kExpAvg, Piece::kExpAvgSq}) {
    const std::size_t p = static_cast<std::size_t>(piece);
    if (has[p] && options.tiers[p] != StoreMedium::kNvme) out.checkpoint_layout = false;
  }
  if (out.checkpoint_layout) {
    out.nvme_bytes += kPage;
    out.nvme_extents += 1;
  }
  for (std::size_t p = 0; p < kPieceCount; ++p) {
    if (!has[p] || options.tiers[p] == StoreMedium::kHost) continue;
    const std::size_t bytes = dtype_bytes(dtype_of(options, piece_at(p)));
    out.block_bytes += round_up(out.sub_group_params * bytes, kPage);
    if (options.tiers[p] == StoreMedium::kBlock) continue;  // a slot only: never stored
    for (std::size_t i = 0; i + 1 < firsts.size(); ++i) {
      out.nvme_bytes += round_up((firsts[i + 1] - firsts[i]) * bytes, kPage);
    }
    out.nvme_extents += out.sub_group_count;
    out.largest_piece_bytes = std::max<std::uint64_t>(
        out.largest_piece_bytes, round_up(out.sub_group_params * bytes, kPage));
  }
  return out;
}

Result<std::unique_ptr<StateStore>> StateStore::open(const StateStoreOptions& options,
                                                     SwapSpace* swap) {
  ZINF_ASSIGN_OR_RETURN(const StoreLayout layout, StateStore::layout(options));
  std::unique_ptr<StateStore> store(new StateStore());
  store->options_ = options;
  StateStore& s = *store;
  s.has_ = pieces_of(options);
  s.sub_group_params_ = layout.sub_group_params;
  s.sub_group_count_ = layout.sub_group_count;
  s.firsts_ = sub_group_firsts(options.param_count, layout.sub_group_params, options.cuts);

  bool any_nvme = false;
  std::size_t offset = 0;
  for (std::size_t p = 0; p < kPieceCount; ++p) {
    const Piece piece = piece_at(p);
    if (!s.has(piece)) continue;
    const std::size_t piece_bytes = s.sub_group_params_ * dtype_bytes(s.dtype(piece));
    if (s.tier(piece) != StoreMedium::kHost) {
      any_nvme = any_nvme || s.tier(piece) == StoreMedium::kNvme;
      s.slot_offset_[p] = offset;
      offset += round_up(piece_bytes, kPage);
    } else {
      // One array for the whole partition, of zero pages that take memory only once written,
      // so a piece nobody fills before the first step (the gradients) costs nothing at open.
      ZINF_RETURN_IF_ERROR(AlignedBuffer::zeroed_pages(
          round_up(options.param_count * dtype_bytes(s.dtype(piece)), kPage),
          fmt::format("StateStore: host array of {}", piece_name(piece)), &s.host_[p]));
    }
  }
  s.block_bytes_ = offset;
  ZINF_ASSERT(s.block_bytes_ == layout.block_bytes);
  if (any_nvme && swap == nullptr) {
    return Status::invalid_argument("StateStore: pieces on the nvme tier need a SwapSpace");
  }
  s.swap_ = swap;
  s.extents_.assign(s.sub_group_count_ * kPieceCount, ExtentId{});
  s.states_.assign(s.sub_group_count_ * kPieceCount, static_cast<std::uint8_t>(Residency::kAbsent));
  s.records_.assign(s.sub_group_count_, Record{});
  // The saved pieces are those of a checkpoint rank file, in its order.
  auto saved = [](Piece piece) { return piece <= Piece::kExpAvgSq; };
  if (layout.checkpoint_layout) {
    ZINF_ASSIGN_OR_RETURN(
        s.header_extent_,
        swap->create(fmt::format("{}/checkpoint_header", options.key_prefix), kPage));
  }
  // The residency of (i, piece), and its extent when it is stored on NVMe.
  auto place = [&](Piece piece, std::size_t i) -> Status {
    if (s.tier(piece) == StoreMedium::kHost) {
      s.state(piece, i) = static_cast<std::uint8_t>(Residency::kHost);
      return Status::ok();
    }
    if (s.tier(piece) == StoreMedium::kBlock) return Status::ok();  // kAbsent for good
    const std::size_t bytes = s.piece_bytes(piece, i);
    if (round_up(bytes, kPage) > swap->options().max_op_bytes) {
      return Status::invalid_argument(fmt::format(
          "StateStore: a sub-group's {} is {} bytes, above the swap space's max_op_bytes {}",
          piece_name(piece), bytes, swap->options().max_op_bytes));
    }
    const std::string key = fmt::format("{}/group{}/{}", options.key_prefix, i, piece_name(piece));
    ZINF_ASSIGN_OR_RETURN(s.extents_[i * kPieceCount + static_cast<std::size_t>(piece)],
                          swap->create(key, bytes));
    return Status::ok();
  };
  // Checkpoint layout: the saved pieces first, piece by piece; then the rest sub-group by
  // sub-group (the only order otherwise).
  const auto first_pass = [&](Piece piece) { return layout.checkpoint_layout && saved(piece); };
  for (std::size_t p = 0; p < kPieceCount; ++p) {
    if (!s.has(piece_at(p)) || !first_pass(piece_at(p))) continue;
    for (std::size_t i = 0; i < s.sub_group_count_; ++i) {
      ZINF_RETURN_IF_ERROR(place(piece_at(p), i));
    }
  }
  for (std::size_t i = 0; i < s.sub_group_count_; ++i) {
    for (std::size_t p = 0; p < kPieceCount; ++p) {
      if (!s.has(piece_at(p)) || first_pass(piece_at(p))) continue;
      ZINF_RETURN_IF_ERROR(place(piece_at(p), i));
    }
  }
  // Linkable when the extents landed where a rank file has them: the header at 0, piece k of
  // sub-group i at 4096 + (k * param_count + first(i)) * 4.
  if (layout.checkpoint_layout && swap->options().dirs.size() == 1 &&
      swap->file_offset(s.header_extent_) == 0) {
    s.linkable_ = true;
    std::uint64_t k = 0;
    for (std::size_t p = 0; p < kPieceCount; ++p) {
      const Piece piece = piece_at(p);
      if (!s.has(piece) || !saved(piece)) continue;
      for (std::size_t i = 0; i < s.sub_group_count_; ++i) {
        const std::uint64_t at =
            kPage + (k * options.param_count + s.sub_group_first(i)) * sizeof(float);
        if (swap->file_offset(s.extent(piece, i)) != at) s.linkable_ = false;
      }
      ++k;
    }
  }
  return store;
}

std::vector<ExtentId> StateStore::saved_extents() const {
  std::vector<ExtentId> in_order = {header_extent_};
  for (std::size_t p = 0; p <= static_cast<std::size_t>(Piece::kExpAvgSq); ++p) {
    if (!has(piece_at(p))) continue;
    for (std::size_t i = 0; i < sub_group_count_; ++i) in_order.push_back(extent(piece_at(p), i));
  }
  return in_order;
}

bool StateStore::adoptable(const std::vector<FileBlockSum>& sums) const {
  if (!linkable_) return false;
  const std::uint64_t block_bytes = swap_->options().block_bytes;
  std::size_t k = 0;
  for (ExtentId id : saved_extents()) {
    const ExtentInfo& info = swap_->info(id);
    const std::uint64_t start = swap_->file_offset(id);
    for (std::uint32_t b = 0; b < info.block_count; ++b, ++k) {
      const std::uint64_t end = std::min(start + (b + 1) * block_bytes, start + info.disk_bytes);
      if (k >= sums.size() || sums[k].end_offset != end) return false;
    }
  }
  return k == sums.size();
}

Status StateStore::adopt_checkpoint(const std::string& path, const std::string& later_name,
                                    const std::vector<FileBlockSum>& sums) {
  ZINF_ASSERT(adoptable(sums));
  std::vector<ExtentId> extents = saved_extents();
  // The header page is not the store's: its block checksum is skipped, its extent left alone.
  const std::size_t header_blocks = swap_->info(header_extent_).block_count;
  extents.erase(extents.begin());
  std::vector<std::uint64_t> checksums;
  checksums.reserve(sums.size() - header_blocks);
  for (std::size_t k = header_blocks; k < sums.size(); ++k) checksums.push_back(sums[k].xxh3);
  for (std::size_t p = 0; p <= static_cast<std::size_t>(Piece::kExpAvgSq); ++p) {
    if (!has(piece_at(p))) continue;
    for (std::size_t i = 0; i < sub_group_count_; ++i) {
      const Residency r = residency(piece_at(p), i);
      ZINF_ASSERT_MSG(r != Residency::kReading && r != Residency::kWriting,
                      "StateStore::adopt_checkpoint: a piece is in flight");
    }
  }
  clear_settled();
  ZINF_RETURN_IF_ERROR(swap_->adopt_file(path, later_name, extents, checksums));
  for (std::size_t p = 0; p <= static_cast<std::size_t>(Piece::kExpAvgSq); ++p) {
    if (!has(piece_at(p))) continue;
    for (std::size_t i = 0; i < sub_group_count_; ++i) {
      state(piece_at(p), i) = static_cast<std::uint8_t>(Residency::kDisk);
    }
  }
  return Status::ok();
}

Result<bool> StateStore::link_checkpoint(const void* header, const std::string& path,
                                         const std::string& later_name,
                                         std::vector<FileBlockSum>* sums) {
  ZINF_ASSERT(linkable_);
  // Per saved extent in file order (the header first): a kZero piece, a hole in the file.
  std::vector<bool> zero = {false};
  for (std::size_t p = 0; p <= static_cast<std::size_t>(Piece::kExpAvgSq); ++p) {
    if (!has(piece_at(p))) continue;
    for (std::size_t i = 0; i < sub_group_count_; ++i) {
      const Residency r = residency(piece_at(p), i);
      if (r != Residency::kDisk && r != Residency::kZero) return false;
      zero.push_back(r == Residency::kZero);
    }
  }
  // The state first (a frozen file, or state left in one, says no before the header's write
  // would start a new generation for nothing), then the header into the same file. A kZero
  // piece's room was punched out of the current file (SwapSpace::release): it reads zeros.
  const std::vector<ExtentId> in_order = saved_extents();
  bool any_stored = false;
  for (std::size_t k = 1; k < in_order.size(); ++k) {
    if (zero[k]) continue;
    any_stored = true;
    if (!swap_->in_current_file(in_order[k])) return false;
  }
  if (!any_stored) return false;  // the master is always stored: a store never stepped or loaded
  const std::uint64_t block_bytes = swap_->options().block_bytes;
  // A hole's checksums are those of zeros, of a block's length. The block of zeros is mapped
  // before anything changes: a refusal after the link would return with the header still held
  // and the settled sub-groups still passed over.
  AlignedBuffer zeros;
  if (std::find(zero.begin(), zero.end(), true) != zero.end()) {
    ZINF_RETURN_IF_ERROR(AlignedBuffer::zeroed_pages(
        block_bytes, "StateStore: a block of zeros to checksum holes", &zeros));
  }
  ZINF_RETURN_IF_ERROR(swap_->write_sync(header_extent_, header));
  if (!swap_->in_current_file(header_extent_)) return false;
  Status linked = swap_->link_files({path}, {later_name});
  if (!linked.is_ok()) {
    const int err = linked.sys_code();
    if (err == EXDEV || err == EPERM || err == EMLINK || err == EOPNOTSUPP || err == ESTALE) {
      return false;
    }
    return linked;
  }
  // The checksums of what was linked, before the header's are forgotten below.
  for (std::size_t k = 0; k < in_order.size(); ++k) {
    const ExtentId id = in_order[k];
    const ExtentInfo& info = swap_->info(id);
    const std::uint64_t start = swap_->file_offset(id);
    for (std::uint32_t b = 0; b < info.block_count; ++b) {
      const std::uint64_t end = std::min(start + (b + 1) * block_bytes, start + info.disk_bytes);
      if (!zero[k]) {
        sums->push_back({end, swap_->block_checksum(id, b)});
        continue;
      }
      const std::uint64_t length = end - (start + b * block_bytes);
      sums->push_back({end, xxh3_64(zeros.data(), static_cast<std::size_t>(length))});
    }
  }
  // The store never reads the header back: it must not keep the frozen file open once the next
  // step has rewritten the state; a step rewrites no sub-group it passes over, so none is
  // passed over until a step has streamed it once more.
  swap_->discard(header_extent_);
  clear_settled();
  return true;
}

std::size_t StateStore::sub_group_first(std::size_t i) const {
  ZINF_ASSERT(i < sub_group_count_);
  return firsts_[i];
}

std::size_t StateStore::sub_group_size(std::size_t i) const {
  ZINF_ASSERT(i < sub_group_count_);
  return firsts_[i + 1] - firsts_[i];
}

std::size_t StateStore::bytes_per_param() const {
  std::size_t bytes = 0;
  for (std::size_t p = 0; p < kPieceCount; ++p) {
    if (has_[p]) bytes += dtype_bytes(dtype(piece_at(p)));
  }
  return bytes;
}

DType StateStore::dtype(Piece piece) const { return dtype_of(options_, piece); }

std::size_t StateStore::piece_bytes(Piece piece, std::size_t i) const {
  return sub_group_size(i) * dtype_bytes(dtype(piece));
}

std::size_t StateStore::slot_offset(Piece piece) const {
  ZINF_ASSERT(in_block(piece));
  return slot_offset_[static_cast<std::size_t>(piece)];
}

std::byte* StateStore::host_data(Piece piece) const {
  ZINF_ASSERT(has(piece) && tier(piece) == StoreMedium::kHost);
  return const_cast<std::byte*>(host_[static_cast<std::size_t>(piece)].data());
}

std::byte* StateStore::host_data(Piece piece, std::size_t i) const {
  return host_data(piece) + sub_group_first(i) * dtype_bytes(dtype(piece));
}

void StateStore::advise_cold(std::size_t first_sub_group, std::size_t count) {
  advise_off_huge_pages(first_sub_group, count, {Piece::kExpAvg, Piece::kExpAvgSq, Piece::kGrads});
}

void StateStore::advise_master_cold(std::size_t first_sub_group, std::size_t count) {
  advise_off_huge_pages(first_sub_group, count, {Piece::kParams});
}

void StateStore::advise_off_huge_pages(std::size_t first_sub_group, std::size_t count,
                                       std::initializer_list<Piece> pieces) {
  ZINF_ASSERT(count > 0 && first_sub_group + count <= sub_group_count_);
  const std::size_t last = first_sub_group + count - 1;
  const std::size_t begin = sub_group_first(first_sub_group);
  const std::size_t end = sub_group_first(last) + sub_group_size(last);
  for (Piece piece : pieces) {
    if (!has(piece) || tier(piece) != StoreMedium::kHost) continue;
    const std::size_t element_bytes = dtype_bytes(dtype(piece));
    (void)host_[static_cast<std::size_t>(piece)].advise_no_huge_pages(
        begin * element_bytes, (end - begin) * element_bytes);
  }
}

ExtentId StateStore::extent(Piece piece, std::size_t i) const {
  ZINF_ASSERT(on_nvme(piece) && i < sub_group_count_);
  return extents_[i * kPieceCount + static_cast<std::size_t>(piece)];
}

std::uint8_t& StateStore::state(Piece piece, std::size_t i) {
  ZINF_ASSERT(i < sub_group_count_);
  return states_[i * kPieceCount + static_cast<std::size_t>(piece)];
}

std::uint8_t StateStore::state(Piece piece, std::size_t i) const {
  ZINF_ASSERT(i < sub_group_count_);
  return states_[i * kPieceCount + static_cast<std::size_t>(piece)];
}

Residency StateStore::residency(Piece piece, std::size_t i) const {
  return static_cast<Residency>(state(piece, i));
}

Status StateStore::write_piece(Piece piece, std::size_t i, const void* data) {
  ZINF_ASSERT(has(piece));
  if (tier(piece) == StoreMedium::kBlock) return not_kept(options_.key_prefix, i, piece);
  // New master or moments: no longer known to be what a step leaves as it is.
  if (piece != Piece::kGrads) records_[i].settled = false;
  if (tier(piece) == StoreMedium::kHost) {
    std::memcpy(host_data(piece, i), data, piece_bytes(piece, i));
    return Status::ok();
  }
  const Residency r = residency(piece, i);
  if (r == Residency::kReading || r == Residency::kWriting) {
    return Status::failed_precondition(fmt::format("{}/group{}/{}: {} is in flight",
                                                   options_.key_prefix, i, piece_name(piece),
                                                   residency_name(r)));
  }
  state(piece, i) = static_cast<std::uint8_t>(Residency::kWriting);
  Status status = swap_->write_sync(extent(piece, i), data);
  state(piece, i) = static_cast<std::uint8_t>(status.is_ok() ? Residency::kDisk : Residency::kLost);
  return status;
}

bool all_zero_bytes(const void* data, std::size_t bytes) {
  const auto* b = static_cast<const unsigned char*>(data);
  return bytes == 0 || (b[0] == 0 && std::memcmp(b, b + 1, bytes - 1) == 0);
}

Status StateStore::read_piece(Piece piece, std::size_t i, void* data) const {
  return read_piece(piece, i, ElementRange{0, sub_group_size(i)}, data);
}

StateStore::ElementRange StateStore::read_range(Piece piece, std::size_t i, std::size_t begin,
                                                std::size_t end) const {
  ZINF_ASSERT(has(piece) && begin < end && end <= sub_group_size(i));
  if (tier(piece) != StoreMedium::kNvme) return {begin, end};
  // Block bounds are whole pages, so whole elements of a 2- or 4-byte dtype.
  const std::size_t element_bytes = dtype_bytes(dtype(piece));
  const std::size_t block_bytes = swap_->options().block_bytes;
  const std::size_t first_byte = begin * element_bytes / block_bytes * block_bytes;
  const std::size_t end_byte =
      std::min(round_up(end * element_bytes, block_bytes), piece_bytes(piece, i));
  return {first_byte / element_bytes, end_byte / element_bytes};
}

Status StateStore::read_piece(Piece piece, std::size_t i, ElementRange range, void* data) const {
  ZINF_ASSERT(has(piece) && range.begin < range.end && range.end <= sub_group_size(i));
  if (tier(piece) == StoreMedium::kBlock) return not_kept(options_.key_prefix, i, piece);
  const std::size_t element_bytes = dtype_bytes(dtype(piece));
  const std::size_t bytes = (range.end - range.begin) * element_bytes;
  if (tier(piece) == StoreMedium::kHost) {
    std::memcpy(data, host_data(piece, i) + range.begin * element_bytes, bytes);
    return Status::ok();
  }
  const ElementRange whole = read_range(piece, i, range.begin, range.end);
  ZINF_ASSERT_MSG(whole.begin == range.begin && whole.end == range.end,
                  "StateStore::read_piece: a range not on swap block bounds");
  const Residency r = residency(piece, i);
  if (r == Residency::kZero) {
    std::memset(data, 0, round_up(bytes, kPage));
    return Status::ok();
  }
  if (r != Residency::kDisk && r != Residency::kInBlock && r != Residency::kLost) {
    return Status::failed_precondition(fmt::format("{}/group{}/{}: {}", options_.key_prefix, i,
                                                   piece_name(piece), residency_name(r)));
  }
  // A kLost piece is still handed to the swap space, which answers io_error for it.
  return swap_->read_sync(extent(piece, i), range.begin * element_bytes, bytes, data);
}

Status StateStore::release_piece(Piece piece, std::size_t i) {
  ZINF_ASSERT(on_nvme(piece));
  const Residency r = residency(piece, i);
  ZINF_ASSERT_MSG(r != Residency::kReading && r != Residency::kWriting,
                  "StateStore::release_piece: the piece is in flight");
  // New moments (or master): no longer known to be what a step leaves as it is.
  if (piece != Piece::kGrads) records_[i].settled = false;
  ZINF_RETURN_IF_ERROR(swap_->release(extent(piece, i)));
  state(piece, i) = static_cast<std::uint8_t>(Residency::kZero);
  return Status::ok();
}

Version StateStore::version(std::size_t i, std::int64_t step) const {
  const Record& r = records_[i];
  if (r.torn) return Version::kTorn;
  ZINF_ASSERT_MSG(r.step == step || r.step == step - 1,
                  "StateStore::version: sub-group holds neither step t nor t - 1");
  return r.step == step ? Version::kNew : Version::kOld;
}

void StateStore::begin_read(Piece piece, std::size_t i) {
  ZINF_ASSERT_MSG(residency(piece, i) == Residency::kDisk,
                  "StateStore: a piece must be on disk to be read");
  state(piece, i) = static_cast<std::uint8_t>(Residency::kReading);
}

void StateStore::end_read(Piece piece, std::size_t i, bool ok) {
  ZINF_ASSERT(residency(piece, i) == Residency::kReading);
  state(piece, i) = static_cast<std::uint8_t>(ok ? Residency::kInBlock : Residency::kDisk);
}

void StateStore::begin_write(Piece piece, std::size_t i) {
  const Residency r = residency(piece, i);
  ZINF_ASSERT_MSG(r != Residency::kReading && r != Residency::kWriting && r != Residency::kHost,
                  "StateStore: a piece written while in flight, or a host piece");
  state(piece, i) = static_cast<std::uint8_t>(Residency::kWriting);
}

void StateStore::end_write(Piece piece, std::size_t i, bool ok) {
  ZINF_ASSERT(residency(piece, i) == Residency::kWriting);
  state(piece, i) = static_cast<std::uint8_t>(ok ? Residency::kDisk : Residency::kLost);
}

void StateStore::drop_block(Piece piece, std::size_t i) {
  ZINF_ASSERT_MSG(residency(piece, i) == Residency::kInBlock,
                  "StateStore: dropping a piece that is not in a block");
  state(piece, i) = static_cast<std::uint8_t>(Residency::kDisk);
}

void StateStore::set_stored(std::size_t i, std::int64_t step) {
  ZINF_ASSERT(i < sub_group_count_);
  records_[i].step = step;
  records_[i].torn = false;
}

void StateStore::set_torn(std::size_t i) {
  ZINF_ASSERT(i < sub_group_count_);
  records_[i].torn = true;
}

void StateStore::set_settled(std::size_t i, bool settled) {
  ZINF_ASSERT(i < sub_group_count_);
  records_[i].settled = settled;
}

void StateStore::clear_settled() {
  for (Record& r : records_) r.settled = false;
}

}  // namespace zinf
