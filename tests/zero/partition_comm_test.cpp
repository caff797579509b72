// The Partitioner's layout driving real collectives on HostDevice + LocalComm, as stage 3 uses it:
// shards all-gathered give back every parameter; per-rank gradients laid out in the group and
// reduce-scattered (average) give each rank the mean over ranks of exactly its slice.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "base/random.hpp"
#include "common/run_ranks.hpp"
#include "zero/partitioner.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"

namespace zinf {
namespace {

class PartitionComm : public ::testing::TestWithParam<int> {};

TEST_P(PartitionComm, GatherRebuildsParametersAndReduceScatterAveragesSlices) {
  const int world_size = GetParam();
  const std::uint64_t seed = 9000 + static_cast<std::uint64_t>(world_size);
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  PartitionerOptions options;
  options.world_size = world_size;
  Result<Partitioner> created = Partitioner::create(options);
  ASSERT_TRUE(created.is_ok());
  Partitioner& p = *created;
  const std::vector<std::vector<std::int64_t>> shapes = {{37, 11}, {5}, {}, {129}, {3, 3, 7}};
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    ASSERT_TRUE(
        p.add({fmt::format("m{}.p{}", i / 2, i), fmt::format("m{}", i / 2), shapes[i], DType::kF32})
            .is_ok());
  }
  ASSERT_TRUE(p.finalize().is_ok());

  // Initial parameter values (the same on every rank) and one gradient per rank per parameter.
  std::vector<std::vector<float>> values(p.param_count());
  std::vector<std::vector<std::vector<float>>> grads(static_cast<std::size_t>(world_size));
  for (ParamId id = 0; id < p.param_count(); ++id) {
    values[id].resize(p.location(id).element_count);
    fill_uniform(values[id].data(), values[id].size(), seed * 31 + id);
  }
  for (int r = 0; r < world_size; ++r) {
    for (ParamId id = 0; id < p.param_count(); ++id) {
      grads[static_cast<std::size_t>(r)].emplace_back(p.location(id).element_count);
      fill_uniform(grads[static_cast<std::size_t>(r)][id].data(), p.location(id).element_count,
                   seed * 977 + static_cast<std::uint64_t>(r) * 101 + id);
    }
  }

  // Stream work delayed at random (seeded by seed + rank), so that a missing wait shows up.
  test::HostRanksOptions rank_options;
  rank_options.jitter_max_us = 50;
  rank_options.jitter_seed = seed;
  test::HostRanks ranks = test::make_host_ranks(world_size, rank_options);
  const std::vector<Status> statuses = test::run_ranks(world_size, [&](int rank) -> Status {
    const auto urank = static_cast<std::size_t>(rank);
    Device& device = *ranks.devices[urank];
    Communicator& comm = *ranks.comms[urank];
    ZINF_ASSIGN_OR_RETURN(auto stream, device.create_stream("zero"));
    ZINF_ASSIGN_OR_RETURN(auto done, device.create_event());
    std::vector<const void*> value_ptrs, grad_ptrs;
    for (ParamId id = 0; id < p.param_count(); ++id) {
      value_ptrs.push_back(values[id].data());
      grad_ptrs.push_back(grads[urank][id].data());
    }
    for (std::uint32_t g = 0; g < p.group_count(); ++g) {
      const GroupInfo& info = p.group(g);
      const std::size_t shard = info.shard_element_count;
      std::vector<float> host_shard(shard);
      std::vector<float> host_full(info.padded_element_count);
      std::vector<float> host_grads(info.padded_element_count);
      // The full gradient of this rank in the group's layout: its slice from each "rank".
      for (int owner = 0; owner < world_size; ++owner) {
        p.fill_shard(g, owner, grad_ptrs, host_grads.data() + p.shard_offset(g, owner));
      }
      p.fill_shard(g, rank, value_ptrs, host_shard.data());
      ZINF_ASSIGN_OR_RETURN(DeviceBuffer full,
                            DeviceBuffer::allocate(device, info.padded_element_count * 4));
      ZINF_ASSIGN_OR_RETURN(DeviceBuffer grad,
                            DeviceBuffer::allocate(device, info.padded_element_count * 4));
      float* own = full.as<float>() + p.shard_offset(g, rank);
      ZINF_RETURN_IF_ERROR(device.copy_h2d(own, host_shard.data(), shard * 4, *stream));
      ZINF_RETURN_IF_ERROR(
          comm.all_gather(own, full.data(), shard, DType::kF32, *stream, "params"));
      ZINF_RETURN_IF_ERROR(
          device.copy_h2d(grad.data(), host_grads.data(), info.padded_element_count * 4, *stream));
      float* grad_slice = grad.as<float>() + p.shard_offset(g, rank);
      ZINF_RETURN_IF_ERROR(comm.reduce_scatter(grad.data(), grad_slice, shard, DType::kF32,
                                               ReduceOp::kAverage, *stream, "grads"));
      ZINF_RETURN_IF_ERROR(
          device.copy_d2h(host_full.data(), full.data(), info.padded_element_count * 4, *stream));
      ZINF_RETURN_IF_ERROR(device.copy_d2h(host_shard.data(), grad_slice, shard * 4, *stream));
      ZINF_RETURN_IF_ERROR(device.record(*done, *stream));
      ZINF_RETURN_IF_ERROR(comm.wait(*done, std::chrono::seconds(30)));
      for (ParamId id = info.first_param; id < info.first_param + info.param_count; ++id) {
        const ParamLocation& loc = p.location(id);
        if (std::memcmp(host_full.data() + loc.group_offset, values[id].data(),
                        loc.element_count * 4) != 0) {
          return Status::internal(fmt::format("gathered parameter {} differs", p.spec(id).name));
        }
      }
      // The mean over ranks, summed in rank order, for every element this rank owns;
      // padding stays zero.
      std::vector<float> expected(shard, 0.0f);
      for (const ParamPiece& piece : p.shard_pieces(g, rank)) {
        for (std::size_t i = 0; i < piece.element_count; ++i) {
          float sum = 0.0f;
          for (int r = 0; r < world_size; ++r) {
            const float x = grads[static_cast<std::size_t>(r)][piece.param][piece.param_offset + i];
            sum = r == 0 ? x : sum + x;
          }
          expected[piece.shard_offset + i] = sum / static_cast<float>(world_size);
        }
      }
      if (host_shard != expected) return Status::internal("averaged gradient slice differs");
    }
    return Status::ok();
  });
  EXPECT_TRUE(test::ranks_ok(statuses));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, PartitionComm, ::testing::Values(1, 2, 3, 4, 5));

}  // namespace
}  // namespace zinf

