// IoRequest with memory in runs (memory_run_bytes / memory_stride_bytes): a contiguous range of
// the file moves to and from runs of memory a stride apart, checked against the file read
// without the engine; the gaps between runs are never touched; overlapping or misaligned runs
// are refused.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "io/io_engine.hpp"
#include "io_test_util.hpp"

namespace zinf {
namespace {

using io_test::must_open;
using io_test::random_buffer;
using io_test::read_file_plain;
using io_test::ScratchDir;

class StridedRequestTest : public io_test::EngineKindTest {};

// Runs of 24 KiB every 56 KiB, pieces of 16 KiB (so a run is a whole piece and part of one), the
// last run 12 KiB: the file holds the runs end to end, and a read puts them back in place.
TEST_P(StridedRequestTest, RunsOfMemoryMoveAContiguousFileRange) {
  const std::uint64_t seed = 0x57d;
  std::printf("strided request: seed %llu\n", static_cast<unsigned long long>(seed));
  ScratchDir dir("strided");
  IoOptions options;
  options.block_bytes = 16 << 10;
  options.queue_depth = 4;
  auto engine = must_open(GetParam(), options);
  ASSERT_TRUE(engine);
  const std::string path = dir.file("strided.bin");
  Result<FileHandle> file =
      engine->open_file(path, {.write = true, .create = true, .direct = true});
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  constexpr std::size_t kRun = 24 << 10;
  constexpr std::size_t kStride = 56 << 10;
  constexpr std::size_t kRuns = 7;
  constexpr std::size_t kBytes = (kRuns - 1) * kRun + (12 << 10);
  constexpr std::uint64_t kFileOffset = 64 << 10;
  AlignedBuffer source = random_buffer(kRuns * kStride, seed);
  ASSERT_TRUE(engine->write_sync(*file, 0, kFileOffset, source.data()).is_ok());

  IoRequest write{IoOp::kWrite, *file, kFileOffset, kBytes, source.data()};
  write.memory_run_bytes = kRun;
  write.memory_stride_bytes = kStride;
  Result<Ticket> t = engine->submit(write);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_TRUE(engine->wait(*t, std::chrono::seconds(30)).is_ok());
  const std::string on_disk = read_file_plain(path);
  ASSERT_EQ(on_disk.size(), kFileOffset + kBytes);
  for (std::size_t at = 0; at < kBytes; at += 4096) {
    const std::size_t memory = (at / kRun) * kStride + at % kRun;
    ASSERT_EQ(std::memcmp(on_disk.data() + kFileOffset + at, source.data() + memory, 4096), 0)
        << "file offset " << kFileOffset + at;
  }

  AlignedBuffer back(kRuns * kStride);
  std::memset(back.data(), 0xee, back.bytes());
  IoRequest read{IoOp::kRead, *file, kFileOffset, kBytes, back.data()};
  read.memory_run_bytes = kRun;
  read.memory_stride_bytes = kStride;
  t = engine->submit(read);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_TRUE(engine->wait(*t, std::chrono::seconds(30)).is_ok());
  for (std::size_t k = 0; k < kRuns; ++k) {
    const std::size_t run = k + 1 < kRuns ? kRun : kBytes - k * kRun;
    EXPECT_EQ(std::memcmp(back.data() + k * kStride, source.data() + k * kStride, run), 0)
        << "run " << k;
    const std::size_t gap_end = k + 1 < kRuns ? (k + 1) * kStride : back.bytes();
    for (std::size_t at = k * kStride + run; at < gap_end; ++at) {
      ASSERT_EQ(static_cast<unsigned char>(back.data()[at]), 0xee) << "gap byte " << at;
    }
  }
}

TEST_P(StridedRequestTest, OverlappingOrMisalignedRunsAreRefused) {
  ScratchDir dir("strided-bad");
  auto engine = must_open(GetParam());
  ASSERT_TRUE(engine);
  const std::string path = dir.file("bad.bin");
  Result<FileHandle> file =
      engine->open_file(path, {.write = true, .create = true, .direct = true});
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  AlignedBuffer memory(1 << 20);
  IoRequest overlap{IoOp::kRead, *file, 0, 64 << 10, memory.data()};
  overlap.memory_run_bytes = 16 << 10;
  overlap.memory_stride_bytes = 8 << 10;
  Result<Ticket> t = engine->submit(overlap);
  EXPECT_EQ(t.status().code(), Code::kInvalidArgument) << t.status().to_string();
  EXPECT_NE(t.status().message().find(path), std::string::npos) << t.status().to_string();
  IoRequest misaligned{IoOp::kRead, *file, 0, 64 << 10, memory.data()};
  misaligned.memory_run_bytes = 6000;
  misaligned.memory_stride_bytes = 12000;
  t = engine->submit(misaligned);
  EXPECT_EQ(t.status().code(), Code::kInvalidArgument) << t.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(Kinds, StridedRequestTest, io_test::kAllEngineKinds, io_test::kind_name);

}  // namespace
}  // namespace zinf
