// How much of the stage-3 gather time prefetching hides: a model of eight modules whose shards
// live on NVMe (or in host memory), each module "computing" for a fixed time (a sleep, so the
// two cores stay free for the I/O and the collectives), trained with prefetch on and off in
// alternating rounds on the same machine. Prints, per round, the forward+backward time and the
// time spent inside gather(), beside the compute-only floor; the figures in docs/ENGINE.md come
// from this test:
//   build/tests/zinf_engine_slow_test --gtest_filter='PrefetchOverlap*'
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "engine_test_util.hpp"
#include "zinf/trace.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::ParamDef;

struct Timing {
  double pass_ms = 0;       // forward + backward, rank 0, per step
  double gather_ms = 0;     // inside gather(), rank 0, per step
  EngineCounters counters;  // rank 0's, at the end of the run
};

constexpr int kModules = 8;
constexpr int kSteps = 3;  // timed steps, after one step that records the order

Model big_model() {
  Model m;
  for (int i = 0; i < kModules; ++i) {
    const std::string name = fmt::format("layer{}", i);
    m.modules.push_back(name);
    m.params.push_back({name + ".w", name, {1024, 1024}, DType::kBF16});
    m.initial.emplace_back(1024 * 1024, 0.01f * static_cast<float>(i + 1));
  }
  return m;
}

Timing run(OffloadDevice tier, bool prefetch, double compute_ms, const std::string& dir) {
  const int world = 2;
  Config config = engine_test::small_config(3, OffloadDevice::kNone, tier, dir);
  config.zero.reduce_bucket_size = 1 << 22;
  config.zero.sub_group_size = 1 << 22;
  config.zero.stage3_param_persistence_threshold = 0;
  config.zero.stage3_max_live_parameters = 8u << 20;
  // Two modules ahead, or none.
  config.zero.stage3_prefetch_bucket_size = prefetch ? (2u << 20) : 0;
  config.zero.offload_param.buffer_count = 4;
  config.aio_block_bytes = 1 << 20;
  const Model model = big_model();
  engine_test::Ranks ranks = engine_test::make_ranks(world);
  std::vector<Timing> timing(world);
  const auto compute = std::chrono::microseconds(static_cast<std::int64_t>(compute_ms * 1000));
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    Env env;
    env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
    env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
    ZINF_RETURN_IF_ERROR(engine->finalize());
    std::vector<float> grad(1024 * 1024, 0.001f);
    std::int64_t pass_ns = 0, gather_ns = 0;
    for (int step = 0; step <= kSteps; ++step) {
      const std::int64_t t0 = Trace::now_ns();
      std::int64_t in_gather = 0;
      auto gather = [&](const std::string& m) -> Status {
        const std::int64_t g0 = Trace::now_ns();
        Status s = engine->gather(m);
        in_gather += Trace::now_ns() - g0;
        return s;
      };
      for (const std::string& m : model.modules) {
        ZINF_RETURN_IF_ERROR(gather(m));
        std::this_thread::sleep_for(compute);
        ZINF_RETURN_IF_ERROR(engine->release(m));
      }
      for (auto it = model.modules.rbegin(); it != model.modules.rend(); ++it) {
        ZINF_RETURN_IF_ERROR(gather(*it));
        std::this_thread::sleep_for(compute);
        GradientRef ref{*it + ".w", grad.data(), grad.size(), DType::kF32};
        ZINF_RETURN_IF_ERROR(engine->reduce_gradients(*it, std::span(&ref, 1)));
        ZINF_RETURN_IF_ERROR(engine->release(*it));
      }
      const std::int64_t t1 = Trace::now_ns();
      if (step > 0) {
        pass_ns += t1 - t0;
        gather_ns += in_gather;
      }
      ZINF_RETURN_IF_ERROR(engine->step().status());
    }
    timing[static_cast<std::size_t>(rank)] = {pass_ns / 1e6 / kSteps, gather_ns / 1e6 / kSteps,
                                              engine->counters()};
    return Status::ok();
  });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  return timing[0];
}

