// release_freed_memory() (lib/base/heap.hpp): the pages of blocks freed into malloc's heap stay
// resident until it runs, and go back to the system when it does; what is still allocated keeps
// its values.
#include "base/heap.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/child_process.hpp"
#include "common/resident_memory.hpp"
#include "common/sanitizer.hpp"

namespace zinf {
namespace {

using test::resident_anon_bytes;

TEST(ReleaseFreedMemory, GivesBackThePagesOfBlocksFreedIntoTheHeap) {
#if !defined(__GLIBC__)
  GTEST_SKIP() << "release_freed_memory() does nothing where the C library is not glibc";
#endif
  if (test::kThreadSanitizer || test::kAddressSanitizer) {
    GTEST_SKIP() << "measures resident memory, which a sanitizer's shadow memory inflates";
  }
  // 64 MiB in blocks of 64 KiB, below glibc's smallest mmap threshold (128 KiB), so every one
  // comes from the heap whatever ran before; a block allocated after them keeps the freed ones
  // off the top of the heap, which free() would trim by itself.
  constexpr std::size_t kBlockBytes = std::size_t{64} << 10;
  constexpr std::size_t kBlocks = 1024;
  constexpr std::size_t kTotalBytes = kBlockBytes * kBlocks;
  const std::uint64_t seed = 20261206;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const std::uint64_t before = resident_anon_bytes();
  ASSERT_GT(before, 0u) << "the kernel reports no RssAnon";
  std::vector<std::uint64_t*> blocks(kBlocks);
  for (std::uint64_t*& b : blocks) {
    b = static_cast<std::uint64_t*>(std::malloc(kBlockBytes));
    ASSERT_NE(b, nullptr);
    for (std::size_t i = 0; i < kBlockBytes / sizeof(std::uint64_t); ++i) b[i] = rng() | 1;
  }
  // The block that stays: its values are checked after the release.
  std::vector<std::uint64_t> kept_values(kBlockBytes / sizeof(std::uint64_t));
  for (std::uint64_t& v : kept_values) v = rng() | 1;
  auto* kept = static_cast<std::uint64_t*>(std::malloc(kBlockBytes));
  ASSERT_NE(kept, nullptr);
  std::memcpy(kept, kept_values.data(), kBlockBytes);
  const std::uint64_t allocated = resident_anon_bytes();
  for (std::uint64_t* b : blocks) std::free(b);
  const std::uint64_t freed = resident_anon_bytes();
  const auto start = std::chrono::steady_clock::now();
  release_freed_memory();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const std::uint64_t released = resident_anon_bytes();
  std::printf(
      "RssAnon: %llu before, %llu with %zu bytes allocated, %llu after the free, %llu after "
      "release_freed_memory() (%.3f ms)\n",
      static_cast<unsigned long long>(before), static_cast<unsigned long long>(allocated),
      kTotalBytes, static_cast<unsigned long long>(freed),
      static_cast<unsigned long long>(released), ms);
  // Allocated and written, the blocks are resident; freed, they stay so (the reason the helper
  // exists); released, at least three quarters of them are gone (the rest of the process may
  // allocate a little meanwhile: the log, gtest).
  ASSERT_GE(allocated, before + kTotalBytes * 3 / 4);
  EXPECT_GE(freed, allocated - kTotalBytes / 4);
  EXPECT_LE(released + kTotalBytes * 3 / 4, freed);
  EXPECT_EQ(std::memcmp(kept, kept_values.data(), kBlockBytes), 0);
  std::free(kept);
}

// Two threads' first calls in a process at once, where glibc's malloc is not the program's
// allocator and nothing has set its heaps up: malloc_trim sets them up unlocked, so without one
// call at a time both threads took the main heap and glibc aborted when the second exited
// ("malloc assertion failure in __malloc_arena_thread_freeres") or crashed before (150 to 190 runs
// of 400 under asan). Each run is a forked child whose glibc heaps are
// as the test process left them: set up where glibc's malloc serves the program (this test then
// passes either way), not set up under asan and tsan, whose allocators serve it, and which never
// call release_freed_memory in the test process before this test (the test above skips there).
TEST(ReleaseFreedMemory, FirstCallsFromTwoThreadsAtOnce) {
  constexpr int kRuns = 100;
  int failed = 0;
  std::string first_failure;
  for (int run = 0; run < kRuns; ++run) {
    const test::ChildEnd end = test::in_child([](int) {
      std::atomic<bool> go{false};
      auto call = [&go] {
        while (!go.load(std::memory_order_acquire)) {
        }
        release_freed_memory();
      };
      std::thread a(call);
      std::thread b(call);
      go.store(true, std::memory_order_release);
      a.join();
      b.join();
      return 0;
    });
    if (end.exit_code() != 0) {
      if (failed++ == 0) {
        first_failure =
            "run " + std::to_string(run) + ": " +
            (end.ended ? "wait status " + std::to_string(end.wstatus) : "no end: " + end.output);
      }
    }
  }
  EXPECT_EQ(failed, 0) << failed << " of " << kRuns
                       << " runs did not exit 0; first: " << first_failure;
}

}  // namespace
}  // namespace zinf
