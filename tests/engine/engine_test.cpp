// The engine's behaviour beyond the equivalence matrix: prefetch in the recorded order within the
// live-parameter bound, f16 overflow (every rank skips, the scale halves, nothing changes), and
// bad input (each a clear Status naming what was wrong, the engine still training correctly).
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>

#include "engine/nvme_dir.hpp"
#include "engine_test_util.hpp"
#include "zinf/dtype.hpp"
#include "zinf/trace.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::ParamDef;
using engine_test::Reference;
using engine_test::TrainOptions;

bool contains(const Status& st, std::string_view text) {
  return st.message().find(text) != std::string_view::npos;
}

Env env_for(engine_test::Ranks& ranks, int rank, Trace* trace = nullptr) {
  Env env;
  env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
  env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
  env.trace = trace;
  return env;
}

// Final masters of every parameter, read on this rank.
Status read_all(Engine& engine, const Model& model, std::vector<std::vector<float>>* out) {
  out->clear();
  for (const ParamDef& d : model.params) {
    std::vector<float> v(d.element_count());
    ZINF_RETURN_IF_ERROR(engine.read_parameters(d.name, v.data()));
    out->push_back(std::move(v));
  }
  return Status::ok();
}

// --- Prefetch --------------------------------------------------------------------------------

// Replays rank 0's "issue <module>" and "release <module>" instants from the trace: from the
// second step on, when module order[k] is released, module order[k + 1] (when it differs) must
// have been issued already and not released since.
void check_prefetch_in_trace(const Trace& trace, const std::vector<std::string>& order,
                             int steps_after_first) {
  const std::vector<std::string> tracks = trace.track_names();
  std::vector<Trace::Event> events;
  std::int64_t first_step_end = 0;
  std::int64_t first_norm_end = 0;
  for (const Trace::Event& e : trace.events()) {
    if (tracks[static_cast<std::size_t>(e.track)] != "rank0 engine") continue;
    if (e.name == "step publish" && first_step_end == 0)
      first_step_end = e.start_ns + e.duration_ns;
    // Overlapped (zinf.overlap_step), step() ends with its norm; the pass publishes on its own
    // thread's track while the next forward runs.
    if (e.name == "step norm" && first_norm_end == 0) first_norm_end = e.start_ns + e.duration_ns;
    if (e.name.starts_with("issue ") || e.name.starts_with("release ")) events.push_back(e);
  }
  if (first_step_end == 0) first_step_end = first_norm_end;
  ASSERT_GT(first_step_end, 0);
  std::stable_sort(events.begin(), events.end(), [](const Trace::Event& a, const Trace::Event& b) {
    return a.start_ns < b.start_ns;
  });
  std::set<std::string> issued;
  std::size_t releases = 0;
  std::size_t checked = 0;
  for (const Trace::Event& e : events) {
    const bool issue = e.name.starts_with("issue ");
    const std::string module = e.name.substr(issue ? 6 : 8);
    if (issue) {
      issued.insert(module);
      continue;
    }
    if (e.start_ns > first_step_end) {
      const std::size_t k = releases % order.size();
      ASSERT_EQ(order[k], module) << "release " << releases;
      if (k + 1 < order.size() && order[k + 1] != module) {
        EXPECT_EQ(issued.count(order[k + 1]), 1u) << "release of " << module << " (position " << k
                                                  << ") before " << order[k + 1] << " was issued";
        ++checked;
      }
      ++releases;
    }
    issued.erase(module);
  }
  EXPECT_EQ(releases, order.size() * static_cast<std::size_t>(steps_after_first));
  EXPECT_EQ(checked, (order.size() - 2) * static_cast<std::size_t>(steps_after_first));
}

TEST(EnginePrefetch, NextModuleIsIssuedBeforeTheCurrentIsReleasedWithinMaxLive) {
  const int world = 2;
  engine_test::ScratchDir dir("prefetch");
  Config config =
      engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNvme, dir.path());
  const Model model = engine_test::make_model(DType::kBF16, 21);
  TrainOptions options;
  options.steps = 4;
  const Reference ref = engine_test::run_reference(config, model, world, options);
  Trace trace;
  engine_test::Ranks ranks = engine_test::make_ranks(world);
  std::vector<EngineCounters> counters(world);
  std::vector<std::vector<std::string>> orders(world);
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank, &trace)));
    ZINF_RETURN_IF_ERROR(
        engine_test::train_rank(*engine, model, rank, options, &ref.device_per_step, nullptr));
    counters[static_cast<std::size_t>(rank)] = engine->counters();
    orders[static_cast<std::size_t>(rank)] = engine->recorded_order();
    return Status::ok();
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  const std::vector<std::string> order = {"embed", "block0", "block1", "block2", "head",
                                          "head",  "block2", "block1", "block0", "embed"};
  EXPECT_EQ(orders[0], order);
  EXPECT_EQ(orders[1], order);
  check_prefetch_in_trace(trace, order, options.steps - 1);
  const EngineCounters& c = counters[0];
  std::printf("gathers %llu issued %llu prefetched %llu hits %llu dropped %llu peak %llu\n",
              static_cast<unsigned long long>(c.gathers),
              static_cast<unsigned long long>(c.gathers_issued),
              static_cast<unsigned long long>(c.prefetches_issued),
              static_cast<unsigned long long>(c.prefetch_hits),
              static_cast<unsigned long long>(c.prefetches_dropped),
              static_cast<unsigned long long>(c.live_elements_peak));
  EXPECT_EQ(c.gathers, order.size() * static_cast<std::size_t>(options.steps));
  EXPECT_GT(c.prefetch_hits, 0u);
  EXPECT_LE(c.live_elements_peak, config.zero.stage3_max_live_parameters);
  EXPECT_EQ(c.order_misses, 0u);
  EXPECT_GT(c.param_nvme_read_bytes, 0u);
}

// stage3_max_live_parameters bounds what is fetched ahead, as DeepSpeed's does, never the module
// the model needs. With 1100, room for the largest module (block0.w, 899 elements, padded to 1024
// at world 2) but no prefetch beside it, the gathered elements never pass the bound and the small
// modules still prefetch; with 600 the largest module is gathered all the same (a config whose
// bound is below the embedding's size trains); 0 turns prefetching off. Training stays exact.
TEST(EnginePrefetch, MaxLiveBoundsPrefetchNotTheModuleInUse) {
  const int world = 2;
  const Model model = engine_test::make_model(DType::kF32, 22);
  TrainOptions options;
  options.steps = 3;
  for (const std::size_t max_live : {std::size_t{1100}, std::size_t{600}, std::size_t{0}}) {
    SCOPED_TRACE(fmt::format("stage3_max_live_parameters {}", max_live));
    Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
    config.zero.stage3_max_live_parameters = max_live;
    const Reference ref = engine_test::run_reference(config, model, world, options);
    engine_test::Ranks ranks = engine_test::make_ranks(world);
    std::vector<EngineCounters> counters(world);
    std::vector<std::vector<std::vector<float>>> finals(world);
    std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
      ZINF_RETURN_IF_ERROR(
          engine_test::train_rank(*engine, model, rank, options, &ref.device_per_step, nullptr));
      counters[static_cast<std::size_t>(rank)] = engine->counters();
      return read_all(*engine, model, &finals[static_cast<std::size_t>(rank)]);
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_GE(counters[0].live_elements_peak, 1024u);
    if (max_live == 1100) {
      EXPECT_LE(counters[0].live_elements_peak, 1100u);
      EXPECT_GT(counters[0].prefetches_issued, 0u);
    }
    if (max_live == 0) {
      EXPECT_EQ(counters[0].prefetches_issued, 0u);
    }
    EXPECT_EQ(engine_test::worst_rel_diff(finals[0], ref.master), 0.0);
  }
}

// --- Overflow --------------------------------------------------------------------------------

