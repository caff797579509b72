// The checkpoint kill test (checkpoint_kill_test.cpp, checkpoint_kill_slow_test.cpp): a child
// process saving a checkpoint of a one-rank engine with its optimizer state on NVMe is killed
// with SIGKILL at a random instant of the save; a fresh process then loads `latest`, which must
// hold exactly the previous checkpoint or the new one (the masters' hash, and the hash after one
// more step, which the moments and the step count decide). That fresh process is the next
// trial's child (it loads, records what it loaded, steps and saves), and a verifier process
// after the last trial, so a trial costs one engine, not two. Prints each trial and the
// distribution of outcomes. gtest assertions report failures.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zinf::engine_test {

// `trials` killed saves (after one that runs to the end and times the save), each at a random
// instant after it started, drawn from `seed`: odd trials in [0, 1.2 x the save's time], even
// ones in [0.9, 1.1 x] (the commit at the save's end).
void run_kill_trials(std::size_t params, int trials, std::uint64_t seed);

}  // namespace zinf::engine_test
