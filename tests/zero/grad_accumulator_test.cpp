// SpillAccumulator (zinf.gradients_on_nvme): chunks added in any order, over several
// micro-batches, with fewer buffers than open sub-groups, must leave on NVMe exactly the sums an
// in-memory float array would hold (same bits: each element gets the same adds in the same
// order), with the per-sub-group sums of squares of those values, while holding only
// buffer_count sub-groups in host memory. A write fault comes back as a Status naming the extent.
#include "zero/grad_accumulator.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "common/scratch_dir.hpp"
#include "io/fault.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "tier/state_store.hpp"

namespace zinf {
namespace {

constexpr std::size_t kParams = 9'001;  // not a multiple of the sub-group size
constexpr std::size_t kSubGroup = 700;  // 13 sub-groups, the last one short

using test::ScratchDir;

// An engine, a swap space and a store whose only NVMe piece is the fp32 gradients.
struct Rig {
  std::unique_ptr<ScratchDir> dir;
  std::unique_ptr<IoEngine> io;
  std::unique_ptr<SwapSpace> swap;
  std::unique_ptr<StateStore> store;
};

Status open_rig(const std::string& name, std::shared_ptr<FaultInjector> faults, Rig* rig,
                std::size_t param_count = kParams, std::size_t sub_group_params = kSubGroup) {
  rig->dir = std::make_unique<ScratchDir>(name);
  IoOptions io;
  io.block_bytes = 64 << 10;
  io.queue_depth = 8;
  io.faults = std::move(faults);
  ZINF_ASSIGN_OR_RETURN(rig->io, open_engine(io));
  StateStoreOptions so;
  so.param_count = param_count;
  so.sub_group_params = sub_group_params;
  so.tiers = {StoreMedium::kHost, StoreMedium::kHost, StoreMedium::kHost, StoreMedium::kNvme,
              StoreMedium::kHost};
  so.key_prefix = "rank0/opt";
  ZINF_ASSIGN_OR_RETURN(StoreLayout layout, StateStore::layout(so));
  SwapOptions swap;
  swap.dirs = {rig->dir->path()};
  swap.block_bytes = 64 << 10;
  swap.capacity_bytes = layout.nvme_bytes + (std::uint64_t{1} << 20);
  ZINF_ASSIGN_OR_RETURN(rig->swap, SwapSpace::open(*rig->io, swap));
  ZINF_ASSIGN_OR_RETURN(rig->store, StateStore::open(so, rig->swap.get()));
  return Status::ok();
}

// One micro-batch: every element exactly once, in chunks of 1..1500 elements taken in a
// shuffled order (so sub-groups open and complete out of order, as with stage-3 persistent
// groups far from their module's main group).
struct Chunk {
  std::size_t first, count;
};
std::vector<Chunk> shuffled_chunks(SplitMix64& rng, std::size_t param_count = kParams,
                                   std::size_t chunk_max = 1500) {
  std::vector<Chunk> chunks;
  for (std::size_t first = 0; first < param_count;) {
    const std::size_t count =
        std::min<std::size_t>(param_count - first, 1 + rng.next() % chunk_max);
    chunks.push_back({first, count});
    first += count;
  }
  for (std::size_t i = chunks.size(); i > 1; --i) {
    std::swap(chunks[i - 1], chunks[rng.next() % i]);
  }
  return chunks;
}

// The same chunks from the partition's end to its start, as backward hands them over.
std::vector<Chunk> backward_chunks(SplitMix64& rng, std::size_t param_count,
                                   std::size_t chunk_max) {
  std::vector<Chunk> chunks;
  for (std::size_t end = param_count; end > 0;) {
    const std::size_t count = std::min<std::size_t>(end, 1 + rng.next() % chunk_max);
    chunks.push_back({end - count, count});
    end -= count;
  }
  return chunks;
}

// Adds `micro_batches` passes of seeded random gradients to `acc` and to `reference`.
Status add_micro_batches(GradAccumulator& acc, std::vector<float>& reference, int micro_batches,
                         std::uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> grads(kParams);
  for (int m = 0; m < micro_batches; ++m) {
    fill_uniform(grads.data(), kParams, seed * 31 + static_cast<std::uint64_t>(m));
    for (const Chunk& c : shuffled_chunks(rng)) {
      ZINF_RETURN_IF_ERROR(acc.add(c.first, c.count, grads.data() + c.first));
      for (std::size_t i = c.first; i < c.first + c.count; ++i) reference[i] += grads[i];
    }
  }
  return Status::ok();
}

// Reads every sub-group's extent and compares it with the reference, bit for bit.
void expect_on_disk(StateStore& store, const std::vector<float>& reference) {
  AlignedBuffer block((kSubGroup * 4 + 4095) / 4096 * 4096);
  for (std::size_t i = 0; i < store.sub_group_count(); ++i) {
    ASSERT_EQ(store.residency(Piece::kGrads, i), Residency::kDisk) << "sub-group " << i;
    Status st = store.read_piece(Piece::kGrads, i, block.data());
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    const std::size_t first = store.sub_group_first(i);
    EXPECT_EQ(std::memcmp(block.data(), reference.data() + first, store.sub_group_size(i) * 4), 0)
        << "sub-group " << i;
  }
}

TEST(SpillAccumulator, SumsOnNvmeEqualAnInMemoryAccumulatorWithEvictions) {
  const std::uint64_t seed = 20261130;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  Rig rig;
  Status st = open_rig("spill", nullptr, &rig);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ZeroCounters counters;
  SpillOptions options;
  options.buffer_count = 2;
  auto acc = SpillAccumulator::create(*rig.store, options, &counters);
  ASSERT_TRUE(acc.is_ok()) << acc.status().to_string();
  // Bounded host memory: two sub-groups, not the partition's fp32 array.
  EXPECT_EQ((*acc)->host_bytes(), 2 * ((kSubGroup * 4 + 4095) / 4096 * 4096));
  EXPECT_LT((*acc)->host_bytes() * 4, kParams * 4);

  std::vector<float> reference(kParams, 0.0f);
  for (int step = 0; step < 2; ++step) {
    st = add_micro_batches(**acc, reference, 3, seed + static_cast<std::uint64_t>(step));
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    ASSERT_TRUE((*acc)->flush().is_ok());
    EXPECT_EQ((*acc)->open_count(), 2u);  // clean, cached until zero() or a new sub-group
    expect_on_disk(*rig.store, reference);
    // The norm's parts are those of the final sums, whichever write was last.
    for (std::size_t i = 0; i < rig.store->sub_group_count(); ++i) {
      const double want = sum_of_squares(reference.data() + rig.store->sub_group_first(i),
                                         rig.store->sub_group_size(i));
      EXPECT_EQ((*acc)->sum_of_squares(i), want) << "sub-group " << i;
      EXPECT_GT(want, 0.0);
    }
    // The next step starts from zeros, without reading anything back.
    const std::uint64_t read_backs = counters.grad_spill_read_backs;
    (*acc)->zero();
    EXPECT_EQ(counters.grad_spill_read_backs, read_backs);
    std::fill(reference.begin(), reference.end(), 0.0f);
  }
  std::printf("writes %llu B, read-backs %llu (%llu B), evictions %llu\n",
              static_cast<unsigned long long>(counters.grad_spill_write_bytes),
              static_cast<unsigned long long>(counters.grad_spill_read_backs),
              static_cast<unsigned long long>(counters.grad_spill_read_bytes),
              static_cast<unsigned long long>(counters.grad_spill_evictions));
  EXPECT_GT(counters.grad_spill_evictions, 0u);
  EXPECT_GT(counters.grad_spill_read_backs, 0u);
  EXPECT_GE(counters.grad_spill_write_bytes, 2u * 3u * kParams * 4u);
}

TEST(SpillAccumulator, InOrderChunksWriteEachSubGroupOncePerMicroBatch) {
  Rig rig;
  Status st = open_rig("inorder", nullptr, &rig);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ZeroCounters counters;
  SpillOptions options;
  options.buffer_count = 2;
  auto acc = SpillAccumulator::create(*rig.store, options, &counters);
  ASSERT_TRUE(acc.is_ok()) << acc.status().to_string();
  // Backward order: chunks from the end of the partition to its start, one micro-batch.
  std::vector<float> grads(kParams), reference(kParams, 0.0f);
  fill_uniform(grads.data(), kParams, 7);
  const std::size_t chunk = 600;
  for (std::size_t end = kParams; end > 0;) {
    const std::size_t first = end > chunk ? end - chunk : 0;
    ASSERT_TRUE((*acc)->add(first, end - first, grads.data() + first).is_ok());
    end = first;
  }
  ASSERT_TRUE((*acc)->flush().is_ok());
  for (std::size_t i = 0; i < kParams; ++i) reference[i] = 0.0f + grads[i];
  expect_on_disk(*rig.store, reference);
  EXPECT_EQ(counters.grad_spill_evictions, 0u);
  EXPECT_EQ(counters.grad_spill_read_backs, 0u);
  std::size_t pages = 0;
  for (std::size_t i = 0; i < rig.store->sub_group_count(); ++i) {
    pages += (rig.store->sub_group_size(i) * 4 + 4095) / 4096;
  }
  EXPECT_EQ(counters.grad_spill_write_bytes, pages * 4096);
}

TEST(SpillAccumulator, WriteFaultIsANamedStatusAndSticks) {
  const std::uint64_t seed = 99;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  FaultSpec spec;
  spec.seed = seed;
  spec.eio_rate = 1.0;
  spec.reads = false;
  auto faults = std::make_shared<FaultInjector>(spec);
  Rig rig;
  Status st = open_rig("fault", faults, &rig);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  SpillOptions options;
  options.buffer_count = 2;
  auto acc = SpillAccumulator::create(*rig.store, options, nullptr);
  ASSERT_TRUE(acc.is_ok()) << acc.status().to_string();
  std::vector<float> reference(kParams, 0.0f);
  st = add_micro_batches(**acc, reference, 1, seed);
  if (st.is_ok()) st = (*acc)->flush();
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), Code::kIoError) << st.to_string();
  EXPECT_NE(st.message().find("rank0/opt/group"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("grads"), std::string::npos) << st.to_string();
  // Sticky: nothing is added after a lost write.
  std::vector<float> more(10, 1.0f);
  EXPECT_EQ((*acc)->add(0, 10, more.data()).code(), Code::kIoError);
  EXPECT_EQ((*acc)->flush().code(), Code::kIoError);
  // The store knows which gradients are lost: a read of one fails rather than returning them.
  std::size_t lost = 0;
  AlignedBuffer block((kSubGroup * 4 + 4095) / 4096 * 4096);
  for (std::size_t i = 0; i < rig.store->sub_group_count(); ++i) {
    if (rig.store->residency(Piece::kGrads, i) != Residency::kLost) continue;
    ++lost;
    EXPECT_FALSE(rig.store->read_piece(Piece::kGrads, i, block.data()).is_ok());
  }
  EXPECT_GT(lost, 0u);
  EXPECT_GT(faults->counts().eio, 0u);
}

}  // namespace
}  // namespace zinf

