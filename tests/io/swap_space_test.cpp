// SwapSpace: extents round-trip through one and several directories; every flipped bit, on
// disk or in flight, is caught by the checksum and named by key and offset; bad paths and full
// disks fail at open naming the path.
#include "io/swap_space.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "common/resident_memory.hpp"
#include "common/sanitizer.hpp"
#include "io/fault.hpp"
#include "io_test_util.hpp"

namespace zinf {
namespace {

using io_test::kSwapBlock;
using io_test::must_open;
using io_test::random_buffer;
using io_test::ScratchDir;
using io_test::ScratchMount;

// Swap options over `dir_count` fresh directories d0, d1, ... under `root`, blocks of kSwapBlock.
SwapOptions options_over_dirs(const ScratchDir& root, std::size_t dir_count,
                              std::uint64_t capacity_bytes) {
  SwapOptions options;
  for (std::size_t d = 0; d < dir_count; ++d) {
    options.dirs.push_back(fmt::format("{}/d{}", root.path(), d));
    std::filesystem::create_directories(options.dirs.back());
  }
  options.capacity_bytes = capacity_bytes;
  options.block_bytes = kSwapBlock;
  return options;
}

class SwapTest : public io_test::EngineKindTest {
 protected:
  std::unique_ptr<IoEngine> engine(std::shared_ptr<FaultInjector> faults = nullptr) {
    IoOptions options;
    options.block_bytes = 32 << 10;
    options.queue_depth = 8;
    options.max_requests = 2048;
    options.faults = std::move(faults);
    return must_open(GetParam(), options);
  }
};

// Extents of awkward sizes, several in flight at once, over 1 and 3 directories.
TEST_P(SwapTest, ExtentsRoundTripAcrossDirectories) {
  for (std::size_t dir_count : {1u, 3u}) {
    const std::uint64_t seed = 0x5a0 + dir_count;
    std::printf("swap round trip over %zu dirs: seed %llu\n", dir_count,
                static_cast<unsigned long long>(seed));
    ScratchDir root("swap-rt");
    const SwapOptions options = options_over_dirs(root, dir_count, 16 << 20);
    auto io = engine();
    ASSERT_TRUE(io);
    Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(*io, options);
    ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
    const std::vector<std::uint64_t> sizes = {1000, kSwapBlock, 3 * kSwapBlock + 4096 * 5 + 17,
                                              5 * kSwapBlock, 12345678 / 8};
    std::vector<ExtentId> ids;
    std::vector<AlignedBuffer> data;
    std::vector<SwapTicket> tickets;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      Result<ExtentId> id =
          (*swap)->create("rank0/group" + std::to_string(i) + "/exp_avg", sizes[i]);
      ASSERT_TRUE(id.is_ok()) << id.status().to_string();
      ids.push_back(*id);
      data.push_back(random_buffer((sizes[i] + 4095) / 4096 * 4096, seed + i));
      Result<SwapTicket> t = (*swap)->write(*id, data.back().data());
      ASSERT_TRUE(t.is_ok()) << t.status().to_string();
      tickets.push_back(*t);
    }
    for (SwapTicket t : tickets) ASSERT_TRUE((*swap)->wait(t, std::chrono::seconds(30)).is_ok());
    tickets.clear();
    std::vector<AlignedBuffer> back;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      back.emplace_back((sizes[i] + 4095) / 4096 * 4096);
      Result<SwapTicket> t = (*swap)->read(ids[i], back.back().data());
      ASSERT_TRUE(t.is_ok()) << t.status().to_string();
      tickets.push_back(*t);
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ASSERT_TRUE((*swap)->wait(tickets[i], std::chrono::seconds(30)).is_ok());
      EXPECT_EQ(std::memcmp(back[i].data(), data[i].data(), sizes[i]), 0) << "extent " << i;
    }
    // A part of an extent: its second and third blocks.
    Result<ExtentId> found = (*swap)->find("rank0/group3/exp_avg");
    ASSERT_TRUE(found.is_ok());
    AlignedBuffer part(2 * kSwapBlock);
    Result<SwapTicket> t = (*swap)->read(*found, kSwapBlock, 2 * kSwapBlock, part.data());
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    ASSERT_TRUE((*swap)->wait(*t, std::chrono::seconds(30)).is_ok());
    EXPECT_EQ(std::memcmp(part.data(), data[3].data() + kSwapBlock, 2 * kSwapBlock), 0);
    // Rewrite one block of it and read the whole extent back.
    AlignedBuffer patch = random_buffer(kSwapBlock, seed * 7);
    t = (*swap)->write(*found, 4 * kSwapBlock, kSwapBlock, patch.data());
    ASSERT_TRUE(t.is_ok());
    ASSERT_TRUE((*swap)->wait(*t, std::chrono::seconds(30)).is_ok());
    std::memcpy(data[3].data() + 4 * kSwapBlock, patch.data(), kSwapBlock);
    ASSERT_TRUE((*swap)->read_sync(*found, back[3].data()).is_ok());
    EXPECT_EQ(std::memcmp(back[3].data(), data[3].data(), sizes[3]), 0);
    // Each directory holds a share of the data when striped.
    for (const std::string& path : (*swap)->file_paths()) {
      EXPECT_TRUE(std::filesystem::exists(path)) << path;
    }
  }
}

