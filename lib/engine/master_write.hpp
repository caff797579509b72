// Parameters' fp32 masters, read or written once the engine is finalized:
// read_master_values is Engine::read_parameters(), write_master_values Engine::write_parameters()
// (new fp32 values of one or many parameters into this rank's slice of the master in one pass,
// the optimizer moments left as they are, then the device copies / shards republished from the
// values written, as after a checkpoint load).
//
// Thread-safety: one thread (the rank's).
#pragma once

#include <chrono>
#include <span>
#include <string>
#include <string_view>

#include "engine/layout.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/publisher.hpp"
#include "engine/rank_exchange.hpp"
#include "zero/param_coordinator.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"
#include "zinf/status.hpp"

namespace zinf {

struct MasterAccess {
  OptimizerState* state = nullptr;
  ParamCoordinator* coord = nullptr;
  Publisher* publisher = nullptr;
  const ParameterLayout* layout = nullptr;
  Device* device = nullptr;
  Communicator* comm = nullptr;
  Stream* stream = nullptr;
  Event* event = nullptr;
  std::chrono::milliseconds timeout{60'000};
  int rank = 0;
  StickyError* sticky = nullptr;  // takes the errors of the collective and of the state
  RankExchange* exchange = nullptr;
};

// Every rank's slice of the parameter's group all-gathered in f32 and the parameter copied to
// `out` (element_count floats). The ranks first agree that each could read its slice, so a rank
// that cannot fails every rank at once. kNotFound for an unknown parameter, kInvalidArgument for
// a null `out`. Collective.
Status read_master_values(const MasterAccess& w, std::string_view name, float* out);
// The same for a moment of the optimizer (`state`: "exp_avg" or "exp_avg_sq"), which it reads
// whole to take the slice; kInvalidArgument for a state `kind` does not keep.
Status read_moment_values(const MasterAccess& w, OptimizerKind kind, std::string_view name,
                          std::string_view state, float* out);

// The call as errors name it: "write_parameters('a')", or "write_parameters('a' and 3 more)".
std::string write_parameters_call(std::span<const std::string_view> names);

// Engine::write_parameters() (both forms) after settle(); `precondition` is the engine's check
// (a module gathered, gradients reduced), returned after the names' checks.
//
// Checks first: kNotFound for an unknown name, kInvalidArgument for a name given twice,
// `precondition` when it is not OK, kInvalidArgument for a root outside the world, then the
// local preparation (the broadcast buffers, `values` on the root, the prefetched modules dropped,
// since the pass may write the shards). The ranks exchange those outcomes and a fingerprint of
// (names, root) whatever they are, and all fail together (the others with kAborted naming the
// rank) when any failed or differs. Then one pass over this rank's slice of the named
// parameters' groups in layout order, the same groups on every rank, in runs of neighbouring
// named groups (two runs joined across the groups between them where the state would rewrite
// one block for both, OptimizerState::shares_rewrite): an OptimizerState::update_master_range
// per run, each sub-group holding the run handed over as it is stored and rewritten on whatever
// tier it lives, so the groups between runs cost nothing, and only the named groups of a joined
// run changed, rounded and written to their shards (its `changed`). During the pass the parameters
// are broadcast from the root one at a time in layout order, each preceded by an agreement that
// every rank is still in the pass (so a rank that fails stops every rank at the same parameter
// instead of leaving them waiting in the broadcast; a failure after the last broadcast is agreed
// once the pass is over). Every rank makes the same broadcasts in the same order, whatever its
// runs: a rank takes the pieces of the parameters it owns as its pass reaches them, which is layout
// order since its partition lies in group order, and broadcasts those it owns no piece of on the
// way. Each patched piece goes to OptimizerState::master_loaded() as it is written, and each run's
// named groups' shards are written from them with write_loaded(), so the master is not read back to
// publish them. The shard writes come before the last agreement and the all-gather of the named
// groups that stay gathered after it: a rank whose shard write fails (a write to the swap) fails
// every rank in this call, itself with the error naming the shard's swap extent, file and offset,
// the others with kAborted naming it, and the engine is then unusable on every rank, since their
// shards disagree. Errors from the exchange on are recorded in `sticky`. Collective.
Status write_master_values(const MasterAccess& w, std::span<const std::string_view> names,
                           const ParameterValues& values, int root, Status precondition);
// The batch of one, `values` (the parameter's element_count floats) on the root; null there is
// the batch's empty `values`.
Status write_master_values(const MasterAccess& w, std::string_view name, const float* values,
                           int root, Status precondition);

}  // namespace zinf
