// HostDevice against what a user of a GPU stream API expects: memory, copies, stream order,
// event ordering across streams (with jitter, and a negative control that shows a missing wait
// being caught), timeouts, sticky errors and the bounded queue.
#include "device/host_device.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "base/random.hpp"
#include "zinf/device.hpp"

namespace zinf {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<Device> make_device(HostDeviceOptions options = {}) {
  Result<std::unique_ptr<Device>> device = make_host_device(options);
  EXPECT_TRUE(device.is_ok()) << device.status().to_string();
  return std::move(device).value();
}

std::unique_ptr<Stream> make_stream(Device& device, std::string_view name = "s") {
  Result<std::unique_ptr<Stream>> stream = device.create_stream(name);
  EXPECT_TRUE(stream.is_ok()) << stream.status().to_string();
  return std::move(stream).value();
}

std::unique_ptr<Event> make_event(Device& device) {
  Result<std::unique_ptr<Event>> event = device.create_event();
  EXPECT_TRUE(event.is_ok()) << event.status().to_string();
  return std::move(event).value();
}

std::vector<float> random_floats(std::size_t count, std::uint64_t seed) {
  std::vector<float> values(count);
  fill_uniform(values.data(), count, seed);
  return values;
}

TEST(HostDevice, AllocatesAlignedPoisonedMemoryWithinItsLimit) {
  HostDeviceOptions options;
  options.memory_limit_bytes = 1 << 20;
  auto device = make_device(options);
  EXPECT_EQ(device->kind(), DeviceKind::kHost);
  EXPECT_EQ(device->name(), "host:0");
  EXPECT_TRUE(device->host_accessible());

  Result<void*> a = device->allocate(1000);
  ASSERT_TRUE(a.is_ok());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(*a) % 256, 0u);
  // Unwritten device memory reads as NaN in every dtype, so uses of it show up.
  const auto* bytes = static_cast<const std::uint8_t*>(*a);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(bytes[i], 0xff);
  EXPECT_EQ(device->memory_used_bytes(), 1000u);

  Result<void*> too_big = device->allocate((1 << 20) - 999);
  ASSERT_FALSE(too_big.is_ok());
  EXPECT_EQ(too_big.status().code(), Code::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("memory limit"), std::string_view::npos);
  EXPECT_EQ(device->allocate(0).status().code(), Code::kInvalidArgument);

  int not_device = 0;
  EXPECT_EQ(device->free(&not_device).code(), Code::kInvalidArgument);
  EXPECT_TRUE(device->free(*a).is_ok());
  EXPECT_EQ(device->free(*a).code(), Code::kInvalidArgument);  // double free
  EXPECT_EQ(device->memory_used_bytes(), 0u);

  Result<DeviceBuffer> buffer = DeviceBuffer::allocate(*device, 4096);
  ASSERT_TRUE(buffer.is_ok());
  EXPECT_EQ(device->memory_used_bytes(), 4096u);
  buffer->reset();
  EXPECT_EQ(device->memory_used_bytes(), 0u);
}

TEST(HostDevice, CopiesRoundTripAndRejectPointersOutsideDeviceMemory) {
  auto device = make_device();
  auto stream = make_stream(*device);
  const std::size_t count = 10007;
  const std::vector<float> host = random_floats(count, 11);
  std::vector<float> back(count, 0.0f);
  Result<DeviceBuffer> a = DeviceBuffer::allocate(*device, count * 4);
  Result<DeviceBuffer> b = DeviceBuffer::allocate(*device, count * 4);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  ASSERT_TRUE(device->copy_h2d(a->data(), host.data(), count * 4, *stream).is_ok());
  ASSERT_TRUE(device->copy_d2d(b->data(), a->data(), count * 4, *stream).is_ok());
  ASSERT_TRUE(device->memset_async(a->data(), 0, count * 4, *stream).is_ok());
  ASSERT_TRUE(device->copy_d2h(back.data(), b->data(), count * 4, *stream).is_ok());
  ASSERT_TRUE(device->synchronize(*stream).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), host.data(), count * 4), 0);
  for (std::size_t i = 0; i < count; ++i) ASSERT_EQ(a->as<float>()[i], 0.0f);

  // Past the end of the allocation, and a host pointer where a device one belongs.
  Status past = device->copy_h2d(a->data(), host.data(), count * 4 + 4, *stream);
  EXPECT_EQ(past.code(), Code::kInvalidArgument);
  EXPECT_NE(past.message().find("host-to-device"), std::string_view::npos) << past.to_string();
  EXPECT_EQ(device->copy_d2h(back.data(), host.data(), 4, *stream).code(), Code::kInvalidArgument);
  EXPECT_EQ(device->memset_async(back.data(), 0, 4, *stream).code(), Code::kInvalidArgument);
  EXPECT_EQ(device->copy_d2d(a->data(), a->as<std::byte>() + 4, 8, *stream).code(),
            Code::kInvalidArgument);  // overlap
}

