#include "zinf/config.hpp"

#include <string>
#include <string_view>

#include "base/assert.hpp"
#include "targets.hpp"

namespace zinf::fuzz {

int config(const std::uint8_t* data, std::size_t bytes) {
  const std::string_view text(reinterpret_cast<const char*>(data), bytes);
  Result<Config> parsed = parse_config(text);
  // `zinf config check` agrees with parse_config(): no key refused where it parses, and the key
  // parse_config() names refused where it does not (unless the text is no JSON object, which
  // both refuse).
  Result<std::vector<KeyReport>> reports = check_config(text);
  bool any_refused = false;
  if (reports.is_ok()) {
    for (const KeyReport& r : *reports) any_refused = any_refused || r.use == KeyUse::kRefused;
  }
  if (!parsed.is_ok()) {
    // An error names what it refused; it never comes back empty.
    ZINF_ASSERT(!parsed.status().message().empty());
    const std::string message(parsed.status().message());
    if (reports.is_ok()) {
      bool named = false;
      for (const KeyReport& r : *reports) {
        named = named || (r.use == KeyUse::kRefused && message.starts_with(r.key + ": "));
      }
      ZINF_ASSERT_MSG(named, "check_config does not refuse the key parse_config names");
    }
    return 0;
  }
  ZINF_ASSERT_MSG(reports.is_ok() && !any_refused,
                  "check_config refuses a key of a config parse_config accepts");
  // What parses prints back to text that parses to the same config.
  const std::string printed = config_to_json(*parsed);
  Result<Config> again = parse_config(printed);
  ZINF_ASSERT_MSG(again.is_ok(), "config_to_json wrote a config parse_config refuses");
  ZINF_ASSERT_MSG(config_to_json(*again) == printed, "config does not round-trip");
  return 0;
}

}  // namespace zinf::fuzz
