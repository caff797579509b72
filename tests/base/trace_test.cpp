#include "zinf/trace.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/assert.hpp"
#include "zinf/log.hpp"

namespace zinf {
namespace {

std::string temp_path(const char* name) {
  const char* dir = std::getenv("ZINF_TEST_TMPDIR");
  std::string base = dir ? dir : "/tmp";
  std::string cmd = "mkdir -p " + base;
  (void)std::system(cmd.c_str());
  return base + "/" + name;
}

TEST(Trace, WritesChromeJsonWithSpansAndTracks) {
  Trace trace;
  const int reads = trace.track("read");
  const int updates = trace.track("update");
  EXPECT_EQ(trace.track("read"), reads);  // same name, same track
  {
    auto a = trace.span(reads, "read group 0");
    auto b = trace.span(updates, "update group 0");
  }
  std::thread other([&] { auto c = trace.span(reads, "read group 1"); });
  other.join();
  Trace::Span disabled(nullptr, 0, "nothing");  // a null trace records nothing
  disabled.end();

  const std::string path = temp_path("trace_test.json");
  ASSERT_TRUE(trace.write_json(path).is_ok());
  std::ifstream in(path);
  nlohmann::json root = nlohmann::json::parse(in);  // throws (fails the test) if not JSON
  ASSERT_TRUE(root.contains("traceEvents"));
  std::map<int, std::string> track_names;
  std::multiset<std::pair<std::string, std::string>> spans;  // (track, name)
  for (const auto& e : root["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") {
      track_names[e["tid"].get<int>()] = e["args"]["name"].get<std::string>();
    }
  }
  for (const auto& e : root["traceEvents"]) {
    if (e["ph"] != "X") continue;
    EXPECT_GE(e["dur"].get<double>(), 0.0);
    EXPECT_GE(e["ts"].get<double>(), 0.0);
    spans.insert({track_names.at(e["tid"].get<int>()), e["name"].get<std::string>()});
  }
  std::multiset<std::pair<std::string, std::string>> expected = {
      {"read", "read group 0"}, {"update", "update group 0"}, {"read", "read group 1"}};
  EXPECT_EQ(spans, expected);
  std::remove(path.c_str());
}

TEST(Trace, BoundedNumberOfEvents) {
  Trace trace(3);
  const int t = trace.track("t");
  for (int i = 0; i < 10; ++i) trace.add(t, "e", 0, 10);
  EXPECT_EQ(trace.event_count(), 3u);
  EXPECT_EQ(trace.dropped_count(), 7u);
  auto root = nlohmann::json::parse(trace.to_json());
  EXPECT_EQ(root["metadata"]["dropped_events"].get<int>(), 7);
}

TEST(Trace, WriteErrorNamesPath) {
  Trace trace;
  Status s = trace.write_json("/nonexistent-dir/zinf/trace.json");
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.to_string().find("/nonexistent-dir/zinf/trace.json"), std::string::npos);
}

TEST(Log, LevelsParseAndFilter) {
  EXPECT_EQ(parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_EQ(parse_log_level("warning"), LogLevel::kWarn);
  EXPECT_FALSE(parse_log_level("loud").has_value());
  set_log_level(LogLevel::kError);
  testing::internal::CaptureStderr();
  log_warn("hidden {}", 1);
  log_error("shown {}", 2);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "zinf error: shown 2\n");
  set_log_level(LogLevel::kWarn);
}

TEST(AssertDeathTest, StaysOnInRelease) {
  EXPECT_DEATH(ZINF_ASSERT_MSG(1 + 1 == 3, "arithmetic"), "assertion failed.*arithmetic");
}

}  // namespace
}  // namespace zinf