TEST(HostDevice, OneStreamRunsItsWorkInIssueOrder) {
  HostDeviceOptions options;
  options.jitter_max_us = 50;
  options.jitter_seed = 7;
  auto device = make_device(options);
  auto stream = make_stream(*device);
  std::vector<int> order;
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(device
                    ->launch_host(*stream,
                                  [&order, i] {
                                    order.push_back(i);
                                    return Status::ok();
                                  })
                    .is_ok());
  }
  ASSERT_TRUE(device->synchronize(*stream).is_ok());
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(order[static_cast<std::size_t>(i)], i);
}

// The producer fills a device buffer slowly on one stream; the consumer copies it out on
// another. With the event wait the consumer always sees the data; without it, it sees the
// poison, which is how a missing wait shows up in tests instead of passing by luck.
TEST(HostDevice, EventsOrderWorkAcrossStreams) {
  HostDeviceOptions options;
  options.jitter_max_us = 200;
  options.jitter_seed = 3;
  auto device = make_device(options);
  auto producer = make_stream(*device, "producer");
  auto consumer = make_stream(*device, "consumer");
  auto ready = make_event(*device);
  const std::size_t count = 4096;
  Result<DeviceBuffer> buffer = DeviceBuffer::allocate(*device, count * 4);
  ASSERT_TRUE(buffer.is_ok());
  std::vector<float> back(count);
  for (int round = 0; round < 20; ++round) {
    const std::vector<float> host = random_floats(count, 100 + static_cast<std::uint64_t>(round));
    ASSERT_TRUE(device->memset_async(buffer->data(), 0xff, count * 4, *producer).is_ok());
    ASSERT_TRUE(device
                    ->launch_host(*producer,
                                  [] {
                                    std::this_thread::sleep_for(std::chrono::microseconds(300));
                                    return Status::ok();
                                  })
                    .is_ok());
    ASSERT_TRUE(device->copy_h2d(buffer->data(), host.data(), count * 4, *producer).is_ok());
    ASSERT_TRUE(device->record(*ready, *producer).is_ok());
    ASSERT_TRUE(device->wait(*consumer, *ready).is_ok());
    ASSERT_TRUE(device->copy_d2h(back.data(), buffer->data(), count * 4, *consumer).is_ok());
    ASSERT_TRUE(device->synchronize(*consumer).is_ok());
    ASSERT_EQ(std::memcmp(back.data(), host.data(), count * 4), 0) << "round " << round;
  }

  // Negative control: the same without the wait reads the buffer before the producer wrote it.
  // (The producer is held back by a flag rather than a sleep, so the outcome is certain and the
  // two streams never touch the buffer at the same time.)
  const std::vector<float> host = random_floats(count, 999);
  std::atomic<bool> release{false};
  ASSERT_TRUE(device
                  ->launch_host(*producer,
                                [&release] {
                                  while (!release.load()) std::this_thread::yield();
                                  return Status::ok();
                                })
                  .is_ok());
  ASSERT_TRUE(device->copy_h2d(buffer->data(), host.data(), count * 4, *producer).is_ok());
  ASSERT_TRUE(device->copy_d2h(back.data(), buffer->data(), count * 4, *consumer).is_ok());
  ASSERT_TRUE(device->synchronize(*consumer).is_ok());
  EXPECT_NE(std::memcmp(back.data(), host.data(), count * 4), 0);
  release = true;
  ASSERT_TRUE(device->synchronize(*producer).is_ok());
}