// One micro-batch and a step on one rank, with f16 gradients of the loss scaled by the engine's
// loss scale; `inject` puts an inf into one gradient element.
Status scaled_step(Engine& engine, const Model& model, int rank, int data_step, bool inject,
                   StepReport* report) {
  const float scale = static_cast<float>(engine.loss_scale());
  for (auto it = model.modules.rbegin(); it != model.modules.rend(); ++it) {
    ZINF_RETURN_IF_ERROR(engine.gather(*it));
    std::vector<std::vector<std::uint16_t>> grads;
    std::vector<GradientRef> refs;
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const ParamDef& d = model.params[p];
      if (d.module != *it) continue;
      ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(d.name));
      std::vector<float> w(view.element_count);
      convert_f16_to_f32(static_cast<const std::uint16_t*>(view.data), w.data(), w.size());
      std::vector<float> g = engine_test::make_grad(d, w, rank, data_step, 0, p);
      // Scaling an f16 value by a power of two is exact, so the step sees the same gradients
      // whatever the scale.
      for (float& x : g) x *= scale;
      if (inject && d.name == "block1.w") g[5] = std::numeric_limits<float>::infinity();
      std::vector<std::uint16_t> h(g.size());
      convert_f32_to_f16(g.data(), h.data(), g.size());
      grads.push_back(std::move(h));
      refs.push_back({d.name, grads.back().data(), d.element_count(), DType::kF16});
    }
    ZINF_RETURN_IF_ERROR(engine.reduce_gradients(*it, refs));
    ZINF_RETURN_IF_ERROR(engine.release(*it));
  }
  ZINF_ASSIGN_OR_RETURN(*report, engine.step());
  return Status::ok();
}

struct OverflowCase {
  int stage;
  OffloadDevice optimizer;
  bool gradients_on_nvme = false;
};

class EngineOverflow : public ::testing::TestWithParam<OverflowCase> {};

