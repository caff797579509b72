// The batch counts of a Config built in code (the fields set, the reader's *_given flags not):
// DeepSpeed's arithmetic train_batch_size = train_micro_batch_size_per_gpu x
// gradient_accumulation_steps x world size keeps counts the program set and refuses three that
// disagree, naming the keys; config_to_json() writes the counts so that the file read back
// holds them.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zinf/config.hpp"
#include "zinf/engine.hpp"
#include "zinf/run_local.hpp"

namespace zinf {
namespace {

// micro 4 x steps 2 x 2 ranks = 16, set as a program sets them.
Config code_config(std::size_t train_batch_size) {
  Config c;
  c.train_batch_size = train_batch_size;
  c.train_micro_batch_size_per_gpu = 4;
  c.gradient_accumulation_steps = 2;
  return c;
}

TEST(ConfigBatchCode, ConsistentCountsSetInCodeAreKept) {
  Config c = code_config(16);
  ASSERT_TRUE(validate(c).is_ok());
  const Status s = resolve_batch_sizes(2, &c);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4u);
  EXPECT_EQ(c.gradient_accumulation_steps, 2u);
  EXPECT_EQ(c.train_batch_size, 16u);

  // The same with zinf.world_size set: validate() resolves at it.
  Config sized = code_config(16);
  sized.world_size = 2;
  EXPECT_TRUE(validate(sized).is_ok());
}

// A count set in code with the other left at its default: the other is derived, as DeepSpeed
// derives a missing key (16 / 4 / 2 ranks = 2 steps; 16 / 2 ranks / 4 steps = micro 2).
TEST(ConfigBatchCode, OneCountSetInCodeDerivesTheOther) {
  Config micro;
  micro.train_batch_size = 16;
  micro.train_micro_batch_size_per_gpu = 4;
  ASSERT_TRUE(resolve_batch_sizes(2, &micro).is_ok());
  EXPECT_EQ(micro.gradient_accumulation_steps, 2u);

  Config steps;
  steps.train_batch_size = 16;
  steps.gradient_accumulation_steps = 4;
  ASSERT_TRUE(resolve_batch_sizes(2, &steps).is_ok());
  EXPECT_EQ(steps.train_micro_batch_size_per_gpu, 2u);

  // Neither: micro-batches of train_batch_size / world, one step.
  Config neither;
  neither.train_batch_size = 16;
  ASSERT_TRUE(resolve_batch_sizes(2, &neither).is_ok());
  EXPECT_EQ(neither.train_micro_batch_size_per_gpu, 8u);
  EXPECT_EQ(neither.gradient_accumulation_steps, 1u);
}

TEST(ConfigBatchCode, DisagreeingCountsSetInCodeAreRefusedNamingTheKeys) {
  Config c = code_config(10);  // 4 x 2 x 2 = 16, not 10
  const Status s = resolve_batch_sizes(2, &c);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  const std::string message(s.message());
  EXPECT_EQ(message.rfind("train_batch_size: 10 is not", 0), 0u) << message;
  EXPECT_NE(message.find("train_micro_batch_size_per_gpu 4"), std::string::npos) << message;
  EXPECT_NE(message.find("gradient_accumulation_steps 2"), std::string::npos) << message;
  EXPECT_NE(message.find("(16)"), std::string::npos) << message;

  Config sized = code_config(10);
  sized.world_size = 2;
  const Status v = validate(sized);
  ASSERT_FALSE(v.is_ok());
  EXPECT_EQ(std::string(v.message()).rfind("train_batch_size: 10 is not", 0), 0u) << v.to_string();
}

TEST(ConfigBatchCode, WrittenAndReadBackKeepsTheCounts) {
  const Config c = code_config(16);
  const std::string json = config_to_json(c);
  Result<Config> back = parse_config(json);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string() << "\n" << json;
  EXPECT_EQ(back->train_batch_size, 16u);
  EXPECT_EQ(back->train_micro_batch_size_per_gpu, 4u) << json;
  EXPECT_EQ(back->gradient_accumulation_steps, 2u) << json;
  Config resolved = *back;
  ASSERT_TRUE(resolve_batch_sizes(2, &resolved).is_ok());
  EXPECT_EQ(resolved.train_micro_batch_size_per_gpu, 4u);
  EXPECT_EQ(resolved.gradient_accumulation_steps, 2u);

  // Counts at their defaults beside train_batch_size stay unwritten, so that the file read back
  // derives them as this config would.
  Config only_total;
  only_total.train_batch_size = 16;
  const std::string total_json = config_to_json(only_total);
  EXPECT_EQ(total_json.find("train_micro_batch_size_per_gpu"), std::string::npos) << total_json;
  EXPECT_EQ(total_json.find("gradient_accumulation_steps"), std::string::npos) << total_json;
}

// The engine of two ranks opened from that Config keeps micro-batches of 4 and 2 accumulation
// steps (its config() reads them back; the counts are what this checks) and steps after 2
// micro-batches.
TEST(ConfigBatchCode, EngineKeepsTheCountsAndStepsAfterThem) {
  Config c = code_config(16);
  c.zero.offload_optimizer.device = OffloadDevice::kHost;
  c.zero.stage3_param_persistence_threshold = 0;
  std::vector<std::size_t> micro(2), steps(2);
  const Status s = run_local(2, c, [&](Engine& e, int rank) -> Status {
    constexpr std::size_t kElements = 512;
    std::vector<float> init(kElements), grad(kElements);
    std::uint64_t x = 0x2545f4914f6cdd1dull;  // seed
    for (std::size_t i = 0; i < kElements; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      init[i] = static_cast<float>(static_cast<double>(x >> 11) / 9007199254740992.0 - 0.5);
      grad[i] = init[i] + 0.25f;
    }
    ParameterSpec spec;
    spec.name = "w";
    spec.module = "layer";
    spec.shape = {kElements};
    spec.dtype = DType::kF32;
    spec.initial_values = init.data();
    ZINF_RETURN_IF_ERROR(e.register_parameter(spec));
    ZINF_RETURN_IF_ERROR(e.finalize());
    micro[static_cast<std::size_t>(rank)] = e.config().train_micro_batch_size_per_gpu;
    steps[static_cast<std::size_t>(rank)] = e.config().gradient_accumulation_steps;
    for (int m = 0; m < 2; ++m) {
      ZINF_RETURN_IF_ERROR(e.gather("layer"));
      const GradientRef refs[] = {{"w", grad.data(), kElements, DType::kF32}};
      ZINF_RETURN_IF_ERROR(e.reduce_gradients("layer", refs));
      ZINF_RETURN_IF_ERROR(e.release("layer"));
    }
    return e.step().status();
  });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(micro, (std::vector<std::size_t>{4, 4}));
  EXPECT_EQ(steps, (std::vector<std::size_t>{2, 2}));
}

}  // namespace
}  // namespace zinf