TEST(HostDevice, EventQueryAndSynchronizeHonourTheirTimeout) {
  auto device = make_device();
  auto stream = make_stream(*device);
  auto event = make_event(*device);
  Result<bool> fresh = device->query(*event);
  ASSERT_TRUE(fresh.is_ok());
  EXPECT_TRUE(*fresh);  // never recorded: complete, as in CUDA
  EXPECT_TRUE(device->synchronize(*event, milliseconds(0)).is_ok());

  std::atomic<bool> release{false};
  ASSERT_TRUE(device
                  ->launch_host(*stream,
                                [&release] {
                                  while (!release.load()) std::this_thread::yield();
                                  return Status::ok();
                                })
                  .is_ok());
  ASSERT_TRUE(device->record(*event, *stream).is_ok());
  Result<bool> pending = device->query(*event);
  ASSERT_TRUE(pending.is_ok());
  EXPECT_FALSE(*pending);
  const auto start = std::chrono::steady_clock::now();
  Status timed_out = device->synchronize(*event, milliseconds(30));
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(timed_out.code(), Code::kTimeout);
  EXPECT_GE(waited, milliseconds(25));
  EXPECT_LT(waited, milliseconds(5000));
  EXPECT_EQ(device->synchronize(*stream, milliseconds(1)).code(), Code::kTimeout);
  release = true;
  EXPECT_TRUE(device->synchronize(*event).is_ok());
  Result<bool> done = device->query(*event);
  ASSERT_TRUE(done.is_ok());
  EXPECT_TRUE(*done);
}

TEST(HostDevice, AFailureIsStickyAndFlowsAlongEventWaits) {
  auto device = make_device();
  auto first = make_stream(*device, "first");
  auto second = make_stream(*device, "second");
  auto after_failure = make_event(*device);
  Result<DeviceBuffer> buffer = DeviceBuffer::allocate(*device, 64);
  ASSERT_TRUE(buffer.is_ok());
  const std::vector<float> ones(16, 1.0f);
  const std::vector<float> twos(16, 2.0f);
  ASSERT_TRUE(device->copy_h2d(buffer->data(), ones.data(), 64, *first).is_ok());
  ASSERT_TRUE(
      device->launch_host(*first, [] { return Status::io_error("read shard 3 failed"); }).is_ok());
  ASSERT_TRUE(device->copy_h2d(buffer->data(), twos.data(), 64, *first).is_ok());
  int ran_after_failure = 0;
  ASSERT_TRUE(device
                  ->launch_host(*first,
                                [&] {
                                  ++ran_after_failure;
                                  return Status::ok();
                                })
                  .is_ok());
  ASSERT_TRUE(device->record(*after_failure, *first).is_ok());
  ASSERT_TRUE(device->wait(*second, *after_failure).is_ok());
  int ran_on_second = 0;
  ASSERT_TRUE(device
                  ->launch_host(*second,
                                [&] {
                                  ++ran_on_second;
                                  return Status::ok();
                                })
                  .is_ok());

  Status first_status = device->synchronize(*first);
  EXPECT_EQ(first_status.code(), Code::kIoError);
  EXPECT_NE(first_status.message().find("read shard 3"), std::string_view::npos);
  EXPECT_EQ(device->synchronize(*after_failure).code(), Code::kIoError);
  EXPECT_EQ(device->query(*after_failure).status().code(), Code::kIoError);
  Status second_status = device->synchronize(*second);
  EXPECT_EQ(second_status.code(), Code::kIoError);
  EXPECT_NE(second_status.message().find("second"), std::string_view::npos);
  // The work after the failure did not run: the buffer still holds the ones.
  EXPECT_EQ(ran_after_failure, 0);
  EXPECT_EQ(ran_on_second, 0);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(buffer->as<float>()[i], 1.0f);
  // Still failed later: the error is sticky.
  EXPECT_EQ(device->synchronize(*first).code(), Code::kIoError);
}