// The floor measured: the same sleeps with no engine, per step.
double sleep_floor_ms(double compute_ms) {
  const auto compute = std::chrono::microseconds(static_cast<std::int64_t>(compute_ms * 1000));
  const std::int64_t t0 = Trace::now_ns();
  for (int step = 0; step < kSteps; ++step) {
    for (int i = 0; i < 2 * kModules; ++i) std::this_thread::sleep_for(compute);
  }
  return (Trace::now_ns() - t0) / 1e6 / kSteps;
}

using engine_test::median;

TEST(PrefetchOverlap, PrefetchHidesGatherTimeBehindCompute) {
  const double compute_ms = 4.0;
  const double nominal_ms = compute_ms * 2 * kModules;
  for (OffloadDevice tier : {OffloadDevice::kNvme, OffloadDevice::kHost}) {
    engine_test::ScratchDir dir("overlap");
    std::vector<double> on_ratio, off_ratio, off_over_on, gather_on, gather_off;
    std::printf(
        "params on %s: 8 modules of 1 Mi bf16 parameters, 2 ranks, %.1f ms compute a "
        "module a pass, %.1f ms a step nominal\n",
        std::string(offload_device_name(tier)).c_str(), compute_ms, nominal_ms);
    std::printf("round  floor_ms  pass_on_ms  pass_off_ms  gather_on_ms  gather_off_ms\n");
    for (int round = 0; round < 5; ++round) {
      // Alternate which runs first, so drift in the machine's load hits both alike.
      Timing on, off;
      const double floor_ms = sleep_floor_ms(compute_ms);
      if (round % 2 == 0) {
        on = run(tier, true, compute_ms, dir.path());
        off = run(tier, false, compute_ms, dir.path());
      } else {
        off = run(tier, false, compute_ms, dir.path());
        on = run(tier, true, compute_ms, dir.path());
      }
      std::printf("%5d  %8.2f  %10.2f  %11.2f  %12.2f  %13.2f\n", round, floor_ms, on.pass_ms,
                  off.pass_ms, on.gather_ms, off.gather_ms);
      on_ratio.push_back(on.pass_ms / floor_ms);
      off_ratio.push_back(off.pass_ms / floor_ms);
      off_over_on.push_back(off.pass_ms / on.pass_ms);
      gather_on.push_back(on.gather_ms);
      gather_off.push_back(off.gather_ms);
      // Whatever the timing, the runs must differ in what the coordinator did: after the step
      // that records the order, each gather but the first of a pass finds its module prefetched
      // (2 * kModules - 2 hits a step at the least, allowing the turn at the end of the forward);
      // with a prefetch budget of zero nothing is issued ahead. Every gather() issues at most one
      // all-gather of its own, so the count of gathers bounds the demand gathers.
      const std::uint64_t gathers = static_cast<std::uint64_t>(2 * kModules * (kSteps + 1));
      EXPECT_EQ(on.counters.gathers, gathers);
      EXPECT_EQ(off.counters.gathers, gathers);
      EXPECT_GE(on.counters.prefetch_hits, static_cast<std::uint64_t>((2 * kModules - 2) * kSteps))
          << offload_device_name(tier) << " round " << round;
      EXPECT_EQ(off.counters.prefetches_issued, 0u) << offload_device_name(tier);
      EXPECT_EQ(off.counters.prefetch_hits, 0u) << offload_device_name(tier);
    }
    std::printf(
        "median: pass/floor with prefetch %.3f, without %.3f; without/with %.3f; "
        "gather ms with %.2f, without %.2f\n",
        median(on_ratio), median(off_ratio), median(off_over_on), median(gather_on),
        median(gather_off));
    // Only the NVMe case has a gather slow enough to tell apart reliably on a loaded machine.
    if (tier == OffloadDevice::kNvme) {
      EXPECT_LT(median(gather_on), median(gather_off));
    }
  }
}

}  // namespace
}  // namespace zinf