TEST_P(SwapTest, RangeAndKeyErrors) {
  ScratchDir root("swap-args");
  auto io = engine();
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(
      *io, {.dirs = {root.path()}, .capacity_bytes = 1 << 20, .block_bytes = kSwapBlock});
  ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
  Result<ExtentId> id = (*swap)->create("a", 3 * kSwapBlock);
  ASSERT_TRUE(id.is_ok());
  EXPECT_EQ((*swap)->create("a", 10).status().code(), Code::kInvalidArgument);
  EXPECT_EQ((*swap)->find("b").status().code(), Code::kNotFound);
  EXPECT_NE((*swap)->find("b").status().message().find("b"), std::string::npos);
  AlignedBuffer buffer(3 * kSwapBlock);
  // Never written: reading is an error naming key and offset, not garbage.
  Result<SwapTicket> unwritten = (*swap)->read(*id, buffer.data());
  ASSERT_FALSE(unwritten.is_ok());
  EXPECT_EQ(unwritten.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(unwritten.status().message().find("a at offset 0"), std::string::npos)
      << unwritten.status().to_string();
  // Ranges must start on a block and cover whole blocks.
  EXPECT_EQ((*swap)->write(*id, 4096, kSwapBlock, buffer.data()).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ((*swap)->write(*id, 0, kSwapBlock + 4096, buffer.data()).status().code(),
            Code::kInvalidArgument);
  // Capacity: 1 MiB holds 16 blocks of 64 KiB; 3 are used.
  Result<ExtentId> too_big = (*swap)->create("big", 14 * kSwapBlock);
  ASSERT_FALSE(too_big.is_ok());
  EXPECT_EQ(too_big.status().code(), Code::kNoSpace);
  EXPECT_NE(too_big.status().message().find("big"), std::string::npos);
  EXPECT_NE(too_big.status().message().find(root.path()), std::string::npos);
  EXPECT_TRUE((*swap)->create("fits", 13 * kSwapBlock).is_ok());
}

// Flip bits in the swap file behind the engine's back: the read that covers them reports
// corruption naming key and offset, and reads of other blocks are unaffected.
TEST_P(SwapTest, BitFlippedOnDiskIsCaught) {
  const std::uint64_t seed = 0xb17;
  std::printf("on-disk bit flips: seed %llu\n", static_cast<unsigned long long>(seed));
  ScratchDir root("swap-flip");
  auto io = engine();
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(
      *io, {.dirs = {root.path()}, .capacity_bytes = 4 << 20, .block_bytes = kSwapBlock});
  ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
  (void)(*swap)->create("pad", 2 * kSwapBlock);  // so the extent does not start at file offset 0
  const std::uint64_t bytes = 8 * kSwapBlock;
  Result<ExtentId> id = (*swap)->create("rank1/group0/param", bytes);
  ASSERT_TRUE(id.is_ok());
  AlignedBuffer data = random_buffer(bytes, seed);
  ASSERT_TRUE((*swap)->write_sync(*id, data.data()).is_ok());

  const std::string file = (*swap)->file_paths()[0];
  const int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  SplitMix64 random(seed);
  AlignedBuffer back(bytes);
  for (int trial = 0; trial < 40; ++trial) {
    const std::uint64_t block = random.next() % 8;
    const std::uint64_t bit = random.next() % (kSwapBlock * 8);
    const off_t at = static_cast<off_t>(2 * kSwapBlock + block * kSwapBlock + bit / 8);
    unsigned char byte;
    ASSERT_EQ(::pread(fd, &byte, 1, at), 1);
    byte ^= static_cast<unsigned char>(1u << (bit % 8));
    ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
    ::fsync(fd);
    Status s = (*swap)->read_sync(*id, back.data());
    ASSERT_EQ(s.code(), Code::kCorruption) << "trial " << trial << ": " << s.to_string();
    EXPECT_NE(s.message().find("rank1/group0/param"), std::string::npos) << s.to_string();
    EXPECT_NE(s.message().find("extent offset " + std::to_string(block * kSwapBlock)),
              std::string::npos)
        << s.to_string();
    EXPECT_NE(s.message().find(file), std::string::npos) << s.to_string();
    // The other blocks still read clean.
    const std::uint64_t other = (block + 1) % 8;
    Result<SwapTicket> t = (*swap)->read(*id, other * kSwapBlock, kSwapBlock, back.data());
    ASSERT_TRUE(t.is_ok());
    EXPECT_TRUE((*swap)->wait(*t, std::chrono::seconds(10)).is_ok());
    EXPECT_EQ(std::memcmp(back.data(), data.data() + other * kSwapBlock, kSwapBlock), 0);
    // Undo the flip.
    byte ^= static_cast<unsigned char>(1u << (bit % 8));
    ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
    ::fsync(fd);
  }
  ::close(fd);
  ASSERT_TRUE((*swap)->read_sync(*id, back.data()).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), bytes), 0);
}

