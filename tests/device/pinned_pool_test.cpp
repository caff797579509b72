// PinnedPool: leases, bounded acquire with a timeout, registration with an engine and a device.
#include "device/pinned_pool.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <set>
#include <thread>

#include "base/random.hpp"
#include "io/io_engine.hpp"
#include "zinf/device.hpp"

namespace zinf {
namespace {

TEST(PinnedPool, BlocksAreDistinctAlignedAndLeasedOnce) {
  Result<std::unique_ptr<PinnedPool>> pool =
      PinnedPool::create({.block_bytes = 64 << 10, .block_count = 4});
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  PinnedPool& p = **pool;
  EXPECT_EQ(p.bytes(), 4u * (64 << 10));
  std::vector<PinnedPool::Lease> leases;
  std::set<std::byte*> seen;
  for (int i = 0; i < 4; ++i) {
    std::optional<PinnedPool::Lease> lease = p.try_acquire();
    ASSERT_TRUE(lease.has_value());
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(lease->data()) % 4096, 0u);
    EXPECT_EQ(lease->bytes(), 64u << 10);
    EXPECT_TRUE(seen.insert(lease->data()).second);
    // Each block holds its own bytes.
    fill_random_bytes(lease->data(), lease->bytes(), 40 + i);
    leases.push_back(std::move(*lease));
  }
  for (int i = 0; i < 4; ++i) {
    std::vector<std::byte> expect(64 << 10);
    fill_random_bytes(expect.data(), expect.size(), 40 + i);
    EXPECT_EQ(std::memcmp(leases[i].data(), expect.data(), expect.size()), 0) << i;
  }
  EXPECT_FALSE(p.try_acquire().has_value());
  EXPECT_EQ(p.free_count(), 0u);
  EXPECT_EQ(p.leased_peak(), 4u);
  leases.pop_back();  // RAII: the block goes back
  EXPECT_EQ(p.free_count(), 1u);
  PinnedPool::Lease moved = std::move(leases.front());
  EXPECT_FALSE(leases.front().valid());
  moved.release();
  EXPECT_FALSE(moved.valid());
  EXPECT_EQ(p.free_count(), 2u);
  leases.clear();
  EXPECT_EQ(p.free_count(), 4u);
}

TEST(PinnedPool, AcquireWaitsWithATimeoutInsteadOfAllocating) {
  Result<std::unique_ptr<PinnedPool>> pool =
      PinnedPool::create({.block_bytes = 4096, .block_count = 1, .huge_pages = HugePages::kNone});
  ASSERT_TRUE(pool.is_ok());
  PinnedPool& p = **pool;
  Result<PinnedPool::Lease> held = p.acquire(std::chrono::milliseconds(10));
  ASSERT_TRUE(held.is_ok());
  const auto start = std::chrono::steady_clock::now();
  Result<PinnedPool::Lease> none = p.acquire(std::chrono::milliseconds(50));
  const auto waited = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), Code::kTimeout);
  EXPECT_NE(none.status().to_string().find("1 blocks of 4096 bytes"), std::string::npos);
  EXPECT_GE(waited, std::chrono::milliseconds(45));
  EXPECT_LT(waited, std::chrono::seconds(5));
  // A block returned by another thread wakes the waiter.
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    held->release();
  });
  Result<PinnedPool::Lease> got = p.acquire(std::chrono::seconds(10));
  releaser.join();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
}

TEST(PinnedPool, RegistersWithEngineAndDevice) {
  Result<std::unique_ptr<Device>> device = make_host_device();
  ASSERT_TRUE(device.is_ok()) << device.status().to_string();
  Result<std::unique_ptr<IoEngine>> engine = open_engine({});
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  void* base = nullptr;
  {
    Result<std::unique_ptr<PinnedPool>> pool =
        PinnedPool::create({.block_bytes = 1 << 20, .block_count = 2, .device = device->get()});
    ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
    EXPECT_TRUE((*pool)->device_registered());
    ASSERT_TRUE((*pool)->register_with(**engine).is_ok());
    ASSERT_TRUE((*pool)->register_with(**engine).is_ok());  // once per engine
    base = (*pool)->block(0);
    // While the pool lives, its range is registered with both: registering it again is refused.
    EXPECT_FALSE((*device)->register_host(base, 1 << 20).is_ok());
    std::printf("pool pages: %s, locked %d\n",
                std::string(page_kind_name((*pool)->page_kind())).c_str(), (*pool)->locked());
  }
  // The destructor unregistered the range from the device and from the engine: unregistering it
  // once more is refused by both, as for memory that was never registered.
  Status device_again = (*device)->unregister_host(base);
  EXPECT_FALSE(device_again.is_ok()) << "the pool left its range registered with the device";
  EXPECT_NE(device_again.to_string().find("not registered"), std::string::npos)
      << device_again.to_string();
  Status engine_again = (*engine)->unregister_memory(base);
  EXPECT_EQ(engine_again.code(), Code::kInvalidArgument)
      << "the pool left its range registered with the engine: " << engine_again.to_string();
  // And the device takes the same range afresh.
  EXPECT_TRUE((*device)->register_host(base, 1 << 20).is_ok());
  EXPECT_TRUE((*device)->unregister_host(base).is_ok());
}

TEST(PinnedPool, BadSizesAreInvalidArgument) {
  EXPECT_EQ(PinnedPool::create({.block_bytes = 1000, .block_count = 2}).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(PinnedPool::create({.block_bytes = 4096, .block_count = 0}).status().code(),
            Code::kInvalidArgument);
}

}  // namespace
}  // namespace zinf
