// Engine::write_parameters on a model of many small parameters, each its own module and group,
// as a loop of single writes makes them (zinf.torch GatheredParameters blocks that change one
// parameter each): every call's parameters get the values written, bit for bit, and every other
// parameter keeps what it held, in its master and its device copy, wherever the optimizer state
// lives (on an opaque device too: DeviceState); a batch of parameters far apart and side by side,
// given out of order, writes the same, on one rank and on two; each call all-gathers its named
// groups alone; and the names' checks report the first bad name in the order given (an unknown
// one, or the second mention of a parameter). The named groups are a sorted list, not a mask over
// every group, so that the call's checks, runs, shard writes and all-gather go over its own
// groups; these check that what it writes, gathers and refuses is unchanged by that.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine_test_util.hpp"
#include "one_param_modules.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

constexpr std::size_t kCostParams = 300;
constexpr std::size_t kCostEach = 24;  // elements a parameter

// Initial and written values: uniform in [kLo, kHi).
constexpr float kLo = -2.0f;
constexpr float kHi = 2.0f;

using engine_test::same_bits;

// Stage 2 (every group stays gathered), AdamW with its state at `offload`; kCostParams parameters
// "w<i>" of kCostEach elements, each in module "m<i>" and its own group, initial values seeded with
// i.
struct CostCase {
  OffloadDevice offload;
  bool opaque;  // the devices opaque (a GPU's memory; offload none: DeviceState)
  int world;
};

// What a group's all-gather receives: kCostEach elements padded to world * 128 (the partitioner's
// alignment_elements), f32.
std::uint64_t gathered_bytes(int world) {
  return static_cast<std::uint64_t>(world) * 128 * sizeof(float);
}

Result<std::unique_ptr<Engine>> open_model(const CostCase& c, const std::string& dir,
                                           Device* device, Communicator* comm) {
  Config config;
  config.optimizer.kind = OptimizerKind::kAdamW;
  config.zero.stage = 2;
  config.zero.offload_optimizer.device = c.offload;
  config.zero.offload_optimizer.nvme_path = dir;
  config.zero.sub_group_size = 1000;     // several sub-groups on NVMe
  config.collective_timeout_ms = 30000;  // as make_ranks()' communicators
  std::filesystem::create_directories(dir);
  Env env;
  env.device = device;
  env.comm = comm;
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::open(config, env));
  ZINF_RETURN_IF_ERROR(engine_test::register_model(
      *engine, engine_test::one_param_modules(kCostParams, kCostEach, /*seed=*/0, kLo, kHi)));
  ZINF_RETURN_IF_ERROR(engine->finalize());
  return engine;
}

// The device copy of parameter i, through the device (an opaque device's memory is not the
// host's).
Result<std::vector<float>> cost_device_copy(Engine& engine, Device& device, std::size_t i) {
  const std::string module = fmt::format("m{}", i);
  ZINF_RETURN_IF_ERROR(engine.gather(module));
  ZINF_ASSIGN_OR_RETURN(TensorView copy, engine.parameter(fmt::format("w{}", i)));
  if (copy.dtype != DType::kF32 || copy.element_count != kCostEach) {
    return Status::internal(fmt::format("w{}'s device copy is not {} f32 elements", i, kCostEach));
  }
  ZINF_ASSIGN_OR_RETURN(std::vector<float> out,
                        engine_test::copy_to_host(device, copy.data, kCostEach));
  ZINF_RETURN_IF_ERROR(engine.release(module));
  return out;
}

class WriteParametersCost : public ::testing::TestWithParam<CostCase> {};