TEST(HostDevice, AFullStreamQueueBlocksTheIssuer) {
  HostDeviceOptions options;
  options.stream_queue_depth = 2;
  auto device = make_device(options);
  auto stream = make_stream(*device);
  std::atomic<bool> release{false};
  std::atomic<int> ran{0};
  ASSERT_TRUE(device
                  ->launch_host(*stream,
                                [&] {
                                  while (!release.load()) std::this_thread::yield();
                                  return Status::ok();
                                })
                  .is_ok());
  std::atomic<int> issued{0};
  std::thread issuer([&] {
    for (int i = 0; i < 5; ++i) {
      EXPECT_TRUE(device
                      ->launch_host(*stream,
                                    [&] {
                                      ++ran;
                                      return Status::ok();
                                    })
                      .is_ok());
      ++issued;
    }
  });
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(issued.load(), 1);  // one slot held by the blocker, one queued, then it waits
  release = true;
  issuer.join();
  ASSERT_TRUE(device->synchronize(*stream).is_ok());
  EXPECT_EQ(ran.load(), 5);
}

TEST(HostDevice, StreamOrderedAllocationAndFree) {
  auto device = make_device();
  auto stream = make_stream(*device);
  Result<void*> block = device->allocate_async(512, *stream);
  ASSERT_TRUE(block.is_ok());
  const std::vector<float> host = random_floats(128, 5);
  std::vector<float> back(128);
  ASSERT_TRUE(device->copy_h2d(*block, host.data(), 512, *stream).is_ok());
  ASSERT_TRUE(device->copy_d2h(back.data(), *block, 512, *stream).is_ok());
  ASSERT_TRUE(device->free_async(*block, *stream).is_ok());
  EXPECT_EQ(device->free_async(*block, *stream).code(), Code::kInvalidArgument);
  EXPECT_EQ(device->free(*block).code(), Code::kInvalidArgument);
  ASSERT_TRUE(device->synchronize(*stream).is_ok());
  EXPECT_EQ(back, host);
  EXPECT_EQ(device->memory_used_bytes(), 0u);
}

// An MPI receive left open after its collective failed may still write the caller's buffer
// (MpiComm, unstaged on a host device): freeing it must not give the memory back while that
// writer lives. The writer here is a thread that writes the block after its owner freed it; under
// AddressSanitizer a released block would be a use after free.
TEST(HostDevice, MemoryAWriterMayStillWriteIsKeptPastItsFreeUntilTheWriterEnds) {
  auto device = make_device();
  auto* host = static_cast<HostDevice*>(device.get());
  Result<void*> kept = device->allocate(4096);
  Result<void*> other = device->allocate(1000);
  ASSERT_TRUE(kept.is_ok() && other.is_ok());
  auto writer = std::make_shared<int>(0);
  // The writer's range is a piece inside the allocation, as one peer's part of an all-gather.
  host->keep_while(static_cast<std::byte*>(*kept) + 1024, 512, writer);

  ASSERT_TRUE(device->free(*kept).is_ok());
  ASSERT_TRUE(device->free(*other).is_ok());
  EXPECT_EQ(device->memory_used_bytes(), 0u);
  EXPECT_EQ(host->kept_bytes(), 4096u);
  EXPECT_EQ(device->free(*kept).code(), Code::kInvalidArgument);  // freed once only

  const std::vector<float> late = random_floats(128, 11);
  std::thread late_writer(
      [&] { std::memcpy(static_cast<std::byte*>(*kept) + 1024, late.data(), 512); });
  late_writer.join();
  std::vector<float> landed(128);
  std::memcpy(landed.data(), static_cast<std::byte*>(*kept) + 1024, 512);
  EXPECT_EQ(landed, late);

  // Once the writer is gone the next allocate or free releases the memory.
  writer.reset();
  EXPECT_EQ(host->kept_bytes(), 4096u);
  Result<void*> next = device->allocate(256);
  ASSERT_TRUE(next.is_ok());
  EXPECT_EQ(host->kept_bytes(), 0u);
  ASSERT_TRUE(device->free(*next).is_ok());

  // A writer over memory that is not freed keeps nothing, and one that outlives the device leaves
  // its memory to the process's end.
  Result<void*> live = device->allocate(2048);
  ASSERT_TRUE(live.is_ok());
  auto outliving = std::make_shared<int>(0);
  host->keep_while(*live, 2048, outliving);
  EXPECT_EQ(host->kept_bytes(), 0u);
  ASSERT_TRUE(device->free(*live).is_ok());
  EXPECT_EQ(host->kept_bytes(), 2048u);
  device.reset();
  std::memcpy(*live, late.data(), 512);
}