// Bits flipped in flight by the fault injector: every read op that got one is caught.
TEST_P(SwapTest, EveryBitFlippedInFlightIsCaught) {
  const std::uint64_t seed = 0xf11b;
  std::printf("in-flight bit flips: seed %llu\n", static_cast<unsigned long long>(seed));
  ScratchDir root("swap-flight");
  auto faults = std::make_shared<FaultInjector>(FaultSpec{.seed = seed, .bit_flip_rate = 0.3});
  faults->set_enabled(false);
  auto io = engine(faults);
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(
      *io, {.dirs = {root.path()}, .capacity_bytes = 8 << 20, .block_bytes = kSwapBlock});
  ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
  constexpr int kExtents = 32;
  const std::uint64_t bytes = 2 * kSwapBlock;  // 4 engine pieces of 32 KiB each
  std::vector<ExtentId> ids;
  std::vector<AlignedBuffer> data;
  for (int i = 0; i < kExtents; ++i) {
    ids.push_back(*(*swap)->create(fmt::format("e{}", i), bytes));
    data.push_back(random_buffer(bytes, seed + i));
    ASSERT_TRUE((*swap)->write_sync(ids.back(), data.back().data()).is_ok());
  }
  faults->set_enabled(true);
  std::uint64_t corrupt_ops = 0;
  for (int round = 0; round < 10; ++round) {
    std::vector<AlignedBuffer> back;
    std::vector<SwapTicket> tickets;
    for (int i = 0; i < kExtents; ++i) {
      back.emplace_back(bytes);
      tickets.push_back(*(*swap)->read(ids[i], back.back().data()));
    }
    for (int i = 0; i < kExtents; ++i) {
      Status s = (*swap)->wait(tickets[i], std::chrono::seconds(30));
      const bool differs = std::memcmp(back[i].data(), data[i].data(), bytes) != 0;
      if (differs) {
        ++corrupt_ops;
        EXPECT_EQ(s.code(), Code::kCorruption) << "extent " << i << " round " << round;
        EXPECT_NE(s.message().find(fmt::format("e{}", i)), std::string::npos);
      } else {
        EXPECT_TRUE(s.is_ok()) << s.to_string();
      }
    }
  }
  EXPECT_GT(faults->counts().bit_flip, 0u);
  EXPECT_GT(corrupt_ops, 0u);
}

// A failed write leaves its blocks unknown: the next read says so instead of returning them.
TEST_P(SwapTest, FailedWriteMarksBlocksLost) {
  const std::uint64_t seed = 0xe10;
  std::printf("failed write: seed %llu\n", static_cast<unsigned long long>(seed));
  ScratchDir root("swap-lost");
  auto faults = std::make_shared<FaultInjector>(FaultSpec{.seed = seed, .eio_rate = 1.0});
  faults->set_enabled(false);
  auto io = engine(faults);
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(
      *io, {.dirs = {root.path()}, .capacity_bytes = 1 << 20, .block_bytes = kSwapBlock});
  ASSERT_TRUE(swap.is_ok());
  ExtentId id = *(*swap)->create("k", kSwapBlock);
  AlignedBuffer data = random_buffer(kSwapBlock, seed);
  ASSERT_TRUE((*swap)->write_sync(id, data.data()).is_ok());
  faults->set_enabled(true);
  Status failed = (*swap)->write_sync(id, data.data());
  EXPECT_EQ(failed.code(), Code::kIoError);
  EXPECT_NE(failed.message().find("swap extent k"), std::string::npos) << failed.to_string();
  faults->set_enabled(false);
  Result<SwapTicket> t = (*swap)->read(id, data.data());
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), Code::kIoError);
}

