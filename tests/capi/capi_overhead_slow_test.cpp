// What the C boundary costs: the same training loop (one rank, stage 2, optimizer on the device)
// timed through zinf.h and through the zinf::Engine inside the same handle, interleaved round by
// round (the order swapped every round), median of the per-round ratios; and the cost of one
// zinf_engine_parameter() beside one Engine::parameter(). Figures go to docs/CAPI.md. Label `slow`:
// not in the default run.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "capi/capi_internal.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"
#include "zinf/zinf.h"

namespace zinf {
namespace {

constexpr int kModules = 8;
constexpr std::size_t kElements = 65536;  // per module: 512 Ki parameters in all
constexpr int kStepsPerRound = 8;
constexpr int kRounds = 31;
constexpr int kCallsPerRound = 200000;
constexpr const char* kJson =
    R"({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}, "zinf": {"cpu_threads": 1}})";

std::string module_name(int m) { return fmt::format("m{}", m); }
std::string param_name(int m) { return fmt::format("m{}.w", m); }

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TEST(CApiOverhead, TrainingLoopThroughCMatchesCpp) {
  const std::uint64_t seed = 4242;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::vector<float> initial(kElements);
  fill_uniform(initial.data(), initial.size(), seed, -1.0f, 1.0f);
  std::vector<std::vector<float>> grads(kModules, std::vector<float>(kElements));
  for (int m = 0; m < kModules; ++m) {
    fill_uniform(grads[m].data(), kElements, seed + 1 + static_cast<std::uint64_t>(m), -1.0f, 1.0f);
  }

  // The C side: its own device and one-rank group.
  zinf_config_t* config = nullptr;
  const std::string json = kJson;
  ASSERT_EQ(zinf_config_from_json(json.data(), json.size(), &config), ZINF_OK);
  zinf_device_t* c_device = nullptr;
  ASSERT_EQ(zinf_host_device_create(0, 0, &c_device), ZINF_OK);
  zinf_comm_group_t* group = nullptr;
  ASSERT_EQ(zinf_local_comm_group_create(&c_device, 1, 0, &group), ZINF_OK);
  zinf_comm_t* comm = nullptr;
  ASSERT_EQ(zinf_comm_group_get(group, 0, &comm), ZINF_OK);
  zinf_env_t env{};
  env.struct_size = sizeof env;
  env.device = c_device;
  env.comm = comm;
  zinf_engine_t* c_engine = nullptr;
  ASSERT_EQ(zinf_engine_open(config, &env, &c_engine), ZINF_OK) << zinf_last_error_message();
  const std::int64_t shape[1] = {static_cast<std::int64_t>(kElements)};
  for (int m = 0; m < kModules; ++m) {
    ASSERT_EQ(
        zinf_engine_register_parameter(c_engine, param_name(m).c_str(), module_name(m).c_str(),
                                       shape, 1, ZINF_DTYPE_F32, initial.data()),
        ZINF_OK);
  }
  ASSERT_EQ(zinf_engine_finalize(c_engine), ZINF_OK);

  // The C++ side: the very engine the handle wraps, so both loops run on the same threads,
  // memory and state, and differ only in the boundary.
  Engine* engine = capi::engine_of(c_engine);
  ASSERT_NE(engine, nullptr);

  std::vector<std::string> modules, params;
  for (int m = 0; m < kModules; ++m) {
    modules.push_back(module_name(m));
    params.push_back(param_name(m));
  }
  auto c_round = [&] {
    for (int s = 0; s < kStepsPerRound; ++s) {
      for (int m = kModules; m-- > 0;) {
        const auto i = static_cast<std::size_t>(m);
        EXPECT_EQ(zinf_engine_gather(c_engine, modules[i].c_str()), ZINF_OK);
        void* data = nullptr;
        EXPECT_EQ(zinf_engine_parameter(c_engine, params[i].c_str(), &data, nullptr, nullptr),
                  ZINF_OK);
        const zinf_gradient_t g = {params[i].c_str(), grads[i].data(), kElements, ZINF_DTYPE_F32};
        EXPECT_EQ(zinf_engine_reduce_gradients(c_engine, modules[i].c_str(), &g, 1), ZINF_OK);
        EXPECT_EQ(zinf_engine_release(c_engine, modules[i].c_str()), ZINF_OK);
      }
      zinf_step_report_t report{};
      report.struct_size = sizeof report;
      EXPECT_EQ(zinf_engine_step(c_engine, &report), ZINF_OK) << zinf_last_error_message();
    }
  };
  auto cpp_round = [&] {
    for (int s = 0; s < kStepsPerRound; ++s) {
      for (int m = kModules; m-- > 0;) {
        const auto i = static_cast<std::size_t>(m);
        EXPECT_TRUE(engine->gather(modules[i]).is_ok());
        EXPECT_TRUE(engine->parameter(params[i]).is_ok());
        const GradientRef g{params[i], grads[i].data(), kElements, DType::kF32};
        EXPECT_TRUE(engine->reduce_gradients(modules[i], {&g, 1}).is_ok());
        EXPECT_TRUE(engine->release(modules[i]).is_ok());
      }
      EXPECT_TRUE(engine->step().is_ok());
    }
  };
  c_round();  // warm-up
  cpp_round();
  std::vector<double> ratios, c_times, cpp_times;
  for (int round = 0; round < kRounds; ++round) {
    double c_s = 0, cpp_s = 0;
    for (int order = 0; order < 2; ++order) {
      const auto start = std::chrono::steady_clock::now();
      if ((order == 0) == (round % 2 == 0)) {
        c_round();
        c_s = seconds_since(start);
      } else {
        cpp_round();
        cpp_s = seconds_since(start);
      }
    }
    ratios.push_back(c_s / cpp_s);
    c_times.push_back(c_s);
    cpp_times.push_back(cpp_s);
  }
  const double step_ratio = median(ratios);
  std::printf(
      "training loop (%d modules x %zu f32, stage 2): C %.3f ms/step, C++ %.3f ms/step (medians), "
      "median of %d ratios C/C++ %.3f (min %.3f, max %.3f)\n",
      kModules, kElements, median(c_times) / kStepsPerRound * 1e3,
      median(cpp_times) / kStepsPerRound * 1e3, kRounds, step_ratio,
      *std::min_element(ratios.begin(), ratios.end()),
      *std::max_element(ratios.begin(), ratios.end()));

  // One call: the parameter lookup, the cheapest forwarding call with a name.
  std::vector<double> call_ratios, c_ns, cpp_ns;
  ASSERT_EQ(zinf_engine_gather(c_engine, "m3"), ZINF_OK);
  for (int round = 0; round < kRounds; ++round) {
    double c_s = 0, cpp_s = 0;
    std::size_t sink = 0;
    for (int order = 0; order < 2; ++order) {
      const auto t0 = std::chrono::steady_clock::now();
      if ((order == 0) == (round % 2 == 0)) {
        void* data = nullptr;
        for (int i = 0; i < kCallsPerRound; ++i) {
          (void)zinf_engine_parameter(c_engine, "m3.w", &data, nullptr, nullptr);
        }
        c_s = seconds_since(t0);
      } else {
        for (int i = 0; i < kCallsPerRound; ++i) {
          Result<TensorView> v = engine->parameter("m3.w");
          sink += v->element_count;
        }
        cpp_s = seconds_since(t0);
      }
    }
    EXPECT_EQ(sink, static_cast<std::size_t>(kCallsPerRound) * kElements);
    call_ratios.push_back(c_s / cpp_s);
    c_ns.push_back(c_s / kCallsPerRound * 1e9);
    cpp_ns.push_back(cpp_s / kCallsPerRound * 1e9);
  }
  std::printf(
      "parameter(): C %.1f ns/call, C++ %.1f ns/call (medians), median of %d ratios C/C++ %.3f\n",
      median(c_ns), median(cpp_ns), kRounds, median(call_ratios));

  EXPECT_EQ(zinf_engine_release(c_engine, "m3"), ZINF_OK);
  zinf_engine_close(c_engine);
  EXPECT_EQ(zinf_comm_group_destroy(group), ZINF_OK);
  EXPECT_EQ(zinf_device_destroy(c_device), ZINF_OK);
  zinf_config_destroy(config);
  // Loose: the boundary is a few hundred nanoseconds a call against milliseconds of step, so
  // anything near 1 is noise on a shared machine; a large ratio means the layer copies data.
  EXPECT_LT(step_ratio, 1.25);
}

}  // namespace
}  // namespace zinf
