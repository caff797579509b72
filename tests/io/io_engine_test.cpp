// IoEngine on both backends: random data round-trips at sizes that are not multiples of the
// block with hundreds of requests in flight, checked against the bytes on disk read without
// the engine; argument errors, bounds, timeouts and the automatic fallback to threads.
#include "io/io_engine.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "io/buffer_pool.hpp"
#include "io/fault.hpp"
#include "io_test_util.hpp"

namespace zinf {
namespace {

using io_test::must_open;
using io_test::random_buffer;
using io_test::read_file_plain;
using io_test::ScratchDir;

class EngineTest : public io_test::EngineKindTest {};

// Requests of random sizes (multiples of 4 KiB, mostly not of the 64 KiB block) at random
// distinct places of one file, all submitted before any wait: 300 in flight with a queue depth
// of 8 on each of 2 rings.
TEST_P(EngineTest, RandomRequestsRoundTripWithHundredsInFlight) {
  const std::uint64_t seed = 0x10e1;
  SCOPED_TRACE("seed " + std::to_string(seed));
  ScratchDir dir("roundtrip");
  IoOptions options;
  options.block_bytes = 64 << 10;
  options.queue_depth = 8;
  options.rings = 2;
  options.max_requests = 512;
  auto engine = must_open(GetParam(), options);
  ASSERT_TRUE(engine);
  EXPECT_EQ(engine->kind(), GetParam());

  constexpr int kRequests = 300;
  SplitMix64 random(seed);
  std::vector<std::size_t> offsets(kRequests), sizes(kRequests);
  std::size_t total = 0;
  for (int i = 0; i < kRequests; ++i) {
    sizes[i] = (1 + random.next() % 60) * 4096;  // 4 KiB .. 240 KiB
    offsets[i] = total;
    total += sizes[i];
  }
  AlignedBuffer source = random_buffer(total, seed);
  const std::string path = dir.file("data.bin");
  Result<FileHandle> file =
      engine->open_file(path, {.write = true, .create = true, .direct = true});
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();

  // Writes in a shuffled order, so pieces of different requests interleave on disk.
  std::vector<int> order(kRequests);
  for (int i = 0; i < kRequests; ++i) order[i] = i;
  for (int i = kRequests - 1; i > 0; --i) std::swap(order[i], order[random.next() % (i + 1)]);
  std::vector<Ticket> tickets;
  for (int i : order) {
    Result<Ticket> t = engine->write(*file, offsets[i], sizes[i], source.data() + offsets[i]);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    tickets.push_back(*t);
  }
  for (Ticket t : tickets) ASSERT_TRUE(engine->wait(t, std::chrono::seconds(60)).is_ok());

  const std::string on_disk = read_file_plain(path);
  ASSERT_EQ(on_disk.size(), total);
  EXPECT_EQ(std::memcmp(on_disk.data(), source.data(), total), 0);

  AlignedBuffer back(total);
  std::memset(back.data(), 0, total);
  tickets.clear();
  for (int i = 0; i < kRequests; ++i) {
    Result<Ticket> t = engine->read(*file, offsets[i], sizes[i], back.data() + offsets[i]);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    tickets.push_back(*t);
  }
  // Redeem in reverse order: completion order must not matter.
  for (auto it = tickets.rbegin(); it != tickets.rend(); ++it) {
    ASSERT_TRUE(engine->wait(*it, std::chrono::seconds(60)).is_ok());
  }
  EXPECT_EQ(std::memcmp(back.data(), source.data(), total), 0);
  const IoEngineStats stats = engine->stats();
  EXPECT_EQ(stats.requests, 2u * kRequests);
  EXPECT_EQ(stats.failed_requests, 0u);
  EXPECT_GT(stats.pieces, stats.requests);  // the larger requests were cut
  ASSERT_TRUE(engine->close_file(*file).is_ok());
}

// One request many blocks long, not a multiple of the block, into registered huge-page
// memory: the pieces use fixed buffers on io_uring.
TEST_P(EngineTest, LargeRequestIntoRegisteredPool) {
  const std::uint64_t seed = 0x10e2;
  SCOPED_TRACE("seed " + std::to_string(seed));
  ScratchDir dir("large");
  IoOptions options;
  options.block_bytes = 256 << 10;
  options.queue_depth = 4;
  auto engine = must_open(GetParam(), options);
  ASSERT_TRUE(engine);
  const std::size_t bytes = (5 << 20) + (20 << 10);  // 5 MiB + 20 KiB
  Result<std::unique_ptr<BufferPool>> pool =
      BufferPool::create({.block_bytes = 6 << 20, .block_count = 2});
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  ASSERT_TRUE((*pool)->register_with(*engine).is_ok());
  std::byte* src = (*pool)->block(0);
  std::byte* dst = (*pool)->block(1);
  fill_random_bytes(src, bytes, seed);
  std::memset(dst, 0, bytes);

  Result<FileHandle> file = engine->open_file(dir.file("big.bin"), {.create = true});
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  const std::uint64_t offset = 3 << 20;  // not at the file's start
  ASSERT_TRUE(engine->write_sync(*file, offset, bytes, src).is_ok());
  ASSERT_TRUE(engine->read_sync(*file, offset, bytes, dst).is_ok());
  EXPECT_EQ(std::memcmp(src, dst, bytes), 0);
  const std::string on_disk = read_file_plain(dir.file("big.bin"));
  ASSERT_EQ(on_disk.size(), offset + bytes);
  EXPECT_EQ(std::memcmp(on_disk.data() + offset, src, bytes), 0);
  const IoEngineStats stats = engine->stats();
  EXPECT_EQ(stats.pieces, 2u * 21u);  // ceil((5 MiB + 20 KiB) / 256 KiB) = 21 per request
  EXPECT_EQ(stats.fixed_pieces, stats.pieces);
  ASSERT_TRUE(engine->close_file(*file).is_ok());
  ASSERT_TRUE(engine->unregister_memory((*pool)->data()).is_ok());
}

// Without O_DIRECT, any offset, length and address works.
TEST_P(EngineTest, BufferedFileTakesUnalignedRanges) {
  const std::uint64_t seed = 0x10e3;
  ScratchDir dir("buffered");
  auto engine = must_open(GetParam(), {.block_bytes = 4096, .queue_depth = 4});
  ASSERT_TRUE(engine);
  Result<FileHandle> file =
      engine->open_file(dir.file("b.bin"), {.write = true, .create = true, .direct = false});
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  const std::size_t bytes = 123457;
  AlignedBuffer src = random_buffer(bytes + 1, seed);
  ASSERT_TRUE(engine->write_sync(*file, 333, bytes, src.data() + 1).is_ok());
  std::vector<std::byte> back(bytes);
  ASSERT_TRUE(engine->read_sync(*file, 333, bytes, back.data()).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), src.data() + 1, bytes), 0);
  // Reading past the end is an error that names the file, not a silent short read.
  Status past = engine->read_sync(*file, 333 + bytes - 10, 100, back.data());
  EXPECT_EQ(past.code(), Code::kIoError);
  EXPECT_NE(past.message().find("end of file"), std::string::npos) << past.to_string();
  EXPECT_NE(past.message().find(dir.file("b.bin")), std::string::npos);
}

