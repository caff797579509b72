// GradReducer at stage 1 with frozen parameters (GradReducerOptions::frozen), on HostDevice +
// LocalComm, 2 and 4 ranks, host-accessible and opaque devices: a LoRA-shaped model (two frozen
// base modules, each followed by a small trainable adapter module) reduced over two steps of two
// micro-batches, the adapters' gradients only. Each rank's accumulator holds the mean over ranks
// of its slice of the adapters' sums, bit for bit, and +0.0 over the base slices (it starts as
// NaN); the reduce-scatters move the adapter groups only (ZeroCounters::reduce_scatter_bytes);
// and the reducer allocates 4 bytes less per element of a frozen group (no full-size copy of it)
// than one made without the frozen flags.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "zero/grad_reducer_test_util.hpp"

namespace zinf {
namespace {

struct FrozenCase {
  int world;
  bool opaque;
};

struct ParamDef {
  const char* name;
  const char* module;
  std::vector<std::int64_t> shape;
  bool frozen;
};

const std::vector<ParamDef>& lora_params() {
  static const std::vector<ParamDef> defs = {
      {"base0.w", "base0", {64, 48}, true}, {"base0.b", "base0", {48}, true},
      {"lora0.a", "lora0", {4, 48}, false}, {"lora0.b", "lora0", {64, 4}, false},
      {"base1.w", "base1", {96, 40}, true}, {"lora1.a", "lora1", {8, 40}, false},
      {"lora1.b", "lora1", {96, 8}, false},
  };
  return defs;
}

// A partitioner of `world` ranks at `stage` over lora_params(), in `p`, and each parameter's
// frozen flag in `frozen`.
void make_lora_partitioner(int world, ZeroStage stage, std::optional<Partitioner>& p,
                           std::vector<bool>& frozen) {
  PartitionerOptions po;
  po.world_size = world;
  po.stage = stage;
  p.emplace(std::move(Partitioner::create(po)).value());
  for (const ParamDef& d : lora_params()) {
    ASSERT_TRUE(p->add({d.name, d.module, d.shape, DType::kF32}).is_ok());
    frozen.push_back(d.frozen);
  }
  ASSERT_TRUE(p->finalize().is_ok());
}

class GradReducerFrozenStage1 : public ::testing::TestWithParam<FrozenCase> {};

TEST_P(GradReducerFrozenStage1, ReducesTheTrainableGroupsOnlyAndKeepsNoFullCopyOfTheFrozen) {
  const FrozenCase c = GetParam();
  const std::uint64_t seed = 9100 + static_cast<std::uint64_t>(c.world) * 2 + (c.opaque ? 1 : 0);
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::optional<Partitioner> lora;
  std::vector<bool> frozen;
  ASSERT_NO_FATAL_FAILURE(make_lora_partitioner(c.world, ZeroStage::kStage1, lora, frozen));
  Partitioner& p = *lora;
  // The groups' kind, and the elements (padding included) of each kind over all ranks.
  std::vector<bool> group_frozen(p.group_count());
  std::size_t frozen_padded = 0, trainable_padded = 0;
  for (std::uint32_t g = 0; g < p.group_count(); ++g) {
    const GroupInfo& info = p.group(g);
    ASSERT_GT(info.param_count, 0u);
    group_frozen[g] = frozen[info.first_param];
    (group_frozen[g] ? frozen_padded : trainable_padded) += info.padded_element_count;
  }
  ASSERT_GT(frozen_padded, 0u);
  ASSERT_GT(trainable_padded, 0u);

  const int micro_batches = 2;
  const int steps = 2;
  // grads[rank][micro][param]; empty for a frozen parameter (it takes none).
  const test::RankGrads grads = test::seeded_grads(p, c.world, micro_batches, seed, frozen);
  test::HostRanks ranks = test::make_host_ranks(c.world, seed, c.opaque);
  const std::size_t partition = GradReducer::partition_element_count(p);
  std::vector<std::vector<float>> acc(static_cast<std::size_t>(c.world),
                                      std::vector<float>(partition, std::nanf("")));
  std::vector<ZeroCounters> counters(static_cast<std::size_t>(c.world));
  // Device bytes a reducer allocates, made with the frozen flags and without them.
  std::vector<std::size_t> bytes_frozen(static_cast<std::size_t>(c.world));
  std::vector<std::size_t> bytes_plain(static_cast<std::size_t>(c.world));
  const std::vector<Status> st = test::run_ranks(c.world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Device& device = *ranks.devices[r];
    GradReducerOptions ro;
    ro.bucket_elements = 256;  // several buckets a group
    {
      std::vector<float> scratch(partition);
      const std::size_t before = device.memory_used_bytes();
      ZINF_ASSIGN_OR_RETURN(auto plain, GradReducer::create(p, rank, device, *ranks.comms[r],
                                                            scratch.data(), ro, nullptr));
      bytes_plain[r] = device.memory_used_bytes() - before;
    }
    ro.frozen = frozen;
    const std::size_t before = device.memory_used_bytes();
    ZINF_ASSIGN_OR_RETURN(auto reducer, GradReducer::create(p, rank, device, *ranks.comms[r],
                                                            acc[r].data(), ro, &counters[r]));
    bytes_frozen[r] = device.memory_used_bytes() - before;
    for (int step = 0; step < steps; ++step) {
      if (step > 0) reducer->zero();
      for (int k = 0; k < micro_batches; ++k) {
        std::vector<GradSource> sources(p.param_count());
        std::vector<DeviceBuffer> uploads;
        ZINF_ASSIGN_OR_RETURN(auto stream, device.create_stream("upload"));
        for (ParamId id = 0; id < p.param_count(); ++id) {
          if (frozen[id]) continue;
          const std::vector<float>& g = grads[r][static_cast<std::size_t>(k)][id];
          sources[id] = {g.data(), DType::kF32};
          if (!c.opaque) continue;
          // A device that is not host-accessible reads gradients from its own memory.
          ZINF_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::allocate(device, g.size() * 4));
          ZINF_RETURN_IF_ERROR(device.copy_h2d(buffer.data(), g.data(), g.size() * 4, *stream));
          sources[id].data = buffer.data();
          uploads.push_back(std::move(buffer));
        }
        ZINF_RETURN_IF_ERROR(device.synchronize(*stream));
        ZINF_RETURN_IF_ERROR(test::reduce_modules(p, *reducer, {"lora1", "lora0"}, sources));
      }
      ZINF_RETURN_IF_ERROR(reducer->wait());
      ZINF_RETURN_IF_ERROR(test::finish_step(*reducer, micro_batches));
    }
    return Status::ok();
  });
  ASSERT_TRUE(test::ranks_ok(st));