TEST(HostDevice, RegisterHostRejectsOverlapsAndUnknownPointers) {
  auto device = make_device();
  std::vector<std::byte> host(8192);
  EXPECT_TRUE(device->register_host(host.data(), 4096).is_ok());
  EXPECT_EQ(device->register_host(host.data() + 100, 100).code(), Code::kInvalidArgument);
  EXPECT_TRUE(device->register_host(host.data() + 4096, 4096).is_ok());
  EXPECT_TRUE(device->unregister_host(host.data()).is_ok());
  EXPECT_EQ(device->unregister_host(host.data()).code(), Code::kInvalidArgument);
  EXPECT_TRUE(device->unregister_host(host.data() + 4096).is_ok());
}

TEST(HostDevice, DestroyingAStreamFinishesItsWork) {
  auto device = make_device();
  std::atomic<int> ran{0};
  {
    auto stream = make_stream(*device);
    for (int i = 0; i < 10; ++i) {
      ASSERT_TRUE(device
                      ->launch_host(*stream,
                                    [&ran] {
                                      std::this_thread::sleep_for(milliseconds(1));
                                      ++ran;
                                      return Status::ok();
                                    })
                      .is_ok());
    }
  }
  EXPECT_EQ(ran.load(), 10);
  EXPECT_EQ(static_cast<HostDevice&>(*device).live_stream_count(), 0);
}

// An opaque HostDevice behaves as a GPU does for host code: host_accessible() is false and its
// pointers cannot be dereferenced (a host read faults), while its own copies and memsets reach the
// memory, and a host address of that memory is not accepted as a device pointer.
TEST(HostDevice, AnOpaqueDeviceHandsOutPointersOnlyItsOperationsReach) {
  HostDeviceOptions options;
  options.opaque = true;
  auto device = make_device(options);
  EXPECT_FALSE(device->host_accessible());
  auto stream = make_stream(*device);
  const std::vector<float> in = random_floats(1000, 41);
  Result<DeviceBuffer> buffer = DeviceBuffer::allocate(*device, in.size() * 4);
  ASSERT_TRUE(buffer.is_ok());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buffer->data()) % 256, 0u);
  ASSERT_TRUE(device->copy_h2d(buffer->data(), in.data(), in.size() * 4, *stream).is_ok());
  // Device pointer arithmetic works as on a GPU: the second half via an offset pointer.
  std::vector<float> out(in.size(), 0.0f);
  ASSERT_TRUE(device->copy_d2h(out.data(), buffer->as<float>() + 500, 500 * 4, *stream).is_ok());
  ASSERT_TRUE(device->memset_async(buffer->as<float>() + 500, 0, 4, *stream).is_ok());
  ASSERT_TRUE(device->copy_d2h(out.data() + 500, buffer->as<float>() + 500, 8, *stream).is_ok());
  ASSERT_TRUE(device->synchronize(*stream).is_ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data() + 500, 500 * 4), 0);
  EXPECT_EQ(out[500], 0.0f);
  EXPECT_EQ(std::memcmp(&out[501], &in[501], 4), 0);

  // The memory's host address is not a device pointer of this device.
  auto& host = static_cast<HostDevice&>(*device);
  void* host_address = host.host_address(buffer->data());
  EXPECT_NE(host_address, buffer->data());
  EXPECT_EQ(device->copy_h2d(host_address, in.data(), 4, *stream).code(), Code::kInvalidArgument);
  EXPECT_EQ(device->free(host_address).code(), Code::kInvalidArgument);

  // Host code reading device memory dies, as it would (or would read garbage) on a GPU.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const volatile float* device_floats = buffer->as<float>();
  EXPECT_DEATH((void)device_floats[0], "");
}

TEST(HostDevice, RejectsBadOptions) {
  HostDeviceOptions options;
  options.stream_queue_depth = 0;
  EXPECT_EQ(make_host_device(options).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace zinf
