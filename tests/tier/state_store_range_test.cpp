// StateStore::read_range and the ranged read_piece: part of a sub-group's piece read from NVMe,
// grown to the swap blocks (the unit of the checksums) that hold it, and nothing else. Checked
// against the bytes written, with the I/O counted by a fault injector that delays every read
// piece by nothing (one swap block, one piece); a corrupted block is caught by the reads that
// cover it and not by those that do not; a released (kZero) piece reads as zeros without I/O.
// Then, on stores of their own: bf16 and f16 pieces (2-byte elements, piece bytes not a multiple
// of 4) and sub-groups of 10001 and 777 elements, the swap space striped over 1 to 3 directories,
// every range of a grid that includes the partial last block, each read into a destination whose
// page past round_up(bytes, 4096) must stay as it was; a released moment, a moment whose write
// failed (kLost: io_error) and half parameters on the block tier (not kept) in every range.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "base/aligned.hpp"
#include "base/arith.hpp"
#include "base/random.hpp"
#include "io/fault.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "tier/state_store.hpp"
#include "tier_test_util.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

constexpr std::size_t kBlockBytes = 4096;  // swap blocks and engine pieces: 1024 f32 elements
constexpr std::size_t kSubGroup = 10'000;  // 40,000 bytes: 9 whole blocks and 3,136 bytes

struct RangeCase {
  std::size_t begin, end;            // asked for, in sub-group 1
  std::size_t want_begin, want_end;  // what read_range() grows it to
  std::uint64_t pieces;              // swap blocks read
};

// Every read piece delayed by nothing, writes untouched: the injector counts the pieces read
// (FaultCounts::latency) and changes nothing.
FaultSpec counted_reads() {
  FaultSpec spec;
  spec.latency_rate = 1.0;
  spec.latency = std::chrono::microseconds(0);
  spec.writes = false;
  return spec;
}

