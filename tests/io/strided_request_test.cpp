// IoRequest with memory in runs (memory_run_bytes / memory_stride_bytes): a contiguous range of
// the file moves to and from runs of memory a stride apart, checked against the file read
// without the engine; the gaps between runs are never touched, short transfers included;
// overlapping or misaligned runs are refused, naming what is misaligned.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "io/fault.hpp"
#include "io/io_engine.hpp"
#include "io_test_util.hpp"

namespace zinf {
namespace {

using io_test::must_open;
using io_test::random_buffer;
using io_test::read_file_plain;
using io_test::ScratchDir;

class StridedRequestTest : public io_test::EngineKindTest {};

// `on_disk` holds, from `file_offset`, `source`'s runs of `run_bytes` every `stride_bytes` end to
// end, `bytes` in all (checked a 4 KiB block at a time).
void expect_file_holds_runs(const std::string& on_disk, std::uint64_t file_offset,
                            const AlignedBuffer& source, std::size_t bytes, std::size_t run_bytes,
                            std::size_t stride_bytes) {
  for (std::size_t at = 0; at < bytes; at += 4096) {
    const std::size_t memory = (at / run_bytes) * stride_bytes + at % run_bytes;
    ASSERT_EQ(std::memcmp(on_disk.data() + file_offset + at, source.data() + memory, 4096), 0)
        << "file offset " << file_offset + at;
  }
}

// `back` (filled with 0xee before the read) holds `source`'s runs of `run_bytes` every
// `stride_bytes`, `bytes` in all (the last run the rest), and its gaps are still 0xee.
void expect_runs_read_back(const AlignedBuffer& back, const AlignedBuffer& source,
                           std::size_t bytes, std::size_t run_bytes, std::size_t stride_bytes) {
  const std::size_t runs = (bytes + run_bytes - 1) / run_bytes;
  for (std::size_t k = 0; k < runs; ++k) {
    const std::size_t run = k + 1 < runs ? run_bytes : bytes - k * run_bytes;
    EXPECT_EQ(std::memcmp(back.data() + k * stride_bytes, source.data() + k * stride_bytes, run), 0)
        << "run " << k;
    const std::size_t gap_end = k + 1 < runs ? (k + 1) * stride_bytes : back.bytes();
    for (std::size_t at = k * stride_bytes + run; at < gap_end; ++at) {
      ASSERT_EQ(static_cast<unsigned char>(back.data()[at]), 0xee) << "gap byte " << at;
    }
  }
}

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

  IoRequest write{IoOp::kWrite, *file, kFileOffset, kBytes, source.data(), kRun, kStride};
  Result<Ticket> t = engine->submit(write);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_TRUE(engine->wait(*t, std::chrono::seconds(30)).is_ok());
  const std::string on_disk = read_file_plain(path);
  ASSERT_EQ(on_disk.size(), kFileOffset + kBytes);
  ASSERT_NO_FATAL_FAILURE(
      expect_file_holds_runs(on_disk, kFileOffset, source, kBytes, kRun, kStride));

