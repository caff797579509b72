#include "zinf/log.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace zinf {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_level{kUnset};
std::mutex g_write_mutex;

std::atomic<bool> g_warned_env{false};

// The level ZINF_LOG names; warn when it is unset or empty. A value that is no level is reported,
// naming it and the levels, by the first call only: threads that read the level together, and
// the read at start-up below followed by the one at the first log line, write one warning.
int level_from_env() {
  const char* text = std::getenv("ZINF_LOG");
  if (text != nullptr && *text != '\0') {
    if (auto level = parse_log_level(text)) return static_cast<int>(*level);
    if (!g_warned_env.exchange(true)) {
      std::fprintf(stderr,
                   "zinf warn: ZINF_LOG=%s is not a log level (error, warn, info, debug); logging "
                   "at warn\n",
                   text);
    }
  }
  return static_cast<int>(LogLevel::kWarn);
}

// Checks ZINF_LOG when the program starts, so that a value that is no level is reported by a
// program that never logs, or sets its level itself, too; not silently ignored. The level itself
// is still read the first time it is needed (log_level()).
[[maybe_unused]] const int g_level_from_env_at_start = level_from_env();

const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "error";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kDebug:
      return "debug";
  }
  return "?";
}

}  // namespace

LogLevel log_level() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level == kUnset) {
    int expected = kUnset;
    g_level.compare_exchange_strong(expected, level_from_env());
    level = g_level.load(std::memory_order_relaxed);
  }
  return static_cast<LogLevel>(level);
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }

std::optional<LogLevel> parse_log_level(std::string_view text) {
  if (text == "error") return LogLevel::kError;
  if (text == "warn" || text == "warning") return LogLevel::kWarn;
  if (text == "info") return LogLevel::kInfo;
  if (text == "debug") return LogLevel::kDebug;
  return std::nullopt;
}

void log_line(LogLevel level, std::string_view message) {
  if (static_cast<int>(level) > static_cast<int>(log_level())) return;
  std::lock_guard<std::mutex> lock(g_write_mutex);
  std::fprintf(stderr, "zinf %s: %.*s\n", level_name(level), static_cast<int>(message.size()),
               message.data());
}

}  // namespace zinf