  for (int rank = 0; rank < c.world; ++rank) {
    const auto r = static_cast<std::size_t>(rank);
    // Each rank sums its micro-batches (f32, in order); the reduce-scatter takes the mean over
    // ranks in rank order. A frozen group's slice is +0.0, padding too.
    std::vector<float> expected(partition, 0.0f);
    std::size_t offset = 0;
    for (std::uint32_t g = 0; g < p.group_count(); ++g) {
      if (!group_frozen[g]) {
        for (const ParamPiece& piece : p.shard_pieces(g, rank)) {
          for (std::size_t i = 0; i < piece.element_count; ++i) {
            expected[offset + piece.shard_offset + i] = test::stage1_mean(
                grads, c.world, micro_batches, piece.param, piece.param_offset + i);
          }
        }
      }
      offset += p.group(g).shard_element_count;
    }
    EXPECT_EQ(std::memcmp(acc[r].data(), expected.data(), partition * 4), 0) << "rank " << rank;
    // Every step reduce-scatters the trainable groups' full copies only: 4 bytes an element of
    // them (padding included), nothing of the frozen groups.
    EXPECT_EQ(counters[r].reduce_scatter_bytes,
              static_cast<std::uint64_t>(steps) * trainable_padded * 4)
        << "rank " << rank << "; frozen groups' share would be " << frozen_padded * 4 * steps;
    // No full-size copy of a frozen group: 4 bytes an element of the frozen groups less.
    EXPECT_EQ(bytes_plain[r] - bytes_frozen[r], frozen_padded * 4)
        << "rank " << rank << ": reducer bytes " << bytes_frozen[r] << " with frozen groups, "
        << bytes_plain[r] << " without";
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, GradReducerFrozenStage1,
                         ::testing::Values(FrozenCase{2, false}, FrozenCase{4, false},
                                           FrozenCase{2, true}, FrozenCase{4, true}),
                         [](const ::testing::TestParamInfo<FrozenCase>& info) {
                           return fmt::format("w{}{}", info.param.world,
                                              info.param.opaque ? "_opaque" : "");
                         });

// GradReducerOptions::group_offsets, stages 1 and 2, 2 ranks, an opaque device with the
// accumulator in its memory (the device optimizer's packed gradients): lora_params()'s groups
// placed in reverse order with gaps between them, the first frozen group given no room
// (kNoRoom) and the second some. Each trainable group's slice lands at its offset, bit for bit
// the reference of the test above; the frozen group with room reads +0.0; and every other
// element of the accumulator (the gaps, where a group without room would have been) keeps the
// NaN it started with: nothing is written outside the slices given.
class GradReducerGroupOffsets : public ::testing::TestWithParam<ZeroStage> {};

TEST_P(GradReducerGroupOffsets, WritesEachGroupAtItsOffsetAndNothingElsewhere) {
  constexpr int kWorld = 2;
  constexpr int kMicroBatches = 2;
  const ZeroStage stage = GetParam();
  const std::uint64_t seed = 9300 + static_cast<std::uint64_t>(stage);
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::optional<Partitioner> lora;
  std::vector<bool> frozen;
  ASSERT_NO_FATAL_FAILURE(make_lora_partitioner(kWorld, stage, lora, frozen));
  Partitioner& p = *lora;
  // Offsets from the last group to the first, 7 elements apart, 5 before the first; the first
  // frozen group has none.
  std::vector<std::size_t> offsets(p.group_count(), GradReducerOptions::kNoRoom);
  std::uint32_t no_room = p.group_count();
  std::size_t next = 5;
  for (std::uint32_t g = p.group_count(); g-- > 0;) {
    const GroupInfo& info = p.group(g);
    if (frozen[info.first_param] && no_room == p.group_count()) {
      no_room = g;
      continue;
    }
    offsets[g] = next;
    next += info.shard_element_count + 7;
  }
  ASSERT_LT(no_room, p.group_count());
  const std::size_t total = next;
  // grads[rank][micro][param]; empty for a frozen parameter.
  const test::RankGrads grads = test::seeded_grads(p, kWorld, kMicroBatches, seed, frozen);
  test::HostRanks ranks = test::make_host_ranks(kWorld, seed, /*opaque=*/true);
  std::vector<std::vector<float>> acc(kWorld, std::vector<float>(total));
  const std::vector<Status> st = test::run_ranks(kWorld, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Device& device = *ranks.devices[r];
    ZINF_ASSIGN_OR_RETURN(auto stream, device.create_stream("upload"));
    ZINF_ASSIGN_OR_RETURN(DeviceBuffer accumulator,
                          DeviceBuffer::allocate(device, total * sizeof(float)));
    const std::vector<float> nans(total, std::nanf(""));
    ZINF_RETURN_IF_ERROR(
        device.copy_h2d(accumulator.data(), nans.data(), total * sizeof(float), *stream));
    ZINF_RETURN_IF_ERROR(device.synchronize(*stream));
    GradReducerOptions ro;
    ro.bucket_elements = 256;  // several buckets a group
    ro.accumulator_on_device = true;
    ro.frozen = frozen;
    ro.group_offsets = offsets;
    ZINF_ASSIGN_OR_RETURN(auto reducer, GradReducer::create(p, rank, device, *ranks.comms[r],
                                                            accumulator.as<float>(), ro, nullptr));
    for (int k = 0; k < kMicroBatches; ++k) {
      std::vector<GradSource> sources(p.param_count());
      std::vector<DeviceBuffer> uploads;
      for (ParamId id = 0; id < p.param_count(); ++id) {
        if (frozen[id]) continue;
        const std::vector<float>& g = grads[r][static_cast<std::size_t>(k)][id];
        ZINF_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::allocate(device, g.size() * 4));
        ZINF_RETURN_IF_ERROR(device.copy_h2d(buffer.data(), g.data(), g.size() * 4, *stream));
        sources[id] = {buffer.data(), DType::kF32};
        uploads.push_back(std::move(buffer));
      }
      ZINF_RETURN_IF_ERROR(device.synchronize(*stream));
      ZINF_RETURN_IF_ERROR(test::reduce_modules(p, *reducer, {"lora1", "lora0"}, sources));
      ZINF_RETURN_IF_ERROR(reducer->wait());
    }
    ZINF_RETURN_IF_ERROR(reducer->reduce_accumulated());
    ZINF_RETURN_IF_ERROR(reducer->wait());
    ZINF_RETURN_IF_ERROR(
        device.copy_d2h(acc[r].data(), accumulator.data(), total * sizeof(float), *stream));
    return device.synchronize(*stream);
  });
  ASSERT_TRUE(test::ranks_ok(st));

  for (int rank = 0; rank < kWorld; ++rank) {
    // Stage 1 sums the micro-batches on each rank, then takes the mean over ranks; stages 2-3
    // take each micro-batch's mean and sum those. Means over ranks in rank order.
    std::vector<float> expected(total, std::nanf(""));
    for (std::uint32_t g = 0; g < p.group_count(); ++g) {
      if (offsets[g] == GradReducerOptions::kNoRoom) continue;
      const GroupInfo& info = p.group(g);
      float* slice = expected.data() + offsets[g];
      std::fill_n(slice, info.shard_element_count, 0.0f);
      if (frozen[info.first_param]) continue;
      for (const ParamPiece& piece : p.shard_pieces(g, rank)) {
        for (std::size_t i = 0; i < piece.element_count; ++i) {
          auto grad = [&](int q, int k) {
            return grads[static_cast<std::size_t>(q)][static_cast<std::size_t>(k)][piece.param]
                        [piece.param_offset + i];
          };
          float v = 0.0f;
          if (stage == ZeroStage::kStage1) {
            const float s0 = grad(0, 0) + grad(0, 1);
            const float s1 = grad(1, 0) + grad(1, 1);
            v = (s0 + s1) / 2.0f;
          } else {
            v = (grad(0, 0) + grad(1, 0)) / 2.0f;
            v += (grad(0, 1) + grad(1, 1)) / 2.0f;
          }
          slice[piece.shard_offset + i] = v;
        }
      }
    }
    const std::vector<float>& got = acc[static_cast<std::size_t>(rank)];
    std::size_t differ = 0;
    for (std::size_t e = 0; e < total; ++e) {
      const bool same =
          std::isnan(expected[e]) ? std::isnan(got[e]) : std::memcmp(&got[e], &expected[e], 4) == 0;
      if (!same && differ++ < 5) {
        ADD_FAILURE() << "rank " << rank << " element " << e << ": " << got[e] << ", expected "
                      << expected[e];
      }
    }
    EXPECT_EQ(differ, 0u) << "rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, GradReducerGroupOffsets,
                         ::testing::Values(ZeroStage::kStage1, ZeroStage::kStage2),
                         [](const ::testing::TestParamInfo<ZeroStage>& info) {
                           return fmt::format("stage{}", static_cast<int>(info.param));
                         });

}  // namespace
}  // namespace zinf
