// Engine::write_parameters: rank `root`'s values replace one parameter's fp32 master on every
// rank, whatever the stage and wherever the master lives (device, host memory, NVMe); the other
// parameters keep their masters to the bit, and the gathered device copy shows the new values.
// Bad calls (an unknown name, a module gathered) fail before any collective and leave the engine
// usable. (python/tests/test_gathered_write.py checks that training goes on from the new values
// as torch does.)
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;

struct Case {
  int world;
  int stage;
  OffloadDevice optimizer;
  OffloadDevice params = OffloadDevice::kNone;
};

std::string case_name(const Case& c) {
  return fmt::format("w{}_s{}_opt_{}_param_{}", c.world, c.stage, offload_device_name(c.optimizer),
                     offload_device_name(c.params));
}

class WriteParameters : public ::testing::TestWithParam<Case> {};

TEST_P(WriteParameters, ReplacesOneMasterFromTheRoot) {
  const Case c = GetParam();
  engine_test::ScratchDir dir("write_parameters_" + case_name(c));
  const Model model = engine_test::make_model(DType::kF32, 77);
  // The largest parameter, so that it spans several sub-groups and ranks.
  std::size_t target = 0;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].element_count() > model.params[target].element_count()) target = p;
  }
  const std::string& name = model.params[target].name;
  std::vector<float> fresh(model.params[target].element_count());
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  for (float& v : fresh) v = dist(gen);
  const int root = c.world - 1;

  engine_test::Ranks ranks = engine_test::make_ranks(c.world);
  const auto world = static_cast<std::size_t>(c.world);
  std::vector<std::vector<std::vector<float>>> masters(world);
  std::vector<std::vector<float>> gathered(world);
  std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Env env;
    env.device = ranks.devices[r].get();
    env.comm = ranks.comms[r].get();
    ZINF_ASSIGN_OR_RETURN(
        auto engine,
        Engine::open(engine_test::small_config(c.stage, c.optimizer, c.params, dir.path()), env));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
    ZINF_RETURN_IF_ERROR(engine->finalize());
    // Refused before any collective, the engine still usable afterwards.
    Status bad = engine->write_parameters("no.such.parameter", fresh.data(), root);
    if (bad.code() != Code::kNotFound) return Status::internal("unknown name: " + bad.to_string());
    ZINF_RETURN_IF_ERROR(engine->gather(model.params[target].module));
    bad = engine->write_parameters(name, fresh.data(), root);
    if (bad.code() != Code::kFailedPrecondition) {
      return Status::internal("while gathered: " + bad.to_string());
    }
    ZINF_RETURN_IF_ERROR(engine->release(model.params[target].module));
    // Only the root's values count: the others pass null.
    ZINF_RETURN_IF_ERROR(
        engine->write_parameters(name, rank == root ? fresh.data() : nullptr, root));
    for (const auto& def : model.params) {
      std::vector<float> out(def.element_count());
      ZINF_RETURN_IF_ERROR(engine->read_parameters(def.name, out.data()));
      masters[r].push_back(std::move(out));
    }
    ZINF_ASSIGN_OR_RETURN(ScopedGather g, engine->scoped_gather(model.params[target].module));
    ZINF_ASSIGN_OR_RETURN(std::span<const float> view, g.param<float>(name));
    gathered[r].assign(view.begin(), view.end());
    return Status::ok();
  });
  for (std::size_t r = 0; r < world; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const std::vector<float>& expected = p == target ? fresh : model.initial[p];
      ASSERT_EQ(0, std::memcmp(masters[r][p].data(), expected.data(), expected.size() * 4))
          << "rank " << r << " parameter " << model.params[p].name;
    }
    ASSERT_EQ(gathered[r], fresh) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, WriteParameters,
    ::testing::Values(Case{1, 1, OffloadDevice::kNone}, Case{2, 1, OffloadDevice::kHost},
                      Case{2, 2, OffloadDevice::kNvme}, Case{2, 3, OffloadDevice::kNone},
                      Case{2, 3, OffloadDevice::kHost, OffloadDevice::kHost},
                      Case{2, 3, OffloadDevice::kNvme, OffloadDevice::kNvme}),
    [](const ::testing::TestParamInfo<Case>& info) { return case_name(info.param); });

}  // namespace
}  // namespace zinf
