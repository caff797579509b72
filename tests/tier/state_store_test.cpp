// StateStore: sizing from sub_group_bytes, block layout, extent keys, piece round trips and the
// residency bookkeeping.
#include "tier/state_store.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "base/aligned.hpp"
#include "base/arith.hpp"
#include "base/hash.hpp"
#include "base/random.hpp"
#include "tier_test_util.hpp"

namespace zinf {
namespace {

TEST(StateStore, SubGroupBytesCountsEveryPieceAndTheBlockHoldsTheNvmeOnes) {
  tier_test::RigOptions so;
  so.store.param_count = 1'000'000;
  so.store.sub_group_bytes = 4 << 20;  // 4 MiB of master + moments + f32 grads + bf16 half
  so.pipeline.optimizer.kind = OptimizerKind::kAdamW;
  tier_test::Rig s;
  ASSERT_TRUE(tier_test::open_rig("sizing", so, &s).is_ok());
  const StateStore& st = *s.store;
  EXPECT_EQ(st.bytes_per_param(), 18u);
  // floor(4 MiB / 18 B) = 233016, rounded down to a multiple of 2048.
  EXPECT_EQ(st.sub_group_params(), 231424u);
  EXPECT_EQ(st.sub_group_count(), 5u);  // 4 full, one of 74304
  EXPECT_EQ(st.sub_group_size(4), 1'000'000u - 4 * 231424u);
  EXPECT_LE(st.block_bytes(), std::size_t{4} << 20);
  EXPECT_EQ(st.block_bytes(), 231424u * 18);
  // Slots are page-aligned and in piece order.
  EXPECT_EQ(st.slot_offset(Piece::kParams), 0u);
  EXPECT_EQ(st.slot_offset(Piece::kExpAvg), 231424u * 4);
  EXPECT_EQ(st.slot_offset(Piece::kParamsHalf) % 4096, 0u);
  // Keys name rank, group and piece.
  Result<ExtentId> id = s.swap->find("rank0/group3/exp_avg");
  ASSERT_TRUE(id.is_ok()) << id.status().to_string();
  EXPECT_EQ(s.swap->info(*id).bytes, 231424u * 4);
  EXPECT_TRUE(s.swap->find("rank0/group4/params_half").is_ok());
  EXPECT_FALSE(s.swap->find("rank0/group5/params").is_ok());
}

// Cuts end sub-groups besides every sub_group_params: [0, 3000) in 2048 + 952, a cut at 3072
// ends the next one early, and [3072, 10240) runs in whole sub-groups up to the cut at 9216 and
// the partition's end. Extents are sized per sub-group, the swap capacity (layout().nvme_bytes)
// is their sum, and with every boundary a multiple of 1024 the master and moments keep the
// checkpoint layout (linkable); a cut elsewhere gives it up. Cuts out of order, outside the
// partition or with the gradients on NVMe are refused.
TEST(StateStore, CutsEndSubGroupsAndKeepTheCheckpointLayoutOnPageMultiples) {
  tier_test::RigOptions so;
  so.store.param_count = 10'240;
  so.store.sub_group_params = 2048;
  so.store.cuts = {3072, 9216};
  so.store.tiers = {StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kHost,
                    StoreMedium::kHost};
  tier_test::Rig s;
  const Status opened = tier_test::open_rig("cuts", so, &s);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  const StateStore& st = *s.store;
  const std::vector<std::size_t> firsts = {0, 2048, 3072, 5120, 7168, 9216};
  const std::vector<std::size_t> sizes = {2048, 1024, 2048, 2048, 2048, 1024};
  ASSERT_EQ(st.sub_group_count(), firsts.size());
  for (std::size_t i = 0; i < firsts.size(); ++i) {
    EXPECT_EQ(st.sub_group_first(i), firsts[i]) << i;
    EXPECT_EQ(st.sub_group_size(i), sizes[i]) << i;
    EXPECT_EQ(s.swap->info(st.extent(Piece::kExpAvg, i)).bytes, sizes[i] * 4) << i;
  }
  EXPECT_EQ(st.sub_group_params(), 2048u);
  EXPECT_TRUE(st.linkable());
  Result<StoreLayout> layout = StateStore::layout(so.store);
  ASSERT_TRUE(layout.is_ok());
  EXPECT_TRUE(layout->checkpoint_layout);
  EXPECT_EQ(layout->sub_group_count, firsts.size());
  EXPECT_EQ(layout->nvme_bytes, 4096u + 3 * 10'240u * 4);  // header + master + two moments
  EXPECT_EQ(layout->nvme_extents, 1 + 3 * firsts.size());

  // A cut off the 1024-element grid: [0, 2048) [2048, 3000) [3000, 5048) [5048, 7096)
  // [7096, 9144) [9144, 10240), each piece rounded up to pages, and no checkpoint layout.
  StateStoreOptions off = so.store;
  off.cuts = {3000};
  layout = StateStore::layout(off);
  ASSERT_TRUE(layout.is_ok());
  EXPECT_FALSE(layout->checkpoint_layout);
  EXPECT_EQ(layout->sub_group_count, 6u);
  EXPECT_EQ(layout->nvme_bytes,
            3 * (4 * round_page(2048 * 4) + round_page(952 * 4) + round_page(1096 * 4)));
  EXPECT_EQ(layout->nvme_extents, 3 * 6u);

  for (const std::vector<std::size_t>& bad :
       {std::vector<std::size_t>{0}, std::vector<std::size_t>{10'240},
        std::vector<std::size_t>{4096, 4096}, std::vector<std::size_t>{5000, 4000}}) {
    StateStoreOptions o = so.store;
    o.cuts = bad;
    EXPECT_EQ(StateStore::layout(o).status().code(), Code::kInvalidArgument);
  }
  StateStoreOptions spilled = so.store;
  spilled.tiers[static_cast<std::size_t>(Piece::kGrads)] = StoreMedium::kNvme;
  const Status refused = StateStore::layout(spilled).status();
  EXPECT_EQ(refused.code(), Code::kInvalidArgument);
  EXPECT_NE(refused.message().find("cuts with the gradients on nvme"), std::string::npos)
      << refused.to_string();
}

TEST(StateStore, PiecesRoundTripOnBothTiersAndTrackResidency) {
  tier_test::RigOptions so;
  so.store.param_count = 10'000;
  so.store.sub_group_params = 3000;
  so.store.tiers = {StoreMedium::kNvme, StoreMedium::kHost, StoreMedium::kNvme, StoreMedium::kHost,
                    StoreMedium::kNvme};
  tier_test::Rig s;
  ASSERT_TRUE(tier_test::open_rig("roundtrip", so, &s).is_ok());
  StateStore& st = *s.store;
  EXPECT_EQ(st.residency(Piece::kParams, 1), Residency::kAbsent);
  EXPECT_EQ(st.residency(Piece::kExpAvg, 1), Residency::kHost);
  AlignedBuffer data(16384, 4096), back(16384, 4096);
  for (Piece piece : {Piece::kParams, Piece::kExpAvg}) {
    for (std::size_t i = 0; i < st.sub_group_count(); ++i) {
      fill_random_bytes(data.data(), st.piece_bytes(piece, i), 1000 + i);
      ASSERT_TRUE(st.write_piece(piece, i, data.data()).is_ok());
      ASSERT_TRUE(st.read_piece(piece, i, back.data()).is_ok());
      EXPECT_EQ(std::memcmp(data.data(), back.data(), st.piece_bytes(piece, i)), 0);
    }
  }
  EXPECT_EQ(st.residency(Piece::kParams, 3), Residency::kDisk);
  EXPECT_EQ(st.sub_group_size(3), 1000u);
  // The host array is the partition in order: sub-group 2 starts at parameter 6000.
  fill_random_bytes(data.data(), st.piece_bytes(Piece::kExpAvg, 2), 1002);
  EXPECT_EQ(std::memcmp(st.host_data(Piece::kExpAvg) + 6000 * 4, data.data(), 3000 * 4), 0);
  // Reading a never-written NVMe piece is refused, not garbage.
  EXPECT_EQ(st.read_piece(Piece::kExpAvgSq, 0, back.data()).code(), Code::kFailedPrecondition);
  // Transitions.
  st.begin_read(Piece::kParams, 0);
  EXPECT_EQ(st.residency(Piece::kParams, 0), Residency::kReading);
  st.end_read(Piece::kParams, 0, true);
  EXPECT_EQ(st.residency(Piece::kParams, 0), Residency::kInBlock);
  st.begin_write(Piece::kParams, 0);
  st.end_write(Piece::kParams, 0, false);
  EXPECT_EQ(st.residency(Piece::kParams, 0), Residency::kLost);
  st.set_torn(0);
  EXPECT_EQ(st.version(0, 1), Version::kTorn);
  st.set_stored(1, 1);
  EXPECT_EQ(st.version(1, 1), Version::kNew);
  EXPECT_EQ(st.version(2, 1), Version::kOld);
}

std::uint64_t allocated_bytes(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_blocks) * 512 : 0;
}

// A released moment (release_piece, kZero): its blocks go back to the filesystem, it reads as
// zeros, a checkpoint linked with it holds zeros there whose block checksums are those of the
// file's bytes, and a write stores it again.
TEST(StateStore, AReleasedPieceReadsZerosTakesNoBlocksAndLinksAsZeros) {
  tier_test::RigOptions so;
  so.store.param_count = 64 * 1024;
  so.store.sub_group_params = 16 * 1024;  // 64 KiB pieces: whole swap blocks
  so.store.with_half = false;
  so.store.tiers = {StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kHost,
                    StoreMedium::kHost};
  tier_test::Rig s;
  ASSERT_TRUE(tier_test::open_rig("release", so, &s).is_ok());
  StateStore& st = *s.store;
  ASSERT_TRUE(st.linkable());
  const std::size_t piece_bytes = st.piece_bytes(Piece::kParams, 0);
  AlignedBuffer data(piece_bytes, 4096), back(piece_bytes, 4096);
  for (Piece piece : {Piece::kParams, Piece::kExpAvg, Piece::kExpAvgSq}) {
    for (std::size_t i = 0; i < st.sub_group_count(); ++i) {
      fill_random_bytes(data.data(), piece_bytes, 300 + i * 3 + static_cast<std::size_t>(piece));
      ASSERT_TRUE(st.write_piece(piece, i, data.data()).is_ok());
    }
  }
  const std::string swap_path = s.swap->file_paths()[0];
  const std::uint64_t before = allocated_bytes(swap_path);
  for (Piece piece : {Piece::kExpAvg, Piece::kExpAvgSq}) {
    for (std::size_t i : {std::size_t{1}, std::size_t{2}}) {
      const Status released = st.release_piece(piece, i);
      if (released.code() == Code::kUnsupported) GTEST_SKIP() << released.to_string();
      ASSERT_TRUE(released.is_ok()) << released.to_string();
      EXPECT_EQ(st.residency(piece, i), Residency::kZero);
    }
  }
  // Less a page per hole, which the filesystem may take for the extents it splits.
  EXPECT_LE(allocated_bytes(swap_path) + 4 * piece_bytes, before + 4 * 4096)
      << "the released pieces still take their blocks";
  std::memset(back.data(), 0xff, piece_bytes);
  ASSERT_TRUE(st.read_piece(Piece::kExpAvg, 1, back.data()).is_ok());
  std::vector<std::byte> zeros(piece_bytes);
  EXPECT_EQ(std::memcmp(back.data(), zeros.data(), piece_bytes), 0);

  // Linked: zeros where the released pieces are, and every block's checksum is its bytes'.
  AlignedBuffer header(4096, 4096);
  fill_random_bytes(header.data(), 4096, 7);
  const std::string linked = s.dir->path() + "/linked.bin";
  std::vector<FileBlockSum> sums;
  Result<bool> link = st.link_checkpoint(header.data(), linked, linked, &sums);
  ASSERT_TRUE(link.is_ok()) << link.status().to_string();
  ASSERT_TRUE(*link);
  std::ifstream in(linked, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t state_bytes = 4096 + 3 * so.store.param_count * 4;
  ASSERT_GE(file.size(), state_bytes);
  const std::size_t exp_avg_1 = 4096 + (so.store.param_count + 16 * 1024) * 4;
  EXPECT_EQ(std::memcmp(file.data() + exp_avg_1, zeros.data(), piece_bytes), 0);
  ASSERT_FALSE(sums.empty());
  EXPECT_EQ(sums.back().end_offset, state_bytes);
  std::uint64_t from = 0;
  for (const FileBlockSum& sum : sums) {
    EXPECT_EQ(sum.xxh3, xxh3_64(file.data() + from, sum.end_offset - from))
        << "block ending at " << sum.end_offset;
    from = sum.end_offset;
  }

  // Written again: stored, and read back as written.
  fill_random_bytes(data.data(), piece_bytes, 900);
  ASSERT_TRUE(st.write_piece(Piece::kExpAvg, 1, data.data()).is_ok());
  EXPECT_EQ(st.residency(Piece::kExpAvg, 1), Residency::kDisk);
  ASSERT_TRUE(st.read_piece(Piece::kExpAvg, 1, back.data()).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), piece_bytes), 0);
}

TEST(StateStoreDeathTest, ReadingAPieceInFlightIsAnAssertion) {
  tier_test::RigOptions so;
  so.store.param_count = 4096;
  so.store.sub_group_params = 4096;
  tier_test::Rig s;
  ASSERT_TRUE(tier_test::open_rig("death", so, &s).is_ok());
  EXPECT_DEATH(s.store->begin_read(Piece::kParams, 0), "on disk");
}

TEST(StateStore, BadOptionsAreInvalidArgument) {
  StateStoreOptions o;
  o.param_count = 100;
  EXPECT_EQ(StateStore::open(o, nullptr).status().code(), Code::kInvalidArgument);  // no swap
  o.param_count = 0;
  o.tiers.fill(StoreMedium::kHost);
  EXPECT_EQ(StateStore::open(o, nullptr).status().code(), Code::kInvalidArgument);
  o.param_count = 100;
  o.sub_group_bytes = 100;  // below 2048 parameters
  EXPECT_EQ(StateStore::open(o, nullptr).status().code(), Code::kInvalidArgument);
  o.sub_group_bytes = 1 << 20;
  EXPECT_TRUE(StateStore::open(o, nullptr).is_ok());
}

}  // namespace
}  // namespace zinf