// A synchronous read the drive never answers returns kTimeout with its ticket redeemed: cancelled
// when the cancel reaches it, abandoned when not even that does; either way the swap space goes
// on serving other ops, and an abandoned write's blocks read back as lost.
TEST_P(SwapTest, SyncOpsPastTheirTimeoutAreCancelledOrAbandoned) {
  for (const bool ignores_cancel : {false, true}) {
    const std::uint64_t seed = 0x5e7c + (ignores_cancel ? 1 : 0);
    ScratchDir root("swap-sync-hang");
    auto faults = std::make_shared<FaultInjector>(
        FaultSpec{.seed = seed, .hang_rate = 1.0, .hang_ignores_cancel = ignores_cancel});
    faults->set_enabled(false);
    auto io = engine(faults);
    ASSERT_TRUE(io);
    Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(
        *io, {.dirs = {root.path()}, .capacity_bytes = 1 << 20, .block_bytes = kSwapBlock});
    ASSERT_TRUE(swap.is_ok());
    ExtentId a = *(*swap)->create("a", kSwapBlock);
    ExtentId b = *(*swap)->create("b", kSwapBlock);
    AlignedBuffer data = random_buffer(kSwapBlock, seed);
    ASSERT_TRUE((*swap)->write_sync(a, data.data()).is_ok());
    ASSERT_TRUE((*swap)->write_sync(b, data.data()).is_ok());
    faults->set_enabled(true);
    AlignedBuffer back(kSwapBlock);
    const Status read = (*swap)->read_sync(a, back.data(), std::chrono::milliseconds(30));
    EXPECT_EQ(read.code(), Code::kTimeout) << read.to_string();
    EXPECT_NE(read.message().find(ignores_cancel ? "abandoned" : "cancelled"), std::string::npos)
        << read.to_string();
    const Status write = (*swap)->write_sync(b, data.data(), std::chrono::milliseconds(30));
    EXPECT_EQ(write.code(), Code::kTimeout) << write.to_string();
    faults->set_enabled(false);
    // The space still works; the hung write's blocks are lost, the other extent intact.
    AlignedBuffer again(kSwapBlock);
    ASSERT_TRUE((*swap)->read_sync(a, again.data()).is_ok());
    EXPECT_EQ(std::memcmp(again.data(), data.data(), kSwapBlock), 0);
    Result<SwapTicket> lost = (*swap)->read(b, again.data());
    ASSERT_FALSE(lost.is_ok());
    EXPECT_EQ(lost.status().code(), Code::kIoError) << lost.status().to_string();
  }
}

// The bytes of `path` from 0 to its end.
std::vector<unsigned char> file_bytes(const std::string& path) {
  std::vector<unsigned char> out(std::filesystem::file_size(path));
  const int fd = ::open(path.c_str(), O_RDONLY);
  EXPECT_GE(fd, 0) << path;
  EXPECT_EQ(::pread(fd, out.data(), out.size(), 0), static_cast<ssize_t>(out.size())) << path;
  ::close(fd);
  return out;
}

ino_t inode_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_ino;
}

// link_files() names the swap file's bytes at no copy, and nothing written afterwards reaches
// them: writes go to a new generation of the file, while blocks not rewritten are still read
// (and checksummed) from the frozen one, one read spanning both generations included.
TEST_P(SwapTest, LinkedFileNeverChangesAfterwards) {
  for (std::size_t dir_count : {1u, 2u}) {
    const std::uint64_t seed = 0x11c0 + dir_count;
    std::printf("linked swap files over %zu dirs: seed %llu\n", dir_count,
                static_cast<unsigned long long>(seed));
    ScratchDir root("swap-link");
    const SwapOptions options = options_over_dirs(root, dir_count, 4 << 20);
    std::vector<std::string> links;
    std::vector<std::string> names;
    for (std::size_t d = 0; d < dir_count; ++d) {
      links.push_back(fmt::format("{}/linked{}.bin", root.path(), d));
      names.push_back(fmt::format("checkpoint file {}", d));
    }
    auto io = engine();
    ASSERT_TRUE(io);
    Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*io, options);
    ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
    SwapSpace& swap = **opened;
    const std::vector<std::uint64_t> sizes = {3 * kSwapBlock + 5000, 2 * kSwapBlock, kSwapBlock};
    std::vector<ExtentId> ids;
    std::vector<AlignedBuffer> data;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      Result<ExtentId> id = swap.create(fmt::format("e{}", i), sizes[i]);
      ASSERT_TRUE(id.is_ok());
      ids.push_back(*id);
      data.push_back(random_buffer((sizes[i] + 4095) / 4096 * 4096, seed + i));
      ASSERT_TRUE(swap.write_sync(*id, data.back().data()).is_ok());
    }
    for (ExtentId id : ids) EXPECT_TRUE(swap.in_current_file(id));
    ASSERT_TRUE(swap.link_files(links, names).is_ok());
    for (std::size_t d = 0; d < dir_count; ++d) {
      EXPECT_EQ(inode_of(links[d]), inode_of(swap.file_paths()[d]));
    }
    for (ExtentId id : ids) EXPECT_FALSE(swap.in_current_file(id));  // frozen
    std::vector<std::vector<unsigned char>> frozen;
    for (const std::string& link : links) frozen.push_back(file_bytes(link));

    // New values for all of extent 0 and the second block of extent 1; extent 2 stays.
    AlignedBuffer new0 = random_buffer(data[0].bytes(), seed * 3);
    ASSERT_TRUE(swap.write_sync(ids[0], new0.data()).is_ok());
    AlignedBuffer new1 = random_buffer(kSwapBlock, seed * 5);
    Result<SwapTicket> t = swap.write(ids[1], kSwapBlock, kSwapBlock, new1.data());
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    ASSERT_TRUE(swap.wait(*t, std::chrono::seconds(30)).is_ok());
    std::memcpy(data[0].data(), new0.data(), new0.bytes());
    std::memcpy(data[1].data() + kSwapBlock, new1.data(), kSwapBlock);
    for (std::size_t d = 0; d < dir_count; ++d) {
      EXPECT_NE(inode_of(links[d]), inode_of(swap.file_paths()[d]));
      EXPECT_EQ(file_bytes(links[d]), frozen[d]) << "the linked file changed after the link";
    }
    EXPECT_TRUE(swap.in_current_file(ids[0]));
    EXPECT_FALSE(swap.in_current_file(ids[1]));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      AlignedBuffer back(data[i].bytes());
      ASSERT_TRUE(swap.read_sync(ids[i], back.data()).is_ok()) << "extent " << i;
      EXPECT_EQ(std::memcmp(back.data(), data[i].data(), sizes[i]), 0) << "extent " << i;
    }
    if (dir_count == 1) {
      // A flipped bit in a block still read from the frozen file is caught, naming that file.
      const off_t at = static_cast<off_t>(swap.file_offset(ids[2]) + 77);
      const int fd = ::open(links[0].c_str(), O_RDWR);
      ASSERT_GE(fd, 0);
      unsigned char byte = 0;
      ASSERT_EQ(::pread(fd, &byte, 1, at), 1);
      byte ^= 0x04;
      ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
      ::fsync(fd);
      AlignedBuffer back(data[2].bytes());
      Status s = swap.read_sync(ids[2], back.data());
      EXPECT_EQ(s.code(), Code::kCorruption) << s.to_string();
      EXPECT_NE(s.message().find(names[0]), std::string::npos) << s.to_string();
      byte ^= 0x04;
      ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
      ::close(fd);
    }
    // A link while a write is in flight is refused.
    t = swap.write(ids[0], new0.data());
    ASSERT_TRUE(t.is_ok());
    std::vector<std::string> again;
    for (const std::string& link : links) again.push_back(fmt::format("{}.2", link));
    Status busy = swap.link_files(again, names);
    EXPECT_EQ(busy.code(), Code::kFailedPrecondition) << busy.to_string();
    ASSERT_TRUE(swap.wait(*t, std::chrono::seconds(30)).is_ok());
    for (const std::string& link : again) EXPECT_FALSE(std::filesystem::exists(link));
  }
}

