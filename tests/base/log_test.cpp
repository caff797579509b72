// The log level from ZINF_LOG: a value that is no level is reported once on stderr, naming the
// value and the levels, whether or not the program ever logs. The checks run this test binary
// again as a child with ZINF_LOG set and read the child's stderr.
#include "zinf/log.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "plan/cli_test_util.hpp"

namespace zinf {
namespace {

// Runs this binary with `args` and ZINF_LOG=`level` (unset when null); returns its stderr.
std::string child_stderr(const char* level, const std::string& args) {
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string env =
      level == nullptr ? std::string("env -u ZINF_LOG") : fmt::format("env ZINF_LOG='{}'", level);
  const std::string cmd = fmt::format("{} '{}' {} 2>&1 >/dev/null", env, exe, args);
  std::string out;
  EXPECT_EQ(plan::run_command(cmd, &out), 0) << cmd << "\n" << out;
  return out;
}

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

constexpr const char* kWarning =
    "zinf warn: ZINF_LOG=verbose is not a log level (error, warn, info, debug); logging at warn\n";

// Many threads asking for the level at once all get the same one. Run as a child with a bad
// ZINF_LOG, it also shows the warning is written once, not once per thread that raced to read it.
TEST(Log, ThreadsAskingForTheLevelTogetherGetOne) {
  constexpr int kThreadCount = 8;
  std::vector<LogLevel> seen(kThreadCount);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreadCount; ++t) {
    threads.emplace_back([&seen, t] { seen[t] = log_level(); });
  }
  for (std::thread& t : threads) t.join();
  for (LogLevel level : seen) EXPECT_EQ(level, seen[0]);
}

// The program that never logs still says that ZINF_LOG was not understood: listing the tests
// logs nothing.
TEST(Log, UnknownLevelIsReportedOnceEvenWhenNothingIsLogged) {
  EXPECT_EQ(child_stderr("verbose", "--gtest_list_tests"), kWarning);
}

TEST(Log, UnknownLevelIsReportedOnceWhenThreadsLog) {
  const std::string err =
      child_stderr("verbose", "--gtest_filter=Log.ThreadsAskingForTheLevelTogetherGetOne");
  EXPECT_EQ(count_of(err, "ZINF_LOG"), 1u) << err;
  EXPECT_NE(err.find(kWarning), std::string::npos) << err;
}

TEST(Log, KnownOrEmptyLevelsAreNotReported) {
  for (const char* level : {"error", "warn", "warning", "info", "debug", ""}) {
    EXPECT_EQ(child_stderr(level, "--gtest_list_tests"), "") << "ZINF_LOG=" << level;
  }
  EXPECT_EQ(child_stderr(nullptr, "--gtest_list_tests"), "");
}

}  // namespace
}  // namespace zinf
