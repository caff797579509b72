// StoreState (lib/engine/store_state.cpp), offload_optimizer cpu: the StateStore's host arrays of
// the moments and of the gradients are zero pages, and the frozen sub-groups' parts of them are
// advised off transparent huge pages, as HostState advises its frozen ranges.
#include <gtest/gtest.h>

#include <cstddef>
#include <memory>

#include "engine/optimizer_state.hpp"
#include "engine/state_fixture.hpp"

namespace zinf {
namespace {

using engine_test::StateFixture;
using engine_test::whole_array;

// The frozen sub-group's part of both moments and of the gradient accumulator is advised off
// transparent huge pages ("nh" in its mapping's flags), so that with THP "always" the first write
// into the trainable sub-group beside it does not fault in 2 MiB pages over its zeros; the
// trainable part, and the master, are not advised.
TEST(StoreStateMemory, TheFrozenSubGroupsAreAdvisedOffHugePages) {
  const bool advised = engine_test::kernel_advises_no_huge_pages();
  if (HasFailure()) return;  // the probe's mapping was refused: not a reason to skip
  if (!advised) GTEST_SKIP() << engine_test::kNoHugePageAdvice;
  // 8 MiB of frozen elements, 4 MiB of trainable ones an array.
  StateFixture f(std::size_t{2} << 20, std::size_t{1} << 20,
                 {.offload = OffloadDevice::kHost, .seed = 21});
  Result<std::unique_ptr<OptimizerState>> opened = open_store_state(f.context());
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  OptimizerState& state = **opened;
  const GradTarget grads = state.grad_target();
  ASSERT_EQ(grads.custom, nullptr);
  for (const float* a : {whole_array(state, Piece::kExpAvg), whole_array(state, Piece::kExpAvgSq),
                         static_cast<const float*>(grads.accumulator)}) {
    engine_test::expect_huge_page_advice(f.layout_, a, /*frozen_advised=*/true);
  }
  engine_test::expect_huge_page_advice(f.layout_, whole_array(state, Piece::kParams),
                                       /*frozen_advised=*/false);
}

}  // namespace
}  // namespace zinf
