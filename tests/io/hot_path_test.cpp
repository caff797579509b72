// The hot path allocates nothing after open (submit, wait, swap read / write / verify), several
// threads may submit to one engine at once, and run_io_bench moves and checks what it claims.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "base/random.hpp"
#include "common/counting_new.hpp"
#include "io/buffer_pool.hpp"
#include "io/io_bench.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "io_test_util.hpp"

using zinf::test::g_allocations;
using zinf::test::g_count_allocations;

namespace zinf {
namespace {

using io_test::must_open;
using io_test::random_buffer;
using io_test::read_file_plain;
using io_test::ScratchDir;

class HotPathTest : public io_test::EngineKindTest {};

TEST_P(HotPathTest, SubmitAndWaitAllocateNothing) {
  ScratchDir dir("noalloc");
  auto engine = must_open(GetParam(), {.block_bytes = 64 << 10, .queue_depth = 8});
  ASSERT_TRUE(engine);
  Result<std::unique_ptr<BufferPool>> pool =
      BufferPool::create({.block_bytes = 1 << 20, .block_count = 4});
  ASSERT_TRUE(pool.is_ok());
  ASSERT_TRUE((*pool)->register_with(*engine).is_ok());
  fill_random_bytes((*pool)->data(), (*pool)->bytes(), 5);
  Result<FileHandle> file = engine->open_file(dir.file("f.bin"), {.create = true});
  ASSERT_TRUE(file.is_ok());
  // Warm-up: the first request may touch lazily built state in the kernel and libraries.
  ASSERT_TRUE(engine->write_sync(*file, 0, 4 << 20, (*pool)->data()).is_ok());

  g_allocations = 0;
  g_count_allocations = true;
  bool all_ok = true;
  for (int round = 0; round < 20; ++round) {
    Ticket tickets[4];
    for (int i = 0; i < 4; ++i) {
      Result<Ticket> t = engine->submit(IoRequest{round % 2 ? IoOp::kRead : IoOp::kWrite, *file,
                                                  static_cast<std::uint64_t>(i) << 20, 1 << 20,
                                                  (*pool)->block(i)});
      if (!t.is_ok()) {
        g_count_allocations = false;
        FAIL() << "submit in round " << round << ": " << t.status().to_string();
      }
      tickets[i] = *t;
    }
    for (Ticket t : tickets) all_ok = all_ok && engine->wait(t, std::chrono::seconds(10)).is_ok();
  }
  g_count_allocations = false;
  EXPECT_TRUE(all_ok);
  EXPECT_EQ(g_allocations.load(), 0u);
}

TEST_P(HotPathTest, SwapReadWriteAllocateNothing) {
  ScratchDir dir("swap-noalloc");
  auto engine = must_open(GetParam(), {.block_bytes = 64 << 10, .queue_depth = 8});
  ASSERT_TRUE(engine);
  SwapOptions options;
  options.dirs = {dir.path() + "/a", dir.path() + "/b"};
  for (const auto& d : options.dirs) std::filesystem::create_directories(d);
  options.capacity_bytes = 8 << 20;
  options.block_bytes = 256 << 10;
  options.max_op_bytes = 4 << 20;
  Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(*engine, options);
  ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
  Result<std::unique_ptr<BufferPool>> pool =
      BufferPool::create({.block_bytes = 1 << 20, .block_count = 2});
  ASSERT_TRUE(pool.is_ok());
  ASSERT_TRUE((*pool)->register_with(*engine).is_ok());
  fill_random_bytes((*pool)->block(0), 1 << 20, 6);
  Result<ExtentId> created = (*swap)->create("rank0/group0/exp_avg_sq", (1 << 20) - 4096);
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  const ExtentId id = *created;
  ASSERT_TRUE((*swap)->write_sync(id, (*pool)->block(0)).is_ok());

  g_allocations = 0;
  g_count_allocations = true;
  bool all_ok = true;
  for (int round = 0; round < 20; ++round) {
    Result<ExtentId> found = (*swap)->find("rank0/group0/exp_avg_sq");  // by key, too
    all_ok = all_ok && found.is_ok() && found->index == id.index;
    Result<SwapTicket> w = (*swap)->write(id, (*pool)->block(0));
    all_ok = all_ok && w.is_ok() && (*swap)->wait(*w, std::chrono::seconds(10)).is_ok();
    Result<SwapTicket> r = (*swap)->read(id, (*pool)->block(1));
    all_ok = all_ok && r.is_ok() && (*swap)->wait(*r, std::chrono::seconds(10)).is_ok();
  }
  g_count_allocations = false;
  EXPECT_TRUE(all_ok);
  EXPECT_EQ(g_allocations.load(), 0u);
  EXPECT_EQ(std::memcmp((*pool)->block(0), (*pool)->block(1), (1 << 20) - 4096), 0);
}

// Four threads submit and wait on one engine at once, each on its own region of one file.
TEST_P(HotPathTest, ManyThreadsShareOneEngine) {
  const std::uint64_t seed = 0xc0c0;
  std::printf("concurrent submitters: seed %llu\n", static_cast<unsigned long long>(seed));
  ScratchDir dir("threads");
  auto engine = must_open(
      GetParam(), {.block_bytes = 32 << 10, .queue_depth = 8, .rings = 2, .max_requests = 256});
  ASSERT_TRUE(engine);
  Result<FileHandle> file = engine->open_file(dir.file("f.bin"), {.create = true});
  ASSERT_TRUE(file.is_ok());
  constexpr int kThreads = 4;
  constexpr std::size_t kRegion = 4 << 20;
  AlignedBuffer source = random_buffer(kThreads * kRegion, seed);
  AlignedBuffer back(kThreads * kRegion);
  std::memset(back.data(), 0, kThreads * kRegion);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      SplitMix64 random(seed + t);
      const std::uint64_t base = t * kRegion;
      // Write the region in random-sized requests, then read it back the same way.
      for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
        std::vector<Ticket> tickets;
        std::byte* memory = op == IoOp::kWrite ? source.data() : back.data();
        for (std::uint64_t at = 0; at < kRegion;) {
          const std::uint64_t bytes =
              std::min<std::uint64_t>((1 + random.next() % 24) * 4096, kRegion - at);
          Result<Ticket> ticket =
              engine->submit(IoRequest{op, *file, base + at, bytes, memory + base + at});
          if (!ticket.is_ok()) {
            ++errors;
            return;
          }
          tickets.push_back(*ticket);
          at += bytes;
          if (tickets.size() == 32) {
            for (Ticket k : tickets) errors += !engine->wait(k, std::chrono::seconds(30)).is_ok();
            tickets.clear();
          }
        }
        for (Ticket k : tickets) errors += !engine->wait(k, std::chrono::seconds(30)).is_ok();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(std::memcmp(back.data(), source.data(), kThreads * kRegion), 0);
  EXPECT_EQ(
      std::memcmp(read_file_plain(dir.file("f.bin")).data(), source.data(), kThreads * kRegion), 0);
}

// run_io_bench moves the bytes it reports, and the bytes written are the pool's.
TEST_P(HotPathTest, IoBenchMovesWhatItReports) {
  ScratchDir dir("iobench");
  IoOptions options;
  options.kind = GetParam();
  options.block_bytes = 128 << 10;
  options.queue_depth = 4;
  options.max_requests = 64;
  auto engine = must_open(GetParam(), options);
  ASSERT_TRUE(engine);
  Result<std::unique_ptr<BufferPool>> pool =
      BufferPool::create({.block_bytes = 2 * options.block_bytes,
                          .block_count = io_bench_pool_blocks(options, 2 * options.block_bytes)});
  ASSERT_TRUE(pool.is_ok());
  ASSERT_TRUE((*pool)->register_with(*engine).is_ok());
  // Every request (two engine blocks) holds the same random pattern, so the whole file must
  // equal it repeated.
  const std::size_t request = (*pool)->block_bytes();
  fill_random_bytes((*pool)->block(0), request, 77);
  for (std::size_t b = 1; b < (*pool)->block_count(); ++b) {
    std::memcpy((*pool)->block(b), (*pool)->block(0), request);
  }
  Result<FileHandle> file = engine->open_file(dir.file("b.bin"), {.create = true});
  ASSERT_TRUE(file.is_ok());
  IoBenchConfig config;
  config.op = IoOp::kWrite;
  config.bytes = (8 << 20) + 1000;  // rounded down to whole blocks
  Result<IoBenchResult> written = run_io_bench(*engine, *file, **pool, config);
  ASSERT_TRUE(written.is_ok()) << written.status().to_string();
  EXPECT_EQ(written->bytes, 8u << 20);
  EXPECT_GT(written->gbps(), 0);
  const std::string on_disk = read_file_plain(dir.file("b.bin"));
  ASSERT_EQ(on_disk.size(), 8u << 20);
  for (std::size_t at = 0; at < on_disk.size(); at += request) {
    ASSERT_EQ(std::memcmp(on_disk.data() + at, (*pool)->block(0), request), 0) << at;
  }
  config.op = IoOp::kRead;
  config.bytes = 32 << 20;  // wraps over the 8 MiB file four times
  config.file_bytes = 8 << 20;
  Result<IoBenchResult> read = run_io_bench(*engine, *file, **pool, config);
  ASSERT_TRUE(read.is_ok()) << read.status().to_string();
  EXPECT_EQ(read->bytes, 32u << 20);
}

INSTANTIATE_TEST_SUITE_P(Kinds, HotPathTest, io_test::kAllEngineKinds, io_test::kind_name);

}  // namespace
}  // namespace zinf
