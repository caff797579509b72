// GradReducer on HostDevice + LocalComm: for bucket sizes smaller than, equal to and larger than
// a shard, stages 1 and 2, f32 and bf16 gradients, each rank's accumulator holds the mean over
// ranks (summed over two micro-batches) of exactly its slice, in the number of buckets the
// bucket size implies, starting from NaN and again after zero() over the first step's sums. On
// opaque HostDevices (not host-accessible, as a GPU) the gradients are handed over in device
// memory and the reducer takes its device path (fill stream, device ops, staged copies back),
// with the same bits; stream jitter shows a missing wait on either path.
#include "zero/grad_reducer.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "base/random.hpp"
#include "zero/grad_reducer_test_util.hpp"

namespace zinf {
namespace {

struct Case {
  int world;
  ZeroStage stage;
  std::size_t bucket_elements;
  DType grad_dtype;
  bool opaque = false;
};

class GradReducerTest : public ::testing::TestWithParam<Case> {};

TEST_P(GradReducerTest, AccumulatorHoldsTheMeanOfItsSliceInTheExpectedBuckets) {
  const Case c = GetParam();
  const std::uint64_t seed = 500 + c.bucket_elements + static_cast<std::uint64_t>(c.world);
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  PartitionerOptions po;
  po.world_size = c.world;
  po.stage = c.stage;
  Partitioner p = std::move(Partitioner::create(po)).value();
  const std::vector<std::vector<std::int64_t>> shapes = {{37, 11}, {5}, {}, {1029}, {3, 3, 7}};
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    ASSERT_TRUE(
        p.add({fmt::format("p{}", i), fmt::format("m{}", i / 2), shapes[i], DType::kBF16}).is_ok());
  }
  ASSERT_TRUE(p.finalize().is_ok());
  const int micro_batches = 2;
  // grads[rank][micro][param], already rounded to the gradient dtype.
  const test::RankGrads grads =
      test::seeded_grads(p, c.world, micro_batches, seed, {}, c.grad_dtype);
  test::HostRanks ranks = test::make_host_ranks(c.world, seed, c.opaque);
  const std::size_t partition = GradReducer::partition_element_count(p);
  // The reducer does not clear an accumulator in memory: each group's first reduction
  // overwrites its slice, padding included, so whatever it held before must not show.
  std::vector<std::vector<float>> acc(static_cast<std::size_t>(c.world),
                                      std::vector<float>(partition, std::nanf("")));
  std::vector<ZeroCounters> counters(static_cast<std::size_t>(c.world));
  const std::vector<Status> st = test::run_ranks(c.world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    GradReducerOptions ro;
    ro.bucket_elements = c.bucket_elements;
    ZINF_ASSIGN_OR_RETURN(auto reducer,
                          GradReducer::create(p, rank, *ranks.devices[r], *ranks.comms[r],
                                              acc[r].data(), ro, &counters[r]));
    // Two steps over the same gradients: the second, after zero(), must store over the
    // first's sums, not add to them.
    for (int step = 0; step < 2; ++step) {
      if (step == 1) reducer->zero();
      for (int k = 0; k < micro_batches; ++k) {
        std::vector<std::vector<std::uint16_t>> halves;
        std::vector<GradSource> sources(p.param_count());
        for (ParamId id = 0; id < p.param_count(); ++id) {
          const std::vector<float>& g = grads[r][static_cast<std::size_t>(k)][id];
          if (c.grad_dtype == DType::kF32) {
            sources[id] = {g.data(), DType::kF32};
          } else {
            halves.emplace_back(g.size());
            convert_f32_to_bf16(g.data(), halves.back().data(), g.size());
          }
        }
        if (c.grad_dtype != DType::kF32) {
          for (ParamId id = 0; id < p.param_count(); ++id) {
            sources[id] = {halves[id].data(), DType::kBF16};
          }
        }
        // A device that is not host-accessible reads gradients from its own memory.
        std::vector<DeviceBuffer> uploads;
        if (c.opaque) {
          ZINF_ASSIGN_OR_RETURN(auto stream, ranks.devices[r]->create_stream("upload"));
          for (ParamId id = 0; id < p.param_count(); ++id) {
            const std::size_t bytes = p.location(id).element_count * dtype_bytes(c.grad_dtype);
            ZINF_ASSIGN_OR_RETURN(DeviceBuffer buffer,
                                  DeviceBuffer::allocate(*ranks.devices[r], bytes));
            ZINF_RETURN_IF_ERROR(
                ranks.devices[r]->copy_h2d(buffer.data(), sources[id].data, bytes, *stream));
            sources[id].data = buffer.data();
            uploads.push_back(std::move(buffer));
          }
          ZINF_RETURN_IF_ERROR(ranks.devices[r]->synchronize(*stream));
        }
        // Module by module, backward order.
        ZINF_RETURN_IF_ERROR(test::reduce_modules(p, *reducer, {"m2", "m1", "m0"}, sources));
      }
      ZINF_RETURN_IF_ERROR(test::finish_step(*reducer, micro_batches));
    }
    return Status::ok();
  });
  ASSERT_TRUE(test::ranks_ok(st));

