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

// The master's host array, which read_state() hands over in place but for the sub-groups whose
// half copy holds their master (each widened into a scratch block): its last call's values.
const float* master_array(OptimizerState& state) {
  const float* out = nullptr;
  const Status st =
      state.read_state(Piece::kParams, [&](std::size_t first, std::size_t, const float* v) {
        out = v - first;
        return Status::ok();
      });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return out;
}

// bf16 modules, the optimizer state in host memory: the frozen sub-group's master is advised off
// transparent huge pages where the half copy holds it exactly (load() never writes it), and not
// where it does not (load() writes it in full: with THP "always", 4 KiB pages for all of it would
// cost a page fault each and the page tables); the moments' and gradients' frozen part is
// advised either way.
TEST(StoreStateMemory, TheMasterIsAdvisedOffHugePagesOnlyWhereTheHalfCopyHoldsIt) {
  const bool advised = engine_test::kernel_advises_no_huge_pages();
  if (HasFailure()) return;  // the probe's mapping was refused: not a reason to skip
  if (!advised) GTEST_SKIP() << engine_test::kNoHugePageAdvice;
  for (bool exact : {false, true}) {
    SCOPED_TRACE(exact ? "base exact in bf16" : "base not exact in bf16");
    // 8 MiB of frozen master, 4 MiB of trainable master.
    StateFixture f(
        std::size_t{2} << 20, std::size_t{1} << 20,
        {.offload = OffloadDevice::kHost, .seed = 23, .dtype = DType::kBF16, .base_exact = exact});
    Result<std::unique_ptr<OptimizerState>> opened = open_store_state(f.context());
    ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
    OptimizerState& state = **opened;
    engine_test::expect_huge_page_advice(f.layout_, master_array(state), /*frozen_advised=*/exact);
    engine_test::expect_huge_page_advice(f.layout_, whole_array(state, Piece::kExpAvg),
                                         /*frozen_advised=*/true);
  }
}

}  // namespace
}  // namespace zinf