TEST_P(WriteParametersCost, SinglesAndAScatteredBatchWriteAndGatherTheirParametersAlone) {
  const CostCase c = GetParam();
  const std::string dir = fmt::format("{}/zinf-wp-cost-{}-{}-{}-{}", ::testing::TempDir(),
                                      static_cast<int>(c.offload), c.opaque, c.world, ::getpid());
  std::filesystem::create_directories(dir);
  engine_test::Ranks ranks =
      engine_test::make_ranks(c.world, std::chrono::seconds(30), /*jitter_max_us=*/0, c.opaque);
  std::vector<std::string> names;
  for (std::size_t i = 0; i < kCostParams; ++i) names.push_back(fmt::format("w{}", i));
  // What every rank's parameters hold at the end, the same on each.
  std::vector<std::vector<float>> expect(kCostParams);
  for (std::size_t i = 0; i < kCostParams; ++i)
    expect[i] = engine_test::seeded(kCostEach, i, kLo, kHi);
  // Single writes of every other parameter, from the last one down.
  std::vector<std::size_t> singles;
  for (std::size_t i = kCostParams; i-- > 0;) {
    if (i % 2 == 0) singles.push_back(i);
  }
  for (std::size_t i : singles) expect[i] = engine_test::seeded(kCostEach, 1000 + i, kLo, kHi);
  // A batch, shuffled: the first parameter, every seventh one and the last (runs of one group
  // with gaps), and three side by side (a run of several groups).
  std::vector<std::size_t> picked = {0, 150, 151, 152};
  for (std::size_t i = 3; i < kCostParams; i += 7) {
    if (i < 150 || i > 152) picked.push_back(i);
  }
  picked.push_back(kCostParams - 1);
  std::shuffle(picked.begin(), picked.end(), std::mt19937_64(7));
  std::vector<std::string_view> batch;
  for (std::size_t i : picked) {
    batch.push_back(names[i]);
    expect[i] = engine_test::seeded(kCostEach, 5000 + i, kLo, kHi);
  }

  std::vector<std::vector<std::uint64_t>> single_gathered(c.world);
  std::vector<std::uint64_t> batch_gathered(c.world);
  std::vector<std::vector<std::vector<float>>> masters(c.world), copies(c.world);
  const std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          open_model(c, fmt::format("{}/rank{}", dir, rank), ranks.devices[r].get(),
                                     ranks.comms[r].get()));
    for (std::size_t i : singles) {
      const std::uint64_t before = engine->counters().all_gather_bytes;
      ZINF_RETURN_IF_ERROR(engine->write_parameters(names[i], expect[i].data()));
      single_gathered[r].push_back(engine->counters().all_gather_bytes - before);
    }
    const std::uint64_t before = engine->counters().all_gather_bytes;
    ZINF_RETURN_IF_ERROR(
        engine->write_parameters(batch, [&](std::string_view name, std::span<float> out) {
          const std::size_t i = std::stoull(std::string(name.substr(1)));
          std::memcpy(out.data(), expect[i].data(), out.size_bytes());
          return Status::ok();
        }));
    batch_gathered[r] = engine->counters().all_gather_bytes - before;
    for (std::size_t i = 0; i < kCostParams; ++i) {
      std::vector<float> got(kCostEach);
      ZINF_RETURN_IF_ERROR(engine->read_parameters(names[i], got.data()));
      masters[r].push_back(std::move(got));
      ZINF_ASSIGN_OR_RETURN(std::vector<float> copy,
                            cost_device_copy(*engine, *ranks.devices[r], i));
      copies[r].push_back(std::move(copy));
    }
    return Status::ok();
  });
  for (int rank = 0; rank < c.world; ++rank) {
    const auto r = static_cast<std::size_t>(rank);
    ASSERT_TRUE(st[r].is_ok()) << "rank " << rank << ": " << st[r].to_string();
    // Each call all-gathers its named groups (each one parameter's), every one of them.
    for (std::size_t k = 0; k < singles.size(); ++k) {
      EXPECT_EQ(single_gathered[r][k], gathered_bytes(c.world))
          << "rank " << rank << ", w" << singles[k];
    }
    EXPECT_EQ(batch_gathered[r], picked.size() * gathered_bytes(c.world)) << "rank " << rank;
    for (std::size_t i = 0; i < kCostParams; ++i) {
      EXPECT_TRUE(same_bits(masters[r][i], expect[i])) << "rank " << rank << ", " << names[i];
      // The device copy (stage 2: kept gathered) shows them too.
      EXPECT_TRUE(same_bits(copies[r][i], expect[i]))
          << "rank " << rank << ", " << names[i] << "'s device copy";
    }
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Homes, WriteParametersCost,
                         ::testing::Values(CostCase{OffloadDevice::kNone, false, 1},
                                           CostCase{OffloadDevice::kHost, false, 1},
                                           CostCase{OffloadDevice::kNvme, false, 1},
                                           CostCase{OffloadDevice::kNone, true, 1},
                                           CostCase{OffloadDevice::kHost, false, 2},
                                           CostCase{OffloadDevice::kNvme, true, 2}),
                         [](const ::testing::TestParamInfo<CostCase>& info) {
                           return fmt::format("{}{}_world{}",
                                              offload_device_name(info.param.offload),
                                              info.param.opaque ? "_opaque" : "", info.param.world);
                         });

TEST(WriteParametersCheck, ReportsTheFirstBadNameInTheOrderGiven) {
  const std::string dir = fmt::format("{}/zinf-wp-check-{}", ::testing::TempDir(), ::getpid());
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Result<std::unique_ptr<Engine>> engine = open_model({OffloadDevice::kHost, false, 1}, dir,
                                                      ranks.devices[0].get(), ranks.comms[0].get());
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  const std::vector<float> values(kCostEach, 1.5f);
  auto give = [&](std::string_view, std::span<float> out) {
    std::memcpy(out.data(), values.data(), out.size_bytes());
    return Status::ok();
  };
  auto call = [&](std::vector<std::string_view> names) {
    return (*engine)->write_parameters(names, give).to_string();
  };
  EXPECT_EQ(call({"w5", "w9", "w5"}),
            "invalid_argument: write_parameters('w5'): the parameter is named twice (at 0 and 2)");
  // The earliest second mention, whatever the parameters' order in the model.
  EXPECT_EQ(call({"w9", "w5", "w7", "w5", "w9"}),
            "invalid_argument: write_parameters('w5'): the parameter is named twice (at 1 and 3)");
  EXPECT_EQ(call({"w2", "w2", "w2"}),
            "invalid_argument: write_parameters('w2'): the parameter is named twice (at 0 and 1)");
  // An unknown name before a second mention, and after one.
  EXPECT_EQ(call({"w4", "nope", "w4"}), "not_found: write_parameters('nope'): unknown parameter");
  EXPECT_EQ(call({"w4", "w4", "nope"}),
            "invalid_argument: write_parameters('w4'): the parameter is named twice (at 0 and 1)");
  // None of those wrote anything.
  std::vector<float> got(kCostEach);
  for (std::size_t i : {2, 4, 5, 7, 9}) {
    ASSERT_TRUE((*engine)->read_parameters(fmt::format("w{}", i), got.data()).is_ok());
    EXPECT_TRUE(same_bits(got, engine_test::seeded(kCostEach, i, kLo, kHi))) << "w" << i;
  }
  engine->reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace zinf
