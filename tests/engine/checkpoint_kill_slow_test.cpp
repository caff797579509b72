// The checkpoint kill test of the acceptance: 50 trials at 64M parameters, optimizer state on
// NVMe (768 MB a checkpoint). See checkpoint_kill_util.hpp.
#include <gtest/gtest.h>

#include "checkpoint_kill_util.hpp"

namespace zinf {
namespace {

TEST(CheckpointKillSlow, KilledSaveOf64MParametersLeavesPreviousOrNewBitForBit) {
  engine_test::run_kill_trials(std::size_t{64} << 20, 50, 4242);
}

}  // namespace
}  // namespace zinf
