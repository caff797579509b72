// Parameter groups in the engine: which run of this rank's optimizer partition steps with which
// group's hyper-parameters, and those hyper-parameters for one step.
//
// Group 0 is the default group (the optimizer's own hyper-parameters, ParameterSpec::group ""),
// group i + 1 is the i-th add_param_group(), and the last, group groups.size() + 1, is the frozen
// parameters' (ParameterSpec::trainable false, whatever their group): learning rate 0 and weight
// decay 0. Their gradient is zero, so every optimizer's moments stay zero and its update is
// exactly zero; a learning rate of 0 alone would still let weight decay shrink them (AdamW's
// p * (1 - lr * wd) is exact at lr 0, but Adam's L2 term adds wd * p to the gradient). Padding in
// the partition goes with group 0, but with the frozen group in a partitioner group of frozen
// parameters (ParameterLayout::frozen_group()), whose shards are then frozen as a whole, padding
// included, and take no gradients; its values and gradients are zero, so either group leaves it
// zero.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/function_ref.hpp"
#include "engine/layout.hpp"
#include "zinf/engine.hpp"
#include "zinf/optim.hpp"
#include "zinf/status.hpp"

namespace zinf {

// Rank `rank`'s partition (ParameterLayout's, after lay_out()) cut into runs of one group, as
// optimizer_step()'s ranges over the whole partition (first begins at 0; neighbours differ in
// group). kInvalidArgument naming the parameter and the group when a parameter names a group
// `groups` does not define.
Result<std::vector<OptimizerRange>> partition_group_ranges(const ParameterLayout& layout, int rank,
                                                           std::span<const ParamGroup> groups);

// The ranges of elements [first, first + count) of the partition, relative to `first`.
std::vector<OptimizerRange> slice_ranges(std::span<const OptimizerRange> ranges, std::size_t first,
                                         std::size_t count);

// For each of `count` consecutive runs of rank `rank`'s partition (run i is elements
// [first(i), first(i) + size(i)), in increasing order): whether no element of it belongs to a
// trainable parameter (it holds frozen parameters and padding only). All false when no parameter
// is frozen.
std::vector<bool> frozen_runs(const ParameterLayout& layout, int rank, std::size_t count,
                              FunctionRef<std::size_t(std::size_t)> first,
                              FunctionRef<std::size_t(std::size_t)> size);

// The multiple of elements frozen_cuts() widens a trainable run to: the f32 elements of a 4 KiB
// page. The planner counts the frozen elements a run is widened over with it
// (plan::estimate_memory).
inline constexpr std::size_t kFrozenCutElements = 1024;

// The elements of one scratch block a half-only frozen master (its half copy alone) is read and
// written through, at most: 256 Ki (1 MiB of f32; lib/engine/store_state.cpp). The planner counts
// those blocks with it (plan::estimate_memory).
inline constexpr std::size_t kHalfOnlyChunkElements = std::size_t{1} << 18;

// Where the optimizer's sub-groups of rank `rank`'s partition must end so that frozen
// parameters and trainable ones fall in sub-groups of their own (StateStoreOptions::cuts): both
// ends of each run of trainable elements, the run widened to multiples of kFrozenCutElements (so
// that every f32 piece stays whole 4 KiB pages) and runs that then touch merged, the partition's
// own ends left out. A sub-group then holds trainable elements (with the frozen ones or padding of
// gaps the widening closed), or frozen parameters and padding only. Empty when no parameter is
// frozen.
std::vector<std::size_t> frozen_cuts(const ParameterLayout& layout, int rank);

// The index of the frozen parameters' group (the last one, see above).
inline std::uint32_t frozen_group(std::span<const ParamGroup> groups) {
  return static_cast<std::uint32_t>(groups.size()) + 1;
}

// The least eps of the frozen parameters' group.
inline constexpr double kFrozenEps = 1e-8;

// out[0] = base with lr; out[i + 1] = base with lr * groups[i].lr_scale and groups[i]'s
// weight_decay when set; out[groups.size() + 1] = base with lr 0, weight decay 0 and an eps of at
// least kFrozenEps (the frozen group: with eps 0 its update would be 0 / 0). REQUIRES:
// out->size() == groups.size() + 2 (nothing is allocated).
void group_params(const OptimizerParams& base, double lr, std::span<const ParamGroup> groups,
                  std::vector<OptimizerParams>* out);

}  // namespace zinf
