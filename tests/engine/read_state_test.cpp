// Engine::read_optimizer_state: a parameter's optimizer moment, whole, on every rank, after
// training, against the single-process reference's moments (the same bits, as the masters are),
// at every stage, with the state in host memory and on NVMe; its refusals; what a failure on
// one rank does to the others; and, with the state on NVMe, that a parameter's moment is read
// from the sub-groups that hold it and no others.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "io/fault.hpp"

namespace zinf {
namespace {

using engine_test::Model;

struct ReadCase {
  int world;
  int stage;
  OffloadDevice optimizer;
  // With kNone: the ranks' devices opaque (not host-accessible, as a GPU), so the state is the
  // device's (DeviceState), read back in chunks.
  bool opaque = false;
};

class ReadOptimizerState : public ::testing::TestWithParam<ReadCase> {};

TEST_P(ReadOptimizerState, GivesEveryRankTheReferenceMoments) {
  const ReadCase c = GetParam();
  engine_test::ScratchDir dir(
      fmt::format("read_state_w{}_s{}_{}", c.world, c.stage, offload_device_name(c.optimizer)));
  const Model model = engine_test::make_model(DType::kF32, 91);
  const Config config =
      engine_test::small_config(c.stage, c.optimizer, OffloadDevice::kNone, dir.path());
  engine_test::TrainOptions options;
  options.steps = 4;
  // The device's kernel rounds each operation where the host optimizer fuses multiply-adds
  // (device_optimizer.hpp): equal to within float rounding there, bit for bit elsewhere.
  // The second moment, a sum of squares, drifts most (1.3e-5 measured after 4 steps).
  const double tolerance = c.opaque ? 1e-4 : 0.0;
  options.gathered_tolerance = c.opaque ? 1e-5 : 0.0;
  const engine_test::Reference ref = engine_test::run_reference(config, model, c.world, options);
  engine_test::Ranks ranks =
      engine_test::make_ranks(c.world, std::chrono::seconds(30), /*jitter_max_us=*/0, c.opaque);
  const std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        engine_test::TrainOptions rank_options = options;
        rank_options.device = ranks.devices[static_cast<std::size_t>(rank)].get();
        ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, model, rank, rank_options,
                                                     &ref.device_per_step, nullptr));
        for (std::size_t p = 0; p < model.params.size(); ++p) {
          const std::string& name = model.params[p].name;
          for (const char* state : {"exp_avg", "exp_avg_sq"}) {
            const std::vector<float>& want =
                std::string_view(state) == "exp_avg" ? ref.exp_avg[p] : ref.exp_avg_sq[p];
            std::vector<float> got(want.size(), -1.0f);
            ZINF_RETURN_IF_ERROR(engine.read_optimizer_state(name, state, got.data()));
            const bool same = tolerance == 0.0 ? std::memcmp(got.data(), want.data(),
                                                             want.size() * sizeof(float)) == 0
                                               : engine_test::max_rel_diff(got, want) <= tolerance;
            if (!same) {
              return Status::internal(fmt::format("{} of '{}': max rel diff {}", state, name,
                                                  engine_test::max_rel_diff(got, want)));
            }
          }
        }
        // Refused alike on every rank, before any collective: the engine stays usable.
        std::vector<float> out(model.params[0].element_count());
        Status bad = engine.read_optimizer_state("no.such.parameter", "exp_avg", out.data());
        if (bad.code() != Code::kNotFound) return Status::internal("unknown: " + bad.to_string());
        bad = engine.read_optimizer_state(model.params[0].name, "momentum_buffer", out.data());
        if (bad.code() != Code::kInvalidArgument ||
            bad.message().find("\"exp_avg\", \"exp_avg_sq\"") == std::string::npos) {
          return Status::internal("unkept state: " + bad.to_string());
        }
        std::vector<float> master(out.size());
        return engine.read_parameters(model.params[0].name, master.data());
      });
  for (std::size_t r = 0; r < st.size(); ++r)
    EXPECT_TRUE(st[r].is_ok()) << r << ": " << st[r].to_string();
}

