// `zinf io bench`, `zinf io tune` and `zinf config check` given what a user may type by mistake:
// a zero block, no bytes, a file smaller than the sweep's filler writes, a directory for a
// config, a config with a NUL byte in it. Each is refused with exit 1 and a line naming the
// option, the path or the offset, or (io tune's file size) raised to what the sweep needs; none
// ends the process on a signal. Runs the zinf binary of the same build; skips when it is absent.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "cli_test_util.hpp"
#include "common/scratch_dir.hpp"
#include "zinf/config.hpp"

namespace zinf::plan {
namespace {

namespace fs = std::filesystem;

class IoConfigCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (zinf_binary().empty()) GTEST_SKIP() << "bin/zinf is not built: build target zinf_cli";
  }
  test::ScratchDir scratch_{"io_config_cli"};
  const fs::path dir_{scratch_.path()};
};

// A zero block was a division by zero (SIGFPE, exit 136); no bytes failed in fallocate.
TEST_F(IoConfigCli, BenchRefusesAZeroBlockAndNoBytesNamingThem) {
  std::string out;
  EXPECT_EQ(run_command(zinf_binary() + " io bench --path " + dir_.string() +
                            " --bytes 1MiB --block 0 2>&1",
                        &out),
            1)
      << out;
  EXPECT_NE(out.find("--block 0: not a multiple of 4KiB"), std::string::npos) << out;
  EXPECT_EQ(run_command(zinf_binary() + " io bench --path " + dir_.string() +
                            " --bytes 1MiB --block 6KiB 2>&1",
                        &out),
            1)
      << out;
  EXPECT_NE(out.find("--block 6KiB"), std::string::npos) << out;
  EXPECT_EQ(
      run_command(zinf_binary() + " io bench --path " + dir_.string() + " --bytes 0 2>&1", &out), 1)
      << out;
  EXPECT_NE(out.find("--bytes 0"), std::string::npos) << out;
}

// The sweep's file is written first by requests of 4 MiB; a smaller --file-bytes failed with
// "1048576 bytes is less than one block of 4194304", naming no option. It is raised instead.
TEST_F(IoConfigCli, TuneRaisesASmallFileToWhatItsFillerWrites) {
  std::string out;
  const fs::path result = dir_ / "tune.json";
  EXPECT_EQ(run_command(zinf_binary() + " io tune --path " + dir_.string() +
                            " --blocks 64KiB --depths 1 --rings 1 --seconds 0.05 --file-bytes "
                            "1MiB --out " +
                            result.string() + " 2>&1",
                        &out),
            0)
      << out;
  std::ifstream saved(result);
  const std::string text((std::istreambuf_iterator<char>(saved)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"best\""), std::string::npos) << text;
}

// A directory opens and reads as nothing: it was reported as JSON that ends too early.
TEST_F(IoConfigCli, ConfigCheckOfADirectorySaysSo) {
  std::string out;
  EXPECT_EQ(run_command(zinf_binary() + " config check " + dir_.string() + " 2>&1", &out), 1)
      << out;
  EXPECT_NE(out.find("Is a directory"), std::string::npos) << out;
  EXPECT_NE(out.find(dir_.string()), std::string::npos) << out;
}

// The parser took a NUL byte for the end of the text and accepted the "{}" before it, leaving out
// the stage 9 after it.
TEST_F(IoConfigCli, ANulByteInAConfigIsRefusedNamingItsOffset) {
  const std::string text = std::string("{}") + '\0' + R"({"zero_optimization": {"stage": 9}})";
  const fs::path file = dir_ / "nul.json";
  std::ofstream(file, std::ios::binary) << text;
  std::string out;
  EXPECT_EQ(run_command(zinf_binary() + " config check " + file.string() + " 2>&1", &out), 1)
      << out;
  EXPECT_NE(out.find("a NUL byte at offset 2 of " + std::to_string(text.size())), std::string::npos)
      << out;
  Result<Config> parsed = parse_config(text);
  ASSERT_FALSE(parsed.is_ok());
  EXPECT_EQ(parsed.status().code(), Code::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("NUL byte at offset 2"), std::string_view::npos)
      << parsed.status().to_string();
}

}  // namespace
}  // namespace zinf::plan
