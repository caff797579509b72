// The checkpoint kill test of the acceptance: 50 trials at 64M parameters, optimizer state on
// NVMe (768 MB a checkpoint). See checkpoint_kill_util.hpp.
#include <gtest/gtest.h>

#include <cstdlib>

#include "checkpoint_kill_util.hpp"

namespace zinf {
namespace {

// ZINF_CKPT_KILL_TRIALS overrides the 50 (a shorter run on a busy machine).
TEST(CheckpointKillSlow, KilledSaveOf64MParametersLeavesPreviousOrNewBitForBit) {
  const char* trials = std::getenv("ZINF_CKPT_KILL_TRIALS");
  engine_test::run_kill_trials(std::size_t{64} << 20, trials != nullptr ? std::atoi(trials) : 50,
                               4242);
}

}  // namespace
}  // namespace zinf