TEST_P(EngineOverflow, InfOnOneRankSkipsEveryRankHalvesTheScaleAndChangesNothing) {
  const int world = 3;
  const OverflowCase oc = GetParam();
  const std::uint64_t seed = 31 + static_cast<std::uint64_t>(oc.stage);
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  engine_test::ScratchDir dir(
      fmt::format("overflow{}{}", oc.stage, oc.gradients_on_nvme ? "spill" : ""));
  Config config =
      engine_test::small_config(oc.stage, oc.optimizer, OffloadDevice::kNone, dir.path());
  config.fp16.enabled = true;
  config.fp16.initial_scale_power = 8;
  config.fp16.hysteresis = 1;
  config.gradients_on_nvme = oc.gradients_on_nvme;
  const Model model = engine_test::make_model(DType::kF16, seed);
  // The reference never sees the bad batch: data steps 1, 2, 3 as optimizer steps 1, 2, 3.
  TrainOptions options;
  options.steps = 3;
  const Reference ref = engine_test::run_reference(config, model, world, options);
  engine_test::Ranks ranks = engine_test::make_ranks(world);
  std::vector<StepReport> bad(world);
  std::vector<std::vector<std::vector<float>>> before(world), after(world), finals(world);
  std::vector<double> scale_after(world);
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
    if (engine->loss_scale() != 256.0) return Status::internal("initial scale is not 2^8");
    StepReport report;
    ZINF_RETURN_IF_ERROR(scaled_step(*engine, model, rank, 1, false, &report));
    ZINF_RETURN_IF_ERROR(read_all(*engine, model, &before[r]));
    // Rank 1 alone hands an inf.
    ZINF_RETURN_IF_ERROR(scaled_step(*engine, model, rank, 1000, rank == 1, &bad[r]));
    ZINF_RETURN_IF_ERROR(read_all(*engine, model, &after[r]));
    scale_after[r] = engine->loss_scale();
    ZINF_RETURN_IF_ERROR(scaled_step(*engine, model, rank, 2, false, &report));
    ZINF_RETURN_IF_ERROR(scaled_step(*engine, model, rank, 3, false, &report));
    if (report.step != 3) return Status::internal(fmt::format("step {} != 3", report.step));
    return read_all(*engine, model, &finals[r]);
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (int r = 0; r < world; ++r) {
    const auto u = static_cast<std::size_t>(r);
    EXPECT_TRUE(bad[u].skipped) << "rank " << r;
    EXPECT_EQ(bad[u].loss_scale, 256.0);
    EXPECT_EQ(bad[u].next_loss_scale, 128.0);
    EXPECT_EQ(scale_after[u], 128.0);
    EXPECT_EQ(bad[u].step, 1);  // the optimizer step count did not move
    // No parameter changed, to the bit.
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      EXPECT_EQ(std::memcmp(before[u][p].data(), after[u][p].data(), before[u][p].size() * 4), 0)
          << model.params[p].name;
    }
    // And no optimizer state either: continuing gives exactly the run that never saw the batch
    // (moments or step counts touched by the skipped step would show here).
    EXPECT_EQ(engine_test::worst_rel_diff(finals[u], ref.master), 0.0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, EngineOverflow,
                         ::testing::Values(OverflowCase{1, OffloadDevice::kNone},
                                           OverflowCase{2, OffloadDevice::kHost},
                                           OverflowCase{3, OffloadDevice::kNvme},
                                           OverflowCase{2, OffloadDevice::kNvme, true}),
                         [](const ::testing::TestParamInfo<OverflowCase>& info) {
                           return fmt::format("stage{}_{}{}", info.param.stage,
                                              offload_device_name(info.param.optimizer),
                                              info.param.gradients_on_nvme ? "_spill" : "");
                         });

TEST(EngineLossScale, GrowsAfterAWindowOfGoodSteps) {
  Config config = engine_test::small_config(2, OffloadDevice::kNone, OffloadDevice::kNone, "");
  config.fp16.enabled = true;
  config.fp16.initial_scale_power = 4;
  config.fp16.loss_scale_window = 2;
  const Model model = engine_test::make_model(DType::kF16, 41);
  const std::vector<Status> status =
      engine_test::with_engines(config, model, 1, [&](int rank, Engine& engine) -> Status {
        StepReport report;
        std::vector<double> scales;
        for (int s = 1; s <= 4; ++s) {
          ZINF_RETURN_IF_ERROR(scaled_step(engine, model, rank, s, false, &report));
          scales.push_back(engine.loss_scale());
        }
        // DeepSpeed's ZeRO rule: doubled at every second good step.
        EXPECT_EQ(scales, (std::vector<double>{16, 32, 32, 64}));
        return Status::ok();
      });
  ASSERT_TRUE(status[0].is_ok()) << status[0].to_string();
}

// An overflow with the scale already at fp16.min_loss_scale: skipped like any other, then
// reported naming the key (DeepSpeed raises an error there); the engine goes on training, with
// the optimizer's state on the host (the overlapped step's path) and on the device (the
// sequential one).
TEST(EngineLossScale, AnOverflowAtTheFloorIsSkippedAndReportedNamingTheKey) {
  for (const OffloadDevice state : {OffloadDevice::kHost, OffloadDevice::kNone}) {
    SCOPED_TRACE(state == OffloadDevice::kHost ? "optimizer state on the host" : "on the device");
    Config config = engine_test::small_config(2, state, OffloadDevice::kNone, "");
    config.fp16.enabled = true;
    config.fp16.initial_scale_power = 2;  // 4: one overflow halves it to the floor
    config.fp16.min_loss_scale = 2;
    config.fp16.hysteresis = 1;
    const Model model = engine_test::make_model(DType::kF16, 43);
    const std::vector<Status> status =
        engine_test::with_engines(config, model, 1, [&](int rank, Engine& engine) -> Status {
          StepReport report;
          // Above the floor: skipped, halved, no error.
          ZINF_RETURN_IF_ERROR(scaled_step(engine, model, rank, 1, true, &report));
          EXPECT_TRUE(report.skipped);
          EXPECT_EQ(engine.loss_scale(), 2.0);
          // At the floor: skipped, the scale kept, and step() says so.
          Status s = scaled_step(engine, model, rank, 2, true, &report);
          EXPECT_EQ(s.code(), Code::kAborted) << s.to_string();
          EXPECT_NE(s.message().find("fp16.min_loss_scale"), std::string::npos) << s.to_string();
          EXPECT_EQ(engine.loss_scale(), 2.0);
          // Not sticky: a good step applies.
          ZINF_RETURN_IF_ERROR(scaled_step(engine, model, rank, 3, false, &report));
          EXPECT_FALSE(report.skipped);
          EXPECT_EQ(report.step, 1);
          return Status::ok();
        });
    ASSERT_TRUE(status[0].is_ok()) << status[0].to_string();
  }
}

// Without loss scaling a non-finite gradient skips the step too, and is said on stderr at the
// 1st, 2nd, 4th, ... such step (a run that stalls on NaNs is not silent); the step after applies.
// (With the state offloaded and no clipping, the overlapped step would have begun updating during
// the backward: that step fails instead, OverlapOpen.ANonFiniteGradientFailsTheStep...)
TEST(EngineLossScale, ANonFiniteGradientWithoutLossScalingIsSkippedAndSaid) {
  const Config config =
      engine_test::small_config(2, OffloadDevice::kNone, OffloadDevice::kNone, "");
  const Model model = engine_test::make_model(DType::kF16, 44);
  std::vector<std::string> said;
  const std::vector<Status> status =
      engine_test::with_engines(config, model, 1, [&](int rank, Engine& engine) -> Status {
        StepReport report;
        for (int call = 1; call <= 3; ++call) {
          ::testing::internal::CaptureStderr();
          Status s = scaled_step(engine, model, rank, call, true, &report);
          said.push_back(::testing::internal::GetCapturedStderr());
          ZINF_RETURN_IF_ERROR(s);
          EXPECT_TRUE(report.skipped) << call;
        }
        ZINF_RETURN_IF_ERROR(scaled_step(engine, model, rank, 4, false, &report));
        EXPECT_FALSE(report.skipped);
        EXPECT_EQ(report.step, 1);
        return Status::ok();
      });
  ASSERT_TRUE(status[0].is_ok()) << status[0].to_string();
  ASSERT_EQ(said.size(), 3u);
  EXPECT_NE(said[0].find("step() call 1: the gradients are not finite (NaN or inf)"),
            std::string::npos)
      << said[0];
  EXPECT_NE(said[1].find("(2 step(s) skipped so far"), std::string::npos) << said[1];
  EXPECT_EQ(said[2].find("not finite"), std::string::npos) << said[2];
}

// --- Bad input -------------------------------------------------------------------------------

// Every bad call in the middle of training on both ranks: each returns a Status naming what was
// wrong, and the training that continues afterwards ends exactly where the reference does.
TEST(EngineBadInput, EachCallFailsClearlyAndTrainingContinuesExactly) {
  const int world = 2;
  engine_test::ScratchDir dir("badinput");
  Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kHost, dir.path());
  const Model model = engine_test::make_model(DType::kF32, 51);
  TrainOptions options;
  options.steps = 6;
  const Reference ref = engine_test::run_reference(config, model, world, options);
  engine_test::Ranks ranks = engine_test::make_ranks(world);
  std::vector<std::vector<std::vector<float>>> finals(world);
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
    TrainOptions first = options;
    first.steps = 3;
    ZINF_RETURN_IF_ERROR(
        engine_test::train_rank(*engine, model, rank, first, &ref.device_per_step, nullptr));

    // Registering after the first step.
    std::vector<float> values(10, 0.5f);
    Status s = engine->register_parameter({"late.w", "late", {10}, DType::kF32, values.data()});
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
    EXPECT_TRUE(contains(s, "late.w")) << s.to_string();
    // Gathering (and releasing) an unknown module.
    s = engine->gather("blokc1");
    EXPECT_EQ(s.code(), Code::kNotFound) << s.to_string();
    EXPECT_TRUE(contains(s, "blokc1")) << s.to_string();
    s = engine->release("nope");
    EXPECT_EQ(s.code(), Code::kNotFound) << s.to_string();
    // Releasing a module that is not gathered; gathering one twice.
    s = engine->release("head");
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
    ZINF_RETURN_IF_ERROR(engine->gather("head"));
    s = engine->gather("head");
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
    // A parameter of a module that is not gathered; an unknown parameter.
    s = engine->parameter("embed.w").status();
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
    EXPECT_TRUE(contains(s, "embed")) << s.to_string();
    EXPECT_EQ(engine->parameter("embed.x").status().code(), Code::kNotFound);
    // A step while a module is gathered.
    s = engine->step().status();
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
    EXPECT_TRUE(contains(s, "head")) << s.to_string();
    ZINF_RETURN_IF_ERROR(engine->release("head"));
    // A step with no gradients reduced.
    s = engine->step().status();
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
    // Gradients: the wrong size, missing, twice, of another module, null, unknown.
    std::vector<float> g(481, 0.25f);
    std::vector<float> gb(13, 0.25f);
    std::vector<GradientRef> wrong = {{"head.w", g.data(), 480, DType::kF32},
                                      {"head.b", gb.data(), 13, DType::kF32}};
    s = engine->reduce_gradients("head", wrong);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    EXPECT_TRUE(contains(s, "head.w") && contains(s, "480") && contains(s, "481")) << s.to_string();
    std::vector<GradientRef> missing = {{"head.w", g.data(), 481, DType::kF32}};
    s = engine->reduce_gradients("head", missing);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    EXPECT_TRUE(contains(s, "head.b")) << s.to_string();
    std::vector<GradientRef> twice = {{"head.w", g.data(), 481, DType::kF32},
                                      {"head.w", g.data(), 481, DType::kF32}};
    EXPECT_EQ(engine->reduce_gradients("head", twice).code(), Code::kInvalidArgument);
    std::vector<GradientRef> other = {{"embed.w", g.data(), 481, DType::kF32}};
    s = engine->reduce_gradients("head", other);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    EXPECT_TRUE(contains(s, "embed")) << s.to_string();
    std::vector<GradientRef> null = {{"head.w", nullptr, 481, DType::kF32},
                                     {"head.b", gb.data(), 13, DType::kF32}};
    EXPECT_EQ(engine->reduce_gradients("head", null).code(), Code::kInvalidArgument);
    // A dtype outside the enum's three (a cast from a binding's integer) is refused, not read
    // as another dtype.
    std::vector<GradientRef> odd_dtype = {{"head.w", g.data(), 481, static_cast<DType>(7)},
                                          {"head.b", gb.data(), 13, DType::kF32}};
    s = engine->reduce_gradients("head", odd_dtype);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    EXPECT_TRUE(contains(s, "head.w") && contains(s, "dtype 7")) << s.to_string();
    std::vector<GradientRef> unknown = {{"head.q", g.data(), 481, DType::kF32}};
    EXPECT_EQ(engine->reduce_gradients("head", unknown).code(), Code::kNotFound);
    EXPECT_EQ(engine->reduce_gradients("heads", unknown).code(), Code::kNotFound);

    // The engine is unharmed: the rest of the training ends exactly at the reference.
    TrainOptions rest = options;
    rest.first_step = 4;
    ZINF_RETURN_IF_ERROR(
        engine_test::train_rank(*engine, model, rank, rest, &ref.device_per_step, nullptr));
    return read_all(*engine, model, &finals[static_cast<std::size_t>(rank)]);
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(engine_test::worst_rel_diff(finals[0], ref.master), 0.0);
  EXPECT_EQ(engine_test::worst_rel_diff(finals[1], ref.master), 0.0);
}

TEST(EngineBadInput, RanksRegisteringDifferentShapesFailOnEveryRankNamingTheParameter) {
  const int world = 3;
  const Model model = engine_test::make_model(DType::kF32, 61);
  Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
  engine_test::Ranks ranks = engine_test::make_ranks(world);
  std::vector<Status> errors(world);
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
    Model mine = model;
    if (rank == 2) mine.params[3].shape = {41, 8};  // block1.w, one column more
    mine.initial[3].resize(mine.params[3].element_count(), 0.0f);
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, mine));
    errors[static_cast<std::size_t>(rank)] = engine->finalize();
    // The error sticks: later calls say the same, and nothing runs on a bad layout.
    Status again = engine->gather("embed");
    EXPECT_EQ(again.to_string(), errors[static_cast<std::size_t>(rank)].to_string());
    return Status::ok();
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (int r = 0; r < world; ++r) {
    const Status& e = errors[static_cast<std::size_t>(r)];
    EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.to_string();
    EXPECT_TRUE(contains(e, "parameter 3")) << e.to_string();
    EXPECT_TRUE(contains(e, "rank 2")) << e.to_string();
    EXPECT_TRUE(contains(e, "block1.w")) << e.to_string();
  }
}

