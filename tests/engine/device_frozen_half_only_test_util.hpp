// What the tests of DeviceOptimizer's frozen runs kept as their half copy alone share, on an
// opaque HostDevice (tests/engine/device_frozen_half_only_test.cpp) and on a GPU
// (tests/gpu/device_optimizer_gpu_test.cpp): a master rounded to a half dtype, a bitwise
// comparison that names the first element that differs, and DeviceOptimizerFrozen
// (device_optimizer_test_util.hpp) with steps and writes of both its optimizers at once; and, for
// the HostDevice tests of failed and timed-out device work (also
// tests/engine/device_optimizer_drain_test.cpp), FaultDevice.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "device/device_ops.hpp"
#include "engine/device_optimizer.hpp"
#include "engine/device_optimizer_test_util.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/status.hpp"

namespace zinf::device_optimizer_test {

// `values` rounded to `half` (kBF16 or kF16) and widened back: each x then equals
// widen(narrow(x)), as a weight loaded from that dtype does.
inline std::vector<float> rounded_to_half(std::vector<float> values, DType half) {
  std::vector<std::uint16_t> bits(values.size());
  if (half == DType::kBF16) {
    convert_f32_to_bf16(values.data(), bits.data(), values.size());
    convert_bf16_to_f32(bits.data(), values.data(), values.size());
  } else {
    convert_f32_to_f16(values.data(), bits.data(), values.size());
    convert_f16_to_f32(bits.data(), values.data(), values.size());
  }
  return values;
}

// An optimizer on `device` told of the frozen runs of `p`, its gradients packed (as
// DeviceOptimizerFrozen's packed_), over `master`.
inline Result<std::unique_ptr<DeviceOptimizer>> make_packed(Device& device, const Partition& p,
                                                            const std::vector<float>& master) {
  return DeviceOptimizer::create(device, p.groups, p.elements, master.data(), kTimeout, p.ranges,
                                 frozen_flags(p), /*pack_grads=*/true);
}

// Fails at the first element of `got` whose bits are not `want`'s, naming it.
inline void expect_bits(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t e = 0; e < got.size(); ++e) {
    ASSERT_EQ(std::memcmp(&got[e], &want[e], sizeof(float)), 0) << "element " << e;
  }
}

// DeviceOptimizerFrozen with steps and master writes of packed_ and full_ together.
class DeviceOptimizerFrozenSteps : public DeviceOptimizerFrozen {
 protected:
  // Steps `first` .. `last` of both optimizers, each after set_grads(grad_seed + step); none after
  // a fatal failure of the test (in a helper too, where it did not end the test).
  void train_both(std::uint64_t grad_seed, std::int64_t first, std::int64_t last) {
    for (std::int64_t step = first; step <= last && !HasFatalFailure(); ++step) {
      set_grads(grad_seed + static_cast<std::uint64_t>(step));
      step_both(step);
    }
  }
  // Writes elements [first, first + count) of `master` into both optimizers' masters.
  void write_both(const std::vector<float>& master, std::size_t first, std::size_t count) {
    for (DeviceOptimizer* o : {packed_.get(), full_.get()}) {
      ASSERT_TRUE(o->write_state(0, first, count, master.data() + first).is_ok())
          << "[" << first << ", " << first + count << ")";
    }
  }
  // Sets element `element` of `master` to `value`, one the half dtype does not hold, and writes it
  // alone into both optimizers: every half-only run of packed_ gets its master back, and every
  // element reads back `master`'s bits.
  void write_inexact(std::vector<float>& master, std::size_t element, float value) {
    master[element] = value;
    ASSERT_NO_FATAL_FAILURE(write_both(master, element, 1));
    EXPECT_EQ(packed_->half_only_elements(), 0u);
    expect_bits(read(*packed_, 0), master);
  }
};

// An opaque HostDevice behind a Device that can fail the n-th device-to-device copy or memset
// issued through it from now on (kInternal, nothing queued), and put a gate in front of the next
// work issued on a stream: that stream's later work waits until the test opens it, as work on a
// GPU stream that outlasts the timeout does. Its device ops are the HostDevice's, issued on it
// directly (neither failed nor gated). Unless fail_nth() arms it, nothing fails.
class FaultDevice final : public Device {
 public:
  explicit FaultDevice(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}
  Device& inner() { return *inner_; }
  // The `nth` (from 1) device-to-device copy from now on fails, or memset with `memsets`.
  void fail_nth(int nth, bool memsets) {
    fail_in_ = nth;
    fail_memsets_ = memsets;
  }
  void close() { closed_ = true; }
  void open() { gate_.set_value(); }

