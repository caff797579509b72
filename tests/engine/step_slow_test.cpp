// What step() costs beyond the optimizer pass it runs: for 8 modules of 512 Ki bf16 parameters
// (4 Mi parameters) on 2 ranks, stage 3, with the optimizer state on the host or on NVMe, the
// step's wall time beside the optimizer's own (the OptimizerPipeline step, the limit here) in
// the same step, and the other phases (the last reduce buckets, the norm exchange, publishing
// the new shards). The sequential step (zinf.overlap_step false): the overlapped one returns
// before its pass ends, so its wall time does not hold the pass (the overlap's own measurements
// are train_lm's, docs/ENGINE.md "The overlapped step"). Median over 5 steps after a warm-up
// step; figures in docs/ENGINE.md:
//   build/tests/zinf_engine_slow_test --gtest_filter='StepCost*'
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::median;

TEST(StepCost, StepWallBesideTheOptimizerPass) {
  const int world = 2;
  const int steps = 6;
  engine_test::Model model;
  for (int i = 0; i < 8; ++i) {
    const std::string name = fmt::format("layer{}", i);
    model.modules.push_back(name);
    model.params.push_back({name + ".w", name, {512, 1024}, DType::kBF16});
    model.initial.emplace_back(512 * 1024, 0.01f * static_cast<float>(i + 1));
  }
  for (OffloadDevice opt : {OffloadDevice::kHost, OffloadDevice::kNvme}) {
    engine_test::ScratchDir dir("stepcost");
    Config config = engine_test::small_config(3, opt, OffloadDevice::kNone, dir.path());
    config.zero.sub_group_size = 1 << 19;
    config.zero.reduce_bucket_size = 1 << 22;
    config.zero.stage3_max_live_parameters = 4u << 20;
    config.zero.stage3_prefetch_bucket_size = 1u << 20;
    config.aio_block_bytes = 1 << 20;
    config.cpu_threads = 0;
    config.overlap_step = false;
    engine_test::TrainOptions options;
    options.steps = steps;
    options.check_gathered = false;
    engine_test::Ranks ranks = engine_test::make_ranks(world);
    std::vector<std::vector<StepReport>> reports(world);
    std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
      Env env;
      env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
      env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
      ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
      return engine_test::train_rank(*engine, model, rank, options, nullptr,
                                     &reports[static_cast<std::size_t>(rank)]);
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
    std::vector<double> wall, opt_ms, ratio, reduce, norm, publish;
    std::printf("optimizer state on %s, 4 Mi bf16 parameters, 2 ranks, stage 3\n",
                std::string(offload_device_name(opt)).c_str());
    std::printf("step  wall_ms  optimizer_ms  reduce_ms  norm_ms  publish_ms  nvme_read_MB\n");
    for (int s = 1; s < steps; ++s) {  // step 0 warms up
      const StepReport& r = reports[0][static_cast<std::size_t>(s)];
      std::printf("%4lld  %7.2f  %12.2f  %9.2f  %7.2f  %10.2f  %12.2f\n",
                  static_cast<long long>(r.step), r.wall_ns / 1e6, r.optimizer_ns / 1e6,
                  r.reduce_ns / 1e6, r.norm_ns / 1e6, r.publish_ns / 1e6,
                  r.optimizer_nvme_read_bytes / 1e6);
      wall.push_back(r.wall_ns / 1e6);
      opt_ms.push_back(r.optimizer_ns / 1e6);
      ratio.push_back(static_cast<double>(r.wall_ns) / static_cast<double>(r.optimizer_ns));
      reduce.push_back(r.reduce_ns / 1e6);
      norm.push_back(r.norm_ns / 1e6);
      publish.push_back(r.publish_ns / 1e6);
    }
    std::printf(
        "median: wall %.2f ms, optimizer %.2f ms, wall/optimizer %.3f; reduce %.2f, norm "
        "%.2f, publish %.2f ms\n",
        median(wall), median(opt_ms), median(ratio), median(reduce), median(norm), median(publish));
    EXPECT_GE(median(ratio), 1.0);
  }
}

}  // namespace
}  // namespace zinf
