// Config against DeepSpeed's own reader: each case cites the DeepSpeed source whose behaviour it
// pins (deepspeed/runtime/config.py, config_utils.py, precision_config.py, zero/config.py,
// zero/offload_config.py). A key is used with DeepSpeed's meaning, accepted with no effect, or
// refused naming it; never read with another meaning.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "zinf/config.hpp"

namespace zinf {
namespace {

// The message of parse_config's refusal of `text`; fails the test when it is accepted.
std::string refusal(const std::string& text) {
  Result<Config> c = parse_config(text);
  EXPECT_FALSE(c.is_ok()) << text;
  if (c.is_ok()) return "";
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << text;
  return std::string(c.status().message());
}

// DeepSpeed asserts both counts are above 0 (config.py, _batch_assertion and _do_error_check).
TEST(ConfigDeepSpeed, ZeroMicroBatchOrAccumulationStepsAreRefused) {
  EXPECT_EQ(refusal(R"({"gradient_accumulation_steps": 0})")
                .rfind("gradient_accumulation_steps: 0 is below 1", 0),
            0u);
  EXPECT_EQ(refusal(R"({"train_micro_batch_size_per_gpu": 0})")
                .rfind("train_micro_batch_size_per_gpu: 0 is below 1", 0),
            0u);
}

// DeepSpeed passes offload_param only to its stage-3 optimizer (runtime/engine.py,
// _configure_zero_optimizer; zero/offload_config.py: "Valid only with stage 3"), so at stages 1
// and 2 it silently asks for nothing. zinf refuses it there, and the message says so.
TEST(ConfigDeepSpeed, OffloadParamBelowStage3IsRefusedSayingDeepSpeedIgnoresIt) {
  const std::string message = refusal(R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})");
  EXPECT_EQ(message.rfind("zero_optimization.offload_param.device: \"cpu\" needs stage 3", 0), 0u)
      << message;
  EXPECT_NE(message.find("DeepSpeed ignores offload_param below stage 3"), std::string::npos)
      << message;
  Result<Config> none =
      parse_config(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "none"}}})");
  EXPECT_TRUE(none.is_ok()) << none.status().to_string();
}

}  // namespace
}  // namespace zinf
