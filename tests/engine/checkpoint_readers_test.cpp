// RankFileReaders on its own: a tag of more rank files than it keeps open
// (kCheckpointOpenReaderCount) is read in an order that closes and reopens them, and every read
// returns the bytes written; a rank file closed by the limit and then replaced (another file
// renamed over it, unlinked and created again, written in place), each time with the same size and
// other bytes, is refused on its reopen with kCorruption naming it, while one only linked and
// unlinked again still reads. The files are seeded random bytes (the seed printed); every fourth is
// a linked one (longer than the manifest says, with block checksums in rank<r>.blocks).
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/scratch_dir.hpp"
#include "engine/checkpoint.hpp"

namespace zinf {
namespace {

constexpr int kRanks = 40;  // more than kCheckpointOpenReaderCount (32)
constexpr std::uint64_t kFileBytes = 3 * 4096;
constexpr std::uint64_t kLinkedTailBytes = 4096;  // a linked file's bytes past the manifest's
constexpr std::uint64_t kReadersSeed = 0x5eed'7e75;

std::vector<char> seeded_bytes(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<char> out(count);
  for (char& c : out) c = static_cast<char>(gen() & 0xff);
  return out;
}

void write_file(const std::string& path, const char* data, std::size_t bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data, static_cast<std::streamsize>(bytes));
  ASSERT_TRUE(out.good()) << path;
}

bool is_linked(int rank) { return rank % 4 == 3; }

// A tag directory of kRanks rank files and the manifest that describes them.
struct Tag {
  explicit Tag(const std::string& name) : dir(name) {
    std::printf("checkpoint_readers_test seed %#llx\n",
                static_cast<unsigned long long>(kReadersSeed));
    for (int r = 0; r < kRanks; ++r) {
      ManifestFile f;
      f.file = fmt::format("rank{}.zinfckpt", r);
      f.bytes = kFileBytes;
      const std::uint64_t on_disk = kFileBytes + (is_linked(r) ? kLinkedTailBytes : 0);
      bytes.push_back(seeded_bytes(on_disk, kReadersSeed + static_cast<std::uint64_t>(r)));
      write_file(dir.file(f.file), bytes.back().data(), on_disk);
      if (is_linked(r)) {
        std::vector<FileBlockSum> sums;
        for (std::uint64_t end = 4096; end <= kFileBytes; end += 4096) {
          sums.push_back({end, XXH3_64bits(bytes.back().data() + end - 4096, 4096)});
        }
        const std::string encoded = encode_block_sums(sums);
        f.blocks = fmt::format("rank{}.blocks", r);
        f.blocks_bytes = encoded.size();
        f.blocks_xxh3 = XXH3_64bits(encoded.data(), encoded.size());
        write_file(dir.file(f.blocks), encoded.data(), encoded.size());
      } else {
        f.xxh3 = XXH3_64bits(bytes.back().data(), kFileBytes);
      }
      manifest.ranks.push_back(f);
    }
  }

  // Every rank file verified, as a resharded load and export do, and handed to `readers`.
  void verify_all(IoEngine& io, RankFileReaders& readers) const {
    for (int r = 0; r < kRanks; ++r) {
      const ManifestFile& f = manifest.ranks[static_cast<std::size_t>(r)];
      Result<std::unique_ptr<CheckpointReader>> reader =
          open_rank_reader(io, dir.path(), f, /*direct=*/false);
      ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();
      Result<std::uint64_t> sum = (*reader)->checksum();
      ASSERT_TRUE(sum.is_ok()) << sum.status().to_string();
      ASSERT_TRUE(check_rank_digest(f, **reader, *sum).is_ok()) << "rank " << r;
      readers.verified(r, std::move(*reader));
    }
  }

  // 256 bytes of rank `rank` at an offset that differs by rank and round, against what was
  // written.
  void expect_read(RankFileReaders& readers, int rank, int round) const {
    const std::uint64_t at = (static_cast<std::uint64_t>(rank) * 200 + round * 4000) % 12000;
    std::vector<char> got(256);
    const Status st = readers.read_at(rank, at, got.size(), got.data());
    ASSERT_TRUE(st.is_ok()) << "rank " << rank << ": " << st.to_string();
    const auto& want = bytes[static_cast<std::size_t>(rank)];
    ASSERT_TRUE(std::equal(got.begin(), got.end(), want.begin() + static_cast<std::ptrdiff_t>(at)))
        << "rank " << rank << " offset " << at;
  }

