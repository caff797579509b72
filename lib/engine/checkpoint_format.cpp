// The checkpoint header's byte layout and the manifest's parser (see checkpoint.hpp), in a file of
// their own so that the fuzz build can link them without the rest of the checkpoint code.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>
#include <utility>

#include "engine/checkpoint.hpp"

namespace zinf {

namespace {

template <typename T>
void put_le(std::byte* out, T value) {
  std::uint64_t bits = 0;
  if constexpr (std::is_same_v<T, double>) {
    bits = std::bit_cast<std::uint64_t>(value);
  } else {
    bits = static_cast<std::uint64_t>(static_cast<std::make_unsigned_t<T>>(value));
  }
  for (std::size_t i = 0; i < sizeof(T); ++i) out[i] = static_cast<std::byte>(bits >> (8 * i));
}

template <typename T>
T get_le(const std::byte* in) {
  std::uint64_t bits = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    bits |= static_cast<std::uint64_t>(in[i]) << (8 * i);
  }
  if constexpr (std::is_same_v<T, double>) {
    return std::bit_cast<double>(bits);
  } else {
    return static_cast<T>(static_cast<std::make_unsigned_t<T>>(bits));
  }
}

constexpr std::size_t kHeaderFieldBytes = 80;  // the fields; zeros after them

Status bad_manifest(std::string_view what) { return Status::corruption(std::string(what)); }

// json[key] as a T: a JSON integer within T's range. (nlohmann's get<T>() would convert a float,
// and a float out of T's range converts with undefined behaviour.)
template <typename T>
Status get_integer(const nlohmann::json& json, const char* key, T* out) {
  const nlohmann::json& value = json.at(key);
  if (value.is_number_unsigned()) {
    const auto v = value.get<std::uint64_t>();
    if (std::in_range<T>(v)) {
      *out = static_cast<T>(v);
      return Status::ok();
    }
  } else if (value.is_number_integer()) {
    const auto v = value.get<std::int64_t>();
    if (std::in_range<T>(v)) {
      *out = static_cast<T>(v);
      return Status::ok();
    }
  }
  return bad_manifest(
      fmt::format("'{}' is not an integer in [{}, {}]: {}", key, std::numeric_limits<T>::min(),
                  std::numeric_limits<T>::max(),
                  value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
}

Status get_string(const nlohmann::json& json, const char* key, std::string* out) {
  const nlohmann::json& value = json.at(key);
  if (!value.is_string()) return bad_manifest(fmt::format("'{}' is not a string", key));
  *out = value.get<std::string>();
  return Status::ok();
}

}  // namespace

void encode_checkpoint_header(const CheckpointHeader& h,
                              std::span<std::byte, kCheckpointHeaderBytes> out) {
  std::fill(out.begin(), out.end(), std::byte{0});
  std::byte* p = out.data();
  put_le(p + 0, h.magic);
  put_le(p + 8, h.version);
  put_le(p + 12, h.rank);
  put_le(p + 16, h.world_size);
  put_le(p + 20, h.stage);
  put_le(p + 24, h.optimizer);
  put_le(p + 28, h.piece_mask);
  put_le(p + 32, h.partition_elements);
  put_le(p + 40, h.fingerprint);
  put_le(p + 48, h.step);
  put_le(p + 56, h.loss_scale);
  put_le(p + 64, h.loss_scale_good_steps);
  put_le(p + 72, h.loss_scale_hysteresis_left);
  put_le(p + 76, h.reserved);
}

Result<CheckpointHeader> decode_checkpoint_header(std::span<const std::byte> bytes) {
  if (bytes.size() != kCheckpointHeaderBytes) {
    return Status::corruption(fmt::format("a checkpoint header is {} bytes, not {}",
                                          kCheckpointHeaderBytes, bytes.size()));
  }
  const std::byte* p = bytes.data();
  CheckpointHeader h;
  h.magic = get_le<std::uint64_t>(p + 0);
  if (h.magic != kCheckpointMagic) {
    return Status::corruption(fmt::format("not a zinf checkpoint (magic {:016x})", h.magic));
  }
  h.version = get_le<std::uint32_t>(p + 8);
  if (h.version != kCheckpointVersion) {
    return Status::invalid_argument(fmt::format(
        "checkpoint format version {}; this build reads version {}", h.version,
        kCheckpointVersion));
  }
  h.rank = get_le<std::uint32_t>(p + 12);
  h.world_size = get_le<std::uint32_t>(p + 16);
  h.stage = get_le<std::uint32_t>(p + 20);
  h.optimizer = get_le<std::uint32_t>(p + 24);
  h.piece_mask = get_le<std::uint32_t>(p + 28);
  h.partition_elements = get_le<std::uint64_t>(p + 32);
  h.fingerprint = get_le<std::uint64_t>(p + 40);
  h.step = get_le<std::int64_t>(p + 48);
  h.loss_scale = get_le<double>(p + 56);
  h.loss_scale_good_steps = get_le<std::int64_t>(p + 64);
  h.loss_scale_hysteresis_left = get_le<std::int32_t>(p + 72);
  h.reserved = get_le<std::uint32_t>(p + 76);
  for (std::size_t i = kHeaderFieldBytes; i < bytes.size(); ++i) {
    if (bytes[i] != std::byte{0}) {
      return Status::corruption(fmt::format("checkpoint header byte {} is not zero padding", i));
    }
  }
  return h;
}

Result<CheckpointManifest> parse_checkpoint_manifest(std::string_view text) {
  const nlohmann::json m = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded() || !m.is_object()) return bad_manifest("not a JSON object");
  for (const char* key : {"format", "version", "world_size", "stage", "optimizer", "fingerprint",
                          "partition_elements", "step", "ranks"}) {
    if (!m.contains(key)) return bad_manifest(fmt::format("no key '{}'", key));
  }
  std::uint32_t version = 0;
  if (!m["format"].is_string() || m["format"].get<std::string>() != "zinf-checkpoint" ||
      !get_integer(m, "version", &version).is_ok() || version != kCheckpointVersion) {
    return bad_manifest(fmt::format("not a zinf checkpoint of version {}", kCheckpointVersion));
  }
  CheckpointManifest out;
  ZINF_RETURN_IF_ERROR(get_integer(m, "world_size", &out.world_size));
  ZINF_RETURN_IF_ERROR(get_integer(m, "stage", &out.stage));
  ZINF_RETURN_IF_ERROR(get_string(m, "optimizer", &out.optimizer));
  ZINF_RETURN_IF_ERROR(get_string(m, "fingerprint", &out.fingerprint));
  ZINF_RETURN_IF_ERROR(get_integer(m, "partition_elements", &out.partition_elements));
  ZINF_RETURN_IF_ERROR(get_integer(m, "step", &out.step));
  const nlohmann::json& ranks = m["ranks"];
  if (out.world_size < 1 || !ranks.is_array() ||
      ranks.size() != static_cast<std::size_t>(out.world_size)) {
    return bad_manifest(
        fmt::format("'ranks' is not an array of world_size ({}) entries", out.world_size));
  }
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const nlohmann::json& entry = ranks[r];
    for (const char* key : {"file", "bytes", "xxh3"}) {
      if (!entry.is_object() || !entry.contains(key)) {
        return bad_manifest(fmt::format("ranks[{}] has no key '{}'", r, key));
      }
    }
    CheckpointManifestRank rank;
    Status got = get_string(entry, "file", &rank.file);
    if (got.is_ok()) got = get_integer(entry, "bytes", &rank.bytes);
    if (got.is_ok()) got = get_string(entry, "xxh3", &rank.xxh3);
    if (!got.is_ok()) return bad_manifest(fmt::format("ranks[{}]: {}", r, got.message()));
    // The file is read from the checkpoint directory: nothing outside it.
    if (rank.file.empty() || rank.file == "." || rank.file == ".." ||
        rank.file.find_first_of(std::string_view("/\0", 2)) != std::string::npos) {
      return bad_manifest(
          fmt::format("ranks[{}]: 'file' is not a file name in the directory: {}", r,
                      nlohmann::json(rank.file).dump(-1, ' ', false,
                                                     nlohmann::json::error_handler_t::replace)));
    }
    out.ranks.push_back(std::move(rank));
  }
  return out;
}

}  // namespace zinf
