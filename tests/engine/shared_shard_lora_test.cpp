// A frozen shard lent by the store's half copy at the size where the bytes show:
// engine_test::big_lora_model() at stage 3 with the shards and the optimizer state in host memory
// (tests/engine/frozen_shared_shard_test.cpp checks the lending itself on a small model). The
// figures in docs/BENCHMARKS.md ("A frozen shard its half copy holds") come from this test:
//   build/tests/zinf_engine_test --gtest_filter='SharedShardLora.*'
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "engine_test_util.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using engine_test::Model;

// engine_test::big_lora_model() (64 Mi frozen bf16 elements, 1 Mi trainable) with its base
// rounded to bf16, world 1, stage 3, AdamW, the state in host memory, sub_group_size 1 Mi: after
// finalize(), MemoryReport::host_bytes with the shards in host memory (offload_param "cpu") is
// that with the shards on the device (offload_param "none") plus the trainable shards alone (2
// bytes a trainable element): the frozen shards, lent by the half copy, take none. Figures in
// docs/BENCHMARKS.md, "A frozen shard its half copy holds".
TEST(SharedShardLora, FrozenShardsTakeNoHostMemory) {
  Model model = engine_test::big_lora_model();
  std::size_t trainable_elements = 0;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].module != model.frozen_module) {
      trainable_elements += model.params[p].element_count();
      continue;
    }
    const std::vector<std::uint16_t> half =
        engine_test::narrow_to_half(model.initial[p], DType::kBF16);
    convert_bf16_to_f32(half.data(), model.initial[p].data(), half.size());
  }
  std::uint64_t host_bytes[2] = {0, 0};  // shards in host memory, on the device
  for (int on_device = 0; on_device < 2; ++on_device) {
    Config config;
    config.optimizer.kind = OptimizerKind::kAdamW;
    config.optimizer.lr = 1e-3;
    config.optimizer.weight_decay = 0.01;
    config.zero.stage = 3;
    config.zero.sub_group_size = std::size_t{1} << 20;
    config.zero.offload_optimizer.device = OffloadDevice::kHost;
    config.zero.offload_param.device = on_device ? OffloadDevice::kNone : OffloadDevice::kHost;
    config.cpu_threads = 2;
    config.collective_timeout_ms = 120'000;
    engine_test::Ranks ranks = engine_test::make_ranks(1, std::chrono::seconds(120));
    const std::vector<Status> st =
        engine_test::run_engines(config, ranks, [&](int, Engine& engine) -> Status {
          ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
          ZINF_RETURN_IF_ERROR(engine.finalize());
          host_bytes[on_device] = engine.memory().host_bytes;
          return Status::ok();
        });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  }
  std::printf("host_bytes %llu with the shards in host memory, %llu on the device\n",
              static_cast<unsigned long long>(host_bytes[0]),
              static_cast<unsigned long long>(host_bytes[1]));
  EXPECT_EQ(host_bytes[0] - host_bytes[1], trainable_elements * 2);
}

}  // namespace
}  // namespace zinf