// A link to another filesystem fails with EXDEV, leaves no link, and freezes nothing.
TEST_P(SwapTest, LinkAcrossFilesystemsIsExdevAndFreezesNothing) {
  ScratchMount other("swap-link-other", "tmpfs", "size=4m");
  if (!other.ok()) GTEST_SKIP() << other.reason();
  ScratchDir root("swap-link-xdev");
  auto io = engine();
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(
      *io, {.dirs = {root.path()}, .capacity_bytes = 1 << 20, .block_bytes = kSwapBlock});
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  SwapSpace& swap = **opened;
  Result<ExtentId> id = swap.create("e", 2 * kSwapBlock);
  ASSERT_TRUE(id.is_ok());
  AlignedBuffer data = random_buffer(2 * kSwapBlock, 0xd1f);
  ASSERT_TRUE(swap.write_sync(*id, data.data()).is_ok());
  const ino_t before = inode_of(swap.file_paths()[0]);
  Status s = swap.link_files({other.path() + "/linked.bin"}, {"elsewhere"});
  EXPECT_EQ(s.sys_code(), EXDEV) << s.to_string();
  EXPECT_NE(s.message().find(other.path()), std::string::npos) << s.to_string();
  EXPECT_FALSE(std::filesystem::exists(other.path() + "/linked.bin"));
  ASSERT_TRUE(swap.write_sync(*id, data.data()).is_ok());
  EXPECT_EQ(inode_of(swap.file_paths()[0]), before);  // written in place: nothing was frozen
  EXPECT_TRUE(swap.in_current_file(*id));
}

