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

// DeepSpeed loads a config file with object_pairs_hook=dict_raise_error_on_duplicate_keys
// (config.py, DeepSpeedConfig.__init__; config_utils.py): a key given twice in one object is an
// error, not "the last one wins".
TEST(ConfigDeepSpeed, DuplicateKeysAreRefusedNamingTheKey) {
  const std::string message = refusal(R"({"zero_optimization": {"stage": 1, "stage": 3}})");
  EXPECT_EQ(message.rfind("zero_optimization.stage: ", 0), 0u) << message;
  EXPECT_NE(message.find("twice"), std::string::npos) << message;
  // At the root too.
  EXPECT_EQ(refusal(R"({"gradient_clipping": 1.0, "steps_per_print": 1, "gradient_clipping": 0})")
                .rfind("gradient_clipping: ", 0),
            0u);
  // The same key in two different objects is no duplicate.
  Result<Config> c = parse_config(
      R"({"fp16": {"enabled": false}, "bf16": {"enabled": true}, "zero_optimization": {}})");
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
}

// A deprecated key and the key that replaces it may not be given together (config_utils.py,
// _process_deprecated_field: "Cannot provide deprecated parameter ... and replacing parameter
// ... together"); zinf refused neither, and the later one in the file won.
TEST(ConfigDeepSpeed, DeprecatedKeyWithItsReplacementIsRefused) {
  const struct {
    const char* json;
    const char* key;
  } cases[] = {
      {R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                                 "cpu_offload": true}})",
       "zero_optimization.cpu_offload"},
      {R"({"zero_optimization": {"cpu_offload": false, "offload_optimizer": {"device": "cpu"}}})",
       "zero_optimization.offload_optimizer"},
      {R"({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/x"},
                                 "cpu_offload_param": true}})",
       "zero_optimization.cpu_offload_param"},
      {R"({"zero_optimization": {"cpu_offload_params": true, "offload_param": {"device": "cpu"}}})",
       "zero_optimization.offload_param"},
      {R"({"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true,
                                 "stage3_gather_fp16_weights_on_model_save": true}})",
       "zero_optimization.stage3_gather_fp16_weights_on_model_save"},
  };
  for (const auto& c : cases) {
    const std::string message = refusal(c.json);
    EXPECT_EQ(message.rfind(fmt::format("{}: ", c.key), 0), 0u) << message;
    EXPECT_NE(message.find("together"), std::string::npos) << message;
  }
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