// Ranks registering different initial values for a parameter (a model built with a seed that
// depends on the rank): each rank would keep its own part of different values, so finalize
// refuses, naming the parameter and the rank, on every rank.
TEST(EngineBadInput, RanksRegisteringDifferentInitialValuesFailNamingTheParameter) {
  const int world = 2;
  const Model model = engine_test::make_model(DType::kF32, 64);
  for (int stage : {1, 3}) {
    Config config =
        engine_test::small_config(stage, OffloadDevice::kNone, OffloadDevice::kNone, "");
    engine_test::Ranks ranks = engine_test::make_ranks(world);
    std::vector<Status> errors(world);
    std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
      Model mine = model;
      if (rank == 1) mine.initial[3][17] += 0.25f;  // block1.w
      ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, mine));
      errors[static_cast<std::size_t>(rank)] = engine->finalize();
      return Status::ok();
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
    for (const Status& e : errors) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.to_string();
      EXPECT_TRUE(contains(e,
                           "parameter 'block1.w' has different initial values on rank 0 and "
                           "rank 1"))
          << e.to_string();
    }
  }
  // Parameters given by initializers: compared by the initializer_values_hash the caller gives
  // (zinf.torch.Init's staged values), not at all without one.
  for (const bool hashed : {true, false}) {
    Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
    engine_test::Ranks ranks = engine_test::make_ranks(world);
    std::vector<Status> errors(world);
    std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
      for (std::size_t p = 0; p < model.params.size(); ++p) {
        const ParamDef& d = model.params[p];
        ParameterSpec spec{d.name, d.module, d.shape, d.dtype, nullptr, nullptr};
        const std::vector<float>* values = &model.initial[p];
        spec.initializer = [values](std::size_t first, std::size_t count, float* out) {
          std::memcpy(out, values->data() + first, count * sizeof(float));
          return Status::ok();
        };
        if (hashed) spec.initializer_values_hash = (rank == 1 && p == 3) ? 0x7100 : 0x5100;
        ZINF_RETURN_IF_ERROR(engine->register_parameter(spec));
      }
      errors[static_cast<std::size_t>(rank)] = engine->finalize();
      return Status::ok();
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
    for (const Status& e : errors) {
      if (!hashed) {
        EXPECT_TRUE(e.is_ok()) << e.to_string();
        continue;
      }
      EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.to_string();
      EXPECT_TRUE(contains(e, "parameter 'block1.w' has different initial values"))
          << e.to_string();
    }
  }
}

// Ranks given configs with different stages (one config file per process, mistyped): finalize
// names the option and both values on every rank.
TEST(EngineBadInput, RanksWithDifferentStagesNameTheStage) {
  const int world = 2;
  const Model model = engine_test::make_model(DType::kF32, 63);
  engine_test::Ranks ranks = engine_test::make_ranks(world);
  std::vector<Status> errors(world);
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    const Config config = engine_test::small_config(rank == 0 ? 2 : 3, OffloadDevice::kNone,
                                                    OffloadDevice::kNone, "");
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
    errors[static_cast<std::size_t>(rank)] = engine->finalize();
    return Status::ok();
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (const Status& e : errors) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.to_string();
    EXPECT_TRUE(contains(e, "zero_optimization.stage is 2 on rank 0 and 3 on rank 1"))
        << e.to_string();
  }
}

TEST(EngineBadInput, RanksRegisteringDifferentCountsFail) {
  const int world = 2;
  const Model model = engine_test::make_model(DType::kF32, 62);
  Config config = engine_test::small_config(2, OffloadDevice::kNone, OffloadDevice::kNone, "");
  engine_test::Ranks ranks = engine_test::make_ranks(world);
  std::vector<Status> errors(world);
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
    std::vector<float> extra(7, 1.0f);
    if (rank == 1) {
      ZINF_RETURN_IF_ERROR(
          engine->register_parameter({"extra.w", "extra", {7}, DType::kF32, extra.data()}));
    }
    errors[static_cast<std::size_t>(rank)] = engine->finalize();
    return Status::ok();
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (const Status& e : errors) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.to_string();
    EXPECT_TRUE(contains(e, "rank 0 registered 10 parameters, rank 1 registered 11"))
        << e.to_string();
  }
}

TEST(EngineBadInput, UnwritableNvmePathFailsAtOpenNamingKeyAndPath) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  engine_test::ScratchDir dir("unwritable");
  // A regular file where a directory should be: nobody, root included, can create files in it.
  const std::string file = dir.path() + "/not-a-dir";
  std::FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  for (const std::string& path : {file, std::string("/proc/zinf")}) {
    Config config = engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone, path);
    Result<std::unique_ptr<Engine>> engine = Engine::open(config, env_for(ranks, 0));
    ASSERT_FALSE(engine.is_ok()) << path;
    const Status& s = engine.status();
    EXPECT_TRUE(contains(s, "zero_optimization.offload_optimizer.nvme_path")) << s.to_string();
    EXPECT_TRUE(contains(s, path)) << s.to_string();
    std::printf("%s\n", s.to_string().c_str());
  }
  // A directory to be made under that file: the error is the creation's, not a later probe's.
  {
    const std::string under = file + "/sub/deeper";
    Config config = engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone, under);
    const Status s = Engine::open(config, env_for(ranks, 0)).status();
    EXPECT_TRUE(contains(s, "cannot create the directory '" + under + "'")) << s.to_string();
    EXPECT_TRUE(contains(s, "zero_optimization.offload_optimizer.nvme_path")) << s.to_string();
  }
  // Parameters on NVMe with no path anywhere.
  Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNvme, "");
  Result<std::unique_ptr<Engine>> engine = Engine::open(config, env_for(ranks, 0));
  ASSERT_FALSE(engine.is_ok());
  EXPECT_TRUE(contains(engine.status(), "zero_optimization.offload_param.nvme_path"))
      << engine.status().to_string();
  // The same directory given through Env::nvme_paths is named as such.
  config.zero.offload_param.nvme_path = "";
  Env env = env_for(ranks, 0);
  env.nvme_paths = {file};
  engine = Engine::open(config, env);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_TRUE(contains(engine.status(), "Env::nvme_paths")) << engine.status().to_string();
}

// step(average_over): a step of fewer micro-batches than it divides by (DeepSpeed divides each
// micro-batch's loss by gradient_accumulation_steps however many a step has) gives the same bits
// as the same micro-batches and zero-gradient ones up to that count, averaged by step(); a
// divisor below the micro-batches reduced is refused and changes nothing.
TEST(EngineStep, AverageOverDividesAsZeroMicroBatchesWould) {
  constexpr std::size_t kElements = 3000;
  std::mt19937 rng(2026);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> initial(kElements), g1(kElements), g2(kElements);
  for (std::size_t i = 0; i < kElements; ++i) {
    initial[i] = uniform(rng);
    g1[i] = uniform(rng);
    g2[i] = uniform(rng);
  }
  const std::vector<float> zeros(kElements, 0.0f);
  for (const OffloadDevice where : {OffloadDevice::kNone, OffloadDevice::kHost}) {
    Config config = engine_test::small_config(2, where, OffloadDevice::kNone, "");
    config.gradient_accumulation_steps = 3;
    config.gradient_clipping = 0.0;
    // Each engine: register, reduce `grads` as micro-batches, step(average_over); its masters.
    auto run = [&](const std::vector<const std::vector<float>*>& grads, int average_over,
                   std::vector<float>* master, Status* refused) -> Status {
      engine_test::Ranks ranks = engine_test::make_ranks(1);
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, 0)));
      ZINF_RETURN_IF_ERROR(engine->register_parameter(
          {"m.w", "m", {static_cast<std::int64_t>(kElements)}, DType::kF32, initial.data()}));
      for (const std::vector<float>* g : grads) {
        const GradientRef ref{"m.w", g->data(), kElements, DType::kF32};
        ZINF_RETURN_IF_ERROR(engine->reduce_gradients("m", std::span(&ref, 1)));
      }
      if (refused != nullptr) *refused = engine->step(1).status();
      ZINF_ASSIGN_OR_RETURN(StepReport report, engine->step(average_over));
      if (report.skipped) return Status::internal("the step was skipped");
      master->resize(kElements);
      return engine->read_parameters("m.w", master->data());
    };
    std::vector<float> divided, padded, mean;
    Status refused;
    ASSERT_TRUE(run({&g1, &g2}, 3, &divided, &refused).is_ok());
    ASSERT_TRUE(run({&g1, &g2, &zeros}, 0, &padded, nullptr).is_ok());
    ASSERT_TRUE(run({&g1, &g2}, 0, &mean, nullptr).is_ok());
    EXPECT_EQ(divided, padded);
    EXPECT_NE(divided, mean);  // the mean of two is another gradient
    EXPECT_EQ(refused.code(), Code::kInvalidArgument) << refused.to_string();
    EXPECT_TRUE(contains(refused, "average_over 1 is below the 2 micro-batches"))
        << refused.to_string();
  }
}

