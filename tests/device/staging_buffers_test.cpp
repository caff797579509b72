#include "device/staging_buffers.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <vector>

#include "base/random.hpp"
#include "device/host_device.hpp"
#include "zinf/device.hpp"

namespace zinf {
namespace {

std::unique_ptr<Device> strict_device() {
  HostDeviceOptions options;
  options.opaque = true;
  options.require_registered_host = true;
  return std::move(make_host_device(options)).value();
}

TEST(StagingBuffers, ReusesRegisteredBuffersAndStaysBounded) {
  std::unique_ptr<Device> device = strict_device();
  auto& host = static_cast<HostDevice&>(*device);
  StagingBuffers staging(*device);
  // Two collectives' worth in flight, then returned, over and over: registered once.
  for (int round = 0; round < 50; ++round) {
    RegisteredBuffer a = std::move(staging.take(100'000)).value();
    RegisteredBuffer b = std::move(staging.take(4'000)).value();
    EXPECT_GE(a.bytes(), 100'000u);
    EXPECT_GE(b.bytes(), StagingBuffers::kMinBytes);
    EXPECT_TRUE(host.registered(a.data(), a.bytes()));
    EXPECT_TRUE(host.registered(b.data(), b.bytes()));
    staging.give_back(std::move(a));
    staging.give_back(std::move(b));
  }
  EXPECT_EQ(staging.registered_count(), 2u);
  // A larger request than any free buffer registers a new one; the smallest fitting is reused.
  RegisteredBuffer big = std::move(staging.take(1'000'000)).value();
  EXPECT_EQ(staging.registered_count(), 3u);
  RegisteredBuffer fits = std::move(staging.take(70'000)).value();
  EXPECT_EQ(fits.bytes(), 128u << 10);  // 100'000 rounded up to 2^17, not the 1 MB one
  staging.give_back(std::move(big));
  staging.give_back(std::move(fits));
  // Many returned at once: no more than kMaxFree stay registered while free.
  std::vector<RegisteredBuffer> held;
  for (std::size_t i = 0; i < StagingBuffers::kMaxFree + 4; ++i) {
    held.push_back(std::move(staging.take(std::size_t{1} << (16 + i % 6))).value());
  }
  for (RegisteredBuffer& b : held) staging.give_back(std::move(b));
  EXPECT_EQ(staging.free_count(), StagingBuffers::kMaxFree);
}

TEST(HostDeviceRequireRegistered, CopiesFromPageableMemoryFailNamingTheCopy) {
  std::unique_ptr<Device> device = strict_device();
  std::unique_ptr<Stream> stream = std::move(device->create_stream("s")).value();
  void* on_device = std::move(device->allocate(4096)).value();
  std::vector<std::byte> pageable(4096);
  fill_random_bytes(pageable.data(), pageable.size(), 11);
  Status refused = device->copy_h2d(on_device, pageable.data(), 4096, *stream);
  EXPECT_EQ(refused.code(), Code::kFailedPrecondition);
  EXPECT_NE(refused.message().find("host-to-device copy of 4096 bytes"), std::string::npos)
      << refused.to_string();
  EXPECT_NE(refused.message().find("not registered"), std::string::npos);
  // Registered memory copies, both ways, and the bytes arrive.
  RegisteredBuffer in = std::move(RegisteredBuffer::allocate(*device, 4096)).value();
  RegisteredBuffer out = std::move(RegisteredBuffer::allocate(*device, 4096)).value();
  std::memcpy(in.data(), pageable.data(), 4096);
  ASSERT_TRUE(device->copy_h2d(on_device, in.data(), 4096, *stream).is_ok());
  ASSERT_TRUE(device->copy_d2h(out.data(), on_device, 4096, *stream).is_ok());
  // A range that runs past the registered buffer's end is refused too.
  EXPECT_FALSE(device->copy_d2h(out.data() + 1, on_device, out.bytes(), *stream).is_ok());
  ASSERT_TRUE(device->synchronize(*stream, std::chrono::seconds(10)).is_ok());
  EXPECT_EQ(std::memcmp(out.data(), pageable.data(), 4096), 0);
  ASSERT_TRUE(device->free(on_device).is_ok());
}

}  // namespace
}  // namespace zinf