// A swap space opened where a process of the same pid left its swap file (killed before its
// destructor ran: remove_files = false here stands for that; a container restarted after a crash
// gives the job the same pids) makes a file of its own: the old file's bytes, which a checkpoint
// linked, stay as they were.
TEST_P(SwapTest, OpenLeavesALinkedFileOfTheSameNameAlone) {
  ScratchDir root("swap-link-reopen");
  const std::string link = root.path() + "/checkpoint.bin";
  SwapOptions options{.dirs = {root.path()}, .capacity_bytes = 1 << 20, .block_bytes = kSwapBlock};
  options.file_name = "zinf-swap-same-pid.bin";
  options.remove_files = false;
  auto io = engine();
  ASSERT_TRUE(io);
  std::vector<unsigned char> linked;
  {
    Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*io, options);
    ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
    Result<ExtentId> id = (*opened)->create("e", 3 * kSwapBlock);
    ASSERT_TRUE(id.is_ok());
    AlignedBuffer data = random_buffer(3 * kSwapBlock, 0x5a5e);
    ASSERT_TRUE((*opened)->write_sync(*id, data.data()).is_ok());
    ASSERT_TRUE((*opened)->link_files({link}, {"checkpoint"}).is_ok());
    linked = file_bytes(link);
    ASSERT_EQ(std::memcmp(linked.data(), data.data(), 3 * kSwapBlock), 0);
  }
  const std::string swap_path = root.path() + "/" + options.file_name;
  ASSERT_EQ(inode_of(swap_path), inode_of(link));  // the name the next open meets
  options.remove_files = true;
  Result<std::unique_ptr<SwapSpace>> again = SwapSpace::open(*io, options);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_NE(inode_of(swap_path), inode_of(link));
  EXPECT_EQ(file_bytes(link), linked) << "opening the swap space changed the linked file";
  Result<ExtentId> id = (*again)->create("e", kSwapBlock);
  ASSERT_TRUE(id.is_ok());
  AlignedBuffer data = random_buffer(kSwapBlock, 0x5a5f);
  ASSERT_TRUE((*again)->write_sync(*id, data.data()).is_ok());
  EXPECT_EQ(file_bytes(link), linked);
}

// Two swap spaces of one process and rank in one directory (an engine opened while another of
// the same rank lives) share a file name: the second takes the name with a file of its own, and
// the first then neither links what the name now holds (ESTALE, nothing linked: the caller copies)
// nor removes the second's name when it closes.
TEST_P(SwapTest, ASpaceWhoseNameWasTakenLinksNothingAndLeavesTheNameAlone) {
  ScratchDir root("swap-link-shared-name");
  SwapOptions options{.dirs = {root.path()}, .capacity_bytes = 1 << 20, .block_bytes = kSwapBlock};
  options.file_name = "zinf-swap-one-name.bin";
  auto io = engine();
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> first = SwapSpace::open(*io, options);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  Result<ExtentId> a = (*first)->create("e", 2 * kSwapBlock);
  ASSERT_TRUE(a.is_ok());
  AlignedBuffer data_a = random_buffer(2 * kSwapBlock, 0xa11);
  ASSERT_TRUE((*first)->write_sync(*a, data_a.data()).is_ok());
  Result<std::unique_ptr<SwapSpace>> second = SwapSpace::open(*io, options);
  ASSERT_TRUE(second.is_ok()) << second.status().to_string();
  Result<ExtentId> b = (*second)->create("e", 2 * kSwapBlock);
  ASSERT_TRUE(b.is_ok());
  AlignedBuffer data_b = random_buffer(2 * kSwapBlock, 0xb22);
  ASSERT_TRUE((*second)->write_sync(*b, data_b.data()).is_ok());
  // The first still reads its own bytes; it does not link the second's file.
  AlignedBuffer back(2 * kSwapBlock);
  ASSERT_TRUE((*first)->read_sync(*a, back.data()).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), data_a.data(), 2 * kSwapBlock), 0);
  const std::string from_first = root.path() + "/first.bin";
  Status s = (*first)->link_files({from_first}, {"first"});
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
  EXPECT_EQ(s.sys_code(), ESTALE) << s.to_string();
  EXPECT_FALSE(std::filesystem::exists(from_first));
  EXPECT_TRUE((*first)->in_current_file(*a));  // nothing was frozen
  // Closing the first leaves the second's name, which it links.
  first->reset();
  const std::string from_second = root.path() + "/second.bin";
  s = (*second)->link_files({from_second}, {"second"});
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  const std::vector<unsigned char> linked = file_bytes(from_second);
  ASSERT_GE(linked.size(), 2 * kSwapBlock);
  EXPECT_EQ(std::memcmp(linked.data(), data_b.data(), 2 * kSwapBlock), 0);
}

// Sets or clears the append-only attribute of `path` (FS_APPEND_FL), on which the filesystem
// refuses to punch holes (EPERM); false where it cannot be set (not root, no such attribute).
bool set_append_only(const std::string& path, bool on) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return false;
  int flags = 0;
  bool ok = ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
  if (ok) {
    flags = on ? (flags | FS_APPEND_FL) : (flags & ~FS_APPEND_FL);
    ok = ::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
  }
  ::close(fd);
  return ok;
}

