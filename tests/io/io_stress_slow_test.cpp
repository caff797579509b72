// Longer runs outside the default suite (label `slow`): many seeds of mixed faults with
// thousands of requests from several threads, and a swap space striped over four directories
// read and written at random for a while. Each seed is printed.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "base/random.hpp"
#include "io/fault.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "io_test_util.hpp"

namespace zinf {
namespace {

using io_test::must_open;
using io_test::random_buffer;
using io_test::ScratchDir;

class StressTest : public io_test::EngineKindTest {};

TEST_P(StressTest, ManySeedsOfMixedFaults) {
  constexpr std::size_t kRegion = 8 << 20;
  constexpr int kThreads = 3;
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    std::printf("mixed faults: seed %llu\n", static_cast<unsigned long long>(seed));
    ScratchDir dir("stress");
    auto faults =
        std::make_shared<FaultInjector>(FaultSpec{.seed = seed,
                                                  .eio_rate = 0.02,
                                                  .enospc_rate = 0.02,
                                                  .short_rate = 0.1,
                                                  .eintr_rate = 0.05,
                                                  .eagain_rate = 0.05,
                                                  .latency_rate = 0.01,
                                                  .latency = std::chrono::microseconds(300),
                                                  .bit_flip_rate = 0});
    IoOptions options;
    options.block_bytes = 16 << 10;
    options.queue_depth = 16;
    options.rings = 2;
    options.max_requests = 1024;
    options.faults = faults;
    auto engine = must_open(GetParam(), options);
    ASSERT_TRUE(engine);
    Result<FileHandle> file = engine->open_file(dir.file("f.bin"), {.create = true});
    ASSERT_TRUE(file.is_ok());
    AlignedBuffer source = random_buffer(kThreads * kRegion, seed);
    AlignedBuffer back(kThreads * kRegion);
    std::atomic<int> mismatches{0}, unexpected{0}, failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        SplitMix64 random(seed * 31 + t);
        const std::uint64_t base = t * kRegion;
        struct Req {
          Ticket ticket;
          std::uint64_t at, bytes;
        };
        // Write everything (retrying a failed request until it succeeds), then read it back the
        // same way: a request that reports OK must have moved exactly its bytes.
        for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
          std::vector<Req> pending;
          std::vector<Req> redo;
          for (std::uint64_t at = 0; at < kRegion;) {
            const std::uint64_t bytes =
                std::min<std::uint64_t>((1 + random.next() % 40) * 4096, kRegion - at);
            redo.push_back({{}, at, bytes});
            at += bytes;
          }
          for (int attempt = 0; attempt < 50 && !redo.empty(); ++attempt) {
            pending.clear();
            for (const Req& r : redo) {
              std::byte* memory = (op == IoOp::kWrite ? source.data() : back.data()) + base + r.at;
              Result<Ticket> ticket =
                  engine->submit(IoRequest{op, *file, base + r.at, r.bytes, memory});
              if (!ticket.is_ok()) {
                ++unexpected;
                return;
              }
              pending.push_back({*ticket, r.at, r.bytes});
            }
            redo.clear();
            for (const Req& r : pending) {
              Status s = engine->wait(r.ticket, std::chrono::seconds(60));
              if (s.is_ok()) {
                if (op == IoOp::kRead && std::memcmp(back.data() + base + r.at,
                                                     source.data() + base + r.at, r.bytes) != 0) {
                  ++mismatches;
                }
                continue;
              }
              ++failures;
              if (s.code() != Code::kIoError && s.code() != Code::kNoSpace) ++unexpected;
              redo.push_back(r);
            }
          }
          if (!redo.empty()) ++unexpected;
        }
      });
    }
    for (auto& thread : threads) thread.join();
    EXPECT_EQ(mismatches.load(), 0) << "seed " << seed;
    EXPECT_EQ(unexpected.load(), 0) << "seed " << seed;
    EXPECT_GT(failures.load(), 0) << "seed " << seed;
    EXPECT_EQ(std::memcmp(back.data(), source.data(), kThreads * kRegion), 0) << "seed " << seed;
  }
}

TEST_P(StressTest, StripedSwapRandomTraffic) {
  const std::uint64_t seed = 0x57e55;
  std::printf("striped swap traffic: seed %llu\n", static_cast<unsigned long long>(seed));
  ScratchDir root("stress-swap");
  SwapOptions options;
  for (int d = 0; d < 4; ++d) {
    options.dirs.push_back(fmt::format("{}/d{}", root.path(), d));
    std::filesystem::create_directories(options.dirs.back());
  }
  options.capacity_bytes = 256 << 20;
  options.block_bytes = 256 << 10;
  options.max_op_bytes = 16 << 20;
  IoOptions io;
  io.block_bytes = 128 << 10;
  io.queue_depth = 16;
  io.rings = 2;
  io.max_requests = 4096;
  auto engine = must_open(GetParam(), io);
  ASSERT_TRUE(engine);
  Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(*engine, options);
  ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
  SplitMix64 random(seed);
  constexpr int kExtents = 24;
  std::vector<ExtentId> ids;
  std::vector<AlignedBuffer> truth;
  for (int i = 0; i < kExtents; ++i) {
    const std::uint64_t bytes = 4096 + random.next() % (8 << 20);
    ids.push_back(*(*swap)->create(fmt::format("rank{}/group{}/state", i % 4, i), bytes));
    truth.push_back(random_buffer((bytes + 4095) / 4096 * 4096, seed + i));
    ASSERT_TRUE((*swap)->write_sync(ids.back(), truth.back().data()).is_ok());
  }
  for (int step = 0; step < 200; ++step) {
    const int i = static_cast<int>(random.next() % kExtents);
    const ExtentInfo& info = (*swap)->info(ids[i]);
    if (random.next() % 3 == 0) {
      // Rewrite one whole block (or the tail) with new data.
      const std::uint64_t block = random.next() % info.block_count;
      const std::uint64_t at = block * options.block_bytes;
      const std::uint64_t bytes = std::min<std::uint64_t>(options.block_bytes, info.bytes - at);
      fill_random_bytes(truth[i].data() + at, (bytes + 4095) / 4096 * 4096, seed * step + 1);
      Result<SwapTicket> t = (*swap)->write(ids[i], at, bytes, truth[i].data() + at);
      ASSERT_TRUE(t.is_ok()) << t.status().to_string();
      ASSERT_TRUE((*swap)->wait(*t, std::chrono::seconds(30)).is_ok());
    } else {
      AlignedBuffer back(truth[i].bytes());
      ASSERT_TRUE((*swap)->read_sync(ids[i], back.data()).is_ok()) << info.key;
      ASSERT_EQ(std::memcmp(back.data(), truth[i].data(), info.bytes), 0) << info.key;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, StressTest, io_test::kAllEngineKinds, io_test::kind_name);

}  // namespace
}  // namespace zinf
