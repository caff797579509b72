#include "base/size_text.hpp"

#include <cctype>
#include <charconv>
#include <cmath>
#include <string>
#include <system_error>

namespace zinf {
namespace {

// The multiple of a unit (see the header's table), nullopt for an unknown one.
std::optional<double> unit_multiple(std::string_view unit, bool decimal) {
  std::string u(unit);
  for (char& c : u) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (u.empty()) return 1.0;
  // A count's "7B" is 7 billion (as model names and train_lm --params write it); a size's is 7
  // bytes.
  if (u == "b") return decimal ? 1e9 : 1.0;
  constexpr std::string_view kPrefixes = "kmgt";
  const std::size_t power = kPrefixes.find(u[0]);
  if (power == std::string_view::npos) return std::nullopt;
  constexpr double kThousands[] = {1e3, 1e6, 1e9, 1e12};
  constexpr double kBinary[] = {1024.0, 1048576.0, 1073741824.0, 1099511627776.0};
  const double thousands = kThousands[power];
  const double binary = kBinary[power];
  const std::string_view rest = std::string_view(u).substr(1);
  if (rest.empty()) return decimal ? thousands : binary;
  if (rest == "b") return thousands;
  // An explicit binary unit is binary for counts too.
  if (rest == "ib") return binary;
  return std::nullopt;
}

}  // namespace

std::optional<double> parse_scaled(std::string_view text, bool decimal) {
  std::size_t i = 0;
  bool any_digit = false;
  bool point = false;
  bool integer_part_nonzero = false;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      any_digit = true;
      if (!point && c != '0') integer_part_nonzero = true;
    } else if (c == '.' && !point) {
      point = true;
    } else {
      break;
    }
  }
  if (!any_digit) return std::nullopt;
  const std::optional<double> multiple = unit_multiple(text.substr(i), decimal);
  if (!multiple) return std::nullopt;
  double value = 0;
  const auto [end, error] =
      std::from_chars(text.data(), text.data() + i, value, std::chars_format::fixed);
  if (error == std::errc::result_out_of_range) {
    // Past the double's range (hundreds of digits), or a fraction below its smallest value.
    value = integer_part_nonzero ? HUGE_VAL : 0.0;
  } else if (error != std::errc{} || end != text.data() + i) {
    return std::nullopt;
  }
  return value * *multiple;
}

bool parse_size(std::string_view text, std::uint64_t* out, bool decimal) {
  const std::optional<double> value = parse_scaled(text, decimal);
  if (!value) return false;
  const double rounded = std::floor(*value + 0.5);
  if (!(rounded < 18446744073709551616.0)) return false;  // 2^64
  *out = static_cast<std::uint64_t>(rounded);
  return true;
}

}  // namespace zinf