// A step (or finalize) before any parameter is registered says so and leaves registration
// open: the engine trains once the parameters are registered. After a finalize that failed
// otherwise, registration is refused quoting that failure.
TEST(EngineBadInput, AStepBeforeRegistrationLeavesRegistrationOpen) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
  Result<std::unique_ptr<Engine>> opened = Engine::open(config, env_for(ranks, 0));
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  Engine& engine = **opened;
  Status s = engine.step().status();
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
  EXPECT_TRUE(contains(s, "no parameters registered")) << s.to_string();
  std::vector<float> v(12, 0.25f);
  ASSERT_TRUE(engine.register_parameter({"a.w", "a", {3, 4}, DType::kF32, v.data()}).is_ok());
  ASSERT_TRUE(engine.finalize().is_ok());
  std::vector<float> back(12, 0.0f);
  ASSERT_TRUE(engine.read_parameters("a.w", back.data()).is_ok());
  EXPECT_EQ(back, v);

  // Two ranks registering different parameters: finalize fails, and registration after it names
  // that failure.
  const int world = 2;
  engine_test::Ranks two = engine_test::make_ranks(world);
  std::vector<Status> late(world);
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    ZINF_ASSIGN_OR_RETURN(auto e, Engine::open(config, env_for(two, rank)));
    ZINF_RETURN_IF_ERROR(
        e->register_parameter({rank == 0 ? "a.w" : "b.w", "a", {3, 4}, DType::kF32, v.data()}));
    EXPECT_FALSE(e->finalize().is_ok());
    late[static_cast<std::size_t>(rank)] =
        e->register_parameter({"c.w", "c", {3}, DType::kF32, v.data()});
    return Status::ok();
  });
  for (const Status& r : st) ASSERT_TRUE(r.is_ok()) << r.to_string();
  for (const Status& r : late) {
    EXPECT_EQ(r.code(), Code::kFailedPrecondition) << r.to_string();
    EXPECT_TRUE(contains(r, "c.w") && contains(r, "finalize failed") &&
                contains(r, "parameter 0 differs"))
        << r.to_string();
  }
}

TEST(EngineBadInput, RegistrationErrorsNameTheParameter) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
  Result<std::unique_ptr<Engine>> opened = Engine::open(config, env_for(ranks, 0));
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  Engine& engine = **opened;
  std::vector<float> v(12, 1.0f);
  ASSERT_TRUE(engine.register_parameter({"a.w", "a", {3, 4}, DType::kF32, v.data()}).is_ok());
  Status s = engine.register_parameter({"a.w", "a", {3, 4}, DType::kF32, v.data()});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(contains(s, "a.w") && contains(s, "registered already")) << s.to_string();
  s = engine.register_parameter({"a.b", "a", {3, 0}, DType::kF32, v.data()});
  EXPECT_TRUE(contains(s, "a.b") && contains(s, "[3, 0]")) << s.to_string();
  s = engine.register_parameter({"a.c", "", {3}, DType::kF32, v.data()});
  EXPECT_TRUE(contains(s, "a.c") && contains(s, "module")) << s.to_string();
  s = engine.register_parameter({"a.d", "a", {3}, DType::kF32, nullptr});
  EXPECT_TRUE(contains(s, "a.d") && contains(s, "initial_values")) << s.to_string();
  s = engine.register_parameter({"a.e", "a", {3}, static_cast<DType>(9), v.data()});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(contains(s, "a.e") && contains(s, "dtype 9")) << s.to_string();
  // A step before anything was reduced names the parameter that lacks gradients.
  s = engine.step().status();
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
  EXPECT_TRUE(contains(s, "a.w")) << s.to_string();
}

TEST(EngineBadInput, OpenChecksTheEnvAndTheWorldSize) {
  engine_test::Ranks ranks = engine_test::make_ranks(2);
  Config config = engine_test::small_config(2, OffloadDevice::kNone, OffloadDevice::kNone, "");
  config.world_size = 4;
  Result<std::unique_ptr<Engine>> e = Engine::open(config, env_for(ranks, 0));
  ASSERT_FALSE(e.is_ok());
  EXPECT_TRUE(contains(e.status(), "zinf.world_size")) << e.status().to_string();
  config.world_size = 0;
  Env env;
  EXPECT_EQ(Engine::open(config, env).status().code(), Code::kInvalidArgument);
  config.zero.stage = 4;
  e = Engine::open(config, env_for(ranks, 0));
  EXPECT_TRUE(contains(e.status(), "zero_optimization.stage")) << e.status().to_string();
}

// --- Stream ordering ---------------------------------------------------------------------------

// With every HostDevice stream sleeping a random time before each operation, a missing event
// wait between the engine's streams (gathers, reductions, norm, publish) would let a reader see
// stale or poisoned data; the masters must still equal the reference to the bit.
TEST(EngineJitter, RandomStreamDelaysChangeNothing) {
  struct Run {
    int stage;
    OffloadDevice optimizer;
    OffloadDevice params;
  };
  for (const Run& run : {Run{3, OffloadDevice::kNvme, OffloadDevice::kNvme},
                         Run{3, OffloadDevice::kNone, OffloadDevice::kNone},
                         Run{1, OffloadDevice::kHost, OffloadDevice::kNone},
                         Run{2, OffloadDevice::kNone, OffloadDevice::kNone}}) {
    const int world = 3;
    engine_test::ScratchDir dir("jitter");
    Config config = engine_test::small_config(run.stage, run.optimizer, run.params, dir.path());
    const Model model = engine_test::make_model(DType::kBF16, 91);
    TrainOptions options;
    options.steps = 4;
    options.micro_batches = 2;
    const Reference ref = engine_test::run_reference(config, model, world, options);
    engine_test::Ranks ranks =
        engine_test::make_ranks(world, std::chrono::seconds(30), /*jitter_max_us=*/200);
    std::vector<std::vector<std::vector<float>>> finals(world);
    std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
      ZINF_RETURN_IF_ERROR(
          engine_test::train_rank(*engine, model, rank, options, &ref.device_per_step, nullptr));
      return read_all(*engine, model, &finals[static_cast<std::size_t>(rank)]);
    });
    for (const Status& s : st)
      ASSERT_TRUE(s.is_ok()) << "stage " << run.stage << ": " << s.to_string();
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(engine_test::worst_rel_diff(finals[static_cast<std::size_t>(r)], ref.master), 0.0)
          << "stage " << run.stage << " rank " << r;
    }
  }
}

// --- A lost rank -------------------------------------------------------------------------------

// When one rank stops taking part mid-training (it closes its engine and leaves), the other
// ranks' next collective call fails within the collective timeout instead of hanging, the error
// sticks, and the engines close cleanly.
TEST(EngineFailure, ALostRankFailsTheOthersWithinTheTimeout) {
  for (int stage : {1, 3}) {
    const int world = 3;
    engine_test::ScratchDir dir("lost");
    Config config =
        engine_test::small_config(stage, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
    config.collective_timeout_ms = 1000;
    const Model model = engine_test::make_model(DType::kF32, 101);
    engine_test::Ranks ranks = engine_test::make_ranks(world, std::chrono::milliseconds(1000));
    std::vector<Status> later(world);
    const std::int64_t start = Trace::now_ns();
    std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
      TrainOptions o;
      o.steps = 2;
      o.check_gathered = false;
      ZINF_RETURN_IF_ERROR(engine_test::train_rank(*engine, model, rank, o, nullptr, nullptr));
      if (rank == 2) return Status::ok();  // gone
      o.first_step = 3;
      o.steps = 4;
      later[static_cast<std::size_t>(rank)] =
          engine_test::train_rank(*engine, model, rank, o, nullptr, nullptr);
      // Sticky: the next call fails too.
      if (engine->step().status().is_ok()) {
        return Status::internal("a step after the failure succeeded");
      }
      return Status::ok();
    });
    const double seconds = static_cast<double>(Trace::now_ns() - start) / 1e9;
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
    for (int r = 0; r < 2; ++r) {
      const Status& e = later[static_cast<std::size_t>(r)];
      EXPECT_TRUE(e.code() == Code::kTimeout || e.code() == Code::kAborted)
          << "stage " << stage << " rank " << r << ": " << e.to_string();
    }
    std::printf("stage %d: %s (%.2f s)\n", stage, later[0].to_string().c_str(), seconds);
    EXPECT_LT(seconds, 20.0);
  }
}

