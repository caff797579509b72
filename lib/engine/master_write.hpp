// One parameter's fp32 master, read or written once the engine is finalized:
// read_master_values is Engine::read_parameters(), write_master_values Engine::write_parameters()
// (new fp32 values into this rank's slice of the master, the optimizer moments left as they are,
// then the device copies / shards republished from the master, as after a checkpoint load).
//
// Thread-safety: one thread (the rank's).
#pragma once

#include <chrono>
#include <string_view>

#include "engine/layout.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/rank_exchange.hpp"
#include "zero/param_coordinator.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/status.hpp"

namespace zinf {

struct MasterAccess {
  OptimizerState* state = nullptr;
  ParamCoordinator* coord = nullptr;
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

// Checks first, returning without any collective:
// kNotFound for an unknown parameter, `precondition` when it is not OK, kInvalidArgument for a
// root outside the world or a null `values` on the root. Then rank `root`'s `values` (the
// parameter's element_count floats; the other ranks' are ignored) are broadcast to every rank,
// and each rank writes the elements of its slice into the master: a pass over its whole
// partition of the master (each sub-group read and rewritten, on whatever tier it lives), the
// prefetched modules are dropped and the master is published. Errors from the broadcast on are
// recorded in `sticky`. Collective.
Status write_master_values(const MasterAccess& w, std::string_view name, const float* values,
                           int root, Status precondition);

}  // namespace zinf