class StateStoreRange : public ::testing::Test {
 protected:
  void SetUp() override {
    faults_ = std::make_shared<FaultInjector>(counted_reads());
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

// The cases below guard the ranged read's layouts beyond the fixture's: 2-byte pieces (bf16 and
// f16 gradients and half parameters, whose piece bytes need not be a multiple of 4), sub-groups of
// awkward sizes (and a shorter last one), the swap space striped over 1 to 3 directories (the
// swap block is the stripe unit, so a range's blocks come from different files), every range of a
// grid that includes the partial last block, and the destination past round_up(bytes, 4096) left
// as it was. The ranged read passed them when they were written; they keep it so.

constexpr std::size_t kGuardBytes = 4096;

// A swap space over `dirs` directories (4 KiB blocks, the stripe unit) and a store of 2 full
// sub-groups of `sub` elements and a last one of `sub` / 3 + 1, every piece on NVMe but the
// half parameters, which are on `half_tier`.
struct StripedRig {
  std::unique_ptr<tier_test::ScratchDir> dir;
  std::shared_ptr<FaultInjector> faults;
  std::unique_ptr<IoEngine> engine;
  std::unique_ptr<SwapSpace> swap;
  std::unique_ptr<StateStore> store;
};

Status open_striped(const std::string& name, std::size_t sub, DType two_byte_dtype, int dirs,
                    StoreMedium half_tier, const FaultSpec& spec, StripedRig* rig) {
  rig->dir = std::make_unique<tier_test::ScratchDir>(name);
  rig->faults = std::make_shared<FaultInjector>(spec);
  IoOptions io;
  io.block_bytes = kBlockBytes;
  io.queue_depth = 16;
  io.faults = rig->faults;
  ZINF_ASSIGN_OR_RETURN(rig->engine, open_engine(io));
  StateStoreOptions so;
  so.sub_group_params = sub;
  so.param_count = 2 * sub + sub / 3 + 1;
  so.grad_dtype = two_byte_dtype;
  so.with_half = true;
  so.half_dtype = two_byte_dtype;
  so.tiers = {StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme,
              half_tier};
  SwapOptions swap;
  for (int d = 0; d < dirs; ++d) {
    swap.dirs.push_back(fmt::format("{}/d{}", rig->dir->path(), d));
    std::filesystem::create_directories(swap.dirs.back());
  }
  swap.block_bytes = kBlockBytes;
  // Each piece rounded up to pages, twice over, and a stripe unit per piece and directory.
  swap.capacity_bytes =
      2 * (16 * so.param_count + 3 * kPieceCount * 4096) + kPieceCount * 3 * dirs * kBlockBytes;
  swap.max_ops = 64;
  ZINF_ASSIGN_OR_RETURN(rig->swap, SwapSpace::open(*rig->engine, swap));
  ZINF_ASSIGN_OR_RETURN(rig->store, StateStore::open(so, rig->swap.get()));
  return Status::ok();
}

// The pieces of `store` that it keeps on NVMe.
std::vector<Piece> nvme_pieces(const StateStore& store) {
  std::vector<Piece> pieces;
  for (std::size_t p = 0; p < kPieceCount; ++p) {
    if (store.on_nvme(static_cast<Piece>(p))) pieces.push_back(static_cast<Piece>(p));
  }
  return pieces;
}

// What write_all() wrote, indexed [piece][sub-group].
using Written = std::vector<std::vector<std::vector<std::byte>>>;

// Writes seeded random bytes to every NVMe piece of every sub-group; returns them, indexed
// [piece][sub-group].
Result<Written> write_all(StateStore& store, std::uint64_t seed) {
  Written written(kPieceCount);
  std::size_t largest = 0;
  for (std::size_t i = 0; i < store.sub_group_count(); ++i) {
    largest = std::max(largest, store.piece_bytes(Piece::kParams, i));
  }
  AlignedBuffer staging(round_page(largest), 4096);
  for (Piece piece : nvme_pieces(store)) {
    auto& per_group = written[static_cast<std::size_t>(piece)];
    for (std::size_t i = 0; i < store.sub_group_count(); ++i) {
      const std::size_t bytes = store.piece_bytes(piece, i);
      per_group.emplace_back(bytes);
      fill_random_bytes(per_group.back().data(), bytes,
                        seed + 16 * i + static_cast<std::size_t>(piece));
      std::memcpy(staging.data(), per_group.back().data(), bytes);
      ZINF_RETURN_IF_ERROR(store.write_piece(piece, i, staging.data()));
    }
  }
  return written;
}

// Element ranges [begin, end) of a piece of `count` elements, `block` elements a swap block:
// every pair of points among the piece's ends, the first blocks' edges, its middle and the last
// block's edges (the last block being partial unless `block` divides `count`).
std::vector<std::pair<std::size_t, std::size_t>> range_grid(std::size_t count, std::size_t block) {
  const std::size_t last = (count - 1) / block * block;  // the last block's first element
  std::vector<std::size_t> points = {0,         1,        block - 1, block,    block + 1, 2 * block,
                                     count / 2, last - 1, last,      last + 1, count - 1, count};
  std::erase_if(points, [count](std::size_t p) { return p > count; });
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  for (std::size_t a = 0; a < points.size(); ++a) {
    for (std::size_t b = a + 1; b < points.size(); ++b) ranges.emplace_back(points[a], points[b]);
  }
  return ranges;
}

// A destination for a ranged read of `bytes`: round_up(bytes, 4096) for the read, then a guard
// page of seeded random bytes; guard() is what the guard page must still hold.
struct GuardedOut {
  GuardedOut(std::size_t bytes, std::uint64_t seed)
      : room(round_up(bytes, kPage)), buffer(room + kGuardBytes, 4096), guard(kGuardBytes) {
    fill_random_bytes(buffer.data(), room, seed);
    fill_random_bytes(guard.data(), kGuardBytes, seed ^ 0x5a5a5a5a);
    std::memcpy(buffer.data() + room, guard.data(), kGuardBytes);
  }
  bool guard_intact() const {
    return std::memcmp(buffer.data() + room, guard.data(), kGuardBytes) == 0;
  }
  std::size_t room;
  AlignedBuffer buffer;
  std::vector<std::byte> guard;
};

struct StripedCase {
  std::size_t sub;
  DType dtype;  // of the gradients and half parameters
  int dirs;
};

void PrintTo(const StripedCase& c, std::ostream* os) {
  *os << "sub-groups of " << c.sub << ", " << dtype_name(c.dtype) << ", " << c.dirs << " dirs";
}

class StateStoreRangeStriped : public ::testing::TestWithParam<StripedCase> {};

TEST_P(StateStoreRangeStriped, EveryRangeOfTheGridReadsItsBlocksBytesAndNothingPast) {
  const StripedCase c = GetParam();
  const FaultSpec spec = counted_reads();
  StripedRig rig;
  const Status opened =
      open_striped("range-striped", c.sub, c.dtype, c.dirs, StoreMedium::kNvme, spec, &rig);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  StateStore& st = *rig.store;
  ASSERT_EQ(st.sub_group_count(), 3u);
  auto written = write_all(st, 9000 + c.sub);
  ASSERT_TRUE(written.is_ok()) << written.status().to_string();
  std::size_t reads = 0;
  for (Piece piece : nvme_pieces(st)) {
    const std::size_t element_bytes = dtype_bytes(st.dtype(piece));
    const std::size_t block = kBlockBytes / element_bytes;
    for (std::size_t i = 0; i < st.sub_group_count(); ++i) {
      const std::size_t count = st.sub_group_size(i);
      const std::vector<std::byte>& bytes = (*written)[static_cast<std::size_t>(piece)][i];
      ASSERT_EQ(bytes.size(), count * element_bytes);
      for (const auto& [begin, end] : range_grid(count, block)) {
        const std::string where =
            fmt::format("{} sg {} [{}, {}) of {}", piece_name(piece), i, begin, end, count);
        const StateStore::ElementRange r = st.read_range(piece, i, begin, end);
        const std::size_t want_begin = begin / block * block;
        const std::size_t want_end = std::min((end + block - 1) / block * block, count);
        ASSERT_EQ(r.begin, want_begin) << where;
        ASSERT_EQ(r.end, want_end) << where;
        const std::size_t range_bytes = (r.end - r.begin) * element_bytes;
        GuardedOut out(range_bytes, reads);
        const std::uint64_t before = rig.faults->counts().latency;
        const Status read = st.read_piece(piece, i, r, out.buffer.data());
        ASSERT_TRUE(read.is_ok()) << where << ": " << read.to_string();
        EXPECT_EQ(rig.faults->counts().latency - before,
                  (r.end + block - 1) / block - r.begin / block)
            << where;
        ASSERT_EQ(
            std::memcmp(out.buffer.data(), bytes.data() + r.begin * element_bytes, range_bytes), 0)
            << where;
        ASSERT_TRUE(out.guard_intact()) << where;
        ++reads;
      }
    }
  }
  EXPECT_GT(reads, 100u);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, StateStoreRangeStriped,
    ::testing::Values(StripedCase{10001, DType::kBF16, 1}, StripedCase{10001, DType::kF16, 2},
                      StripedCase{10001, DType::kBF16, 3}, StripedCase{777, DType::kF16, 1},
                      StripedCase{777, DType::kBF16, 2}, StripedCase{777, DType::kF16, 3}),
    [](const ::testing::TestParamInfo<StripedCase>& info) {
      return fmt::format("sub{}_{}_dirs{}", info.param.sub, dtype_name(info.param.dtype),
                         info.param.dirs);
    });

// Reads every range of the grid in each sub-group of f32 `piece` into a GuardedOut, and leaves
// sub-group `odd` to odd_check(where, the read's status, the destination, its range's bytes, the
// pieces the read took); the others must read their written bytes. Every guard page must stay.
void read_grid_one_odd(
    StripedRig& rig, const Written& written, Piece piece, std::size_t odd,
    const std::function<void(const std::string&, const Status&, const GuardedOut&, std::size_t,
                             std::uint64_t)>& odd_check) {
  StateStore& st = *rig.store;
  for (std::size_t i = 0; i < st.sub_group_count(); ++i) {
    const std::vector<std::byte>& bytes = written[static_cast<std::size_t>(piece)][i];
    for (const auto& [begin, end] : range_grid(st.sub_group_size(i), kBlockBytes / 4)) {
      const std::string where = fmt::format("sg {} [{}, {})", i, begin, end);
      const StateStore::ElementRange r = st.read_range(piece, i, begin, end);
      const std::size_t range_bytes = (r.end - r.begin) * 4;
      GuardedOut out(range_bytes, begin * 31 + end);
      const std::uint64_t before = rig.faults->counts().latency;
      const Status read = st.read_piece(piece, i, r, out.buffer.data());
      const std::uint64_t pieces = rig.faults->counts().latency - before;
      if (i == odd) {
        odd_check(where, read, out, range_bytes, pieces);
      } else {
        ASSERT_TRUE(read.is_ok()) << where << ": " << read.to_string();
        EXPECT_EQ(std::memcmp(out.buffer.data(), bytes.data() + r.begin * 4, range_bytes), 0)
            << where;
      }
      ASSERT_TRUE(out.guard_intact()) << where;
    }
  }
}

// A released moment of a striped store reads as zeros without I/O, in every range, and leaves
// the guard page; the sub-groups beside it still read their bytes.
TEST(StateStoreRangeStates, AReleasedMomentReadsZerosInEveryRange) {
  const FaultSpec spec = counted_reads();
  StripedRig rig;
  const Status opened =
      open_striped("range-zero", 10001, DType::kBF16, 2, StoreMedium::kNvme, spec, &rig);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  StateStore& st = *rig.store;
  auto written = write_all(st, 7100);
  ASSERT_TRUE(written.is_ok()) << written.status().to_string();
  const Status released = st.release_piece(Piece::kExpAvg, 1);
  if (released.code() == Code::kUnsupported) GTEST_SKIP() << released.to_string();
  ASSERT_TRUE(released.is_ok()) << released.to_string();
  ASSERT_EQ(st.residency(Piece::kExpAvg, 1), Residency::kZero);
  read_grid_one_odd(rig, *written, Piece::kExpAvg, 1,
                    [](const std::string& where, const Status& read, const GuardedOut& out,
                       std::size_t range_bytes, std::uint64_t pieces) {
                      ASSERT_TRUE(read.is_ok()) << where << ": " << read.to_string();
                      EXPECT_EQ(pieces, 0u) << where;
                      EXPECT_TRUE(all_zero_bytes(out.buffer.data(), range_bytes)) << where;
                    });
}

// A moment whose last write failed (kLost) answers io_error naming its extent for every range,
// leaving the guard page; the same moment's other sub-groups still read their bytes.
TEST(StateStoreRangeStates, ALostMomentAnswersIoErrorInEveryRange) {
  FaultSpec spec;  // every write fails with EIO once enabled
  spec.eio_rate = 1.0;
  spec.reads = false;
  StripedRig rig;
  const Status opened =
      open_striped("range-lost", 10001, DType::kF16, 3, StoreMedium::kNvme, spec, &rig);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  StateStore& st = *rig.store;
  rig.faults->set_enabled(false);
  auto written = write_all(st, 7200);
  ASSERT_TRUE(written.is_ok()) << written.status().to_string();
  rig.faults->set_enabled(true);
  AlignedBuffer fresh(round_page(st.piece_bytes(Piece::kExpAvgSq, 1)), 4096);
  fill_random_bytes(fresh.data(), st.piece_bytes(Piece::kExpAvgSq, 1), 7300);
  const Status write = st.write_piece(Piece::kExpAvgSq, 1, fresh.data());
  ASSERT_FALSE(write.is_ok());
  rig.faults->set_enabled(false);
  ASSERT_EQ(st.residency(Piece::kExpAvgSq, 1), Residency::kLost);
  read_grid_one_odd(rig, *written, Piece::kExpAvgSq, 1,
                    [](const std::string& where, const Status& read, const GuardedOut&, std::size_t,
                       std::uint64_t) {
                      EXPECT_EQ(read.code(), Code::kIoError) << where << ": " << read.to_string();
                      EXPECT_NE(read.message().find("group1/exp_avg_sq"), std::string::npos)
                          << where << ": " << read.to_string();
                    });
}

// Half parameters on the block tier are not kept: a ranged read of them is the whole read's
// failed_precondition naming the piece, and writes nothing into the destination.
TEST(StateStoreRangeStates, AHalfPieceOnTheBlockTierIsNotKept) {
  StripedRig rig;
  const Status opened =
      open_striped("range-block", 10001, DType::kBF16, 2, StoreMedium::kBlock, FaultSpec{}, &rig);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  StateStore& st = *rig.store;
  ASSERT_TRUE(st.streams_half());
  auto written = write_all(st, 7400);
  ASSERT_TRUE(written.is_ok()) << written.status().to_string();
  for (std::size_t i = 0; i < st.sub_group_count(); ++i) {
    for (const auto& [begin, end] : range_grid(st.sub_group_size(i), kBlockBytes / 2)) {
      const std::string where = fmt::format("sg {} [{}, {})", i, begin, end);
      const StateStore::ElementRange r = st.read_range(Piece::kParamsHalf, i, begin, end);
      EXPECT_EQ(r.begin, begin) << where;
      EXPECT_EQ(r.end, end) << where;
      // The whole destination is guard: nothing of it may be written.
      GuardedOut out(0, begin * 41 + end);
      const std::vector<std::byte> before(out.buffer.data(),
                                          out.buffer.data() + out.buffer.bytes());
      const Status read = st.read_piece(Piece::kParamsHalf, i, r, out.buffer.data());
      EXPECT_EQ(read.code(), Code::kFailedPrecondition) << where << ": " << read.to_string();
      EXPECT_NE(read.message().find(fmt::format("group{}/params_half", i)), std::string::npos)
          << where << ": " << read.to_string();
      ASSERT_EQ(std::memcmp(out.buffer.data(), before.data(), before.size()), 0) << where;
    }
  }
}

}  // namespace
}  // namespace zinf