// --- Learning rate ---------------------------------------------------------------------------

// With the learning rate set to 0, AdamW moves nothing (p * (1 - 0 * wd) - 0 * update), on the
// in-memory path and through the pipeline (which is reopened with the new rate); a rate set back
// moves the masters again.
TEST(EngineLearningRate, SetLearningRateTakesEffectAtTheNextStep) {
  for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kNvme}) {
    engine_test::ScratchDir dir("lr");
    Config config = engine_test::small_config(2, opt, OffloadDevice::kNone, dir.path());
    const Model model = engine_test::make_model(DType::kF32, 81);
    engine_test::Ranks ranks = engine_test::make_ranks(2);
    std::vector<Status> st = engine_test::run_ranks(2, [&](int rank) -> Status {
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
      TrainOptions o;
      o.steps = 1;
      o.check_gathered = false;
      ZINF_RETURN_IF_ERROR(engine_test::train_rank(*engine, model, rank, o, nullptr, nullptr));
      std::vector<std::vector<float>> a, b, c;
      ZINF_RETURN_IF_ERROR(read_all(*engine, model, &a));
      ZINF_RETURN_IF_ERROR(engine->set_learning_rate(0.0));
      o.first_step = 2;
      o.steps = 2;
      ZINF_RETURN_IF_ERROR(engine_test::train_rank(*engine, model, rank, o, nullptr, nullptr));
      ZINF_RETURN_IF_ERROR(read_all(*engine, model, &b));
      ZINF_RETURN_IF_ERROR(engine->set_learning_rate(1e-2));
      o.first_step = 3;
      o.steps = 3;
      ZINF_RETURN_IF_ERROR(engine_test::train_rank(*engine, model, rank, o, nullptr, nullptr));
      ZINF_RETURN_IF_ERROR(read_all(*engine, model, &c));
      EXPECT_EQ(engine_test::worst_rel_diff(b, a), 0.0) << offload_device_name(opt);
      EXPECT_GT(engine_test::worst_rel_diff(c, b), 1e-4) << offload_device_name(opt);
      return Status::ok();
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  }
}

// --- Memory per placement ----------------------------------------------------------------------

// Bytes per rank on each tier for every placement, for 8 modules of 65536 bf16 parameters on 4
// ranks (P = 524288, Pr = 131072): each offload choice moves its state where docs/ENGINE.md says,
// and the table printed here is the one in that file.
TEST(EngineMemory, EachPlacementPutsItsStateOnItsTier) {
  const int world = 4;
  Model model;
  for (int i = 0; i < 8; ++i) {
    const std::string name = fmt::format("layer{}", i);
    model.modules.push_back(name);
    model.params.push_back({name + ".w", name, {256, 256}, DType::kBF16});
    model.initial.emplace_back(65536, 0.5f);
  }
  struct Row {
    int stage;
    OffloadDevice optimizer;
    OffloadDevice params;
    MemoryReport memory;
  };
  std::vector<Row> rows;
  const OffloadDevice tiers[] = {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme};
  for (int stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice opt : tiers) {
      for (OffloadDevice param : tiers) {
        if (stage != 3 && param != OffloadDevice::kNone) continue;
        engine_test::ScratchDir dir("memory");
        Config config = engine_test::small_config(stage, opt, param, dir.path());
        config.zero.sub_group_size = 1 << 14;
        config.zero.reduce_bucket_size = 1 << 16;
        config.zero.stage3_max_live_parameters = 1 << 18;
        engine_test::Ranks ranks = engine_test::make_ranks(world);
        std::vector<MemoryReport> memory(world);
        std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
          ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
          ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
          ZINF_RETURN_IF_ERROR(engine->finalize());
          memory[static_cast<std::size_t>(rank)] = engine->memory();
          return Status::ok();
        });
        for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
        rows.push_back({stage, opt, param, memory[0]});
      }
    }
  }
  std::printf("stage  optimizer  params   device_bytes  host_bytes  nvme_bytes\n");
  for (const Row& r : rows) {
    std::printf("%5d  %9s  %6s  %13llu  %10llu  %10llu\n", r.stage,
                std::string(offload_device_name(r.optimizer)).c_str(),
                std::string(offload_device_name(r.params)).c_str(),
                static_cast<unsigned long long>(r.memory.device_bytes),
                static_cast<unsigned long long>(r.memory.host_bytes),
                static_cast<unsigned long long>(r.memory.nvme_bytes));
  }
  auto find = [&](int stage, OffloadDevice opt, OffloadDevice param) {
    for (const Row& r : rows) {
      if (r.stage == stage && r.optimizer == opt && r.params == param) return r.memory;
    }
    return MemoryReport{};
  };
  const std::uint64_t p = 8 * 65536, pr = p / world;
  const auto none = OffloadDevice::kNone, host = OffloadDevice::kHost, nvme = OffloadDevice::kNvme;
  // Stage 1: bf16 parameters 2P, full f32 gradients 4P, optimizer state and accumulator 16 Pr.
  EXPECT_EQ(find(1, none, none).device_bytes, 2 * p + 4 * p + 16 * pr);
  // Stage 2 drops the full gradients; stage 3 keeps a 2 Pr shard instead of 2P.
  EXPECT_EQ(find(2, none, none).device_bytes, 2 * p + 16 * pr);
  EXPECT_EQ(find(3, none, none).device_bytes, 2 * pr + 16 * pr);
  // Offloading the optimizer takes its 16 Pr off the device.
  EXPECT_EQ(find(3, host, none).device_bytes, 2 * pr);
  EXPECT_EQ(find(3, host, host).device_bytes, 0u);
  EXPECT_EQ(find(3, nvme, nvme).device_bytes, 0u);
  // On NVMe: the master and moments (12 Pr), plus the 2 Pr shard when the parameters go too.
  EXPECT_GE(find(3, nvme, none).nvme_bytes, 12 * pr);
  EXPECT_GE(find(3, nvme, nvme).nvme_bytes, 14 * pr);
  EXPECT_EQ(find(3, none, nvme).nvme_bytes, 2 * pr);
  // The host then holds gradients and half copies (6 Pr) and the pinned blocks, not 16 Pr.
  EXPECT_LT(find(3, nvme, none).host_bytes, find(3, host, none).host_bytes);
  // Host state: master, moments, gradients (16 Pr) and the store's half array (2 Pr), from which
  // the new values are published without a second copy. With the optimizer in device memory the
  // publish copy is the host's only engine-owned bytes.
  EXPECT_EQ(find(3, host, none).host_bytes, 18 * pr);
  EXPECT_EQ(find(2, none, none).host_bytes, 2 * pr);
}

// --- Telemetry -------------------------------------------------------------------------------

