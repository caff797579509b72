// Input layout: three lines (the --params text, --layers, --hidden), then JSON text that is read
// both as a machine profile and as a plan config.
#include <charconv>
#include <string>
#include <string_view>

#include "base/assert.hpp"
#include "plan/config.hpp"
#include "plan/model.hpp"
#include "plan/profile.hpp"
#include "targets.hpp"
#include "zinf/command.hpp"

namespace zinf::fuzz {
namespace {

std::string_view next_line(std::string_view* text) {
  const std::size_t end = text->find('\n');
  const std::string_view line = text->substr(0, end);
  text->remove_prefix(end == std::string_view::npos ? text->size() : end + 1);
  return line;
}

std::uint64_t to_u64(std::string_view text) {
  std::uint64_t value = 0;
  std::from_chars(text.data(), text.data() + text.size(), value);
  return value;
}

}  // namespace

int plan_input(const std::uint8_t* data, std::size_t bytes) {
  std::string_view text(reinterpret_cast<const char*>(data), bytes);
  const std::string_view params_text = next_line(&text);
  const std::uint64_t layers = to_u64(next_line(&text));
  const std::uint64_t hidden = to_u64(next_line(&text));

  (void)plan::find_model_preset(params_text);
  std::size_t params = 0;
  // What `zinf plan --params P --layers L --hidden H` accepts, it must be able to describe.
  if (cli::parse_size(params_text, &params, /*decimal=*/true) && layers > 0 && hidden > 0) {
    const plan::ModelShape model = plan::custom_model(params, layers, hidden);
    (void)plan::param_count(model);
    (void)plan::largest_tensor_params(model);
    (void)plan::layer_params(model);
    (void)plan::small_tensor_params(model);
  }

  plan::MachineProfile profile;
  (void)plan::parse_machine_profile(text, "fuzz.json", 1 << 20, 32, &profile);
  Result<plan::PlanConfig> config = plan::config_from_json(text);
  if (config.is_ok()) {
    const std::string printed = plan::config_to_json(*config);
    Result<plan::PlanConfig> again = plan::config_from_json(printed);
    ZINF_ASSERT_MSG(again.is_ok(), "plan::config_to_json wrote a config it refuses");
    ZINF_ASSERT_MSG(plan::config_to_json(*again) == printed, "plan config does not round-trip");
  }
  return 0;
}

}  // namespace zinf::fuzz
