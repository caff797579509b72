// zinf.gradients_on_nvme: the fp32 gradient accumulator spilled to NVMe sub-group by sub-group.
// A spilled run must be the same run: the final masters and every step's norm equal, to the
// bit, to the same config without spill (world 1, 2 and 4, stages 2 and 3, 1 and 3
// micro-batches, clipping, bf16 device copies), and within 1e-6 of the single-process reference;
// with host memory for the gradients bounded by a few sub-groups instead of the partition.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::Reference;
using engine_test::TrainOptions;

struct SpillCase {
  int world;
  int stage;
  OffloadDevice params = OffloadDevice::kNone;
  DType dtype = DType::kF32;
  int micro_batches = 1;
  double clipping = 0.0;
  std::size_t spill_buffers = 4;
  // The spilled run on opaque HostDevices (the GPU path: reduced chunks come back through pinned
  // staging before the spill adds them); the run without spill stays on plain ones.
  bool opaque = false;
};

std::string case_name(const SpillCase& c) {
  return fmt::format("w{}_s{}_param_{}_{}_mb{}{}_buf{}{}", c.world, c.stage,
                     offload_device_name(c.params), dtype_name(c.dtype), c.micro_batches,
                     c.clipping > 0 ? "_clip" : "", c.spill_buffers, c.opaque ? "_opaque" : "");
}

struct RunResult {
  std::vector<std::vector<std::vector<float>>> finals;  // [rank][param]
  std::vector<std::vector<StepReport>> reports;         // [rank][step]
  std::vector<EngineCounters> counters;
  std::vector<MemoryReport> memory;
};

void train(const Config& config, const Model& model, int world, const TrainOptions& options,
           const Reference& ref, RunResult* run, bool opaque = false) {
  engine_test::Ranks ranks =
      engine_test::make_ranks(world, std::chrono::seconds(30), /*jitter_max_us=*/0, opaque);
  const auto w = static_cast<std::size_t>(world);
  run->finals.assign(w, {});
  run->reports.assign(w, {});
  run->counters.assign(w, {});
  run->memory.assign(w, {});
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Env env;
    env.device = ranks.devices[r].get();
    env.comm = ranks.comms[r].get();
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
    TrainOptions mine = options;
    if (opaque) mine.device = env.device;
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(*engine, model, rank, mine, &ref.device_per_step,
                                                 &run->reports[r]));
    for (const engine_test::ParamDef& d : model.params) {
      std::vector<float> out(d.element_count());
      ZINF_RETURN_IF_ERROR(engine->read_parameters(d.name, out.data()));
      run->finals[r].push_back(std::move(out));
    }
    run->counters[r] = engine->counters();
    run->memory[r] = engine->memory();
    return Status::ok();
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(st[static_cast<std::size_t>(r)].is_ok())
        << "rank " << r << ": " << st[static_cast<std::size_t>(r)].to_string();
  }
}

class Spill : public ::testing::TestWithParam<SpillCase> {};

