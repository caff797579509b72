// DeviceOptimizer's packed gradients on a GPU (tests/engine/device_optimizer_test.cpp runs the
// same fixture on an opaque HostDevice): an optimizer that keeps no gradients for a group of
// frozen runs only, the groups after it packed past an alignment gap, steps the same bits through
// CUDA's kernels as one that keeps gradients for the whole partition, and its norm over the
// packed accumulator, whose fp32 block sums fall on other elements than over the whole partition,
// is the full one's to float rounding (printed, with the difference). Over a master bf16 holds
// exactly, the bf16 groups' frozen runs keep no fp32 master ("half-only"); one element bf16 does
// not hold, written alone, gives them their masters back, widened from their half copies by
// CUDA's widen kernel into the new packed master: every other element reads back its bits, and
// steps give the full optimizer's. Without a CUDA device the tests skip with the reason.
#include <gtest/gtest.h>

#if defined(ZINF_HAVE_CUDA)

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/device_frozen_half_only_test_util.hpp"
#include "engine/device_optimizer_test_util.hpp"
#include "zinf/device.hpp"

namespace zinf {
namespace {

using device_optimizer_test::DeviceOptimizerFrozenSteps;
using device_optimizer_test::kPartition;
using device_optimizer_test::rounded_to_half;
using device_optimizer_test::seeded;

class DeviceOptimizerFrozenCuda : public DeviceOptimizerFrozenSteps {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<Device>> cuda = make_cuda_device(0);
    if (!cuda.is_ok()) GTEST_SKIP() << "no CUDA device: " << cuda.status().to_string();
    device_ = std::move(cuda).value();
    DeviceOptimizerFrozenSteps::SetUp();
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

// The fixture over seeded values rounded to bf16.
class DeviceOptimizerHalfOnlyCuda : public DeviceOptimizerFrozenCuda {
 protected:
  void SetUp() override {
    master_ = rounded_to_half(seeded(kPartition, 960, -1.0f, 1.0f), DType::kBF16);
    DeviceOptimizerFrozenCuda::SetUp();
  }
};

TEST_F(DeviceOptimizerHalfOnlyCuda, WidenedMastersKeepTheirBits) {
  // The frozen runs of the bf16 groups: [1024, 2048), [4000, 6003), [9003, 11'003), [13'006,
  // 14'011).
  EXPECT_EQ(packed_->half_only_elements(), std::size_t{1024 + 2003 + 2000 + 1005});
  train_both(970, 1, 2);
  std::vector<float> master = read(*full_, 0);
  EXPECT_EQ(std::memcmp(read(*packed_, 0).data(), master.data(), master.size() * 4), 0);
  write_inexact(master, 10'500, std::nextafter(master[10'500], 2.0f));  // one bit below bf16's
  train_both(970, 3, 4);
  expect_same("masters widened on the GPU, two steps");
}

}  // namespace
}  // namespace zinf

#else  // !ZINF_HAVE_CUDA

TEST(DeviceOptimizerFrozenCuda, NeedsCuda) {
  GTEST_SKIP() << "no CUDA device: zinf was built without CUDA";
}

TEST(DeviceOptimizerHalfOnlyCuda, NeedsCuda) {
  GTEST_SKIP() << "no CUDA device: zinf was built without CUDA";
}

#endif
