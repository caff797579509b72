#include <string>
#include <string_view>

#include "base/assert.hpp"
#include "targets.hpp"
#include "zinf/config.hpp"

namespace zinf::fuzz {

int config(const std::uint8_t* data, std::size_t bytes) {
  const std::string_view text(reinterpret_cast<const char*>(data), bytes);
  Result<Config> parsed = parse_config(text);
  if (!parsed.is_ok()) {
    // An error names what it refused; it never comes back empty.
    ZINF_ASSERT(!parsed.status().message().empty());
    return 0;
  }
  // What parses prints back to text that parses to the same config.
  const std::string printed = config_to_json(*parsed);
  Result<Config> again = parse_config(printed);
  ZINF_ASSERT_MSG(again.is_ok(), "config_to_json wrote a config parse_config refuses");
  ZINF_ASSERT_MSG(config_to_json(*again) == printed, "config does not round-trip");
  return 0;
}

}  // namespace zinf::fuzz