// release() over two directories whose second refuses the hole (its swap file append-only) after
// the first gave its part back: the first directory's blocks read zeros now, so they are lost
// (io_error, not a checksum mismatch or silent zeros), the second's keep their content, the error
// names both directories, and a write stores the extent again.
TEST_P(SwapTest, AReleaseThatFailsPartWayMarksTheBlocksGivenBackLost) {
  const std::uint64_t seed = 0x4e1;
  std::printf("release failing part-way: seed %llu\n", static_cast<unsigned long long>(seed));
  ScratchDir root("swap-release-part");
  const SwapOptions options = options_over_dirs(root, 2, 4 << 20);
  auto io = engine();
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*io, options);
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  SwapSpace& swap = **opened;
  constexpr std::size_t kUnits = 4;  // two in each directory
  const ExtentId id = *swap.create("k", kUnits * kSwapBlock);
  AlignedBuffer data = random_buffer(kUnits * kSwapBlock, seed);
  ASSERT_TRUE(swap.write_sync(id, data.data()).is_ok());
  const std::string second = swap.file_paths()[1];
  if (!set_append_only(second, true)) GTEST_SKIP() << "cannot make " << second << " append-only";
  struct Restore {
    std::string path;
    ~Restore() { (void)set_append_only(path, false); }  // or the scratch directory stays
  } restore{second};

  const Status released = swap.release(id);
  if (released.code() == Code::kUnsupported) GTEST_SKIP() << released.to_string();
  ASSERT_FALSE(released.is_ok());
  std::printf("%s\n", released.to_string().c_str());
  EXPECT_EQ(released.sys_code(), EPERM) << released.to_string();
  const std::string message(released.message());
  EXPECT_NE(message.find("swap extent k"), std::string::npos) << message;
  EXPECT_NE(message.find(options.dirs[1]), std::string::npos) << message;
  EXPECT_NE(message.find("given back already"), std::string::npos) << message;
  EXPECT_NE(message.find(options.dirs[0] + "/"), std::string::npos) << message;
  // Block by block: those of the first directory lost, those of the second as written.
  AlignedBuffer back(kSwapBlock, 4096);
  int lost = 0, kept = 0;
  for (std::size_t u = 0; u < kUnits; ++u) {
    Result<SwapTicket> t = swap.read(id, u * kSwapBlock, kSwapBlock, back.data());
    if (!t.is_ok()) {
      EXPECT_EQ(t.status().code(), Code::kIoError) << t.status().to_string();
      ++lost;
      continue;
    }
    ASSERT_TRUE(swap.wait(*t, std::chrono::seconds(10)).is_ok()) << "block " << u;
    EXPECT_EQ(std::memcmp(back.data(), data.data() + u * kSwapBlock, kSwapBlock), 0)
        << "block " << u;
    ++kept;
  }
  EXPECT_EQ(lost, 2);
  EXPECT_EQ(kept, 2);
  // Written again, the extent reads back whole.
  ASSERT_TRUE(set_append_only(second, false));
  AlignedBuffer next = random_buffer(kUnits * kSwapBlock, seed + 1);
  ASSERT_TRUE(swap.write_sync(id, next.data()).is_ok());
  AlignedBuffer whole(kUnits * kSwapBlock, 4096);
  ASSERT_TRUE(swap.read_sync(id, whole.data()).is_ok());
  EXPECT_EQ(std::memcmp(whole.data(), next.data(), kUnits * kSwapBlock), 0);
}

// A ticket per unit an op may move, for every op that can be in flight (max_ops, default 256):
// bounded by the space's files as well as max_op_bytes (default 1 GiB), so that a small space
// of small blocks costs kilobytes.
TEST_P(SwapTest, ASmallSpaceOfSmallBlocksCostsKilobytesNotTheDefaultOpsTickets) {
  if (test::kThreadSanitizer || test::kAddressSanitizer) {
    GTEST_SKIP() << "a sanitizer's shadow memory grows with every byte touched";
  }
  if (test::resident_anon_bytes() == 0) GTEST_SKIP() << "the kernel reports no RssAnon";
  ScratchDir root("swap-tickets-small");
  const SwapOptions options = options_over_dirs(root, 1, 2 << 20);
  auto io = engine();
  ASSERT_TRUE(io);
  const std::uint64_t before = test::resident_anon_bytes();
  Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(*io, options);
  ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
  const auto growth =
      static_cast<std::int64_t>(test::resident_anon_bytes()) - static_cast<std::int64_t>(before);
  // 256 ops of 2 MiB / 64 KiB + 1 = 33 tickets of 8 bytes: 66 KiB. With tickets for 1 GiB ops
  // it was 256 * 16385 * 8 bytes = 32 MiB.
  EXPECT_LE(growth, std::int64_t{2} << 20);
}

