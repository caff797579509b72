// Logging through fmt, to stderr, filtered by a level.
//
// The level comes from the environment variable ZINF_LOG (error, warn, info, debug; default
// warn) the first time it is needed, and can be changed with set_log_level(). Each line is
// "zinf <level>: <message>". Thread-safety: all functions may be called from any thread; lines
// from different threads do not interleave.
#pragma once

#include <fmt/format.h>

#include <optional>
#include <string_view>
#include <utility>

namespace zinf {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

LogLevel log_level();
void set_log_level(LogLevel level);
// Parses "error", "warn"/"warning", "info", "debug".
std::optional<LogLevel> parse_log_level(std::string_view text);
// Writes one line if `level` is enabled.
void log_line(LogLevel level, std::string_view message);

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (static_cast<int>(level) > static_cast<int>(log_level())) return;
  log_line(level, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void log_error(fmt::format_string<Args...> format, Args&&... args) {
  log(LogLevel::kError, format, std::forward<Args>(args)...);
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> format, Args&&... args) {
  log(LogLevel::kWarn, format, std::forward<Args>(args)...);
}
template <typename... Args>
void log_info(fmt::format_string<Args...> format, Args&&... args) {
  log(LogLevel::kInfo, format, std::forward<Args>(args)...);
}
template <typename... Args>
void log_debug(fmt::format_string<Args...> format, Args&&... args) {
  log(LogLevel::kDebug, format, std::forward<Args>(args)...);
}

}  // namespace zinf
