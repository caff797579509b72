// A rank file's writer and reader hold a pipeline of aligned blocks no larger than the file:
// a small model's rank file costs a few pages, not the 48 MiB (6 blocks of 8 MiB) a large one
// moves through, and the bytes written read back the same whatever the pipeline's shape.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/resident_memory.hpp"
#include "common/sanitizer.hpp"
#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"

namespace zinf {
namespace {

// Eight random bytes a draw (the payloads are multiples of 4096).
std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (std::size_t at = 0; at < n; at += sizeof(std::uint64_t)) {
    const std::uint64_t word = rng();
    std::memcpy(out.data() + at, &word, std::min(sizeof word, n - at));
  }
  return out;
}

std::vector<std::byte> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  std::vector<std::byte> out(static_cast<std::size_t>(in.tellg()));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
  return out;
}

// ThreadSanitizer's shadow memory grows with every byte the pipeline touches, so under it the
// round trips run and the resident growth goes unchecked.
constexpr const char* kShadowGrowth = "resident growth under ThreadSanitizer is its shadow's";

// What a pipeline's blocks add to: anonymous pages, or huge pages where the machine reserves them.
std::uint64_t resident_bytes() { return test::resident_anon_bytes() + test::hugetlb_bytes(); }

// The resident memory the pipeline adds (its blocks are touched when it is made).
struct Growth {
  std::uint64_t before = resident_bytes();
  std::int64_t now() const {
    return static_cast<std::int64_t>(resident_bytes()) - static_cast<std::int64_t>(before);
  }
};

// Writes `payload` (a multiple of 4096, so that O_DIRECT adds no padding) with a writer told the
// file's size, and reads it back with a reader; returns each one's resident growth.
void round_trip(const std::string& path, const std::vector<std::byte>& payload,
                std::int64_t* writer_growth, std::int64_t* reader_growth) {
  Result<std::unique_ptr<IoEngine>> io = open_checkpoint_io(nullptr);
  ASSERT_TRUE(io.is_ok()) << io.status().to_string();
  {
    Growth growth;
    Result<std::unique_ptr<CheckpointWriter>> w =
        CheckpointWriter::create(**io, path, /*direct=*/true, payload.size());
    ASSERT_TRUE(w.is_ok()) << w.status().to_string();
    *writer_growth = growth.now();
    // In pieces that do not line up with any block.
    for (std::size_t at = 0; at < payload.size(); at += 1'000'003) {
      const std::size_t n = std::min<std::size_t>(1'000'003, payload.size() - at);
      ASSERT_TRUE((*w)->append(payload.data() + at, n).is_ok());
    }
    ASSERT_TRUE((*w)->commit().is_ok());
    EXPECT_EQ((*w)->bytes(), payload.size());
  }
  EXPECT_EQ(file_bytes(path), payload) << path;
  Result<std::unique_ptr<CheckpointReader>> r = CheckpointReader::open(**io, path, true);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  std::vector<std::byte> back(payload.size());
  Growth growth;
  ASSERT_TRUE((*r)->read(back.data(), 1).is_ok());  // the first read sets the pipeline up
  *reader_growth = growth.now();
  ASSERT_TRUE((*r)->read(back.data() + 1, back.size() - 1).is_ok());
  EXPECT_EQ(back, payload);
  Result<std::uint64_t> end = (*r)->finish();
  EXPECT_TRUE(end.is_ok()) << end.status().to_string();
}

constexpr std::int64_t kMiB = std::int64_t{1} << 20;

TEST(CheckpointPipeline, ASmallRankFileTakesAPipelineOfItsOwnSizeNotTheWholeOne) {
  engine_test::ScratchDir scratch("ckpt-pipeline-small");
  if (test::resident_anon_bytes() == 0) GTEST_SKIP() << "the kernel reports no RssAnon";
  const std::vector<std::byte> payload = random_bytes(3 * 4096, 7);
  std::int64_t writer = 0, reader = 0;
  round_trip(scratch.path() + "/small.zinfckpt", payload, &writer, &reader);
  if (test::kThreadSanitizer) GTEST_SKIP() << kShadowGrowth;
  // One block of 12 KiB, mapped in one 2 MiB page at most; the whole pipeline is 48 MiB.
  EXPECT_LE(writer, 4 * kMiB);
  EXPECT_LE(reader, 4 * kMiB);
}

TEST(CheckpointPipeline, AFileOfAFewBlocksTakesThoseBlocksAndReadsBackTheSame) {
  engine_test::ScratchDir scratch("ckpt-pipeline-mid");
  if (test::resident_anon_bytes() == 0) GTEST_SKIP() << "the kernel reports no RssAnon";
  // Two full 8 MiB blocks and part of a third.
  const std::size_t bytes = 2 * kCheckpointBlockBytes + std::size_t{1'234'567} / 4096 * 4096 + 4096;
  const std::vector<std::byte> payload = random_bytes(bytes, 11);
  std::int64_t writer = 0, reader = 0;
  round_trip(scratch.path() + "/mid.zinfckpt", payload, &writer, &reader);
  if (test::kThreadSanitizer) GTEST_SKIP() << kShadowGrowth;
  const std::int64_t three_blocks = 3 * static_cast<std::int64_t>(kCheckpointBlockBytes);
  EXPECT_LE(writer, three_blocks + 4 * kMiB);
  EXPECT_LE(reader, three_blocks + 4 * kMiB);
}

TEST(CheckpointPipeline, AFileLargerThanThePipelineTakesAllOfItAndReadsBackTheSame) {
  engine_test::ScratchDir scratch("ckpt-pipeline-large");
  if (test::resident_anon_bytes() == 0) GTEST_SKIP() << "the kernel reports no RssAnon";
  const std::size_t bytes = (kCheckpointPipelineBlocks + 1) * kCheckpointBlockBytes + 8192;
  const std::vector<std::byte> payload = random_bytes(bytes, 13);
  std::int64_t writer = 0, reader = 0;
  round_trip(scratch.path() + "/large.zinfckpt", payload, &writer, &reader);
  if (test::kThreadSanitizer) GTEST_SKIP() << kShadowGrowth;
  // Six blocks of 8 MiB, touched when the pipeline is made: no fewer, and no more.
  const std::int64_t whole = kCheckpointPipelineBlocks * kCheckpointBlockBytes;
  EXPECT_GE(writer, whole - 4 * kMiB);
  EXPECT_LE(writer, whole + 4 * kMiB);
  EXPECT_GE(reader, whole - 4 * kMiB);
  EXPECT_LE(reader, whole + 4 * kMiB);
}

}  // namespace
}  // namespace zinf
