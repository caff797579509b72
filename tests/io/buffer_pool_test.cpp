// BufferPool: the memory kinds it reports are the ones the kernel gave, blocks are aligned and
// disjoint, and the free list is bounded and thread-safe.
#include "io/buffer_pool.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/random.hpp"

namespace zinf {
namespace {

long hugetlb_free_pages() {
  std::ifstream in("/proc/sys/vm/nr_hugepages");
  long total = 0;
  in >> total;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  long value = 0;
  while (meminfo >> key >> value) {
    if (key == "HugePages_Free:") return value;
    meminfo.ignore(256, '\n');
  }
  return 0;
}

TEST(BufferPool, BlocksAreAlignedDisjointAndHoldData) {
  Result<std::unique_ptr<BufferPool>> pool =
      BufferPool::create({.block_bytes = 3 << 20, .block_count = 3});
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  BufferPool& p = **pool;
  EXPECT_EQ(p.bytes(), 9u << 20);
  for (std::size_t i = 0; i < p.block_count(); ++i) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.block(i)) % 4096, 0u);
    fill_random_bytes(p.block(i), p.block_bytes(), 40 + i);
  }
  std::vector<std::byte> expect(p.block_bytes());
  for (std::size_t i = 0; i < p.block_count(); ++i) {
    fill_random_bytes(expect.data(), expect.size(), 40 + i);
    EXPECT_EQ(std::memcmp(p.block(i), expect.data(), expect.size()), 0) << "block " << i;
  }
  // Huge pages when the kernel offers them: hugetlb with a reserve, else THP.
  if (hugetlb_free_pages() >= 6) {
    EXPECT_EQ(p.page_kind(), PageKind::kHugeTlb);
  } else {
    EXPECT_NE(p.page_kind(), PageKind::kExternal);
  }
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.data()) % (2 << 20), 0u)
      << page_kind_name(p.page_kind());
}

TEST(BufferPool, KindsCanBeForced) {
  Result<std::unique_ptr<BufferPool>> normal = BufferPool::create(
      {.block_bytes = 1 << 20, .block_count = 2, .huge_pages = HugePages::kNone});
  ASSERT_TRUE(normal.is_ok());
  EXPECT_EQ((*normal)->page_kind(), PageKind::kNormal);
  Result<std::unique_ptr<BufferPool>> thp = BufferPool::create(
      {.block_bytes = 1 << 20, .block_count = 2, .huge_pages = HugePages::kThpOnly});
  ASSERT_TRUE(thp.is_ok());
  EXPECT_NE(thp.value()->page_kind(), PageKind::kHugeTlb);
  if (hugetlb_free_pages() == 0) {
    Result<std::unique_ptr<BufferPool>> tlb = BufferPool::create(
        {.block_bytes = 1 << 20, .block_count = 2, .huge_pages = HugePages::kHugeTlbOnly});
    ASSERT_FALSE(tlb.is_ok());
    EXPECT_EQ(tlb.status().code(), Code::kResourceExhausted);
    EXPECT_NE(tlb.status().message().find("nr_hugepages"), std::string::npos);
  }
}

TEST(BufferPool, AcquireIsBoundedAndThreadSafe) {
  Result<std::unique_ptr<BufferPool>> pool =
      BufferPool::create({.block_bytes = 4096, .block_count = 4, .huge_pages = HugePages::kNone});
  ASSERT_TRUE(pool.is_ok());
  BufferPool& p = **pool;
  std::set<std::size_t> taken;
  for (int i = 0; i < 4; ++i) taken.insert(*p.acquire(std::chrono::milliseconds(10)));
  EXPECT_EQ(taken.size(), 4u);
  EXPECT_FALSE(p.try_acquire().has_value());
  Result<std::size_t> none = p.acquire(std::chrono::milliseconds(5));
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), Code::kTimeout);
  for (std::size_t i : taken) p.release(i);
  EXPECT_EQ(p.free_count(), 4u);

  // Four threads cycle blocks; each writes its id into the block it holds and checks it.
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        Result<std::size_t> b = p.acquire(std::chrono::seconds(10));
        if (!b.is_ok()) {
          ++errors;
          return;
        }
        auto* word = reinterpret_cast<volatile int*>(p.block(*b));
        *word = t;
        std::this_thread::yield();
        if (*word != t) ++errors;
        p.release(*b);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(p.free_count(), 4u);
}

TEST(BufferPool, AdoptsExternalMemory) {
  alignas(4096) static std::byte memory[4 * 8192];
  Result<std::unique_ptr<BufferPool>> pool = BufferPool::adopt(memory, 8192, 4);
  ASSERT_TRUE(pool.is_ok());
  EXPECT_EQ((*pool)->page_kind(), PageKind::kExternal);
  EXPECT_EQ((*pool)->block(3), memory + 3 * 8192);
  EXPECT_FALSE(BufferPool::adopt(memory + 1, 8192, 4).is_ok());
}

}  // namespace
}  // namespace zinf
