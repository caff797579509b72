// Refusals that name the key the file holds and report no value it does not hold: "auto" on a key
// whose value zinf reads, and DeepSpeed's deprecated parameter-offload switch below stage 3.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "zinf/config.hpp"

namespace zinf {
namespace {

std::string refusal_of(const std::string& json) {
  Result<Config> c = parse_config(json);
  EXPECT_FALSE(c.is_ok()) << json;
  return c.is_ok() ? std::string() : std::string(c.status().message());
}

const KeyReport* report_of(const std::vector<KeyReport>& reports, const std::string& key) {
  for (const KeyReport& r : reports) {
    if (r.key == key) return &r;
  }
  return nullptr;
}

// These keys are accepted with no effect at one value (use_gds false, prescale_gradients false,
// communication_data_type "fp32" or null, gradient_predivide_factor 1.0) and refused at the
// others. "auto" is none of their values: DeepSpeed reads the string itself (a truthy
// use_gds / prescale_gradients, a dtype it refuses, a factor it cannot divide by), and zinf,
// with nothing to fill it in, refuses it instead of reporting a setting the file does not hold.
TEST(ConfigRefusalNames, AutoOnAKeyWhoseValueMattersIsRefused) {
  const struct {
    const char* json;
    const char* key;
  } cases[] = {
      {R"({"aio": {"use_gds": "auto"}})", "aio.use_gds"},
      {R"({"prescale_gradients": "auto"})", "prescale_gradients"},
      {R"({"communication_data_type": "auto"})", "communication_data_type"},
      {R"({"gradient_predivide_factor": "auto"})", "gradient_predivide_factor"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.json);
    const std::string message = refusal_of(c.json);
    EXPECT_EQ(message.rfind(fmt::format("{}: \"auto\" is a placeholder", c.key), 0), 0u) << message;
    Result<std::vector<KeyReport>> reports = check_config(c.json);
    ASSERT_TRUE(reports.is_ok()) << reports.status().to_string();
    const KeyReport* r = report_of(*reports, c.key);
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(r->use, KeyUse::kRefused) << r->why;
  }
}

// Where the value changes nothing, "auto" is one more such value; under zero_optimization (the
// stage aside) it is the field's default, as DeepSpeed's ZeRO config drops "auto", readers or not.
TEST(ConfigRefusalNames, AutoStaysAcceptedWhereNoValueMatters) {
  const char* json = R"({"steps_per_print": "auto", "wall_clock_breakdown": "auto",
      "aio": {"thread_count": "auto"},
      "zero_optimization": {"overlap_comm": "auto", "zero_quantized_weights": "auto",
                            "reduce_bucket_size": "auto"}})";
  Result<Config> c = parse_config(json);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->zero.reduce_bucket_size, Config{}.zero.reduce_bucket_size);
  Result<std::vector<KeyReport>> reports = check_config(json);
  ASSERT_TRUE(reports.is_ok()) << reports.status().to_string();
  for (const char* key :
       {"steps_per_print", "wall_clock_breakdown", "aio.thread_count",
        "zero_optimization.overlap_comm", "zero_optimization.zero_quantized_weights",
        "zero_optimization.reduce_bucket_size"}) {
    const KeyReport* r = report_of(*reports, key);
    ASSERT_NE(r, nullptr) << key;
    EXPECT_EQ(r->use, KeyUse::kNoEffect) << key << ": " << r->why;
  }
}

// cpu_offload_param (and its older spelling cpu_offload_params) true is offload_param.device
// "cpu", which needs stage 3: below it DeepSpeed ignores both, and zinf refuses both, as it
// refuses offload_param.device "cpu" there. The refusal names the switch the file holds, not
// zero_optimization.offload_param.device, which it does not.
TEST(ConfigRefusalNames, ParamOffloadSwitchBelowStage3IsRefusedNamingIt) {
  for (const char* name : {"cpu_offload_param", "cpu_offload_params"}) {
    for (int stage : {1, 2}) {
      SCOPED_TRACE(fmt::format("{} at stage {}", name, stage));
      const std::string json =
          fmt::format(R"({{"zero_optimization": {{"stage": {}, "{}": true}}}})", stage, name);
      const std::string message = refusal_of(json);
      EXPECT_EQ(message.rfind(fmt::format("zero_optimization.{}: true", name), 0), 0u) << message;
      EXPECT_NE(message.find(fmt::format("needs stage 3 (stage {}", stage)), std::string::npos)
          << message;
      Result<std::vector<KeyReport>> reports = check_config(json);
      ASSERT_TRUE(reports.is_ok()) << reports.status().to_string();
      const KeyReport* r = report_of(*reports, fmt::format("zero_optimization.{}", name));
      ASSERT_NE(r, nullptr);
      EXPECT_EQ(r->use, KeyUse::kRefused) << r->why;
      EXPECT_EQ(report_of(*reports, "zero_optimization.offload_param.device"), nullptr);

      // false asks for nothing, at any stage.
      Result<Config> off = parse_config(
          fmt::format(R"({{"zero_optimization": {{"stage": {}, "{}": false}}}})", stage, name));
      EXPECT_TRUE(off.is_ok()) << off.status().to_string();
    }
    // At stage 3 (written, or the default) it is read.
    Result<Config> on =
        parse_config(fmt::format(R"({{"zero_optimization": {{"stage": 3, "{}": true}}}})", name));
    ASSERT_TRUE(on.is_ok()) << on.status().to_string();
    EXPECT_EQ(on->zero.offload_param.device, OffloadDevice::kHost);
  }
}

}  // namespace
}  // namespace zinf
