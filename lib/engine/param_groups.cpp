// Parameter groups in the engine (see param_groups.hpp).
#include "engine/param_groups.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "base/arith.hpp"
#include "base/assert.hpp"

namespace zinf {

Result<std::vector<OptimizerRange>> partition_group_ranges(const ParameterLayout& layout, int rank,
                                                           std::span<const ParamGroup> groups) {
  const Partitioner& part = layout.partitioner();
  // Each parameter's group index, checked once.
  std::vector<std::uint32_t> param_group(part.param_count(), 0);
  for (std::uint32_t id = 0; id < part.param_count(); ++id) {
    const std::string& name = layout.param(id).spec.group;
    if (!layout.param(id).spec.trainable) {
      param_group[id] = frozen_group(groups);
      continue;
    }
    if (name.empty()) continue;
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const ParamGroup& g) { return g.name == name; });
    if (it == groups.end()) {
      return Status::invalid_argument(
          fmt::format("parameter '{}': group '{}' was not defined by add_param_group()",
                      layout.param(id).spec.name, name));
    }
    param_group[id] = static_cast<std::uint32_t>(it - groups.begin()) + 1;
  }
  std::vector<OptimizerRange> ranges;
  // A run of `group` from element `begin` (runs arrive in order, never empty).
  auto run = [&](std::size_t begin, std::uint32_t group) {
    if (!ranges.empty() && ranges.back().group == group) return;
    ranges.push_back({begin, group});
  };
  for (std::uint32_t g = 0; g < layout.group_count(); ++g) {
    const std::size_t base = layout.offset(g);
    const std::size_t end = base + layout.group(g).shard_element_count;
    // Padding goes with the default group, but with the frozen group in a partitioner group of
    // frozen parameters (no stage reduces it, so no rank's shard of it, padding included, needs
    // gradients). A trainable group's padding keeps group 0: the reducer writes every rank's
    // shard of it, one of padding alone too.
    const std::uint32_t padding = layout.frozen_group(g) ? frozen_group(groups) : 0;
    std::size_t at = base;
    for (const ParamPiece& piece : part.shard_pieces(g, rank)) {
      const std::size_t begin = base + piece.shard_offset;
      if (begin > at) run(at, padding);
      run(begin, param_group[piece.param]);
      at = begin + piece.element_count;
    }
    if (at < end) run(at, padding);
  }
  if (ranges.empty()) ranges.push_back({0, 0});
  ZINF_ASSERT(ranges[0].begin == 0);
  return ranges;
}

namespace {

bool has_frozen(const ParameterLayout& layout) {
  for (std::uint32_t id = 0; id < layout.partitioner().param_count(); ++id) {
    if (!layout.param(id).spec.trainable) return true;
  }
  return false;
}

// fn(begin, end) for each trainable parameter's piece of rank `rank`'s partition, in partition
// order (elements of the partition).
template <typename Fn>
void for_each_trainable_piece(const ParameterLayout& layout, int rank, const Fn& fn) {
  const Partitioner& part = layout.partitioner();
  for (std::uint32_t g = 0; g < layout.group_count(); ++g) {
    const std::size_t base = layout.offset(g);
    for (const ParamPiece& piece : part.shard_pieces(g, rank)) {
      if (!layout.param(piece.param).spec.trainable || piece.element_count == 0) continue;
      fn(base + piece.shard_offset, base + piece.shard_offset + piece.element_count);
    }
  }
}

}  // namespace

std::vector<bool> frozen_runs(const ParameterLayout& layout, int rank, std::size_t count,
                              FunctionRef<std::size_t(std::size_t)> first,
                              FunctionRef<std::size_t(std::size_t)> size) {
  const bool any_frozen = has_frozen(layout);
  std::vector<bool> frozen(count, any_frozen);
  if (!any_frozen) return frozen;
  // Each trainable piece, in partition order, marks the sub-groups it overlaps.
  std::size_t r = 0;
  for_each_trainable_piece(layout, rank, [&](std::size_t begin, std::size_t end) {
    while (r < count && first(r) + size(r) <= begin) ++r;
    for (std::size_t k = r; k < count && first(k) < end; ++k) frozen[k] = false;
  });
  return frozen;
}

std::vector<std::size_t> frozen_cuts(const ParameterLayout& layout, int rank) {
  std::vector<std::size_t> cuts;
  if (!has_frozen(layout)) return cuts;
  const std::size_t count = layout.partition_elements();
  // The trainable pieces in partition order, widened to whole quanta; a cut at each end of every
  // maximal run of them.
  std::size_t run_begin = 0, run_end = 0;
  bool in_run = false;
  auto close_run = [&] {
    if (!in_run) return;
    if (run_begin > 0) cuts.push_back(run_begin);
    if (run_end < count) cuts.push_back(run_end);
  };
  for_each_trainable_piece(layout, rank, [&](std::size_t piece_begin, std::size_t piece_end) {
    const std::size_t begin = piece_begin / kFrozenCutElements * kFrozenCutElements;
    const std::size_t end = std::min(round_up(piece_end, kFrozenCutElements), count);
    if (in_run && begin <= run_end) {
      run_end = std::max(run_end, end);
      return;
    }
    close_run();
    run_begin = begin;
    run_end = end;
    in_run = true;
  });
  close_run();
  return cuts;
}

std::vector<OptimizerRange> slice_ranges(std::span<const OptimizerRange> ranges, std::size_t first,
                                         std::size_t count) {
  std::vector<OptimizerRange> out;
  const std::size_t end = first + count;
  for (std::size_t r = 0; r < ranges.size(); ++r) {
    const std::size_t stop = r + 1 < ranges.size() ? ranges[r + 1].begin : SIZE_MAX;
    if (stop <= first || ranges[r].begin >= end) continue;
    out.push_back({std::max(ranges[r].begin, first) - first, ranges[r].group});
  }
  if (out.empty()) out.push_back({0, 0});
  return out;
}

void group_params(const OptimizerParams& base, double lr, std::span<const ParamGroup> groups,
                  std::vector<OptimizerParams>* out) {
  ZINF_ASSERT(out->size() == groups.size() + 2);
  (*out)[0] = base;
  (*out)[0].lr = lr;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    OptimizerParams& p = (*out)[i + 1];
    p = base;
    p.lr = lr * groups[i].lr_scale;
    if (groups[i].weight_decay >= 0) p.weight_decay = groups[i].weight_decay;
  }
  OptimizerParams& frozen = (*out)[frozen_group(groups)];
  frozen = base;
  frozen.lr = 0.0;
  frozen.weight_decay = 0.0;
  // A frozen element's update divides its zero first moment by sqrt(0) + eps: with eps 0 that is
  // NaN, and -0 * NaN is NaN. No other bit depends on eps here (the moments do not; the update
  // is multiplied by lr 0), so any eps above 0 keeps the frozen masters as they are.
  frozen.eps = std::max(frozen.eps, kFrozenEps);
}

}  // namespace zinf
