// Engine::write_parameters on a model of many small parameters, each its own module and group,
// as a loop of single writes makes them (zinf.torch GatheredParameters blocks that change one
// parameter each): every call's parameters get the values written, bit for bit, and every other
// parameter keeps what it held, in its master and its device copy, wherever the optimizer state
// lives; a batch of parameters far apart, given out of order, writes the same; and the names'
// checks report the first bad name in the order given (an unknown one, or the second mention of a
// parameter). A call's host work is its own parameters' (the named groups are a sorted list, not a
// mask over every group), so these check that what it writes and refuses is unchanged by that.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

constexpr std::size_t kParams = 300;
constexpr std::size_t kEach = 24;  // elements a parameter

std::vector<float> seeded(std::uint64_t seed, std::size_t count) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> out(count);
  for (float& v : out) v = dist(rng);
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One rank, stage 2, AdamW with its state at `offload`; kParams parameters "w<i>" of kEach
// elements, each in module "m<i>", initial values seeded(i).
struct OneRank {
  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::unique_ptr<Engine> engine;
  std::vector<std::string> names;
};

OneRank open_model(OffloadDevice offload, const std::string& dir) {
  OneRank r;
  std::filesystem::create_directories(dir);
  Result<std::unique_ptr<Device>> device = make_host_device({});
  EXPECT_TRUE(device.is_ok());
  r.device = std::move(*device);
  Result<std::vector<std::unique_ptr<Communicator>>> comms =
      make_local_comm_group({r.device.get()});
  EXPECT_TRUE(comms.is_ok());
  r.comms = std::move(*comms);
  Config config;
  config.optimizer.kind = OptimizerKind::kAdamW;
  config.zero.stage = 2;
  config.zero.offload_optimizer.device = offload;
  config.zero.offload_optimizer.nvme_path = dir;
  config.zero.sub_group_size = 1000;  // several sub-groups on NVMe
  Env env;
  env.device = r.device.get();
  env.comm = r.comms[0].get();
  Result<std::unique_ptr<Engine>> engine = Engine::open(config, env);
  EXPECT_TRUE(engine.is_ok()) << engine.status().to_string();
  r.engine = std::move(*engine);
  for (std::size_t i = 0; i < kParams; ++i) {
    r.names.push_back(fmt::format("w{}", i));
    ParameterSpec spec;
    spec.name = r.names.back();
    spec.module = fmt::format("m{}", i);
    spec.shape = {static_cast<std::int64_t>(kEach)};
    const std::vector<float> initial = seeded(i, kEach);
    spec.initial_values = initial.data();  // copied at registration
    EXPECT_TRUE(r.engine->register_parameter(spec).is_ok());
  }
  EXPECT_TRUE(r.engine->finalize().is_ok());
  return r;
}

class WriteParametersCost : public ::testing::TestWithParam<OffloadDevice> {};

TEST_P(WriteParametersCost, SinglesAndAScatteredBatchWriteTheirParametersAlone) {
  const std::string dir = fmt::format("{}/zinf-wp-cost-{}-{}", ::testing::TempDir(),
                                      static_cast<int>(GetParam()), ::getpid());
  OneRank r = open_model(GetParam(), dir);
  ASSERT_NE(r.engine, nullptr);
  std::vector<std::vector<float>> expect(kParams);
  for (std::size_t i = 0; i < kParams; ++i) expect[i] = seeded(i, kEach);

  // Single writes of every other parameter, from the last one down.
  for (std::size_t i = kParams; i-- > 0;) {
    if (i % 2 != 0) continue;
    expect[i] = seeded(1000 + i, kEach);
    ASSERT_TRUE(r.engine->write_parameters(r.names[i], expect[i].data()).is_ok()) << i;
  }
  // A batch of every seventh parameter and the last, shuffled: runs of one group with gaps.
  std::vector<std::size_t> picked;
  for (std::size_t i = 3; i < kParams; i += 7) picked.push_back(i);
  picked.push_back(kParams - 1);
  std::shuffle(picked.begin(), picked.end(), std::mt19937_64(7));
  std::vector<std::string_view> batch;
  for (std::size_t i : picked) {
    batch.push_back(r.names[i]);
    expect[i] = seeded(5000 + i, kEach);
  }
  Status st = r.engine->write_parameters(batch, [&](std::string_view name, std::span<float> out) {
    const std::size_t i = std::stoull(std::string(name.substr(1)));
    std::memcpy(out.data(), expect[i].data(), out.size_bytes());
    return Status::ok();
  });
  ASSERT_TRUE(st.is_ok()) << st.to_string();

  std::vector<float> got(kEach);
  for (std::size_t i = 0; i < kParams; ++i) {
    ASSERT_TRUE(r.engine->read_parameters(r.names[i], got.data()).is_ok());
    EXPECT_TRUE(same_bits(got, expect[i])) << r.names[i];
    // The device copy (stage 2: kept gathered; host memory on HostDevice) shows them too.
    const std::string module = fmt::format("m{}", i);
    ASSERT_TRUE(r.engine->gather(module).is_ok());
    Result<TensorView> copy = r.engine->parameter(r.names[i]);
    ASSERT_TRUE(copy.is_ok()) << copy.status().to_string();
    ASSERT_EQ(copy->dtype, DType::kF32);
    ASSERT_EQ(copy->element_count, kEach);
    EXPECT_EQ(std::memcmp(copy->data, expect[i].data(), kEach * sizeof(float)), 0)
        << r.names[i] << "'s device copy";
    ASSERT_TRUE(r.engine->release(module).is_ok());
  }
  r.engine.reset();
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Homes, WriteParametersCost,
                         ::testing::Values(OffloadDevice::kNone, OffloadDevice::kHost,
                                           OffloadDevice::kNvme),
                         [](const ::testing::TestParamInfo<OffloadDevice>& info) {
                           return std::string(offload_device_name(info.param));
                         });

TEST(WriteParametersCheck, ReportsTheFirstBadNameInTheOrderGiven) {
  const std::string dir = fmt::format("{}/zinf-wp-check-{}", ::testing::TempDir(), ::getpid());
  OneRank r = open_model(OffloadDevice::kHost, dir);
  ASSERT_NE(r.engine, nullptr);
  const std::vector<float> values(kEach, 1.5f);
  auto give = [&](std::string_view, std::span<float> out) {
    std::memcpy(out.data(), values.data(), out.size_bytes());
    return Status::ok();
  };
  auto call = [&](std::vector<std::string_view> names) {
    return r.engine->write_parameters(names, give).to_string();
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
  std::vector<float> got(kEach);
  for (std::size_t i : {2, 4, 5, 7, 9}) {
    ASSERT_TRUE(r.engine->read_parameters(r.names[i], got.data()).is_ok());
    EXPECT_TRUE(same_bits(got, seeded(i, kEach))) << r.names[i];
  }
  r.engine.reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace zinf
