#include <xxhash.h>

#include <fmt/format.h>

#include <string>
#include <string_view>

#include "base/assert.hpp"
#include "engine/checkpoint.hpp"
#include "targets.hpp"

namespace zinf::fuzz {

namespace {

constexpr std::string_view kChecksumKey = "\"checksum\": \"";

// The input with its checksum digits replaced by the right ones (as save_checkpoint writes them),
// so that the fuzzer explores the structure behind the checksum, not only the checksum test.
std::string stamped(std::string_view text) {
  std::string out(text);
  const std::size_t at = out.find(kChecksumKey);
  if (at == std::string::npos || out.size() - at - kChecksumKey.size() < 16) return out;
  out.replace(at + kChecksumKey.size(), 16, std::string(16, '0'));
  out.replace(at + kChecksumKey.size(), 16,
              fmt::format("{:016x}", XXH3_64bits(out.data(), out.size())));
  return out;
}

void check(std::string_view text) {
  Result<CheckpointManifest> parsed = parse_checkpoint_manifest(text, "fuzz/manifest.json");
  if (!parsed.is_ok()) {
    const Code code = parsed.status().code();
    ZINF_ASSERT(code == Code::kCorruption || code == Code::kInvalidArgument);
    ZINF_ASSERT(parsed.status().message().find("fuzz/manifest.json") != std::string::npos);
    return;
  }
  // What the load path relies on: one entry per rank, each a plain file name in the directory,
  // and every parameter inside its group.
  const CheckpointManifest& m = *parsed;
  ZINF_ASSERT(m.world_size >= 1 && m.ranks.size() == static_cast<std::size_t>(m.world_size));
  for (const ManifestFile& f : m.ranks) {
    ZINF_ASSERT(!f.file.empty() && f.file[0] != '.' && f.file.find('/') == std::string::npos);
  }
  for (const ManifestParam& p : m.params) ZINF_ASSERT(p.group < m.groups.size());
  // Written back as save_checkpoint writes it, it parses to the same fields.
  const std::string printed = encode_checkpoint_manifest(m);
  Result<CheckpointManifest> again = parse_checkpoint_manifest(printed, "fuzz/manifest.json");
  ZINF_ASSERT_MSG(again.is_ok(), "a parsed manifest, written again, does not parse");
  ZINF_ASSERT_MSG(encode_checkpoint_manifest(*again) == printed,
                  "a checkpoint manifest does not round-trip");
}

}  // namespace

int checkpoint_manifest(const std::uint8_t* data, std::size_t bytes) {
  const std::string_view text(reinterpret_cast<const char*>(data), bytes);
  check(text);
  check(stamped(text));
  return 0;
}

}  // namespace zinf::fuzz