TEST_P(EngineTest, RejectsMisalignedDirectRequestsNamingFileAndOffset) {
  ScratchDir dir("misaligned");
  auto engine = must_open(GetParam());
  ASSERT_TRUE(engine);
  Result<FileHandle> file = engine->open_file(dir.file("m.bin"), {.create = true});
  ASSERT_TRUE(file.is_ok());
  AlignedBuffer buffer(8192);
  Result<Ticket> t = engine->write(*file, 100, 4096, buffer.data());
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), Code::kInvalidArgument);
  EXPECT_NE(t.status().message().find(dir.file("m.bin")), std::string::npos);
  EXPECT_NE(t.status().message().find("offset 100"), std::string::npos);
  EXPECT_EQ(engine->write(*file, 0, 4000, buffer.data()).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(engine->write(*file, 0, 4096, buffer.data() + 512).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(engine->write(FileHandle{}, 0, 4096, buffer.data()).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(engine->write(*file, 0, 0, buffer.data()).status().code(), Code::kInvalidArgument);
}

TEST_P(EngineTest, OpenErrorsNameThePath) {
  auto engine = must_open(GetParam());
  ASSERT_TRUE(engine);
  Result<FileHandle> missing = engine->open_file("/nonexistent-zinf/x.bin", {});
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent-zinf/x.bin"), std::string::npos);
}

TEST_P(EngineTest, BoundsRequestsInFlight) {
  ScratchDir dir("bound");
  auto engine = must_open(GetParam(), {.max_requests = 4});
  ASSERT_TRUE(engine);
  Result<FileHandle> file = engine->open_file(dir.file("f.bin"), {.create = true});
  ASSERT_TRUE(file.is_ok());
  AlignedBuffer buffer = random_buffer(5 * 4096, 7);
  std::vector<Ticket> tickets;
  for (int i = 0; i < 4; ++i) {
    Result<Ticket> t = engine->write(*file, i * 4096, 4096, buffer.data() + i * 4096);
    ASSERT_TRUE(t.is_ok());
    tickets.push_back(*t);
  }
  Result<Ticket> extra = engine->write(*file, 4 * 4096, 4096, buffer.data() + 4 * 4096);
  ASSERT_FALSE(extra.is_ok());
  EXPECT_EQ(extra.status().code(), Code::kResourceExhausted);
  for (Ticket t : tickets) ASSERT_TRUE(engine->wait(t, std::chrono::seconds(10)).is_ok());
  // Redeemed tickets free their slots.
  EXPECT_TRUE(engine->write_sync(*file, 4 * 4096, 4096, buffer.data() + 4 * 4096).is_ok());
}

// A wait that runs out says so, naming the file and offset, and the same ticket can be waited
// on again until the request finishes.
TEST_P(EngineTest, WaitTimesOutWithoutHanging) {
  const std::uint64_t seed = 0x10e4;
  SCOPED_TRACE("seed " + std::to_string(seed));
  ScratchDir dir("timeout");
  IoOptions options;
  options.faults = std::make_shared<FaultInjector>(
      FaultSpec{.seed = seed, .latency_rate = 1.0, .latency = std::chrono::milliseconds(300)});
  auto engine = must_open(GetParam(), options);
  ASSERT_TRUE(engine);
  Result<FileHandle> file = engine->open_file(dir.file("slow.bin"), {.create = true});
  ASSERT_TRUE(file.is_ok());
  AlignedBuffer buffer = random_buffer(8192, seed);
  Result<Ticket> t = engine->write(*file, 8192, 8192, buffer.data());
  ASSERT_TRUE(t.is_ok());
  const auto start = std::chrono::steady_clock::now();
  Status first = engine->wait(*t, std::chrono::milliseconds(20));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(250));
  ASSERT_EQ(first.code(), Code::kTimeout) << first.to_string();
  EXPECT_NE(first.message().find(dir.file("slow.bin")), std::string::npos) << first.to_string();
  EXPECT_NE(first.message().find("offset 8192"), std::string::npos) << first.to_string();
  EXPECT_FALSE(engine->poll(*t));
  EXPECT_TRUE(engine->wait(*t, std::chrono::seconds(10)).is_ok());
}

INSTANTIATE_TEST_SUITE_P(Kinds, EngineTest, io_test::kAllEngineKinds, io_test::kind_name);

// A read the kernel really holds (an empty pipe with a writer that never writes): cancel()
// reaches it through IORING_OP_ASYNC_CANCEL, and it fails with ECANCELED naming the place.
// (ThreadEngine cannot stop a running pread; its cancel is tested with the hang fault.)
TEST(UringCancel, ReadBlockedInTheKernelIsCancelled) {
  std::string why;
  if (!io_test::uring_available(&why)) GTEST_SKIP() << "io_uring unavailable here: " << why;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0) << std::strerror(errno);
  auto engine = must_open(EngineKind::kUring, {.block_bytes = 4096, .queue_depth = 4});
  ASSERT_TRUE(engine);
  Result<FileHandle> file = engine->adopt_fd(fds[0], "test-pipe", /*direct=*/false);
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  AlignedBuffer buffer(4096, 4096);
  Result<Ticket> t = engine->read(*file, 0, 4096, buffer.data());
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(engine->wait(*t, std::chrono::milliseconds(50)).code(), Code::kTimeout);
  EXPECT_TRUE(engine->cancel(*t).is_ok());
  const auto start = std::chrono::steady_clock::now();
  const Status s = engine->wait(*t, std::chrono::seconds(10));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_EQ(s.sys_code(), ECANCELED) << s.to_string();
  EXPECT_NE(s.message().find("read of test-pipe at offset 0"), std::string::npos) << s.to_string();
  // The ring goes on: the pipe now has data, and a new read gets it.
  const char hello[] = "hello";
  ASSERT_EQ(::write(fds[1], hello, sizeof(hello)), static_cast<ssize_t>(sizeof(hello)));
  Result<Ticket> again = engine->read(*file, 0, 4096, buffer.data());
  ASSERT_TRUE(again.is_ok());
  // A pipe read returns what is there: a short transfer, then the engine waits for the rest,
  // which never comes; cancel that too, and check the bytes that did arrive.
  EXPECT_EQ(engine->wait(*again, std::chrono::milliseconds(50)).code(), Code::kTimeout);
  EXPECT_EQ(std::memcmp(buffer.data(), hello, sizeof(hello)), 0);
  EXPECT_TRUE(engine->cancel(*again).is_ok());
  EXPECT_EQ(engine->wait(*again, std::chrono::seconds(10)).sys_code(), ECANCELED);
  ASSERT_TRUE(engine->close_file(*file).is_ok());
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(EngineOptions, RejectsOutOfRangeOptions) {
  EXPECT_EQ(open_engine({.block_bytes = 1000}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(open_engine({.queue_depth = 0}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(open_engine({.rings = 0}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(open_engine({.rings = 17}).status().code(), Code::kInvalidArgument);
}

TEST(EngineAuto, FallsBackToThreadsWhenUringIsRefused) {
  ::setenv("ZINF_IO_DISABLE_URING", "1", 1);
  Result<std::unique_ptr<IoEngine>> automatic = open_engine({.kind = EngineKind::kAuto});
  Result<std::unique_ptr<IoEngine>> forced = open_engine({.kind = EngineKind::kUring});
  ::unsetenv("ZINF_IO_DISABLE_URING");
  ASSERT_TRUE(automatic.is_ok()) << automatic.status().to_string();
  EXPECT_EQ((*automatic)->kind(), EngineKind::kThread);
  ASSERT_FALSE(forced.is_ok());
  EXPECT_EQ(forced.status().code(), Code::kUnsupported);

  std::string why;
  Result<std::unique_ptr<IoEngine>> again = open_engine({.kind = EngineKind::kAuto});
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ((*again)->kind(),
            io_test::uring_available(&why) ? EngineKind::kUring : EngineKind::kThread);
}

TEST(EngineKindNames, ParseAndPrint) {
  EngineKind kind;
  ASSERT_TRUE(parse_engine_kind("uring", &kind));
  EXPECT_EQ(kind, EngineKind::kUring);
  ASSERT_TRUE(parse_engine_kind("thread", &kind));
  EXPECT_EQ(engine_kind_name(kind), "thread");
  EXPECT_FALSE(parse_engine_kind("libaio", &kind));
}

}  // namespace
}  // namespace zinf