namespace zinf {
namespace {

// Ranks that register different parameters get the same clear error on every rank, naming the
// first parameter that differs; ranks that agree get OK.
TEST(PartitionComm, LayoutAgreementNamesTheFirstDifferingParameter) {
  using Tweak = std::function<void(int rank, PartitionerOptions&, std::vector<ParamSpec>&)>;
  struct Case {
    const char* what;
    Tweak tweak;
    const char* expected;  // empty: agreement
  };
  const std::vector<Case> cases = {
      {"same", [](int, PartitionerOptions&, std::vector<ParamSpec>&) {}, ""},
      {"shape",
       [](int rank, PartitionerOptions&, std::vector<ParamSpec>& specs) {
         if (rank == 2) specs[3].shape = {4, 5};
       },
       "parameter #3 is 'm1.p3'"},
      {"dtype",
       [](int rank, PartitionerOptions&, std::vector<ParamSpec>& specs) {
         if (rank == 0) specs[1].dtype = DType::kBF16;
       },
       "parameter #1 is 'm0.p1'"},
      {"extra parameter",
       [](int rank, PartitionerOptions&, std::vector<ParamSpec>& specs) {
         if (rank == 1) specs.push_back({"m9.extra", "m9", {7}, DType::kF32});
       },
       "registered 5"},
      {"options",
       [](int rank, PartitionerOptions& options, std::vector<ParamSpec>&) {
         if (rank == 1) options.stage = ZeroStage::kStage2;
       },
       "options"},
  };
  const int world_size = 3;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    test::HostRanks ranks = test::make_host_ranks(world_size);
    const std::vector<Status> statuses = test::run_ranks(world_size, [&](int rank) -> Status {
      PartitionerOptions options;
      options.world_size = world_size;
      std::vector<ParamSpec> specs = {{"m0.p0", "m0", {3, 4}, DType::kF32},
                                      {"m0.p1", "m0", {5}, DType::kF32},
                                      {"m1.p2", "m1", {}, DType::kF32},
                                      {"m1.p3", "m1", {4, 4}, DType::kF32}};
      c.tweak(rank, options, specs);
      ZINF_ASSIGN_OR_RETURN(Partitioner p, Partitioner::create(options));
      for (const ParamSpec& spec : specs) (void)p.add(spec);
      ZINF_RETURN_IF_ERROR(p.finalize());
      return check_layout_agreement(p, *ranks.comms[static_cast<std::size_t>(rank)],
                                    std::chrono::seconds(30));
    });
    for (int r = 0; r < world_size; ++r) {
      const Status& s = statuses[static_cast<std::size_t>(r)];
      if (std::string_view(c.expected).empty()) {
        EXPECT_TRUE(s.is_ok()) << s.to_string();
        continue;
      }
      EXPECT_EQ(s.code(), Code::kInvalidArgument) << "rank " << r << ": " << s.to_string();
      EXPECT_NE(s.message().find(c.expected), std::string_view::npos)
          << "rank " << r << ": " << s.to_string();
    }
  }
}

}  // namespace
}  // namespace zinf