  AlignedBuffer back(kRuns * kStride);
  std::memset(back.data(), 0xee, back.bytes());
  IoRequest read{IoOp::kRead, *file, kFileOffset, kBytes, back.data(), kRun, kStride};
  t = engine->submit(read);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_TRUE(engine->wait(*t, std::chrono::seconds(30)).is_ok());
  ASSERT_NO_FATAL_FAILURE(expect_runs_read_back(back, source, kBytes, kRun, kStride));
}

// Most pieces come back short (whole 4 KiB blocks, as O_DIRECT does) and the engine resubmits
// the rest from where each stopped: within a run of memory, never into the gap after it. Runs
// of 40 KiB every 72 KiB in pieces of 16 KiB (16 + 16 + 8 per run), the last run 20 KiB.
TEST_P(StridedRequestTest, ShortTransfersResumeWithinTheirRun) {
  const std::uint64_t seed = 0x57e;
  std::printf("strided request with short transfers: seed %llu\n",
              static_cast<unsigned long long>(seed));
  ScratchDir dir("strided-short");
  auto faults = std::make_shared<FaultInjector>(FaultSpec{.seed = seed, .short_rate = 0.7});
  faults->set_enabled(false);
  IoOptions options;
  options.block_bytes = 16 << 10;
  options.queue_depth = 8;
  options.faults = faults;
  auto engine = must_open(GetParam(), options);
  ASSERT_TRUE(engine);
  const std::string path = dir.file("strided-short.bin");
  Result<FileHandle> file =
      engine->open_file(path, {.write = true, .create = true, .direct = true});
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  constexpr std::size_t kRun = 40 << 10;
  constexpr std::size_t kStride = 72 << 10;
  constexpr std::size_t kRuns = 12;
  constexpr std::size_t kBytes = (kRuns - 1) * kRun + (20 << 10);
  constexpr std::uint64_t kFileOffset = 32 << 10;
  // The file starts as other random bytes, so a write that missed a place shows.
  AlignedBuffer before = random_buffer(kFileOffset + kRuns * kStride, seed ^ 0xb4);
  ASSERT_TRUE(engine->write_sync(*file, 0, before.bytes(), before.data()).is_ok());
  AlignedBuffer source = random_buffer(kRuns * kStride, seed);
  faults->set_enabled(true);

  IoRequest write{IoOp::kWrite, *file, kFileOffset, kBytes, source.data(), kRun, kStride};
  Result<Ticket> t = engine->submit(write);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  Status done = engine->wait(*t, std::chrono::seconds(30));
  ASSERT_TRUE(done.is_ok()) << done.to_string();
  const std::uint64_t write_shorts = faults->counts().short_io;
  EXPECT_GT(write_shorts, 0u);
  const std::string on_disk = read_file_plain(path);
  ASSERT_EQ(on_disk.size(), before.bytes());
  EXPECT_EQ(std::memcmp(on_disk.data(), before.data(), kFileOffset), 0) << "before the range";
  ASSERT_NO_FATAL_FAILURE(
      expect_file_holds_runs(on_disk, kFileOffset, source, kBytes, kRun, kStride));
  EXPECT_EQ(std::memcmp(on_disk.data() + kFileOffset + kBytes, before.data() + kFileOffset + kBytes,
                        before.bytes() - kFileOffset - kBytes),
            0)
      << "after the range";

  AlignedBuffer back(kRuns * kStride);
  std::memset(back.data(), 0xee, back.bytes());
  IoRequest read{IoOp::kRead, *file, kFileOffset, kBytes, back.data(), kRun, kStride};
  t = engine->submit(read);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  done = engine->wait(*t, std::chrono::seconds(30));
  ASSERT_TRUE(done.is_ok()) << done.to_string();
  EXPECT_GT(faults->counts().short_io, write_shorts);
  EXPECT_GE(engine->stats().short_resubmits, faults->counts().short_io);
  ASSERT_NO_FATAL_FAILURE(expect_runs_read_back(back, source, kBytes, kRun, kStride));
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
  EXPECT_NE(t.status().message().find("memory_run_bytes 6000"), std::string::npos)
      << t.status().to_string();
  EXPECT_NE(t.status().message().find("memory_stride_bytes 12000"), std::string::npos)
      << t.status().to_string();
  // Offset, length, address and run aligned, the stride not: the message names the stride and
  // nothing else as misaligned.
  IoRequest stride{IoOp::kRead, *file, 0, 64 << 10, memory.data()};
  stride.memory_run_bytes = 8 << 10;
  stride.memory_stride_bytes = (12 << 10) + 512;
  t = engine->submit(stride);
  ASSERT_EQ(t.status().code(), Code::kInvalidArgument) << t.status().to_string();
  const std::string message(t.status().message());
  EXPECT_NE(message.find("not aligned: memory_stride_bytes 12800"), std::string::npos) << message;
  EXPECT_EQ(message.find("memory_run_bytes 8192"), std::string::npos) << message;
  EXPECT_NE(message.find(path), std::string::npos) << message;
}

INSTANTIATE_TEST_SUITE_P(Kinds, StridedRequestTest, io_test::kAllEngineKinds, io_test::kind_name);

}  // namespace
}  // namespace zinf
