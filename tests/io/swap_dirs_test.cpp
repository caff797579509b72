// SwapSpace over several directories: an op takes a few engine requests per directory, not one
// per block (a few more where a checkpoint link left its blocks in two generations), and its
// blocks land where the striping puts them; a directory listed twice, or spelled two ways, is
// refused at open naming it.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "io/swap_space.hpp"
#include "io_test_util.hpp"

namespace zinf {
namespace {

using io_test::kSwapBlock;
using io_test::must_open;
using io_test::random_buffer;
using io_test::read_file_plain;
using io_test::ScratchDir;

// `dir_count` fresh directories d0, d1, ... under `root`.
std::vector<std::string> make_dirs(const ScratchDir& root, std::size_t dir_count) {
  std::vector<std::string> dirs;
  for (std::size_t d = 0; d < dir_count; ++d) {
    dirs.push_back(fmt::format("{}/d{}", root.path(), d));
    std::filesystem::create_directories(dirs.back());
  }
  return dirs;
}

class SwapDirsTest : public io_test::EngineKindTest {
 protected:
  // Pieces of one swap block, 32 deep: the engine of an aio block of 64 KiB at depth 32.
  std::unique_ptr<IoEngine> engine(std::uint32_t max_requests) {
    IoOptions options;
    options.block_bytes = kSwapBlock;
    options.queue_depth = 32;
    options.max_requests = max_requests;
    return must_open(GetParam(), options);
  }

  // A SwapSpace on `io` striped over `dir_count` fresh directories under `root`, in blocks of
  // kSwapBlock up to `capacity_bytes`; null, failing the test, where it does not open.
  static std::unique_ptr<SwapSpace> open_striped(IoEngine& io, const ScratchDir& root,
                                                 std::size_t dir_count,
                                                 std::uint64_t capacity_bytes) {
    SwapOptions options;
    options.dirs = make_dirs(root, dir_count);
    options.block_bytes = kSwapBlock;
    options.capacity_bytes = capacity_bytes;
    Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(io, options);
    EXPECT_TRUE(opened.is_ok()) << opened.status().to_string();
    if (!opened.is_ok()) return nullptr;
    return std::move(opened).value();
  }
};

// Eight 8 MiB ops in flight at once over 2 directories fit an engine of 64 requests: each takes
// 8 (4 rounds of 16 blocks per directory), where one request per block took 128 and the first op
// already ran out. What lands in each file is the striping's layout, checked byte for byte
// against the caller's memory with plain reads, and everything reads back.
TEST_P(SwapDirsTest, StripedOpsTakeAFewRequestsPerDirectory) {
  const std::uint64_t seed = 0x5d1;
  std::printf("striped ops: seed %llu\n", static_cast<unsigned long long>(seed));
  ScratchDir root("swap-dirs-requests");
  constexpr std::size_t kDirs = 2;
  constexpr std::size_t kOps = 8;
  constexpr std::uint64_t kExtentBytes = 8 << 20;
  SwapOptions options;
  options.dirs = make_dirs(root, kDirs);
  options.block_bytes = kSwapBlock;
  options.capacity_bytes = kOps * kExtentBytes + kDirs * kOps * kSwapBlock;
  options.max_ops = kOps;
  options.max_op_bytes = kExtentBytes;
  auto io = engine(kOps * 8);
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*io, options);
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  SwapSpace& swap = **opened;
  EXPECT_EQ(swap.op_requests(kExtentBytes), 8u);
  EXPECT_EQ(swap.op_requests(kSwapBlock), 1u);
  EXPECT_EQ(swap.op_requests(3 * kSwapBlock), 2u);

