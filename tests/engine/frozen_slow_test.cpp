// A LoRA-shaped step at a size where the bytes show: a bf16 model of 64 Mi frozen elements (a base
// of 16 weights of 2048 x 2048) and 1 Mi trainable ones (8 adapters of 1024 x 128), world 1,
// stage 3 with the parameter shards on NVMe, the optimizer state (AdamW) on NVMe (the new
// parameters stream from the pass into the shards) or in host memory (the store's half array),
// the sequential step, eight steps. A step does not republish the frozen base: the pass reads and
// writes the trainable share's master and moments only (12 bytes an element each way; nothing of
// the frozen master), and the shards written are the adapters' (2 bytes an element). Prints each
// step's bytes and times; the figures in docs/BENCHMARKS.md ("Frozen groups are not
// republished after a step") come from this test:
//   build/tests/zinf_engine_slow_test --gtest_filter='FrozenSlow.*'
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::big_lora_model;
using engine_test::Model;
using engine_test::TrainOptions;

void check_big_lora_step(OffloadDevice opt) {
  const Model model = big_lora_model();
  std::size_t trainable_elements = 0;
  for (const engine_test::ParamDef& d : model.params) {
    if (d.module != model.frozen_module) trainable_elements += d.element_count();
  }
  engine_test::ScratchDir dir(fmt::format("frozen_slow_{}", offload_device_name(opt)));
  Config config = engine_test::small_config(3, opt, OffloadDevice::kNvme, dir.path());
  config.zero.sub_group_size = 1'000'000'000;
  config.zero.stage3_max_live_parameters = 1'000'000'000;
  config.zero.stage3_prefetch_bucket_size = 50'000'000;
  config.zero.reduce_bucket_size = 50'000'000;
  config.aio_block_bytes = 1 << 20;
  config.cpu_threads = 2;
  config.overlap_step = false;
  std::vector<StepReport> reports;
  std::vector<Status> st =
      engine_test::with_engines(config, model, 1, [&](int rank, Engine& engine) -> Status {
        TrainOptions options;
        options.steps = 8;
        options.check_gathered = false;
        return engine_test::train_rank(engine, model, rank, options, nullptr, &reports);
      });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  ASSERT_EQ(reports.size(), 8u);
  const bool state_on_nvme = opt == OffloadDevice::kNvme;
  for (const StepReport& r : reports) {
    std::printf(
        "state %s step %lld: optimizer read %llu B, written %llu B; shards written %llu B; "
        "optimizer %.3f s, publish %.3f s, step %.3f s\n",
        offload_device_name(opt).data(), static_cast<long long>(r.step),
        static_cast<unsigned long long>(r.optimizer_nvme_read_bytes),
        static_cast<unsigned long long>(r.optimizer_nvme_write_bytes),
        static_cast<unsigned long long>(r.param_nvme_write_bytes), r.optimizer_ns / 1e9,
        r.publish_ns / 1e9, r.wall_ns / 1e9);
    EXPECT_EQ(r.optimizer_nvme_read_bytes, state_on_nvme ? trainable_elements * 12 : 0)
        << "step " << r.step;
    EXPECT_EQ(r.optimizer_nvme_write_bytes, state_on_nvme ? trainable_elements * 12 : 0)
        << "step " << r.step;
    EXPECT_EQ(r.param_nvme_write_bytes, trainable_elements * 2) << "step " << r.step;
    EXPECT_EQ(r.master_nvme_read_bytes, 0u) << "step " << r.step;
  }
}

TEST(FrozenSlow, ALoraStepWithTheStateOnNvmeMovesTheTrainableShareOnly) {
  check_big_lora_step(OffloadDevice::kNvme);
}
TEST(FrozenSlow, ALoraStepWithTheStateInHostMemoryWritesTheTrainableShardsOnly) {
  check_big_lora_step(OffloadDevice::kHost);
}

}  // namespace
}  // namespace zinf