  DeviceKind kind() const override { return inner_->kind(); }
  std::string_view name() const override { return inner_->name(); }
  bool host_accessible() const override { return inner_->host_accessible(); }
  Result<void*> allocate(std::size_t bytes) override { return inner_->allocate(bytes); }
  Status free(void* ptr) override { return inner_->free(ptr); }
  Result<void*> allocate_async(std::size_t bytes, Stream& s) override {
    return inner_->allocate_async(bytes, s);
  }
  Status free_async(void* ptr, Stream& s) override { return inner_->free_async(ptr, s); }
  std::size_t memory_used_bytes() const override { return inner_->memory_used_bytes(); }
  std::size_t memory_limit_bytes() const override { return inner_->memory_limit_bytes(); }
  Status register_host(void* ptr, std::size_t bytes) override {
    return inner_->register_host(ptr, bytes);
  }
  Status unregister_host(void* ptr) override { return inner_->unregister_host(ptr); }
  Result<std::unique_ptr<Stream>> create_stream(std::string_view name) override {
    return inner_->create_stream(name);
  }
  Result<std::unique_ptr<Event>> create_event() override { return inner_->create_event(); }
  Status record(Event& e, Stream& s) override { return inner_->record(e, s); }
  Status wait(Stream& s, Event& e) override { return inner_->wait(s, e); }
  Result<bool> query(Event& e) override { return inner_->query(e); }
  Status synchronize(Event& e, std::chrono::milliseconds timeout) override {
    return inner_->synchronize(e, timeout);
  }
  Status synchronize(Stream& s, std::chrono::milliseconds timeout) override {
    return inner_->synchronize(s, timeout);
  }
  Status copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                    Stream& s) override {
    if (kind == CopyKind::kDeviceToDevice && !fail_memsets_) ZINF_RETURN_IF_ERROR(count_down());
    ZINF_RETURN_IF_ERROR(gate(s));
    return inner_->copy_async(dst, src, bytes, kind, s);
  }
  Status memset_async(void* dst, int value, std::size_t bytes, Stream& s) override {
    if (fail_memsets_) ZINF_RETURN_IF_ERROR(count_down());
    ZINF_RETURN_IF_ERROR(gate(s));
    return inner_->memset_async(dst, value, bytes, s);
  }
  Status launch_host_func(Stream& s, HostFunc func, void* user) override {
    ZINF_RETURN_IF_ERROR(gate(s));
    return inner_->launch_host_func(s, func, user);
  }

 private:
  Status count_down() {
    if (fail_in_ == 0 || --fail_in_ > 0) return Status::ok();
    return Status::internal("injected: this operation fails to queue");
  }
  Status gate(Stream& s) {
    if (!closed_) return Status::ok();
    closed_ = false;
    return inner_->launch_host_func(
        s,
        [](void* user, const Status&) {
          static_cast<std::shared_future<void>*>(user)->wait();
          return Status::ok();
        },
        &opened_);
  }
  std::unique_ptr<Device> inner_;
  int fail_in_ = 0;  // the operations of the armed kind left up to the failing one; 0: none
  bool fail_memsets_ = false;
  bool closed_ = false;
  std::promise<void> gate_;
  std::shared_future<void> opened_ = gate_.get_future().share();
};

// Opens `device`: a FaultDevice over an opaque HostDevice, with the DeviceOps factory set to give
// it its HostDevice's ops (the test resets the factory with set_device_ops_factory(nullptr)).
inline void open_fault_device(std::unique_ptr<FaultDevice>& device) {
  HostDeviceOptions options;
  options.opaque = true;
  auto inner = make_host_device(options);
  ASSERT_TRUE(inner.is_ok()) << inner.status().to_string();
  device = std::make_unique<FaultDevice>(std::move(inner).value());
  set_device_ops_factory([](Device& d) -> std::unique_ptr<DeviceOps> {
    auto* faulty = dynamic_cast<FaultDevice*>(&d);
    if (faulty == nullptr) return nullptr;
    auto ops = make_device_ops(faulty->inner());
    return ops.is_ok() ? std::move(ops).value() : nullptr;
  });
}

// A test on a FaultDevice opened by open_fault_device (device_, the factory reset after the test),
// holding before_bytes_ of device memory before the test's own, with optimizers of kElements
// elements waiting kWait.
class FaultDeviceTest : public ::testing::Test {
 protected:
  static constexpr std::size_t kElements = 4096;
  static constexpr std::chrono::milliseconds kWait{400};

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(open_fault_device(device_));
    before_bytes_ = device_->memory_used_bytes();
  }
  void TearDown() override { set_device_ops_factory(nullptr); }

  std::unique_ptr<FaultDevice> device_;
  std::size_t before_bytes_ = 0;
};

}  // namespace zinf::device_optimizer_test