  std::vector<ExtentId> ids;
  std::vector<AlignedBuffer> data;
  for (std::size_t i = 0; i < kOps; ++i) {
    Result<ExtentId> id = swap.create(fmt::format("rank0/group{}/exp_avg", i), kExtentBytes);
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    ids.push_back(*id);
    data.push_back(random_buffer(kExtentBytes, seed + i));
  }
  for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
    std::vector<AlignedBuffer> back;
    std::vector<SwapTicket> tickets;
    const std::uint64_t requests_before = io->stats().requests;
    for (std::size_t i = 0; i < kOps; ++i) {
      back.emplace_back(kExtentBytes);
      std::memset(back.back().data(), 0, kExtentBytes);
      Result<SwapTicket> t = op == IoOp::kWrite ? swap.write(ids[i], data[i].data())
                                                : swap.read(ids[i], back.back().data());
      ASSERT_TRUE(t.is_ok()) << io_op_name(op) << " " << i << ": " << t.status().to_string();
      tickets.push_back(*t);
    }
    for (std::size_t i = 0; i < kOps; ++i) {
      Status s = swap.wait(tickets[i], std::chrono::seconds(60));
      ASSERT_TRUE(s.is_ok()) << io_op_name(op) << " " << i << ": " << s.to_string();
      if (op == IoOp::kRead) {
        EXPECT_EQ(std::memcmp(back[i].data(), data[i].data(), kExtentBytes), 0) << "extent " << i;
      }
    }
    EXPECT_EQ(io->stats().requests - requests_before, kOps * 8) << io_op_name(op);
  }
  // Extent i starts in directory i % 2 and goes round: block u in directory (i + u) % 2, at the
  // extent's region (i earlier extents of half their blocks each) plus u / 2 blocks.
  std::vector<std::string> files;
  for (const std::string& path : swap.file_paths()) files.push_back(read_file_plain(path));
  for (std::size_t i = 0; i < kOps; ++i) {
    const std::uint64_t blocks = kExtentBytes / kSwapBlock;
    for (std::uint64_t u = 0; u < blocks; ++u) {
      const std::size_t d = (i + u) % kDirs;
      const std::uint64_t at = i * (blocks / kDirs) * kSwapBlock + (u / kDirs) * kSwapBlock;
      ASSERT_LE(at + kSwapBlock, files[d].size());
      ASSERT_EQ(std::memcmp(files[d].data() + at, data[i].data() + u * kSwapBlock, kSwapBlock), 0)
          << "extent " << i << " block " << u << " in directory " << d;
    }
  }
}

// Awkward sizes over 3 directories (a last block short of a page-rounded end, fewer blocks than
// directories) round-trip, with a partial read from an inner block.
TEST_P(SwapDirsTest, AwkwardExtentsRoundTripOverThreeDirectories) {
  const std::uint64_t seed = 0x5d3;
  std::printf("awkward striped extents: seed %llu\n", static_cast<unsigned long long>(seed));
  ScratchDir root("swap-dirs-awkward");
  auto io = engine(1024);
  ASSERT_TRUE(io);
  std::unique_ptr<SwapSpace> opened = open_striped(*io, root, 3, 16 << 20);
  ASSERT_TRUE(opened);
  SwapSpace& swap = *opened;
  const std::vector<std::uint64_t> sizes = {1000, 2 * kSwapBlock + 17,
                                            37 * kSwapBlock + 4096 * 3 + 5, 100 * kSwapBlock};
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    Result<ExtentId> id = swap.create(fmt::format("e{}", i), sizes[i]);
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    AlignedBuffer data = random_buffer((sizes[i] + 4095) / 4096 * 4096, seed + i);
    ASSERT_TRUE(swap.write_sync(*id, data.data()).is_ok());
    AlignedBuffer back(data.bytes());
    std::memset(back.data(), 0, back.bytes());
    ASSERT_TRUE(swap.read_sync(*id, back.data()).is_ok()) << "extent " << i;
    EXPECT_EQ(std::memcmp(back.data(), data.data(), sizes[i]), 0) << "extent " << i;
    if (sizes[i] > 4 * kSwapBlock) {
      std::memset(back.data(), 0, back.bytes());
      ASSERT_TRUE(swap.read_sync(*id, kSwapBlock, 3 * kSwapBlock, back.data()).is_ok());
      EXPECT_EQ(std::memcmp(back.data(), data.data() + kSwapBlock, 3 * kSwapBlock), 0)
          << "extent " << i;
    }
  }
}