INSTANTIATE_TEST_SUITE_P(Cases, ReadOptimizerState,
                         ::testing::Values(ReadCase{1, 1, OffloadDevice::kHost},
                                           ReadCase{2, 1, OffloadDevice::kNvme},
                                           ReadCase{2, 2, OffloadDevice::kHost},
                                           ReadCase{2, 3, OffloadDevice::kHost},
                                           ReadCase{2, 3, OffloadDevice::kNvme},
                                           ReadCase{1, 2, OffloadDevice::kNone, true},
                                           ReadCase{2, 3, OffloadDevice::kNone, true}),
                         [](const ::testing::TestParamInfo<ReadCase>& info) {
                           return fmt::format("w{}_s{}_{}{}", info.param.world, info.param.stage,
                                              offload_device_name(info.param.optimizer),
                                              info.param.opaque ? "_device" : "");
                         });

// Three modules, one group each, f32. Two ways to cut the state on NVMe:
//
// Sub-groups of 256 elements (aio block 64 KiB, larger than any sub-group's 1 KiB moment: each
// sub-group's moment is one piece of I/O). m0.w and m2.w are {8, 128}, m1.b {200}; the partition
// at world 1 (each group padded to a multiple of 128 elements, each parameter starting at a
// multiple of 16) is
//   sub-groups 0-3  m0.w  [0, 1024)
//   sub-group  4    m1.a  [1024, 1124)   in the middle of the partition, inside one sub-group
//   sub-groups 4-5  m1.b  [1136, 1336)   across the boundary at 1280
//   sub-groups 5-9  m2.w  [1408, 2432)
// and at world 2 (groups padded to multiples of 256) each rank's is m0.w's slice (512), m1's
// (256: sub-group 2, which holds m1.a and rank 0's part of m1.b, or rank 1's), then m2.w's (512):
// five sub-groups.
//
// One sub-group (the default sub_group_size) read in swap blocks of 4 KiB (aio block_size
// 4096: 1024 elements, one piece of I/O each). m0.w and m2.w are {32, 128}, m1.b {1000}; at
// world 1 the partition is
//   blocks 0-3  m0.w  [0, 4096)
//   block  4    m1.a  [4096, 4196)
//   blocks 4-5  m1.b  [4208, 5208)   across the block boundary at 5120
//   blocks 5-9  m2.w  [5248, 9344)
// ten blocks in all (the last one partial); at world 2 each rank's is m0.w's slice [0, 2048),
// m1's [2048, 2688) (m1.a and m1.b's first 528 on rank 0, m1.b's last 472 on rank 1), m2.w's
// [2688, 4736): five blocks.
struct SliceCase {
  int world;
  int stage;
  OffloadDevice optimizer;
  bool blocks;  // one sub-group read in 4 KiB blocks, else sub-groups of 256 elements
};

Model slice_model(bool blocks, std::uint64_t seed) {
  const std::int64_t rows = blocks ? 32 : 8;
  Model m;
  m.modules = {"m0", "m1", "m2"};
  m.params = {
      {"m0.w", "m0", {rows, 128}, DType::kF32},
      {"m1.a", "m1", {100}, DType::kF32},
      {"m1.b", "m1", {blocks ? 1000 : 200}, DType::kF32},
      {"m2.w", "m2", {rows, 128}, DType::kF32},
  };
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (const engine_test::ParamDef& def : m.params) {
    std::vector<float> v(def.element_count());
    for (float& x : v) x = dist(rng);
    m.initial.push_back(std::move(v));
  }
  return m;
}

// The pieces of NVMe I/O one read_optimizer_state of each of slice_model's parameters makes on
// rank `rank`: one per sub-group or block that holds the rank's part of it, none where the rank
// owns none of it (m1.a at world 2, on rank 1). A read of the whole partition makes 10 (sub-groups,
// world 1), 5 (sub-groups, world 2), 10 (blocks, world 1) or 5 (blocks, world 2).
std::vector<std::uint64_t> expected_reads(const SliceCase& c, int rank) {
  if (c.world == 1) return {4, 1, 2, 5};
  const std::uint64_t m1a = rank == 0 ? 1 : 0;
  return {2, m1a, 1, c.blocks ? 3u : 2u};
}