TEST(EngineTelemetry, ReportsAndMemoryPerTier) {
  const int world = 2;
  engine_test::ScratchDir dir("telemetry");
  Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNvme, dir.path());
  const Model model = engine_test::make_model(DType::kBF16, 71);
  TrainOptions options;
  options.steps = 2;
  engine_test::Ranks ranks = engine_test::make_ranks(world);
  std::vector<std::vector<StepReport>> reports(world);
  std::vector<MemoryReport> memory(world);
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(*engine, model, rank, options, nullptr,
                                                 &reports[static_cast<std::size_t>(rank)]));
    memory[static_cast<std::size_t>(rank)] = engine->memory();
    return Status::ok();
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  const StepReport& r = reports[0].back();
  EXPECT_EQ(r.step, 2);
  EXPECT_GT(r.grad_norm, 0.0);
  EXPECT_EQ(r.clip_coef, 1.0);
  EXPECT_EQ(r.loss_scale, 1.0);
  // zinf.overlap_step is on by default: step 2 returned while its pass ran on, and its report
  // carries step 1's pass, finished by then.
  EXPECT_TRUE(r.overlapped);
  // The masters and moments (12 bytes a parameter of this rank's partition) went to NVMe and
  // back; bf16 shards went to NVMe after the step.
  EXPECT_GT(r.optimizer_nvme_read_bytes, 0u);
  EXPECT_EQ(r.optimizer_nvme_read_bytes, r.optimizer_nvme_write_bytes);
  EXPECT_GT(r.param_nvme_write_bytes, 0u);
  EXPECT_EQ(r.master_nvme_read_bytes, 0u);  // bf16 everywhere: the pass writes the half copy
  EXPECT_GT(r.optimizer_ns, 0);
  EXPECT_GE(r.hidden_ns, 0);
  EXPECT_LE(r.hidden_ns, r.optimizer_ns + r.publish_ns);
  EXPECT_GT(memory[0].nvme_bytes, r.optimizer_nvme_read_bytes);
  EXPECT_GT(memory[0].host_bytes, 0u);
  EXPECT_GT(memory[0].device_bytes, 0u);  // the persistent small parameters
}

TEST(EngineLearningRate, NanInfiniteAndNegativeRatesAreRefusedAndChangeNothing) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Config config = engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, "");
  config.optimizer.lr = 3e-3;
  Result<std::unique_ptr<Engine>> engine = Engine::open(config, env_for(ranks, 0));
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  for (double lr :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
        -std::numeric_limits<double>::infinity(), -1e-3}) {
    Status st = (*engine)->set_learning_rate(lr);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << lr;
    EXPECT_TRUE(contains(st, "set_learning_rate")) << st.to_string();
    EXPECT_EQ((*engine)->config().optimizer.lr, 3e-3);
  }
  EXPECT_TRUE((*engine)->set_learning_rate(0.0).is_ok());
  EXPECT_EQ((*engine)->config().optimizer.lr, 0.0);
}

// read_parameters() on a rank whose device cannot hold the gathered group fails there, and every
// other rank fails at once with kAborted naming that rank, instead of waiting in the all-gather
// until the collective timeout (60 s here).
TEST(EngineFailure, ReadParametersFailsEveryRankPromptlyWhenOneCannotAllocate) {
  const Model model = engine_test::make_model(DType::kF32, 19);
  Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
  config.collective_timeout_ms = 60'000;
  const std::string name = model.params[0].name;
  // The bytes each rank's engine uses once finalized, to set rank 1's limit just above them.
  std::vector<std::size_t> used(2);
  {
    engine_test::Ranks ranks = engine_test::make_ranks(2);
    std::vector<Status> st = engine_test::run_ranks(2, [&](int rank) -> Status {
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
      ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
      ZINF_RETURN_IF_ERROR(engine->finalize());
      used[static_cast<std::size_t>(rank)] =
          ranks.devices[static_cast<std::size_t>(rank)]->memory_used_bytes();
      return Status::ok();
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  }
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  for (int r = 0; r < 2; ++r) {
    HostDeviceOptions o;
    o.ordinal = r;
    if (r == 1) o.memory_limit_bytes = used[1] + 16;  // no room for any gathered group
    devices.push_back(std::move(make_host_device(o)).value());
    raw.push_back(devices.back().get());
  }
  LocalCommOptions co;
  co.timeout = std::chrono::seconds(60);
  std::vector<std::unique_ptr<Communicator>> comms =
      std::move(make_local_comm_group(raw, co)).value();
  std::vector<Status> read(2);
  std::vector<double> seconds(2);
  std::vector<Status> st = engine_test::run_ranks(2, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Env env;
    env.device = devices[r].get();
    env.comm = comms[r].get();
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
    ZINF_RETURN_IF_ERROR(engine->finalize());
    std::vector<float> out(model.params[0].element_count());
    const auto start = std::chrono::steady_clock::now();
    read[r] = engine->read_parameters(name, out.data());
    seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return Status::ok();
  });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(read[1].code(), Code::kResourceExhausted) << read[1].to_string();
  EXPECT_EQ(read[0].code(), Code::kAborted) << read[0].to_string();
  EXPECT_TRUE(contains(read[0], "rank 1")) << read[0].to_string();
  EXPECT_TRUE(contains(read[0], name)) << read[0].to_string();
  EXPECT_LT(seconds[0], 10.0);
  EXPECT_LT(seconds[1], 10.0);
}

// A device too small for what finalize() builds fails it with kResourceExhausted, the device's own
// code, and a message that says the call was finalize, which part of the engine's state it was
// allocating, the device's limit, and the config key that makes that part smaller. Every limit
// from just above what Engine::open() allocated to a byte short of what a finalized engine holds
// is tried (in steps of 256 bytes), at stage 1 (the reducer keeps a full gradient copy of every
// group and every rank the whole parameters) and stage 3 (parameter shards and gather buffers);
// the failure stays: finalize() again and register_parameter() return it.
TEST(EngineFailure, FinalizeOutOfDeviceMemoryNamesTheStateAndTheSetting) {
  const Model model = engine_test::make_model(DType::kF32, 29);
  struct Case {
    int stage;
    OffloadDevice params;  // zero_optimization.offload_param.device
    // (state named in the message, a key the message then names): every pair must be seen.
    std::vector<std::pair<std::string, std::string>> states;
    // Advice no message may give (a setting that is in place already), or empty.
    std::string absent;
  };
  const std::vector<Case> cases = {
      {1,
       OffloadDevice::kNone,
       {{"the optimizer state in device memory", "zero_optimization.offload_optimizer.device"},
        {"the gradient reduce buckets and the full gradient copy of every group",
         "zero_optimization.reduce_bucket_size"},
        {"the parameters (", "zero_optimization.stage"}},
       ""},
      {3,
       OffloadDevice::kNone,
       {{"the optimizer state in device memory", "zero_optimization.offload_optimizer.device"},
        {"the parameter shards and the gather buffers",
         "zero_optimization.offload_param.device to cpu or nvme"}},
       ""},
      {3,
       OffloadDevice::kHost,
       {{"the optimizer state in device memory", "zero_optimization.offload_optimizer.device"},
        {"the parameter shards and the gather buffers",
         "zero_optimization.stage3_max_live_parameters"}},
       "offload_param.device to"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("stage {}, offload_param {}", c.stage, offload_device_name(c.params)));
    const Config config = engine_test::small_config(c.stage, OffloadDevice::kNone, c.params, "");
    // What the engine holds once opened and once finalized, on a device without a limit.
    std::size_t opened_bytes = 0;
    std::size_t finalized_bytes = 0;
    {
      engine_test::Ranks ranks = engine_test::make_ranks(1);
      Result<std::unique_ptr<Engine>> opened = Engine::open(config, env_for(ranks, 0));
      ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
      std::unique_ptr<Engine> engine = std::move(opened).value();
      opened_bytes = ranks.devices[0]->memory_used_bytes();
      ASSERT_TRUE(engine_test::register_model(*engine, model).is_ok());
      ASSERT_TRUE(engine->finalize().is_ok());
      finalized_bytes = ranks.devices[0]->memory_used_bytes();
    }
    ASSERT_GT(finalized_bytes, opened_bytes + 4096);
    std::set<std::size_t> seen;
    // Above the layout's small exchange buffers, so that each failure is in building the state.
    for (std::size_t limit = opened_bytes + 64; limit <= finalized_bytes; limit += 256) {
      HostDeviceOptions o;
      o.memory_limit_bytes = std::min(limit, finalized_bytes - 1);
      std::unique_ptr<Device> device = std::move(make_host_device(o)).value();
      std::vector<Device*> raw{device.get()};
      LocalCommOptions co;
      co.timeout = std::chrono::milliseconds(config.collective_timeout_ms);
      std::vector<std::unique_ptr<Communicator>> comms =
          std::move(make_local_comm_group(raw, co)).value();
      Env env;
      env.device = device.get();
      env.comm = comms[0].get();
      Result<std::unique_ptr<Engine>> opened = Engine::open(config, env);
      ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
      std::unique_ptr<Engine> engine = std::move(opened).value();
      ASSERT_TRUE(engine_test::register_model(*engine, model).is_ok());
      const Status st = engine->finalize();
      SCOPED_TRACE(fmt::format("limit {} bytes: {}", o.memory_limit_bytes, st.to_string()));
      ASSERT_EQ(st.code(), Code::kResourceExhausted);
      EXPECT_TRUE(st.message().starts_with("finalize: "));
      EXPECT_TRUE(contains(st, "would exceed the device memory limit"));
      EXPECT_TRUE(contains(st, fmt::format(" of {} bytes in use)", o.memory_limit_bytes)));
      std::size_t named = c.states.size();
      for (std::size_t k = 0; k < c.states.size(); ++k) {
        if (contains(st, "finalize: " + c.states[k].first)) named = k;
      }
      ASSERT_LT(named, c.states.size()) << "names none of the states";
      EXPECT_TRUE(contains(st, "; to need less memory for it, "));
      EXPECT_TRUE(contains(st, c.states[named].second));
      if (!c.absent.empty()) {
        EXPECT_FALSE(contains(st, c.absent));
      }
      seen.insert(named);
      // Sticky: the same error again, and registration closed naming it.
      const Status again = engine->finalize();
      EXPECT_EQ(again.code(), st.code());
      EXPECT_EQ(again.message(), st.message());
      const Status reg = engine->register_parameter(
          ParameterSpec{.name = "late", .module = model.modules[0], .shape = {4}});
      EXPECT_EQ(reg.code(), Code::kFailedPrecondition);
      EXPECT_TRUE(contains(reg, st.message())) << reg.to_string();
    }
    EXPECT_EQ(seen.size(), c.states.size()) << "not every state's allocation failed at some limit";
  }
}

TEST(EngineNvmePath, AMissingDirectoryIsCreatedWithItsParentsAndLogged) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  engine_test::ScratchDir dir("nvme-create");
  const std::string path = dir.path() + "/not/there/yet";
  Config config = engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNvme, path);
  ::testing::internal::CaptureStderr();
  Result<std::unique_ptr<Engine>> engine = Engine::open(config, env_for(ranks, 0));
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  EXPECT_TRUE(std::filesystem::is_directory(path));
  EXPECT_NE(log.find("created the missing directory '" + path + "'"), std::string::npos) << log;
  EXPECT_NE(log.find("zero_optimization.offload_optimizer.nvme_path"), std::string::npos) << log;
  // It trains there.
  const Model model = engine_test::make_model(DType::kF32, 5);
  TrainOptions o;
  o.steps = 2;
  o.check_gathered = false;
  EXPECT_TRUE(engine_test::train_rank(**engine, model, 0, o, nullptr, nullptr).is_ok());
}

