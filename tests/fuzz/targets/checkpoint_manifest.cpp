#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "base/assert.hpp"
#include "engine/checkpoint.hpp"
#include "targets.hpp"

namespace zinf::fuzz {

namespace {

// The manifest's JSON as save_checkpoint writes it, from its parsed fields.
std::string to_json(const CheckpointManifest& m) {
  nlohmann::json j;
  j["format"] = "zinf-checkpoint";
  j["version"] = kCheckpointVersion;
  j["world_size"] = m.world_size;
  j["stage"] = m.stage;
  j["optimizer"] = m.optimizer;
  j["fingerprint"] = m.fingerprint;
  j["partition_elements"] = m.partition_elements;
  j["step"] = m.step;
  nlohmann::json ranks = nlohmann::json::array();
  for (const CheckpointManifestRank& r : m.ranks) {
    ranks.push_back({{"file", r.file}, {"bytes", r.bytes}, {"xxh3", r.xxh3}});
  }
  j["ranks"] = ranks;
  return j.dump();
}

}  // namespace

int checkpoint_manifest(const std::uint8_t* data, std::size_t bytes) {
  const std::string_view text(reinterpret_cast<const char*>(data), bytes);
  Result<CheckpointManifest> parsed = parse_checkpoint_manifest(text);
  if (!parsed.is_ok()) {
    ZINF_ASSERT(parsed.status().code() == Code::kCorruption);
    ZINF_ASSERT(!parsed.status().message().empty());
    return 0;
  }
  // What the load path relies on: one entry per rank, each a file name inside the directory.
  const CheckpointManifest& m = *parsed;
  ZINF_ASSERT(m.world_size >= 1 && m.ranks.size() == static_cast<std::size_t>(m.world_size));
  for (const CheckpointManifestRank& r : m.ranks) {
    ZINF_ASSERT(!r.file.empty() && r.file != "." && r.file != "..");
    ZINF_ASSERT(r.file.find('/') == std::string::npos);
  }
  // Written back as save_checkpoint writes it, it parses to the same fields.
  const std::string printed = to_json(m);
  Result<CheckpointManifest> again = parse_checkpoint_manifest(printed);
  ZINF_ASSERT_MSG(again.is_ok(), "a parsed manifest, written again, does not parse");
  ZINF_ASSERT_MSG(to_json(*again) == printed, "a checkpoint manifest does not round-trip");
  return 0;
}

}  // namespace zinf::fuzz
