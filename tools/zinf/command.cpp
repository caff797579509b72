#include "command.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <iostream>

namespace zinf::cli {
namespace {
int g_exit_code = 0;
}

std::vector<RegisteredCommand>& registered_commands() {
  static std::vector<RegisteredCommand> commands;
  return commands;
}

CommandRegistrar::CommandRegistrar(const char* name, CommandSetup setup) {
  registered_commands().push_back({name, setup});
}

CLI::App* group(CLI::App& app, const std::string& name, const std::string& description) {
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    if (sub->get_name() == name) return sub;
  }
  CLI::App* sub = app.add_subcommand(name, description);
  sub->require_subcommand(1);
  return sub;
}

void set_exit_code(int code) { g_exit_code = code; }
int exit_code() { return g_exit_code; }

void fail(std::string_view message) {
  std::fprintf(stderr, "zinf: %.*s\n", static_cast<int>(message.size()), message.data());
  set_exit_code(1);
}

void Table::print() const {
  std::vector<std::size_t> widths(headers_.size(), 0);
  for (std::size_t c = 0; c < headers_.size(); ++c) widths[c] = headers_[c].size();
  for (const auto& row : rows_) {
    for (std::size_t c = 0; c < row.size() && c < widths.size(); ++c) {
      widths[c] = std::max(widths[c], row[c].size());
    }
  }
  auto print_row = [&](const std::vector<std::string>& row) {
    std::string line;
    for (std::size_t c = 0; c < widths.size(); ++c) {
      const std::string cell = c < row.size() ? row[c] : "";
      if (c == 0) {
        line += fmt::format("{:<{}}", cell, widths[c]);
      } else {
        line += fmt::format("  {:>{}}", cell, widths[c]);
      }
    }
    std::cout << line << '\n';
  };
  print_row(headers_);
  std::size_t total = 0;
  for (std::size_t w : widths) total += w + 2;
  std::cout << std::string(total > 2 ? total - 2 : total, '-') << '\n';
  for (const auto& row : rows_) print_row(row);
  std::cout.flush();
}

void print_json(const nlohmann::json& object) { std::cout << object.dump() << std::endl; }

bool parse_size(std::string_view text, std::size_t* bytes, bool decimal) {
  std::size_t i = 0;
  double value = 0;
  bool any_digit = false;
  double fraction_scale = 0;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      any_digit = true;
      if (fraction_scale > 0) {
        value += (c - '0') * fraction_scale;
        fraction_scale /= 10;
      } else {
        value = value * 10 + (c - '0');
      }
    } else if (c == '.' && fraction_scale == 0) {
      fraction_scale = 0.1;
    } else {
      break;
    }
  }
  if (!any_digit) return false;
  std::string suffix(text.substr(i));
  for (char& c : suffix) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double multiplier = 1;
  const double k = decimal ? 1e3 : 1024.0;
  if (suffix.empty()) {
    multiplier = 1;
  } else if (suffix == "b") {
    // A count's "7B" is 7 billion (as model names and train_lm --params write it); a size's
    // is 7 bytes.
    multiplier = decimal ? 1e9 : 1;
  } else if (suffix == "k" || suffix == "kib" || suffix == "kb") {
    multiplier = suffix == "kb" ? 1e3 : k;
  } else if (suffix == "m" || suffix == "mib" || suffix == "mb") {
    multiplier = suffix == "mb" ? 1e6 : k * k;
  } else if (suffix == "g" || suffix == "gib" || suffix == "gb") {
    multiplier = suffix == "gb" ? 1e9 : k * k * k;
  } else if (suffix == "t" || suffix == "tib" || suffix == "tb") {
    multiplier = suffix == "tb" ? 1e12 : k * k * k * k;
  } else {
    return false;
  }
  if (suffix == "kib" || suffix == "mib" || suffix == "gib" || suffix == "tib") {
    // An explicit binary unit is binary even for counts.
    multiplier = suffix == "kib"   ? 1024.0
                 : suffix == "mib" ? 1048576.0
                 : suffix == "gib" ? 1073741824.0
                                   : 1099511627776.0;
  }
  // A size beyond 64 bits is refused (converting it would be undefined behaviour).
  const double rounded = value * multiplier + 0.5;
  if (!(rounded < 18446744073709551616.0)) return false;  // 2^64
  *bytes = static_cast<std::size_t>(rounded);
  return true;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) {
    bytes /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[unit]);
}

}  // namespace zinf::cli
