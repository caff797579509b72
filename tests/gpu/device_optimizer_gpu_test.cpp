// DeviceOptimizer's packed gradients on a GPU (tests/engine/device_optimizer_test.cpp runs the
// same fixture on an opaque HostDevice): an optimizer that keeps no gradients for a group of
// frozen runs only, the groups after it packed past an alignment gap, steps the same bits through
// CUDA's kernels as one that keeps gradients for the whole partition, and its norm over the
// packed accumulator, whose fp32 block sums fall on other elements than over the whole partition,
// is the full one's to float rounding (printed, with the difference). Without a CUDA device the
// test skips with the reason.
#include <gtest/gtest.h>

#if defined(ZINF_HAVE_CUDA)

#include <cstdint>
#include <cstdio>
#include <memory>

#include "engine/device_optimizer_test_util.hpp"
#include "zinf/device.hpp"

namespace zinf {
namespace {

using device_optimizer_test::DeviceOptimizerFrozen;

class DeviceOptimizerFrozenCuda : public DeviceOptimizerFrozen {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<Device>> cuda = make_cuda_device(0);
    if (!cuda.is_ok()) GTEST_SKIP() << "no CUDA device: " << cuda.status().to_string();
    device_ = std::move(cuda).value();
    DeviceOptimizerFrozen::SetUp();
  }
};

TEST_F(DeviceOptimizerFrozenCuda, PackedGradientsStepTheSameBits) {
  ASSERT_EQ(packed_->grad_offsets(),
            (std::vector<std::size_t>{0, DeviceOptimizer::kNoGrad, 4003, 7003}));
  for (std::int64_t step = 1; step <= 3; ++step) {
    set_grads(950 + static_cast<std::uint64_t>(step));
    const double packed = packed_->sum_of_squares().value();
    const double full = full_->sum_of_squares().value();
    std::printf("step %lld: sum of squares packed %.9g, full %.9g, difference %.3g\n",
                static_cast<long long>(step), packed, full, packed - full);
    EXPECT_NEAR(packed, full, 1e-6 * full);
    step_both(step);
  }
  expect_same("three steps on the GPU");
}

}  // namespace
}  // namespace zinf

#else  // !ZINF_HAVE_CUDA

TEST(DeviceOptimizerFrozenCuda, NeedsCuda) {
  GTEST_SKIP() << "no CUDA device: zinf was built without CUDA";
}

#endif
