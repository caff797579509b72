// parse_checkpoint_manifest_summary (what a save reads of each tag it lists: tag, serial, step)
// against parse_checkpoint_manifest (what a load reads): the summary passes over most of the
// manifest without building it, and claims the full parser's checks of the checksum, format,
// version, "tag", "serial" and "step" with the same errors. Each damaged text below goes to both
// and must give the same status code and the same message; an intact one must give the full
// parser's tag, serial and step.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"

namespace zinf {
namespace {

// `text` with its (first) checksum's digits made those of its xxh3-64 with them as zeros, as
// save_checkpoint stamps a manifest: a hand edit that also fixed the checksum.
std::string restamp(std::string text) {
  const std::string key = "\"checksum\": \"";
  const std::size_t at = text.find(key) + key.size();
  text.replace(at, 16, std::string(16, '0'));
  text.replace(at, 16, fmt::format("{:016x}", XXH3_64bits(text.data(), text.size())));
  return text;
}

// Manifest `j` as save_checkpoint lays it out, with a correct checksum.
std::string summary_stamp(const nlohmann::json& j) { return restamp(j.dump(1) + "\n"); }

struct Damaged {
  const char* name;
  std::string text;
  Code code;  // what both parsers must return
};

TEST(CheckpointSummary, DamagedManifestsGiveTheFullParsersErrors) {
  engine_test::ScratchDir tmp("ckpt-summary");
  const std::string dir = tmp.path() + "/ckpt";
  const engine_test::Model model = engine_test::make_model(DType::kF32, 9127);
  const Config config =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, tmp.path());
  const Status saved = engine_test::train_and_save(config, model, 1, 3, dir, "t");
  ASSERT_TRUE(saved.is_ok()) << saved.to_string();
  const std::string path = dir + "/t/manifest.json";
  const std::string text = engine_test::read_file(path);
  const nlohmann::json original = nlohmann::json::parse(text);
  ASSERT_TRUE(original.at("params").is_array() && !original.at("params").empty());

  std::vector<Damaged> cases;
  {
    // One digit of the stored checksum changed.
    std::string t = text;
    const std::size_t at = t.find("\"checksum\": \"") + std::string("\"checksum\": \"").size();
    t[at] = t[at] == '0' ? '1' : '0';
    cases.push_back({"flipped checksum digit", t, Code::kCorruption});
  }
  {
    nlohmann::json j = original;
    j["version"] = 99;
    cases.push_back({"version 99", summary_stamp(j), Code::kInvalidArgument});
  }
  {
    nlohmann::json j = original;
    j["tag"] = 5;
    cases.push_back({"tag 5", summary_stamp(j), Code::kCorruption});
  }
  {
    nlohmann::json j = original;
    j["step"] = -4;
    cases.push_back({"negative step", summary_stamp(j), Code::kCorruption});
  }
  cases.push_back({"top-level array", restamp("[" + text + "]\n"), Code::kCorruption});
  cases.push_back({"trailing garbage", restamp(text + "}x\n"), Code::kCorruption});

  for (const Damaged& c : cases) {
    SCOPED_TRACE(c.name);
    const Result<CheckpointManifest> full = parse_checkpoint_manifest(c.text, path);
    const Result<CheckpointTagSummary> summary = parse_checkpoint_manifest_summary(c.text, path);
    ASSERT_FALSE(full.is_ok());
    ASSERT_FALSE(summary.is_ok());
    EXPECT_EQ(full.status().code(), c.code) << full.status().to_string();
    EXPECT_EQ(summary.status().code(), full.status().code()) << summary.status().to_string();
    EXPECT_EQ(summary.status().message(), full.status().message());
    EXPECT_NE(summary.status().message().find(path), std::string_view::npos);
  }
}

// A "tag", "serial" and "step" nested in a parameter's entry ("params" sorts, and is written,
// before the top-level keys) are not the manifest's: the summary takes the top-level ones, as
// the full parser does.
TEST(CheckpointSummary, NestedKeysBeforeTheTopLevelOnesAreNotTaken) {
  engine_test::ScratchDir tmp("ckpt-summary-nested");
  const std::string dir = tmp.path() + "/ckpt";
  const engine_test::Model model = engine_test::make_model(DType::kF32, 5310);
  const Config config =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, tmp.path());
  const Status saved = engine_test::train_and_save(config, model, 1, 3, dir, "top");
  ASSERT_TRUE(saved.is_ok()) << saved.to_string();
  const std::string path = dir + "/top/manifest.json";
  nlohmann::json j = nlohmann::json::parse(engine_test::read_file(path));
  j["params"][0]["tag"] = "nested";
  j["params"][0]["serial"] = 777;
  j["params"][0]["step"] = 888;
  const std::string text = summary_stamp(j);
  ASSERT_LT(text.find("\"nested\""), text.find("\"tag\": \"top\""));

  const Result<CheckpointManifest> full = parse_checkpoint_manifest(text, path);
  ASSERT_TRUE(full.is_ok()) << full.status().to_string();
  const Result<CheckpointTagSummary> summary = parse_checkpoint_manifest_summary(text, path);
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  EXPECT_EQ(full->tag, "top");
  EXPECT_EQ(full->resume.step, 3);
  EXPECT_EQ(summary->tag, full->tag);
  EXPECT_EQ(summary->serial, full->serial);
  EXPECT_EQ(summary->step, full->resume.step);
}

}  // namespace
}  // namespace zinf
