// The checkpoint kill test, small enough for the default run: 8 trials at 256K parameters (the
// 50-trial, 64M-parameter run is checkpoint_kill_slow_test.cpp). See checkpoint_kill_util.hpp.
#include <gtest/gtest.h>

#include "checkpoint_kill_util.hpp"

namespace zinf {
namespace {

TEST(CheckpointKill, KilledSaveLeavesPreviousOrNewBitForBit) {
  engine_test::run_kill_trials(std::size_t{1} << 18, 8, 42);
}

}  // namespace
}  // namespace zinf