// Ops over the whole of an extent that fills the space, in one directory and striped over three,
// take every ticket the bound allows and read back what they wrote.
TEST_P(SwapTest, AnOpOverAWholeSpaceHasATicketForEveryUnit) {
  for (std::size_t dir_count : {1u, 3u}) {
    SCOPED_TRACE(fmt::format("{} directories", dir_count));
    ScratchDir root("swap-tickets-whole");
    const std::uint64_t bytes = 2 << 20;  // whole blocks: no striping slack needed
    const SwapOptions options = options_over_dirs(root, dir_count, bytes);
    auto io = engine();
    ASSERT_TRUE(io);
    Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(*io, options);
    ASSERT_TRUE(swap.is_ok()) << swap.status().to_string();
    Result<ExtentId> id = (*swap)->create("whole", bytes);
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    AlignedBuffer out = random_buffer(bytes, 41 + dir_count);
    AlignedBuffer back(bytes);
    ASSERT_TRUE((*swap)->write_sync(*id, out.data()).is_ok());
    ASSERT_TRUE((*swap)->read_sync(*id, back.data()).is_ok());
    EXPECT_EQ(0, std::memcmp(out.data(), back.data(), bytes));
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, SwapTest, io_test::kAllEngineKinds, io_test::kind_name);

TEST(SwapOpen, MissingDirectoryNamesIt) {
  auto io = must_open(EngineKind::kAuto);
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> swap =
      SwapSpace::open(*io, {.dirs = {"/nonexistent-zinf-swap"}, .capacity_bytes = 1 << 20});
  ASSERT_FALSE(swap.is_ok());
  EXPECT_EQ(swap.status().code(), Code::kNotFound);
  EXPECT_NE(swap.status().message().find("/nonexistent-zinf-swap"), std::string::npos);
}

// Asking for more than the disk has fails at open (fallocate), naming the path.
TEST(SwapOpen, MoreThanTheDiskHoldsIsNoSpaceAtOpen) {
  ScratchDir root("swap-full");
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(root.path().c_str(), &vfs), 0);
  const std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  auto io = must_open(EngineKind::kAuto);
  ASSERT_TRUE(io);
  Result<std::unique_ptr<SwapSpace>> swap = SwapSpace::open(
      *io, {.dirs = {root.path()}, .capacity_bytes = free_bytes + (std::uint64_t{1} << 40)});
  ASSERT_FALSE(swap.is_ok());
  EXPECT_EQ(swap.status().code(), Code::kNoSpace) << swap.status().to_string();
  EXPECT_NE(swap.status().message().find(root.path()), std::string::npos);
  // Nothing is left behind.
  EXPECT_TRUE(std::filesystem::is_empty(root.path()));
}

// A real full filesystem: a 2 MiB tmpfs. Writing past its size is no_space naming the file.
TEST(FullDisk, WriteOnFullFilesystemIsNoSpaceNamingThePath) {
  ScratchMount mount("full", "tmpfs", "size=2m");
  if (!mount.ok()) GTEST_SKIP() << mount.reason();
  for (EngineKind kind : {EngineKind::kUring, EngineKind::kThread}) {
    std::string why;
    if (kind == EngineKind::kUring && !io_test::uring_available(&why)) continue;
    auto io = must_open(kind, {.block_bytes = 256 << 10});
    ASSERT_TRUE(io);
    const std::string path = mount.path() + "/" + std::string(engine_kind_name(kind)) + ".bin";
    Result<FileHandle> file = io->open_file(path, {.create = true, .direct = false});
    ASSERT_TRUE(file.is_ok()) << file.status().to_string();
    AlignedBuffer data = random_buffer(4 << 20, 99);
    Status s = io->write_sync(*file, 0, 4 << 20, data.data());
    EXPECT_EQ(s.code(), Code::kNoSpace) << s.to_string();
    EXPECT_EQ(s.sys_code(), ENOSPC);
    EXPECT_NE(s.message().find(path), std::string::npos) << s.to_string();
    ASSERT_TRUE(io->close_file(*file).is_ok());
    std::filesystem::remove(path);
  }
}

// Swap files on a filesystem that refuses O_DIRECT (ramfs), or a read-only one, fail at open.
TEST(SwapOpen, RefusedODirectAndReadOnlyFailAtOpen) {
  auto io = must_open(EngineKind::kAuto);
  ASSERT_TRUE(io);
  {
    ScratchMount ramfs("ramfs", "ramfs", "");
    if (!ramfs.ok()) GTEST_SKIP() << ramfs.reason();
    Result<std::unique_ptr<SwapSpace>> swap =
        SwapSpace::open(*io, {.dirs = {ramfs.path()}, .capacity_bytes = 1 << 20});
    ASSERT_FALSE(swap.is_ok());
    EXPECT_EQ(swap.status().code(), Code::kUnsupported) << swap.status().to_string();
    EXPECT_NE(swap.status().message().find("O_DIRECT"), std::string::npos);
    EXPECT_NE(swap.status().message().find(ramfs.path()), std::string::npos);
  }
  {
    ScratchMount readonly("ro", "tmpfs", "size=1m,ro");
    if (!readonly.ok()) GTEST_SKIP() << readonly.reason();
    Result<std::unique_ptr<SwapSpace>> swap =
        SwapSpace::open(*io, {.dirs = {readonly.path()}, .capacity_bytes = 1 << 20});
    ASSERT_FALSE(swap.is_ok());
    EXPECT_EQ(swap.status().code(), Code::kIoError) << swap.status().to_string();
    EXPECT_NE(swap.status().message().find("not writable"), std::string::npos);
    EXPECT_NE(swap.status().message().find(readonly.path()), std::string::npos);
  }
}

}  // namespace
}  // namespace zinf
