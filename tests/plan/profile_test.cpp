// Measuring now: the small disk and memory measurements the planner falls back on when no
// profile is saved. They must give plausible rates and leave nothing behind.
#include "plan/profile.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace zinf::plan {
namespace {

namespace fs = std::filesystem;

// An empty scratch directory for this test, named after it: ctest runs the tests of this file
// as processes side by side, and one's directory must not be another's.
std::string scratch_dir() {
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/plan_profile_test_" +
                          ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  fs::create_directories(dir);
  return dir;
}

TEST(MeasureDisk, GivesRatesAndRemovesItsFile) {
  const std::string dir = scratch_dir();
  Result<DiskRates> rates = measure_disk(dir, std::uint64_t{16} << 20, 1 << 20, 2);
  if (!rates.is_ok() && rates.status().code() == Code::kUnsupported) {
    // tmpfs and some overlay filesystems refuse O_DIRECT: the message must say what to do.
    EXPECT_NE(rates.status().message().find("--nvme-read-gbps"), std::string_view::npos)
        << rates.status().to_string();
    GTEST_SKIP() << "O_DIRECT refused in " << dir << ": " << rates.status().to_string();
  }
  ASSERT_TRUE(rates.is_ok()) << rates.status().to_string();
  // Anything from a slow network disk (0.01 GB/s) to a fast array (100 GB/s) is plausible; a
  // zero or an absurd figure means the timing is broken.
  EXPECT_GT(rates->read_gbps, 0.01);
  EXPECT_GT(rates->write_gbps, 0.01);
  EXPECT_LT(rates->read_gbps, 100);
  EXPECT_LT(rates->write_gbps, 100);
  // The swap file (zinf-plan-disk-<pid>.bin) is gone; nothing else was there.
  for (const auto& entry : fs::directory_iterator(dir)) {
    ADD_FAILURE() << "left behind: " << entry.path();
  }
}

TEST(MeasureDisk, RejectsUnalignedBlocksAndNamesAMissingDirectory) {
  EXPECT_EQ(measure_disk(scratch_dir(), 1 << 20, 1000, 1).status().code(), Code::kInvalidArgument);
  const Status missing = measure_disk("/nonexistent/zinf-plan", 1 << 20, 1 << 20, 1).status();
  EXPECT_FALSE(missing.is_ok());
  EXPECT_NE(missing.message().find("/nonexistent/zinf-plan"), std::string_view::npos)
      << missing.to_string();
}

TEST(MeasureMemory, AdamPatternBandwidthIsPlausible) {
  const double gbps = measure_adam_gbps(std::uint64_t{16} << 20, 1);
  EXPECT_GT(gbps, 0.5);
  EXPECT_LT(gbps, 5000);
}

// Sets an environment variable for the scope, restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    had_ = std::getenv(name) != nullptr;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(ProfilePaths, EnvironmentOverridesTheDefaults) {
  {
    ScopedEnv a("ZINF_MACHINE_PROFILE", "/x/machine.json");
    ScopedEnv b("ZINF_IO_TUNE_FILE", "/x/io.json");
    EXPECT_EQ(default_profile_path(), "/x/machine.json");
    EXPECT_EQ(default_io_tune_path(), "/x/io.json");
  }
  ScopedEnv a("ZINF_MACHINE_PROFILE", nullptr);
  ScopedEnv b("ZINF_IO_TUNE_FILE", nullptr);
  ScopedEnv c("XDG_CACHE_HOME", "/cache");
  EXPECT_EQ(default_profile_path(), "/cache/zinf/machine.json");
  EXPECT_EQ(default_io_tune_path(), "/cache/zinf/io-tune.json");
}

}  // namespace
}  // namespace zinf::plan