  test::ScratchDir dir;
  CheckpointManifest manifest;
  std::vector<std::vector<char>> bytes;  // each file as written
};

TEST(CheckpointReaders, ReopensPastTheOpenLimitAndReadsTheVerifiedBytes) {
  Tag tag("ckpt-readers-reopen");
  Result<std::unique_ptr<IoEngine>> io = open_checkpoint_io(nullptr);
  ASSERT_TRUE(io.is_ok()) << io.status().to_string();
  RankFileReaders readers(**io, tag.dir.path(), tag.manifest);
  tag.verify_all(**io, readers);
  EXPECT_EQ(readers.open_count(), kCheckpointOpenReaderCount);
  // A reopen reads the rank file alone: a linked file's block checksums were kept at verify.
  for (int r = 3; r < kRanks; r += 4) {
    std::filesystem::remove(tag.dir.file(tag.manifest.ranks[static_cast<std::size_t>(r)].blocks));
  }
  // Rank order twice, as an export reading each parameter across every rank does: the first round
  // opens ranks 32-39 (closing 0-7), the second finds none of the 40 open (least recently read
  // closed first).
  for (int round = 0; round < 2; ++round) {
    for (int r = 0; r < kRanks; ++r) {
      tag.expect_read(readers, r, round);
      ASSERT_LE(readers.open_count(), kCheckpointOpenReaderCount);
    }
  }
  EXPECT_EQ(readers.reopened_count(), 8u + kRanks);
  // A reopened linked file still ends where the manifest says, not at the end of its bytes.
  std::vector<char> past(16);
  const Status st = readers.read_at(39, kFileBytes - 8, past.size(), past.data());
  EXPECT_EQ(st.code(), Code::kCorruption) << st.to_string();
}

// How a closed rank file is changed: each leaves the same size and other bytes at its name.
struct Change {
  const char* name;
  std::function<void(const std::string& path, const std::vector<char>& other)> apply;
};

class CheckpointReadersChanged : public ::testing::TestWithParam<int> {};

const Change kChanges[] = {
    {"renamed-over",
     [](const std::string& path, const std::vector<char>& other) {
       write_file(path + ".new", other.data(), other.size());
       ASSERT_EQ(::rename((path + ".new").c_str(), path.c_str()), 0);
     }},
    // ext4 hands the freed inode number to the new file almost always.
    {"unlinked-and-created",
     [](const std::string& path, const std::vector<char>& other) {
       ASSERT_EQ(::unlink(path.c_str()), 0);
       write_file(path, other.data(), other.size());
     }},
    // The same inode throughout.
    {"written-in-place",
     [](const std::string& path, const std::vector<char>& other) {
       const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
       ASSERT_GE(fd, 0);
       ASSERT_EQ(::pwrite(fd, other.data(), other.size(), 0), static_cast<ssize_t>(other.size()));
       ASSERT_EQ(::close(fd), 0);
     }},
};

TEST_P(CheckpointReadersChanged, RefusedOnReopenNamingTheFile) {
  const Change& change = kChanges[GetParam()];
  SCOPED_TRACE(change.name);
  Tag tag(fmt::format("ckpt-readers-{}", change.name));
  Result<std::unique_ptr<IoEngine>> io = open_checkpoint_io(nullptr);
  ASSERT_TRUE(io.is_ok()) << io.status().to_string();
  RankFileReaders readers(**io, tag.dir.path(), tag.manifest);
  tag.verify_all(**io, readers);
  for (int r = 0; r < kRanks; ++r) tag.expect_read(readers, r, 0);  // rank 1 closed again
  const int rank = 1;
  const std::string path = tag.dir.file(tag.manifest.ranks[rank].file);
  // A link added and removed (as a process that linked a swap file into the tag does when it
  // unlinks its swap path) changes nothing of the file's content: it still reads.
  ASSERT_EQ(::link(path.c_str(), (path + ".link").c_str()), 0);
  ASSERT_EQ(::unlink((path + ".link").c_str()), 0);
  for (int r = 0; r < kRanks; ++r) tag.expect_read(readers, r, 1);  // closed again
  // Past the filesystem's timestamp granularity (a clock tick), as a change after a save is.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const std::vector<char> other = seeded_bytes(kFileBytes, kReadersSeed + 1000);
  ASSERT_NO_FATAL_FAILURE(change.apply(path, other));
  std::vector<char> got(256);
  const Status st = readers.read_at(rank, 0, got.size(), got.data());
  ASSERT_EQ(st.code(), Code::kCorruption) << st.to_string();
  EXPECT_NE(st.message().find(fmt::format("'{}' is no longer the file", path)),
            std::string_view::npos)
      << st.message();
  // The other files read on.
  tag.expect_read(readers, 2, 0);
}

INSTANTIATE_TEST_SUITE_P(Changes, CheckpointReadersChanged, ::testing::Range(0, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           std::string name = kChanges[info.param].name;
                           std::erase(name, '-');
                           return name;
                         });

}  // namespace
}  // namespace zinf