// After link_files(), rewriting some blocks leaves an extent in two generations of each file,
// so one directory's share of a round is several requests, each read from the file its blocks
// were last written to. 13 blocks over 2 directories (the last short), all in one round of the
// engine's depth: directory 0 holds blocks 0, 2, ..., 12 and directory 1 blocks 1, 3, ..., 11.
// Rewriting blocks 2, 3, 6 and 9 splits directory 0's share into {0} {2} {4} {6} {8 10 12} and
// directory 1's into {1} {3} {5 7} {9} {11}: 10 requests, and every byte reads back, the whole
// extent and a range from inside it.
TEST_P(SwapDirsTest, ADirectorysShareSplitsByGeneration) {
  const std::uint64_t seed = 0x5d9;
  std::printf("striped extent over two generations: seed %llu\n",
              static_cast<unsigned long long>(seed));
  ScratchDir root("swap-dirs-generations");
  auto io = engine(1024);
  ASSERT_TRUE(io);
  std::unique_ptr<SwapSpace> opened = open_striped(*io, root, 2, 4 << 20);
  ASSERT_TRUE(opened);
  SwapSpace& swap = *opened;
  constexpr std::uint64_t kExtentBytes = 12 * kSwapBlock + 20000;
  constexpr std::uint64_t kMemoryBytes = 13 * kSwapBlock;
  EXPECT_EQ(swap.op_requests(kExtentBytes), 2u);  // one round: one request per directory
  Result<ExtentId> id = swap.create("rank0/group0/fp32", kExtentBytes);
  ASSERT_TRUE(id.is_ok()) << id.status().to_string();
  AlignedBuffer data = random_buffer(kMemoryBytes, seed);
  ASSERT_TRUE(swap.write_sync(*id, data.data()).is_ok());
  std::vector<std::string> links;
  for (std::size_t d = 0; d < 2; ++d) {
    links.push_back(fmt::format("{}/linked{}.bin", root.path(), d));
  }
  Status linked = swap.link_files(links, {"checkpoint file 0", "checkpoint file 1"});
  ASSERT_TRUE(linked.is_ok()) << linked.to_string();

  // New values for blocks 2 and 3 (one write over both directories), 6 and 9.
  AlignedBuffer fresh = random_buffer(kMemoryBytes, seed * 7);
  for (const auto& [first, blocks] :
       {std::pair<std::uint64_t, std::uint64_t>{2, 2}, {6, 1}, {9, 1}}) {
    Result<SwapTicket> t =
        swap.write(*id, first * kSwapBlock, blocks * kSwapBlock, fresh.data() + first * kSwapBlock);
    ASSERT_TRUE(t.is_ok()) << "block " << first << ": " << t.status().to_string();
    Status written = swap.wait(*t, std::chrono::seconds(30));
    ASSERT_TRUE(written.is_ok()) << "block " << first << ": " << written.to_string();
    std::memcpy(data.data() + first * kSwapBlock, fresh.data() + first * kSwapBlock,
                blocks * kSwapBlock);
  }
  EXPECT_FALSE(swap.in_current_file(*id));

  AlignedBuffer back(kMemoryBytes);
  std::memset(back.data(), 0, back.bytes());
  const std::uint64_t requests_before = io->stats().requests;
  Status read = swap.read_sync(*id, back.data());
  ASSERT_TRUE(read.is_ok()) << read.to_string();
  EXPECT_EQ(io->stats().requests - requests_before, 10u);
  for (std::uint64_t b = 0; b < 13; ++b) {
    const std::uint64_t bytes = std::min(kSwapBlock, kExtentBytes - b * kSwapBlock);
    EXPECT_EQ(std::memcmp(back.data() + b * kSwapBlock, data.data() + b * kSwapBlock, bytes), 0)
        << "block " << b;
  }
  // Blocks 1 to 10: a range that starts in directory 1 and crosses every split.
  std::memset(back.data(), 0, back.bytes());
  read = swap.read_sync(*id, kSwapBlock, 10 * kSwapBlock, back.data());
  ASSERT_TRUE(read.is_ok()) << read.to_string();
  EXPECT_EQ(std::memcmp(back.data(), data.data() + kSwapBlock, 10 * kSwapBlock), 0);
}