// A communicator made with another collective timeout than zinf.collective_timeout_ms: open
// warns (once, rank 0), naming both values; with the same value it says nothing.
TEST(EngineOpen, ACommunicatorTimeoutOtherThanTheConfigsIsWarned) {
  for (const auto comm_timeout :
       {std::chrono::milliseconds(7'000), std::chrono::milliseconds(30'000)}) {
    engine_test::Ranks ranks = engine_test::make_ranks(1, comm_timeout);
    const Config config =
        engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
    ASSERT_EQ(config.collective_timeout_ms, 30'000);
    ::testing::internal::CaptureStderr();
    Result<std::unique_ptr<Engine>> engine = Engine::open(config, env_for(ranks, 0));
    const std::string log = ::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
    if (comm_timeout.count() == config.collective_timeout_ms) {
      EXPECT_EQ(log.find("collective_timeout"), std::string::npos) << log;
    } else {
      EXPECT_NE(log.find("zinf.collective_timeout_ms is 30000 ms, but the communicator (local rank "
                         "0 of 1) was made with a collective timeout of 7000 ms"),
                std::string::npos)
          << log;
    }
  }
}

// A process killed while it trained leaves its swap file; the next engine to open in the
// directory on this machine removes it (saying so), also while the process is a zombie not yet
// reaped (mpirun may return before a killed rank is), and leaves alone the files of running
// processes and of other machines.
TEST(EngineNvmePath, SwapFilesOfKilledProcessesAreRemovedAtOpen) {
  engine_test::ScratchDir dir("nvme-stale");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // a process id no process has now
  const pid_t zombie = ::fork();
  ASSERT_GE(zombie, 0);
  if (zombie == 0) ::_exit(0);
  // Exited and not reaped until the end of the test: a zombie.
  for (int i = 0; i < 500; ++i) {
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(zombie), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid == zombie) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto named = [](const std::string& pattern, long pid) {
    std::string name = pattern;
    name.replace(name.find("{pid}"), 5, std::to_string(pid));
    return name;
  };
  const std::string dead = named(swap_file_name("swap", 1), child);
  const std::string dead_activations = named(swap_file_name("activations", 0), child);
  const std::string exited = named(swap_file_name("swap", 3), zombie);
  const std::string alive = named(swap_file_name("swap", 1), ::getppid());
  const std::string elsewhere = fmt::format("zinf-swap-another_host-{}-rank1.bin", child);
  // Not a swap file's name, though it starts as one.
  std::string backup = named(swap_file_name("swap", 1), child);
  backup.replace(backup.size() - 4, 4, "-backup.bin");
  // A dead pid here, but the file is open and locked (as by a process of another pid namespace
  // on this machine, which kill() cannot see).
  const std::string held = named(swap_file_name("swap", 2), child);
  for (const std::string& name : {dead, dead_activations, exited, alive, elsewhere, backup, held}) {
    std::ofstream(dir.path() + "/" + name) << "stale swap bytes";
  }
  const int held_fd = ::open((dir.path() + "/" + held).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(held_fd, 0);
  ASSERT_EQ(::flock(held_fd, LOCK_SH), 0);
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  const Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
  ::testing::internal::CaptureStderr();
  Result<std::unique_ptr<Engine>> engine = Engine::open(config, env_for(ranks, 0));
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/" + dead));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/" + dead_activations));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/" + exited)) << "a zombie's";
  ASSERT_EQ(::waitpid(zombie, nullptr, 0), zombie);
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/" + alive));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/" + elsewhere));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/" + backup));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/" + held));
  ::close(held_fd);
  EXPECT_NE(log.find("removed '" + dir.path() + "/" + dead + "' (16 bytes)"), std::string::npos)
      << log;
}

TEST(EngineNvmePath, AnExistingDirectoryIsNotReportedAsCreated) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  engine_test::ScratchDir dir("nvme-exists");
  Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
  ::testing::internal::CaptureStderr();
  Result<std::unique_ptr<Engine>> engine = Engine::open(config, env_for(ranks, 0));
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  EXPECT_EQ(log.find("created"), std::string::npos) << log;
}

// DeepSpeed's default persistence threshold (1e5 elements) keeps every parameter of a small
// model gathered: stage 3 then shards nothing, which the log says once (rank 0).
TEST(EngineStage3, AModelLeftEntirelyUnshardedByPersistenceIsWarnedOnce) {
  const Model model = engine_test::make_model(DType::kF32, 23);
  for (std::size_t threshold : {std::size_t{100'000}, std::size_t{30}}) {
    Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
    config.zero.stage3_param_persistence_threshold = threshold;
    engine_test::Ranks ranks = engine_test::make_ranks(2);
    ::testing::internal::CaptureStderr();
    std::vector<Status> st = engine_test::run_ranks(2, [&](int rank) -> Status {
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env_for(ranks, rank)));
      TrainOptions o;
      o.steps = 2;
      o.check_gathered = false;
      return engine_test::train_rank(*engine, model, rank, o, nullptr, nullptr);
    });
    const std::string log = ::testing::internal::GetCapturedStderr();
    for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
    const std::string key = "stage3_param_persistence_threshold";
    std::size_t lines = 0;
    for (std::size_t at = log.find(key); at != std::string::npos; at = log.find(key, at + 1)) {
      ++lines;
    }
    if (threshold == 100'000) {
      EXPECT_EQ(lines, 1u) << log;
      EXPECT_NE(log.find("nothing is sharded"), std::string::npos) << log;
    } else {
      EXPECT_EQ(lines, 0u) << log;
    }
  }
}

}  // namespace
}  // namespace zinf