  for (int rank = 0; rank < c.world; ++rank) {
    std::vector<float> expected(partition, 0.0f);
    std::size_t offset = 0;
    std::size_t buckets = 0;
    for (std::uint32_t g = 0; g < p.group_count(); ++g) {
      const std::size_t shard = p.group(g).shard_element_count;
      const std::size_t chunk =
          std::clamp<std::size_t>(c.bucket_elements / static_cast<std::size_t>(c.world), 1, [&] {
            std::size_t largest = 1;
            for (std::uint32_t h = 0; h < p.group_count(); ++h) {
              largest = std::max(largest, p.group(h).shard_element_count);
            }
            return largest;
          }());
      buckets += (shard + chunk - 1) / chunk;
      for (const ParamPiece& piece : p.shard_pieces(g, rank)) {
        for (std::size_t i = 0; i < piece.element_count; ++i) {
          float total = 0.0f;
          if (c.stage == ZeroStage::kStage1) {
            // Each rank sums its micro-batches; then the mean over ranks in rank order.
            total = test::stage1_mean(grads, c.world, micro_batches, piece.param,
                                      piece.param_offset + i);
          } else {
            for (int k = 0; k < micro_batches; ++k) {
              float s = grads[0][static_cast<std::size_t>(k)][piece.param][piece.param_offset + i];
              for (int q = 1; q < c.world; ++q) {
                s += grads[static_cast<std::size_t>(q)][static_cast<std::size_t>(k)][piece.param]
                          [piece.param_offset + i];
              }
              total += s / static_cast<float>(c.world);
            }
          }
          expected[offset + piece.shard_offset + i] = total;
        }
      }
      offset += shard;
    }
    const std::vector<float>& got = acc[static_cast<std::size_t>(rank)];
    EXPECT_EQ(std::memcmp(got.data(), expected.data(), partition * 4), 0) << "rank " << rank;
    const std::size_t rounds = c.stage == ZeroStage::kStage1 ? 1 : micro_batches;
    // One rank with its accumulator in host memory adds each gradient in place at stages 2-3.
    const bool in_place = c.world == 1 && !c.opaque && c.stage != ZeroStage::kStage1;
    EXPECT_EQ(counters[static_cast<std::size_t>(rank)].buckets_reduced,
              in_place ? 0 : 2 * buckets * rounds)
        << "rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Buckets, GradReducerTest,
                         ::testing::Values(Case{3, ZeroStage::kStage2, 300, DType::kF32},
                                           Case{3, ZeroStage::kStage2, 1 << 20, DType::kBF16},
                                           Case{4, ZeroStage::kStage3, 12, DType::kF32},
                                           Case{2, ZeroStage::kStage1, 1000, DType::kBF16},
                                           Case{1, ZeroStage::kStage2, 128, DType::kF32},
                                           Case{3, ZeroStage::kStage2, 300, DType::kF32, true},
                                           Case{2, ZeroStage::kStage3, 1 << 20, DType::kBF16, true},
                                           Case{4, ZeroStage::kStage3, 12, DType::kF32, true},
                                           Case{2, ZeroStage::kStage1, 1000, DType::kBF16, true},
                                           Case{3, ZeroStage::kStage1, 40, DType::kF32, true},
                                           // One rank: in place at stages 2-3 on the host,
                                           // else its bucket reduce-scattered in place.
                                           Case{1, ZeroStage::kStage3, 12, DType::kBF16},
                                           Case{1, ZeroStage::kStage1, 100, DType::kF32},
                                           Case{1, ZeroStage::kStage2, 128, DType::kF32, true},
                                           Case{1, ZeroStage::kStage3, 1 << 20, DType::kBF16, true},
                                           Case{1, ZeroStage::kStage1, 40, DType::kBF16, true}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return fmt::format("w{}_stage{}_bucket{}_{}{}", info.param.world,
                                              static_cast<int>(info.param.stage),
                                              info.param.bucket_elements,
                                              dtype_name(info.param.grad_dtype),
                                              info.param.opaque ? "_opaque" : "");
                         });

// One rank with its accumulator in host memory adds in place, spread over threads by blocks of
// 256 Ki elements: parameters larger than a block and a block boundary inside each, micro-batches
// widened then added, the padding cleared, a group zeroed by zero_group() overwritten by its next
// reduction while the other keeps its sum. Against float sums computed here.
TEST(GradReducerInPlace, LargeParametersOverBlocksAndMicroBatches) {
  PartitionerOptions po;
  po.stage = ZeroStage::kStage2;
  Partitioner p = std::move(Partitioner::create(po)).value();
  const std::vector<std::vector<std::int64_t>> shapes = {{700001}, {3}, {1000, 301}};
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    ASSERT_TRUE(p.add({fmt::format("p{}", i), i < 2 ? "a" : "b", shapes[i], DType::kBF16}).is_ok());
  }
  ASSERT_TRUE(p.finalize().is_ok());
  std::unique_ptr<Device> device = std::move(make_host_device({})).value();
  auto comms = std::move(make_local_comm_group(std::vector<Device*>{device.get()})).value();
  const std::size_t partition = GradReducer::partition_element_count(p);
  std::vector<float> acc(partition, std::nanf(""));
  ZeroCounters counters;
  auto reducer =
      std::move(GradReducer::create(p, 0, *device, *comms[0], acc.data(), {}, &counters)).value();
  // grads[micro][param] as bf16, and the same values widened.
  std::vector<std::vector<std::vector<std::uint16_t>>> halves(3);
  std::vector<std::vector<std::vector<float>>> wide(3);
  for (std::size_t k = 0; k < 3; ++k) {
    for (ParamId id = 0; id < p.param_count(); ++id) {
      const std::size_t n = p.location(id).element_count;
      std::vector<float> g(n);
      fill_uniform(g.data(), n, 4242 + k * 31 + id, -1.0f, 1.0f);
      halves[k].emplace_back(n);
      convert_f32_to_bf16(g.data(), halves[k].back().data(), n);
      wide[k].emplace_back(n);
      convert_bf16_to_f32(halves[k].back().data(), wide[k].back().data(), n);
    }
  }
  auto reduce = [&](std::size_t k, std::string_view module) {
    std::vector<GradSource> sources(p.param_count());
    for (ParamId id = 0; id < p.param_count(); ++id) {
      sources[id] = {halves[k][id].data(), DType::kBF16};
    }
    auto groups = std::move(p.module_groups(module)).value();
    ASSERT_TRUE(reducer->reduce(groups, sources).is_ok());
  };
  // The accumulator as expected when group g holds the sum of micro-batches `micros` (in order).
  auto expect = [&](std::uint32_t g, std::vector<std::size_t> micros) {
    const GroupInfo& info = p.group(g);
    std::vector<float> want(info.shard_element_count, 0.0f);
    for (ParamId id = info.first_param; id < info.first_param + info.param_count; ++id) {
      const ParamLocation& loc = p.location(id);
      for (std::size_t i = 0; i < loc.element_count; ++i) {
        float s = wide[micros[0]][id][i];
        for (std::size_t j = 1; j < micros.size(); ++j) s += wide[micros[j]][id][i];
        want[loc.group_offset + i] = s;
      }
    }
    const float* got = acc.data() + reducer->partition_offset(g);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && bad++ == 0) {
        ADD_FAILURE() << "group " << g << " element " << i << ": " << got[i] << " != " << want[i];
      }
    }
    EXPECT_EQ(bad, 0u) << "group " << g;
  };
  ASSERT_EQ(p.group_count(), 2u);
  // Group a ends in padding (the expectation holds zeros there).
  ASSERT_GT(p.group(0).shard_element_count, std::size_t{700001 + 3});
  reduce(0, "b");
  reduce(0, "a");
  reduce(1, "b");
  reduce(1, "a");
  ASSERT_TRUE(reducer->wait().is_ok());
  expect(0, {0, 1});
  expect(1, {0, 1});
  EXPECT_EQ(reducer->micro_batches().value(), 2);
  EXPECT_EQ(counters.buckets_reduced, 0u);  // no collective on one rank
  // Group 1 cleared and reduced again: only micro-batch 2; group 0 keeps its sum.
  reducer->zero_group(1);
  reduce(2, "b");
  ASSERT_TRUE(reducer->wait().is_ok());
  expect(0, {0, 1});
  expect(1, {2});
  // zero(), then one micro-batch: that micro-batch alone everywhere. Before it, and half-way
  // through it, the count check names what is missing.
  reducer->zero();
  const Status none = reducer->micro_batches().status();
  EXPECT_EQ(none.code(), Code::kFailedPrecondition);
  EXPECT_NE(
      none.message().find("no gradients were reduced since the last step (parameter 'p0' had 0"),
      std::string::npos)
      << none.to_string();
  reduce(2, "b");
  const Status half = reducer->micro_batches().status();
  EXPECT_EQ(half.code(), Code::kFailedPrecondition);
  EXPECT_NE(half.message().find("parameter 'p0' had 0 gradient(s) reduced since the last step, "
                                "'p2' had 1"),
            std::string::npos)
      << half.to_string();
  reduce(2, "a");
  ASSERT_TRUE(reducer->wait().is_ok());
  expect(0, {2});
  expect(1, {2});
  EXPECT_EQ(reducer->micro_batches().value(), 1);
}

}  // namespace
}  // namespace zinf