class ReadOptimizerStateSlice : public ::testing::TestWithParam<SliceCase> {};

// Every parameter's master and moments are the reference's bits when the parameter sits inside
// one sub-group (or swap block) in the middle of the partition, or across a boundary; on NVMe each
// read moves the sub-groups or blocks that hold the parameter and no others (read pieces counted
// by engine_test::io_counter).
TEST_P(ReadOptimizerStateSlice, ReadsTheSubGroupsThatHoldTheParameter) {
  const SliceCase c = GetParam();
  engine_test::ScratchDir dir(fmt::format("read_state_slice_w{}_s{}_{}_{}", c.world, c.stage,
                                          offload_device_name(c.optimizer), c.blocks));
  const Model model = slice_model(c.blocks, 97);
  Config config = engine_test::small_config(c.stage, c.optimizer, OffloadDevice::kNone, dir.path());
  if (c.blocks) {
    config.zero.sub_group_size = Config().zero.sub_group_size;
    config.aio_block_bytes = 4096;
  } else {
    config.zero.sub_group_size = 256;
  }
  engine_test::TrainOptions options;
  options.steps = 3;
  const engine_test::Reference ref = engine_test::run_reference(config, model, c.world, options);
  engine_test::Ranks ranks = engine_test::make_ranks(c.world);
  const bool nvme = c.optimizer == OffloadDevice::kNvme;
  // reads[rank][3 * p + k]: the pieces read by read_parameters (k = 0) and
  // read_optimizer_state of exp_avg (1) and exp_avg_sq (2) of parameter p.
  std::vector<std::vector<std::uint64_t>> reads(static_cast<std::size_t>(c.world));
  const std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    const std::shared_ptr<FaultInjector> faults = engine_test::io_counter(/*reads=*/true);
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          engine_test::open_rank(ranks, rank, config, faults));
    engine_test::TrainOptions rank_options = options;
    rank_options.device = ranks.devices[r].get();
    ZINF_RETURN_IF_ERROR(
        engine_test::train_rank(*engine, model, rank, rank_options, &ref.device_per_step, nullptr));
    // The last step's pass done (it may still run behind the call), so that only the reads
    // below are counted.
    std::vector<float> master(model.params[0].element_count());
    ZINF_RETURN_IF_ERROR(engine->read_parameters(model.params[0].name, master.data()));
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const std::string& name = model.params[p].name;
      for (const char* state : {"params", "exp_avg", "exp_avg_sq"}) {
        const std::string_view which = state;
        const std::vector<float>& want = which == "params"    ? ref.master[p]
                                         : which == "exp_avg" ? ref.exp_avg[p]
                                                              : ref.exp_avg_sq[p];
        std::vector<float> got(want.size(), -1.0f);
        const std::uint64_t before = faults->counts().latency;
        ZINF_RETURN_IF_ERROR(which == "params"
                                 ? engine->read_parameters(name, got.data())
                                 : engine->read_optimizer_state(name, state, got.data()));
        reads[r].push_back(faults->counts().latency - before);
        if (std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) != 0) {
          return Status::internal(fmt::format("{} of '{}': max rel diff {}", state, name,
                                              engine_test::max_rel_diff(got, want)));
        }
      }
    }
    return Status::ok();
  });
  for (std::size_t r = 0; r < st.size(); ++r) {
    ASSERT_TRUE(st[r].is_ok()) << r << ": " << st[r].to_string();
  }
  for (std::size_t r = 0; r < reads.size(); ++r) {
    const std::vector<std::uint64_t> want_reads = expected_reads(c, static_cast<int>(r));
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const std::uint64_t want = nvme ? want_reads[p] : 0;
      for (std::size_t k = 0; k < 3; ++k) {
        EXPECT_EQ(reads[r][3 * p + k], want) << "rank " << r << ", "
                                             << (k == 0   ? "master"
                                                 : k == 1 ? "exp_avg"
                                                          : "exp_avg_sq")
                                             << " of " << model.params[p].name;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ReadOptimizerStateSlice,
                         ::testing::Values(SliceCase{1, 2, OffloadDevice::kNvme, false},
                                           SliceCase{1, 1, OffloadDevice::kHost, false},
                                           SliceCase{2, 2, OffloadDevice::kNvme, false},
                                           SliceCase{2, 3, OffloadDevice::kNvme, false},
                                           SliceCase{2, 3, OffloadDevice::kHost, false},
                                           SliceCase{1, 2, OffloadDevice::kNvme, true},
                                           SliceCase{2, 3, OffloadDevice::kNvme, true}),
                         [](const ::testing::TestParamInfo<SliceCase>& info) {
                           return fmt::format("w{}_s{}_{}_{}", info.param.world, info.param.stage,
                                              offload_device_name(info.param.optimizer),
                                              info.param.blocks ? "blocks" : "sub_groups");
                         });

// A read that fails on one rank (an I/O error reading its NVMe state, or a null `out`) fails every
// rank in the same call (the others with kAborted naming it), not in the all-gather after their
// collective timeout; and it leaves no rank's engine failed: once the fault is gone, every rank
// reads again and they agree.
TEST(ReadOptimizerStateErrors, AFailureOnOneRankFailsEveryRankAndStaysNoFailure) {
  constexpr int kWorld = 2;
  engine_test::ScratchDir dir("read_state_errors");
  const Model model = engine_test::make_model(DType::kF32, 93);
  Config config =
      engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
  config.collective_timeout_ms = 5000;
  engine_test::TrainOptions options;
  options.steps = 2;
  options.check_gathered = false;
  engine_test::Ranks ranks = engine_test::make_ranks(kWorld, std::chrono::seconds(5));
  const std::string& name = model.params[0].name;
  const std::size_t count = model.params[0].element_count();
  std::vector<Status> failed_read(kWorld), null_out(kWorld);
  std::vector<std::vector<float>> again(kWorld, std::vector<float>(count));
  const std::vector<Status> st = engine_test::run_ranks(kWorld, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    auto faults = engine_test::failing_io(/*reads=*/true);
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          engine_test::open_rank(ranks, rank, config, faults));
    engine_test::TrainOptions rank_options = options;
    rank_options.device = ranks.devices[r].get();
    ZINF_RETURN_IF_ERROR(
        engine_test::train_rank(*engine, model, rank, rank_options, nullptr, nullptr));
    std::vector<float> out(count);
    // The last step's pass done (it may still run behind the call): the faults meet this read.
    ZINF_RETURN_IF_ERROR(engine->read_parameters(name, out.data()));
    faults->set_enabled(rank == 0);
    failed_read[r] = engine->read_optimizer_state(name, "exp_avg_sq", out.data());
    faults->set_enabled(false);
    null_out[r] = engine->read_optimizer_state(name, "exp_avg", rank == 1 ? nullptr : out.data());
    return engine->read_optimizer_state(name, "exp_avg_sq", again[r].data());
  });
  for (std::size_t r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
  }
  EXPECT_EQ(failed_read[0].code(), Code::kIoError) << failed_read[0].to_string();
  EXPECT_EQ(failed_read[1].code(), Code::kAborted) << failed_read[1].to_string();
  EXPECT_THAT(failed_read[1].message(), ::testing::HasSubstr("rank 0 failed (io_error)"));
  EXPECT_EQ(null_out[1].code(), Code::kInvalidArgument) << null_out[1].to_string();
  EXPECT_EQ(null_out[0].code(), Code::kAborted) << null_out[0].to_string();
  EXPECT_THAT(null_out[0].message(), ::testing::HasSubstr("rank 1 failed (invalid_argument)"));
  EXPECT_EQ(std::memcmp(again[0].data(), again[1].data(), count * sizeof(float)), 0);
}

}  // namespace
}  // namespace zinf
