// The public EngineCounters (include/zinf/engine.hpp) from the zero layer's ZeroCounters.
#pragma once

#include <cstdint>

#include "zero/zero_counters.hpp"
#include "zinf/engine.hpp"

namespace zinf {

// Copies the fields of the same names into `out`, and the engine's own step counts.
void copy_engine_counters(const ZeroCounters& z, std::uint64_t steps, std::uint64_t skipped_steps,
                          EngineCounters& out);

}  // namespace zinf
