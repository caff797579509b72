// ParameterLayout: registration and layout. It keeps what register_parameter() was given (the
// specs, the initial values or initializers until finalize ends), and at finalize lays the
// parameters out: the Partitioner's groups, the modules and which groups stay gathered, and this
// rank's optimizer partition (its slice of every group, end to end; group g's slice starts at
// offset(g)). The fp32 master, moments and gradient accumulator all use that partition layout,
// so a step is one pass over it whatever the stage; the new device-dtype values of the
// partition are packed group after group (group g's at byte_offset(g)).
//
// Thread-safety: one thread (the rank's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/rank_exchange.hpp"
#include "zero/param_coordinator.hpp"
#include "zero/partitioner.hpp"
#include "zinf/config.hpp"
#include "zinf/engine.hpp"

namespace zinf {

class ParameterLayout {
 public:
  struct Registered {
    ParameterSpec spec;  // initial_values cleared
    std::size_t element_count = 0;
    std::vector<float> values;  // until finalize(); empty with spec.initializer
  };

  // register_parameter()'s checks and bookkeeping (the engine checks that registration is open).
  Status add(const ParameterSpec& spec);

  // finalize's layout, for rank `rank` of `world`: the partitioner, the modules, the partition.
  // Then checks with every rank that all registered the same parameters (kInvalidArgument
  // naming the first that differs). Collective.
  Status lay_out(const Config& config, int rank, int world, RankExchange& exchange);

  // out[0, count) <- the initial master of partition elements [first, first + count), from the
  // registered values or initializers; padding is zero. An initializer's error names the
  // parameter and its elements. REQUIRES: lay_out() done, drop_initial_values() not yet.
  Status fill_master(std::size_t first, std::size_t count, float* out) const;
  // The initial values are placed (or will never be): the copies and initializers go, and their
  // pages go back to the system (release_freed_memory()).
  void drop_initial_values();

  // --- Lookups -------------------------------------------------------------------------------
  bool empty() const { return regs_.empty(); }
  // kNotFound naming `call`, the module and the registered ones.
  Result<std::size_t> find_module(std::string_view call, std::string_view module) const;
  // The index of parameter `name` (its ParamId after lay_out()), or nullopt.
  std::optional<std::size_t> find_param(std::string_view name) const;
  const Registered& param(std::size_t index) const { return regs_[index]; }
  std::size_t module_of(std::size_t param) const;
  const std::vector<std::string>& module_names() const { return module_names_; }
  const std::vector<std::size_t>& module_params(std::size_t m) const { return module_params_[m]; }
  const std::vector<std::uint32_t>& module_groups(std::size_t m) const { return module_groups_[m]; }

  // --- After lay_out() -----------------------------------------------------------------------
  const Partitioner& partitioner() const { return *part_; }
  std::uint32_t group_count() const { return part_->group_count(); }
  const GroupInfo& group(std::uint32_t g) const { return part_->group(g); }
  std::size_t partition_elements() const { return partition_elements_; }
  std::size_t offset(std::uint32_t g) const { return offsets_[g]; }
  // The first group whose slice ends after partition element `element` (the one holding it,
  // unless that one is empty), or group_count().
  std::uint32_t first_group_ending_after(std::size_t element) const;
  std::size_t byte_offset(std::uint32_t g) const { return byte_offsets_[g]; }
  // Bytes of the partition's values in the device dtypes, packed.
  std::size_t device_copy_bytes() const { return device_copy_bytes_; }
  // Every group is bf16 or f16, all of one dtype (half_dtype()).
  bool all_one_half() const { return all_one_half_; }
  DType half_dtype() const { return half_dtype_; }
  // Bytes of the largest group's shard in half_dtype().
  std::size_t largest_half_shard_bytes() const;
  // Per group: it stays gathered (stages 1 and 2, or under the persistence threshold).
  const std::vector<bool>& persistent() const { return persistent_; }
  // Group g holds frozen parameters only (ParameterSpec::trainable false; a module is all frozen
  // or all trainable, so grouped by module a group is one or the other). No step changes such a
  // group's master or its device-dtype values: a step neither writes its shard nor all-gathers it
  // again (publisher.hpp).
  bool frozen_group(std::uint32_t g) const { return frozen_groups_[g]; }
  // Whether a step rewrites group g: it holds trainable parameters (it is not frozen_group()).
  // After a step only such groups' shards are written and, where they stay gathered, all-gathered
  // again; a frozen group's shard already holds what the step would write, and it is published
  // only after its master was written (finalize, a checkpoint load, write_parameters).
  bool republished(std::uint32_t g) const { return !frozen_groups_[g]; }
  // The coordinator's modules (taken once: the coordinator keeps them).
  std::vector<CoordinatorModule> take_coordinator_modules() { return std::move(coord_modules_); }

 private:
  // Every rank must have registered the same parameters (names, modules, shapes, dtypes, in
  // order). Ranks exchange (count, fingerprint); when they differ, per-parameter hashes, so the
  // error names the first parameter that differs. Every rank computes the same error.
  Status check_ranks_agree(int rank, int world, RankExchange& exchange) const;
  // Every rank registered the same parameters frozen (ParameterSpec::trainable): a rank that froze
  // another would step its slice of that parameter differently, or reduce gradients the others
  // do not. kInvalidArgument naming the first parameter that differs and the ranks.
  Status check_trainable_agree(int world, RankExchange& exchange) const;
  // Every rank registered the same initial values for each parameter given by initial_values
  // (each rank keeps its own partition of them, so values that differ would mix the ranks'
  // models); parameters with an initializer are compared by their initializer_values_hash where
  // given. kInvalidArgument naming the first parameter that differs and the ranks.
  Status check_initial_values_agree(int world, RankExchange& exchange) const;

  // One registered parameter's run of elements inside this rank's partition.
  struct MasterPiece {
    std::size_t first;  // partition element where the run starts
    std::size_t param;  // index into regs_
    std::size_t param_offset;
    std::size_t element_count;
  };

  std::vector<Registered> regs_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
  std::map<std::string, std::size_t, std::less<>> module_index_;
  std::vector<std::string> module_names_;
  std::vector<std::vector<std::size_t>> module_params_;
  std::vector<std::vector<std::uint32_t>> module_groups_;

  std::optional<Partitioner> part_;
  std::vector<CoordinatorModule> coord_modules_;
  std::vector<bool> persistent_;
  std::vector<bool> frozen_groups_;
  std::size_t partition_elements_ = 0;
  std::vector<std::size_t> offsets_;
  std::vector<std::size_t> byte_offsets_;
  std::size_t device_copy_bytes_ = 0;
  bool all_one_half_ = false;
  DType half_dtype_ = DType::kBF16;
  std::vector<MasterPiece> master_pieces_;  // sorted by first; until drop_initial_values()
};

}  // namespace zinf