namespace zinf {
namespace {

// Sub-groups longer than sum_of_squares's 64 Ki-element tiles: the accumulator sums each tile as
// its last element arrives (in the add's own pass when a chunk covers the tile whole) and folds
// them at the write; the norm's parts must still be sum_of_squares's bits over the final sums,
// for chunks in backward order and shuffled, with evictions and read-backs.
TEST(SpillAccumulator, MultiTileSubGroupsKeepSumOfSquaresBits) {
  constexpr std::size_t kBigSubGroup = 600'001;                   // 16 tiles of 37500-37501
  constexpr std::size_t kBigParams = 3 * kBigSubGroup + 277'777;  // the last one short: 8 tiles
  const std::uint64_t seed = 20261131;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  Rig rig;
  Status st = open_rig("tiles", nullptr, &rig, kBigParams, kBigSubGroup);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ZeroCounters counters;
  SpillOptions options;
  options.buffer_count = 2;
  auto acc = SpillAccumulator::create(*rig.store, options, &counters);
  ASSERT_TRUE(acc.is_ok()) << acc.status().to_string();

  SplitMix64 rng(seed);
  std::vector<float> grads(kBigParams), reference(kBigParams, 0.0f);
  for (int step = 0; step < 2; ++step) {
    for (int m = 0; m < 3; ++m) {
      fill_uniform(grads.data(), kBigParams, seed * 7 + static_cast<std::uint64_t>(step * 3 + m));
      // Chunks up to 100k elements: some cover whole tiles, some end or start inside one.
      const std::vector<Chunk> chunks = (step + m) % 2 == 0
                                            ? backward_chunks(rng, kBigParams, 100'000)
                                            : shuffled_chunks(rng, kBigParams, 100'000);
      for (const Chunk& c : chunks) {
        ASSERT_TRUE((*acc)->add(c.first, c.count, grads.data() + c.first).is_ok());
        for (std::size_t i = c.first; i < c.first + c.count; ++i) reference[i] += grads[i];
      }
    }
    ASSERT_TRUE((*acc)->flush().is_ok());
    for (std::size_t i = 0; i < rig.store->sub_group_count(); ++i) {
      const double want = sum_of_squares(reference.data() + rig.store->sub_group_first(i),
                                         rig.store->sub_group_size(i));
      EXPECT_EQ((*acc)->sum_of_squares(i), want) << "step " << step << " sub-group " << i;
      // A sanity check of the reference itself: the tiled sum is close to the plain one.
      double plain = 0.0;
      for (std::size_t k = 0; k < rig.store->sub_group_size(i); ++k) {
        const double v = reference[rig.store->sub_group_first(i) + k];
        plain += v * v;
      }
      EXPECT_NEAR(want, plain, 1e-9 * plain);
    }
    (*acc)->zero();
    std::fill(reference.begin(), reference.end(), 0.0f);
  }
  EXPECT_GT(counters.grad_spill_read_backs, 0u);
  EXPECT_GT(counters.grad_spill_evictions, 0u);
}

}  // namespace
}  // namespace zinf

namespace zinf {
namespace {

// Later micro-batches in backward order: a read-back after the first of a micro-batch is read
// ahead while the sub-group above it is summed (when a buffer is free or its write landed, which
// depends on the drive's timing, so the count is only bounded), and a chunk comes for every one
// read ahead. The sums on disk and the norm's parts stay those of an in-memory array.
TEST(SpillAccumulator, BackwardOrderReadsTheNextSubGroupAhead) {
  const std::uint64_t seed = 20261132;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  Rig rig;
  Status st = open_rig("ahead", nullptr, &rig);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ZeroCounters counters;
  SpillOptions options;
  options.buffer_count = 6;
  auto acc = SpillAccumulator::create(*rig.store, options, &counters);
  ASSERT_TRUE(acc.is_ok()) << acc.status().to_string();
  SplitMix64 rng(seed);
  std::vector<float> grads(kParams), reference(kParams, 0.0f);
  constexpr int kMicroBatches = 3;
  for (int m = 0; m < kMicroBatches; ++m) {
    fill_uniform(grads.data(), kParams, seed + static_cast<std::uint64_t>(m));
    for (const Chunk& c : backward_chunks(rng, kParams, 500)) {
      ASSERT_TRUE((*acc)->add(c.first, c.count, grads.data() + c.first).is_ok());
      for (std::size_t i = c.first; i < c.first + c.count; ++i) reference[i] += grads[i];
    }
  }
  ASSERT_TRUE((*acc)->flush().is_ok());
  expect_on_disk(*rig.store, reference);
  for (std::size_t i = 0; i < rig.store->sub_group_count(); ++i) {
    EXPECT_EQ((*acc)->sum_of_squares(i),
              sum_of_squares(reference.data() + rig.store->sub_group_first(i),
                             rig.store->sub_group_size(i)))
        << "sub-group " << i;
  }
  // Thirteen sub-groups through six buffers: each later micro-batch reads back every sub-group
  // not still in a buffer from the micro-batch before. Which ones stay depends on the drive's
  // timing (a read ahead takes only a buffer whose write landed; open() takes the oldest clean
  // one), so at most six are spared a micro-batch, usually none.
  const std::uint64_t later = kMicroBatches - 1;
  const std::uint64_t sub_groups = rig.store->sub_group_count();
  ASSERT_GT(sub_groups, options.buffer_count);
  EXPECT_LE(counters.grad_spill_read_backs, later * sub_groups);
  EXPECT_GE(counters.grad_spill_read_backs, later * (sub_groups - options.buffer_count));
  std::printf("read-backs %llu, %llu of them ahead\n",
              static_cast<unsigned long long>(counters.grad_spill_read_backs),
              static_cast<unsigned long long>((*acc)->read_ahead_count()));
  EXPECT_GT((*acc)->read_ahead_count(), 0u);
  EXPECT_LE((*acc)->read_ahead_count(), later * (sub_groups - 1));
  EXPECT_EQ((*acc)->read_ahead_hit_count(), (*acc)->read_ahead_count());
  EXPECT_EQ(counters.grad_spill_evictions, 0u);
}

}  // namespace
}  // namespace zinf