INSTANTIATE_TEST_SUITE_P(Kinds, SwapDirsTest, io_test::kAllEngineKinds, io_test::kind_name);

SwapOptions small_options(std::vector<std::string> dirs) {
  SwapOptions options;
  options.dirs = std::move(dirs);
  options.block_bytes = kSwapBlock;
  options.capacity_bytes = 1 << 20;
  return options;
}

// A directory listed twice is refused, naming it, and leaves no swap file behind.
TEST(SwapDirsOpen, ADirectoryListedTwiceIsRefusedNamingIt) {
  ScratchDir root("swap-dirs-twice");
  const std::string dir = root.path() + "/a-directory-of-a-long-name-past-any-small-string";
  std::filesystem::create_directories(dir);
  auto io = must_open(EngineKind::kThread);
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*io, small_options({dir, dir}));
  ASSERT_EQ(opened.status().code(), Code::kInvalidArgument) << opened.status().to_string();
  EXPECT_NE(opened.status().message().find(dir), std::string::npos) << opened.status().to_string();
  EXPECT_TRUE(std::filesystem::is_empty(dir));
}

// One directory spelled two ways (a trailing slash, a symlink) is refused naming both
// spellings: two swap files at one path would unlink each other's name.
TEST(SwapDirsOpen, OneDirectorySpelledTwoWaysIsRefusedNamingBoth) {
  ScratchDir root("swap-dirs-spelled");
  const std::string dir = root.path() + "/nvme";
  const std::string link = root.path() + "/nvme-link";
  std::filesystem::create_directories(dir);
  std::filesystem::create_directory_symlink(dir, link);
  auto io = must_open(EngineKind::kThread);
  ASSERT_TRUE(io);
  for (const std::string& other : {dir + "/", dir + "/.", link}) {
    Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*io, small_options({dir, other}));
    ASSERT_EQ(opened.status().code(), Code::kInvalidArgument)
        << other << ": " << opened.status().to_string();
    EXPECT_NE(opened.status().message().find(dir + " "), std::string::npos)
        << opened.status().to_string();
    EXPECT_NE(opened.status().message().find(other), std::string::npos)
        << opened.status().to_string();
    EXPECT_TRUE(std::filesystem::is_empty(dir)) << other;
  }
  // Two directories are two directories.
  const std::string second = root.path() + "/nvme2";
  std::filesystem::create_directories(second);
  Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*io, small_options({dir, second}));
  EXPECT_TRUE(opened.is_ok()) << opened.status().to_string();
}

TEST(SwapDirsOpen, UniqueDirectoriesKeepsTheFirstSpellingOfEach) {
  ScratchDir root("swap-dirs-unique");
  const std::string a = root.path() + "/a";
  const std::string b = root.path() + "/b";
  const std::string link = root.path() + "/to-b";
  std::filesystem::create_directories(a);
  std::filesystem::create_directories(b);
  std::filesystem::create_directory_symlink(b, link);
  const std::string missing = root.path() + "/missing";
  EXPECT_TRUE(same_directory(a, a + "/"));
  EXPECT_TRUE(same_directory(link, b));
  EXPECT_FALSE(same_directory(a, b));
  EXPECT_FALSE(same_directory(missing, missing + "/"));  // not there: compared as strings
  const std::vector<std::string> unique =
      unique_directories({a, b, a + "/", link, missing, a + "/./", missing, b + "/"});
  EXPECT_EQ(unique, (std::vector<std::string>{a, b, missing}));
}

}  // namespace
}  // namespace zinf
