// DeviceOptimizer's failure paths that queued device work into buffers of their own: giving the
// half-only runs their master back (restore_masters) and allocating the whole partition's
// moments (unpack), when a copy or memset fails to queue after others were queued. The call
// returns that error with nothing changed, and the new buffers go only once the work queued into
// them can no longer write there: at once when the wait for the stream succeeds, else (the
// stream held past the timeout) with the optimizer, after its own wait. The failed waits
// themselves are tested in device_frozen_half_only_test.cpp (DeviceFrozenHalfOnlyTimeout).
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "device/device_ops.hpp"
#include "engine/device_frozen_half_only_test_util.hpp"
#include "engine/device_optimizer.hpp"
#include "engine/engine_test_util.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/status.hpp"

namespace zinf {
namespace {

using device_optimizer_test::FaultDeviceTest;
using device_optimizer_test::rounded_to_half;
using engine_test::seeded;

// A DeviceOptimizer of one bf16 group of kElements: [0, 1024) and [2048, kElements) trainable,
// [1024, 2048) frozen, on a FaultDevice, waiting kWait.
class DeviceOptimizerDrain : public FaultDeviceTest {
 protected:
  std::unique_ptr<DeviceOptimizer> make(const std::vector<float>& master) {
    auto made = DeviceOptimizer::create(*device_, {{0, kElements, 0, DType::kBF16}}, kElements,
                                        master.data(), kWait, {{0, 0}, {1024, 1}, {2048, 0}},
                                        {false, true, false});
    EXPECT_TRUE(made.is_ok()) << made.status().to_string();
    return made.is_ok() ? std::move(made).value() : nullptr;
  }
  // Piece `which` of `o`, read back whole.
  std::vector<float> read(DeviceOptimizer& o, int which) {
    std::vector<float> out(kElements);
    const Status s = o.read_state(which, 0, kElements, out.data());
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    return out;
  }
  // Writes `value` into element 1500 (the frozen run) of piece `which`, failing to queue as armed:
  // the call returns the injected error after at most one wait.
  void expect_injected_failure(DeviceOptimizer& o, int which, float value) {
    const auto start = std::chrono::steady_clock::now();
    const Status s = o.write_state(which, 1500, 1, &value);
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_EQ(s.code(), Code::kInternal) << s.to_string();
    EXPECT_NE(s.message().find("injected"), std::string::npos) << s.to_string();
    EXPECT_LT(waited, kWait * 2) << "waited twice";
  }
};

// A master write that bf16 does not hold into the half-only run: the copy of the second run with
// a master into the new master fails to queue after the first run's copy and the half-only
// run's widen were queued. The stream drains: the new master is freed at once, and the run stays
// half-only with its bits.
TEST_F(DeviceOptimizerDrain, ARestoreThatFailsToQueueFreesItsMasterOnceDrained) {
  const std::vector<float> master =
      rounded_to_half(seeded(kElements, 8601, -1.0f, 1.0f), DType::kBF16);
  std::unique_ptr<DeviceOptimizer> o = make(master);
  ASSERT_NE(o, nullptr);
  ASSERT_EQ(o->half_only_elements(), 1024u);
  const std::size_t held = device_->memory_used_bytes();
  const std::uint64_t bytes = o->device_bytes();
  device_->fail_nth(2, /*memsets=*/false);
  expect_injected_failure(*o, 0, 0.1f);  // 0.1 is not a bf16 value
  EXPECT_EQ(device_->memory_used_bytes(), held);
  EXPECT_EQ(o->half_only_elements(), 1024u);
  EXPECT_EQ(o->device_bytes(), bytes);
  EXPECT_EQ(std::memcmp(read(*o, 0).data(), master.data(), kElements * sizeof(float)), 0);
}

// The same with the stream held past the timeout from the first copy on: the wait after the
// failure times out, so the new master, which the queued copy and widen still write, stays
// allocated until the optimizer, gone after the work has run, frees it. The call returns the
// error that failed it, not the timeout.
TEST_F(DeviceOptimizerDrain, ARestoreThatFailsToQueueOnAHeldStreamKeepsItsMaster) {
  const std::vector<float> master =
      rounded_to_half(seeded(kElements, 8602, -1.0f, 1.0f), DType::kBF16);
  {
    std::unique_ptr<DeviceOptimizer> o = make(master);
    ASSERT_NE(o, nullptr);
    ASSERT_EQ(o->half_only_elements(), 1024u);
    const std::size_t held = device_->memory_used_bytes();
    device_->fail_nth(2, /*memsets=*/false);
    device_->close();
    expect_injected_failure(*o, 0, 0.1f);
    // The new master (the whole partition's) is still allocated.
    EXPECT_EQ(device_->memory_used_bytes(), held + kElements * sizeof(float));
    EXPECT_EQ(o->half_only_elements(), 1024u);
    device_->open();
  }
  EXPECT_EQ(device_->memory_used_bytes(), before_bytes_);
}

// Non-zero exp_avg written into the frozen run (the master drawn: no half-only run): the zeroing
// of exp_avg_sq's new array fails to queue after exp_avg's zeroing and copies were queued. The
// stream drains: both new arrays are freed at once, and the moments stay packed, reading back
// zeros.
TEST_F(DeviceOptimizerDrain, AnUnpackThatFailsToQueueFreesItsMomentsOnceDrained) {
  std::unique_ptr<DeviceOptimizer> o = make(seeded(kElements, 8603, -1.0f, 1.0f));
  ASSERT_NE(o, nullptr);
  ASSERT_EQ(o->half_only_elements(), 0u);
  const std::size_t held = device_->memory_used_bytes();
  const std::uint64_t bytes = o->device_bytes();
  device_->fail_nth(2, /*memsets=*/true);
  expect_injected_failure(*o, 1, 0.25f);
  EXPECT_EQ(device_->memory_used_bytes(), held);
  EXPECT_TRUE(o->packed());
  EXPECT_EQ(o->device_bytes(), bytes);
  for (int which = 1; which <= 2; ++which) {
    EXPECT_EQ(read(*o, which), std::vector<float>(kElements, 0.0f)) << "piece " << which;
  }
}

// The same with the stream held past the timeout from the first zeroing on: both new moment
// arrays stay allocated until the optimizer goes.
TEST_F(DeviceOptimizerDrain, AnUnpackThatFailsToQueueOnAHeldStreamKeepsItsMoments) {
  {
    std::unique_ptr<DeviceOptimizer> o = make(seeded(kElements, 8604, -1.0f, 1.0f));
    ASSERT_NE(o, nullptr);
    const std::size_t held = device_->memory_used_bytes();
    device_->fail_nth(2, /*memsets=*/true);
    device_->close();
    expect_injected_failure(*o, 1, 0.25f);
    EXPECT_EQ(device_->memory_used_bytes(), held + 2 * kElements * sizeof(float));
    EXPECT_TRUE(o->packed());
    device_->open();
  }
  EXPECT_EQ(device_->memory_used_bytes(), before_bytes_);
}

}  // namespace
}  // namespace zinf
