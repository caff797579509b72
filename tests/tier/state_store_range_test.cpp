// StateStore::read_range and the ranged read_piece: part of a sub-group's piece read from NVMe,
// grown to the swap blocks (the unit of the checksums) that hold it, and nothing else. Checked
// against the bytes written, with the I/O counted by a fault injector that delays every read
// piece by nothing (one swap block, one piece); a corrupted block is caught by the reads that
// cover it and not by those that do not; a released (kZero) piece reads as zeros without I/O.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/aligned.hpp"
#include "base/arith.hpp"
#include "base/random.hpp"
#include "io/fault.hpp"
#include "tier/state_store.hpp"
#include "tier_test_util.hpp"

namespace zinf {
namespace {

constexpr std::size_t kBlockBytes = 4096;  // swap blocks and engine pieces: 1024 f32 elements
constexpr std::size_t kSubGroup = 10'000;  // 40,000 bytes: 9 whole blocks and 3,136 bytes

struct RangeCase {
  std::size_t begin, end;            // asked for, in sub-group 1
  std::size_t want_begin, want_end;  // what read_range() grows it to
  std::uint64_t pieces;              // swap blocks read
};

class StateStoreRange : public ::testing::Test {
 protected:
  void SetUp() override {
    FaultSpec spec;
    spec.latency_rate = 1.0;
    spec.latency = std::chrono::microseconds(0);
    spec.writes = false;
    faults_ = std::make_shared<FaultInjector>(spec);
    tier_test::RigOptions so;
    so.store.param_count = 2 * kSubGroup;
    so.store.sub_group_params = kSubGroup;
    so.store.with_half = false;
    so.store.tiers = {StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme,
                      StoreMedium::kHost, StoreMedium::kHost};
    so.io_block_bytes = kBlockBytes;
    so.faults = faults_;
    const Status opened = tier_test::open_rig("range", so, &s_);
    ASSERT_TRUE(opened.is_ok()) << opened.to_string();
    StateStore& st = *s_.store;
    written_ = AlignedBuffer(round_page(kSubGroup * 4), 4096);
    for (Piece piece : {Piece::kParams, Piece::kExpAvg, Piece::kExpAvgSq}) {
      for (std::size_t i = 0; i < st.sub_group_count(); ++i) {
        fill_random_bytes(written_.data(), st.piece_bytes(piece, i),
                          500 + 3 * i + static_cast<std::size_t>(piece));
        ASSERT_TRUE(st.write_piece(piece, i, written_.data()).is_ok());
      }
    }
    // written_ holds the last one written: exp_avg_sq of sub-group 1.
  }

  // Reads elements [r.begin, r.end) of exp_avg_sq's sub-group 1; *pieces: the pieces it read.
  Status read(StateStore::ElementRange r, AlignedBuffer* out, std::uint64_t* pieces) {
    const std::uint64_t before = faults_->counts().latency;
    Status st = s_.store->read_piece(Piece::kExpAvgSq, 1, r, out->data());
    *pieces = faults_->counts().latency - before;
    return st;
  }

  std::shared_ptr<FaultInjector> faults_;
  tier_test::Rig s_;
  AlignedBuffer written_;
};

TEST_F(StateStoreRange, ReadsTheBlocksThatHoldTheRangeAndGivesTheirBytes) {
  const std::vector<RangeCase> cases = {
      {1500, 1600, 1024, 2048, 1},       // inside block 1
      {2000, 2100, 1024, 3072, 2},       // across the boundary of blocks 1 and 2
      {9500, 9600, 9216, 10000, 1},      // in the last block, which is partial
      {3072, 4096, 3072, 4096, 1},       // exactly block 3
      {0, kSubGroup, 0, kSubGroup, 10},  // the whole piece
  };
  AlignedBuffer out(round_page(kSubGroup * 4), 4096);
  for (const RangeCase& c : cases) {
    const StateStore::ElementRange r = s_.store->read_range(Piece::kExpAvgSq, 1, c.begin, c.end);
    EXPECT_EQ(r.begin, c.want_begin) << c.begin << ".." << c.end;
    EXPECT_EQ(r.end, c.want_end) << c.begin << ".." << c.end;
    std::memset(out.data(), 0xa5, out.bytes());
    std::uint64_t pieces = 0;
    const Status st = read(r, &out, &pieces);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_EQ(pieces, c.pieces) << c.begin << ".." << c.end;
    EXPECT_EQ(std::memcmp(out.data(), written_.data() + r.begin * 4, (r.end - r.begin) * 4), 0)
        << c.begin << ".." << c.end;
  }
  // On the host tier (the gradients) the range is the one asked for.
  const StateStore::ElementRange host = s_.store->read_range(Piece::kGrads, 1, 1500, 1600);
  EXPECT_EQ(host.begin, 1500u);
  EXPECT_EQ(host.end, 1600u);
}

TEST_F(StateStoreRange, ACorruptBlockFailsTheReadsThatCoverItOnly) {
  StateStore& st = *s_.store;
  // A bit of block 5 of exp_avg_sq's sub-group 1 flipped on disk.
  const std::uint64_t at =
      s_.swap->file_offset(st.extent(Piece::kExpAvgSq, 1)) + 5 * kBlockBytes + 77;
  const int fd = ::open(s_.swap->file_paths()[0].c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(at)), 1);
  byte ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(at)), 1);
  ::fsync(fd);
  ::close(fd);
  AlignedBuffer out(round_page(kSubGroup * 4), 4096);
  std::uint64_t pieces = 0;
  Status clean = read(st.read_range(Piece::kExpAvgSq, 1, 1500, 1600), &out, &pieces);
  EXPECT_TRUE(clean.is_ok()) << clean.to_string();
  Status bad = read(st.read_range(Piece::kExpAvgSq, 1, 5200, 5300), &out, &pieces);
  EXPECT_EQ(bad.code(), Code::kCorruption) << bad.to_string();
  EXPECT_NE(bad.message().find("group1/exp_avg_sq"), std::string::npos) << bad.to_string();
  Status whole = st.read_piece(Piece::kExpAvgSq, 1, out.data());
  EXPECT_EQ(whole.code(), Code::kCorruption) << whole.to_string();
}

TEST_F(StateStoreRange, AReleasedPieceReadsZerosWithoutIo) {
  StateStore& st = *s_.store;
  const Status released = st.release_piece(Piece::kExpAvgSq, 1);
  if (released.code() == Code::kUnsupported) GTEST_SKIP() << released.to_string();
  ASSERT_TRUE(released.is_ok()) << released.to_string();
  AlignedBuffer out(round_page(kSubGroup * 4), 4096);
  std::memset(out.data(), 0xa5, out.bytes());
  std::uint64_t pieces = 0;
  const StateStore::ElementRange r = st.read_range(Piece::kExpAvgSq, 1, 2000, 2100);
  ASSERT_TRUE(read(r, &out, &pieces).is_ok());
  EXPECT_EQ(pieces, 0u);
  const std::vector<std::byte> zeros((r.end - r.begin) * 4);
  EXPECT_EQ(std::memcmp(out.data(), zeros.data(), zeros.size()), 0);
}

}  // namespace
}  // namespace zinf
