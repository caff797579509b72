// DeviceOps on HostDevice (opaque, as a GPU's memory is to host code): widen runs the kernel's
// scalar reference in stream order, between the copies around it, on offset device pointers; and
// RegisteredBuffer keeps its memory registered with the device while it lives.
#include "device/device_ops.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <vector>

#include "base/random.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

TEST(DeviceOps, HostOpsWidenInStreamOrderOnOpaqueMemory) {
  HostDeviceOptions options;
  options.opaque = true;
  options.jitter_max_us = 50;  // a missing order would show
  std::unique_ptr<Device> device = std::move(make_host_device(options)).value();
  Result<std::unique_ptr<DeviceOps>> ops = make_device_ops(*device);
  ASSERT_TRUE(ops.is_ok()) << ops.status().to_string();
  std::unique_ptr<Stream> stream = std::move(device->create_stream("ops")).value();
  const std::size_t count = 1029;
  std::vector<float> base(count), values(count);
  fill_uniform(base.data(), count, 5, -2.0f, 2.0f);
  fill_uniform(values.data(), count, 6, -1.0f, 1.0f);
  std::vector<std::uint16_t> half(count);
  convert_f32_to_bf16(values.data(), half.data(), count);
  DeviceBuffer src = std::move(DeviceBuffer::allocate(*device, count * 2)).value();
  DeviceBuffer dst = std::move(DeviceBuffer::allocate(*device, count * 4)).value();
  std::vector<float> copied(count), summed(count);
  for (int round = 0; round < 5; ++round) {
    ASSERT_TRUE(device->copy_h2d(src.data(), half.data(), count * 2, *stream).is_ok());
    // dst[0, 3) stays as base; dst[3, count) = base + widen(src[3, count)).
    ASSERT_TRUE(device->copy_h2d(dst.data(), base.data(), count * 4, *stream).is_ok());
    ASSERT_TRUE((*ops)
                    ->widen(src.as<std::uint16_t>() + 3, DType::kBF16, dst.as<float>() + 3,
                            count - 3, /*accumulate=*/true, *stream)
                    .is_ok());
    ASSERT_TRUE(device->copy_d2h(summed.data(), dst.data(), count * 4, *stream).is_ok());
    ASSERT_TRUE(
        (*ops)->widen(src.data(), DType::kBF16, dst.as<float>(), count, false, *stream).is_ok());
    ASSERT_TRUE(device->copy_d2h(copied.data(), dst.data(), count * 4, *stream).is_ok());
    ASSERT_TRUE(device->synchronize(*stream).is_ok());
    for (std::size_t i = 0; i < count; ++i) {
      const float x = bf16_to_f32(half[i]);
      const float want = i < 3 ? base[i] : base[i] + x;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(summed[i]), std::bit_cast<std::uint32_t>(want))
          << "round " << round << " i=" << i;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(copied[i]), std::bit_cast<std::uint32_t>(x)) << i;
    }
  }
}

TEST(DeviceOps, RegisteredBufferStaysRegisteredWhileItLives) {
  std::unique_ptr<Device> device = std::move(make_host_device()).value();
  Result<RegisteredBuffer> buffer = RegisteredBuffer::allocate(*device, 100);
  ASSERT_TRUE(buffer.is_ok()) << buffer.status().to_string();
  EXPECT_EQ(buffer->bytes(), 4096u);  // whole pages
  // Registered: registering any part again overlaps.
  EXPECT_EQ(device->register_host(buffer->data() + 8, 8).code(), Code::kInvalidArgument);
  RegisteredBuffer moved = std::move(buffer).value();
  std::byte* data = moved.data();
  moved.reset();
  // Unregistered by reset(): unregistering again is refused.
  EXPECT_EQ(device->unregister_host(data).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace zinf