TEST_P(Spill, MastersAndNormsEqualTheRunWithoutSpill) {
  const SpillCase c = GetParam();
  const std::uint64_t seed = 777 + static_cast<std::uint64_t>(c.world * 10 + c.stage);
  std::printf("case %s seed %llu\n", case_name(c).c_str(), static_cast<unsigned long long>(seed));
  engine_test::ScratchDir dir(case_name(c));
  Config plain = engine_test::small_config(c.stage, OffloadDevice::kNvme, c.params, dir.path());
  plain.gradient_clipping = c.clipping;
  Config spill = plain;
  spill.gradients_on_nvme = true;
  spill.gradient_spill_buffers = c.spill_buffers;
  const Model model = engine_test::make_model(c.dtype, seed);
  TrainOptions options;
  options.steps = 8;
  options.micro_batches = c.micro_batches;
  if (c.clipping > 0) options.gathered_tolerance = 1e-5;
  const Reference ref = engine_test::run_reference(plain, model, c.world, options);

  RunResult a, b;
  train(plain, model, c.world, options, ref, &a);
  if (HasFatalFailure()) return;
  train(spill, model, c.world, options, ref, &b, c.opaque);
  if (HasFatalFailure()) return;

  for (std::size_t p = 0; p < model.params.size(); ++p) {
    EXPECT_LE(engine_test::max_rel_diff(b.finals[0][p], ref.master[p]), 1e-6)
        << model.params[p].name;
    EXPECT_GT(engine_test::max_rel_diff(b.finals[0][p], model.initial[p]), 1e-3)
        << model.params[p].name << " did not train";
    for (int r = 0; r < c.world; ++r) {
      const auto u = static_cast<std::size_t>(r);
      EXPECT_EQ(
          std::memcmp(b.finals[u][p].data(), a.finals[u][p].data(), a.finals[u][p].size() * 4), 0)
          << "rank " << r << ": " << model.params[p].name << " differs from the run without spill";
    }
  }
  for (int r = 0; r < c.world; ++r) {
    const auto u = static_cast<std::size_t>(r);
    ASSERT_EQ(b.reports[u].size(), a.reports[u].size());
    for (std::size_t s = 0; s < a.reports[u].size(); ++s) {
      EXPECT_EQ(b.reports[u][s].grad_norm, a.reports[u][s].grad_norm)
          << "rank " << r << " step " << s + 1;
      EXPECT_EQ(b.reports[u][s].grad_norm, b.reports[0][s].grad_norm) << "rank " << r;
    }
  }
  if (c.clipping > 0) {
    EXPECT_LT(b.reports[0].back().clip_coef, 1.0);
  }

  // Every step wrote the whole gradient partition at least once per micro-batch.
  const EngineCounters& k = b.counters[0];
  std::printf("spill: writes %llu B, read-backs %llu (%llu B), evictions %llu\n",
              static_cast<unsigned long long>(k.grad_spill_write_bytes),
              static_cast<unsigned long long>(k.grad_spill_read_backs),
              static_cast<unsigned long long>(k.grad_spill_read_bytes),
              static_cast<unsigned long long>(k.grad_spill_evictions));
  EXPECT_EQ(a.counters[0].grad_spill_write_bytes, 0u);
  EXPECT_GT(k.grad_spill_write_bytes, 0u);
  if (c.micro_batches > 1) {
    // Later micro-batches add to sums already on NVMe (every case has more sub-groups than
    // buffers).
    EXPECT_GT(k.grad_spill_read_backs, 0u);
  }
  if (c.spill_buffers == 1 && c.stage == 3) {
    // A module's persistent group sits apart from its main group in the partition: with one
    // buffer, the sub-group left open by one is evicted by the other.
    EXPECT_GT(k.grad_spill_evictions, 0u);
  }
  // The gradients' extents on NVMe beside the rest (host bytes: SpillMemory below; this model's
  // partition is smaller than a few page-rounded sub-group buffers).
  EXPECT_GT(b.memory[0].nvme_bytes, a.memory[0].nvme_bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, Spill,
    ::testing::Values(SpillCase{1, 2},
                      SpillCase{2, 2, OffloadDevice::kNone, DType::kF32, 3, 0.0, 2},
                      SpillCase{4, 2, OffloadDevice::kNone, DType::kF32, 1, 0.5},
                      SpillCase{1, 3, OffloadDevice::kNone, DType::kF32, 3},
                      SpillCase{2, 3, OffloadDevice::kHost, DType::kBF16, 1},
                      SpillCase{4, 3, OffloadDevice::kNvme, DType::kF32, 3, 0.0, 1},
                      SpillCase{2, 3, OffloadDevice::kNone, DType::kBF16, 3, 0.5, 2},
                      SpillCase{2, 3, OffloadDevice::kNvme, DType::kBF16, 3, 0.5, 2, true},
                      SpillCase{2, 2, OffloadDevice::kNone, DType::kF32, 3, 0.0, 1, true}),
    [](const ::testing::TestParamInfo<SpillCase>& info) { return case_name(info.param); });

// Host memory: a model whose fp32 gradients are many sub-groups; the spilled engine holds
// gradient_spill_buffers of them, and its MemoryReport says so.
TEST(SpillMemory, HostHoldsSpillBuffersNotThePartition) {
  const int world = 2;
  Model model;
  for (int i = 0; i < 8; ++i) {
    const std::string name = fmt::format("layer{}", i);
    model.modules.push_back(name);
    model.params.push_back({name + ".w", name, {256, 256}, DType::kBF16});
    model.initial.emplace_back(65536, 0.5f);
  }
  MemoryReport memory[2];
  for (int spill = 0; spill < 2; ++spill) {
    engine_test::ScratchDir dir("spill_memory");
    Config config =
        engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
    config.zero.sub_group_size = 1 << 14;
    config.zero.reduce_bucket_size = 1 << 16;
    config.zero.stage3_max_live_parameters = 1 << 18;
    config.gradients_on_nvme = spill == 1;
    config.gradient_spill_buffers = 3;
    engine_test::Ranks ranks = engine_test::make_ranks(world);
    std::vector<MemoryReport> got(world);
    std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
      Env env;
      env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
      env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
      ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
      ZINF_RETURN_IF_ERROR(engine->finalize());
      got[static_cast<std::size_t>(rank)] = engine->memory();
      return Status::ok();
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
    memory[spill] = got[0];
  }
  const std::uint64_t pr = 8 * 65536 / world;
  const std::uint64_t sub_group = 1 << 14;
  std::printf("host: %llu B without spill, %llu B with; nvme: %llu B, %llu B\n",
              static_cast<unsigned long long>(memory[0].host_bytes),
              static_cast<unsigned long long>(memory[1].host_bytes),
              static_cast<unsigned long long>(memory[0].nvme_bytes),
              static_cast<unsigned long long>(memory[1].nvme_bytes));
  // 4 Pr of gradients leave the host; 3 buffers of one sub-group each (4 B a parameter) and a
  // 4 B/param grads slot in each pinned pool block come in.
  const std::uint64_t pool_growth = 3 * 4 * sub_group;  // small_config: buffer_count 3
  EXPECT_EQ(memory[0].host_bytes - memory[1].host_bytes, 4 * pr - 3 * 4 * sub_group - pool_growth);
  EXPECT_EQ(memory[1].nvme_bytes - memory[0].nvme_bytes, 4 * pr);
}

// Config errors name the key.
TEST(SpillConfig, UnsupportedCombinationsNameTheKey) {
  Config c = engine_test::small_config(1, OffloadDevice::kNvme, OffloadDevice::kNone, "/tmp");
  c.gradients_on_nvme = true;
  Status st = validate(c);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("zinf.gradients_on_nvme"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("stage 2 or 3"), std::string::npos) << st.to_string();
  c.zero.stage = 2;
  c.zero.offload_optimizer.device = OffloadDevice::kHost;
  st = validate(c);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("offload_optimizer.device"), std::string::npos) << st.to_string();
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  EXPECT_TRUE(validate(c).is_ok());
  for (std::size_t buffers : {0, 65}) {
    c.gradient_spill_buffers = buffers;
    st = validate(c);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << buffers;
    EXPECT_NE(st.message().find("zinf.gradient_spill_buffers"), std::string::npos)
        << st.to_string();
  }
  Result<Config> parsed = parse_config(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
      "zinf": {"gradients_on_nvme": true, "gradient_spill_buffers": 2}})");
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_TRUE(parsed->gradients_on_nvme);
  EXPECT_EQ(parsed->gradient_spill_buffers, 2u);
}

}  // namespace
}  // namespace zinf
