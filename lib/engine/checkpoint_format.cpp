// The checkpoint header's byte layout and the manifest's JSON (see checkpoint.hpp), in a file of
// their own so that the fuzz build can link them without the rest of the checkpoint code.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <type_traits>

#include "base/assert.hpp"
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

constexpr LossScalerMode kLossScalerModes[] = {LossScalerMode::kOff, LossScalerMode::kStatic,
                                               LossScalerMode::kDynamic};

}  // namespace

std::string_view loss_scaler_mode_name(LossScalerMode mode) {
  switch (mode) {
    case LossScalerMode::kOff:
      return "off";
    case LossScalerMode::kStatic:
      return "static";
    case LossScalerMode::kDynamic:
      return "dynamic";
  }
  ZINF_ASSERT(false);
  return "";
}

LossScalerMode loss_scaler_mode(const Fp16Config& fp16) {
  if (!fp16.enabled) return LossScalerMode::kOff;
  return fp16.loss_scale == 0.0 ? LossScalerMode::kDynamic : LossScalerMode::kStatic;
}

bool restores_loss_scaler(bool dynamic, LossScalerMode saved) {
  return dynamic && saved == LossScalerMode::kDynamic;
}

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
  if (h.version < kCheckpointOldestVersion || h.version > kCheckpointVersion) {
    return Status::invalid_argument(
        fmt::format("checkpoint format version {}; this build reads versions {} to {}", h.version,
                    kCheckpointOldestVersion, kCheckpointVersion));
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

std::uint64_t checkpoint_rank_file_bytes(std::size_t pieces, std::uint64_t partition_elements) {
  const std::uint64_t bytes = kCheckpointHeaderBytes + pieces * partition_elements * sizeof(float);
  return (bytes + 4095) / 4096 * 4096;
}

namespace {

using Json = nlohmann::json;

// How encode_checkpoint_manifest() writes the checksum key (nlohmann's dump with indent 1).
constexpr std::string_view kChecksumKey = "\"checksum\": \"";

Json schedule_to_json(const ScheduleConfig& s) {
  return Json{{"type", std::string(schedule_name(s.kind))},
              {"warmup_num_steps", s.warmup_num_steps},
              {"warmup_linear", s.warmup_linear},
              {"warmup_min_lr", s.warmup_min_lr},
              {"warmup_max_lr", s.warmup_max_lr},
              {"total_num_steps", s.total_num_steps},
              {"warmup_min_ratio", s.warmup_min_ratio},
              {"cos_min_ratio", s.cos_min_ratio},
              {"cycle_min_lr", s.cycle_min_lr},
              {"cycle_max_lr", s.cycle_max_lr},
              {"decay_lr_rate", s.decay_lr_rate},
              {"cycle_first_step_size", s.cycle_first_step_size},
              {"cycle_second_step_size", s.cycle_second_step_size},
              {"cycle_first_stair_count", s.cycle_first_stair_count},
              {"cycle_second_stair_count", s.cycle_second_stair_count},
              {"decay_step_size", s.decay_step_size},
              {"cycle_momentum", s.cycle_momentum},
              {"cycle_min_mom", s.cycle_min_mom},
              {"cycle_max_mom", s.cycle_max_mom},
              {"decay_mom_rate", s.decay_mom_rate},
              {"last_batch_iteration", s.last_batch_iteration}};
}

// Reads one key of an object with the type it must have; the error names the key's path.
class Reader {
 public:
  explicit Reader(std::string_view path) : path_(path) {}
  Status bad(std::string_view key, std::string_view what) const {
    return Status::corruption(fmt::format("checkpoint manifest '{}': '{}' {}", path_, key, what));
  }
  const Json* find(const Json& obj, std::string_view key, Status* st) const {
    if (!st->is_ok()) return nullptr;
    if (!obj.is_object()) {
      *st = bad(key, "is in something that is not an object");
      return nullptr;
    }
    auto it = obj.find(std::string(key));
    if (it == obj.end()) {
      *st = bad(key, "is missing");
      return nullptr;
    }
    return &*it;
  }
  template <typename T>
  void get(const Json& obj, std::string_view key, T* out, Status* st) const {
    const Json* v = find(obj, key, st);
    if (v == nullptr) return;
    if constexpr (std::is_same_v<T, bool>) {
      if (!v->is_boolean())
        *st = bad(key, "is not true or false");
      else
        *out = v->get<bool>();
    } else if constexpr (std::is_same_v<T, double>) {
      if (!v->is_number())
        *st = bad(key, "is not a number");
      else
        *out = v->get<double>();
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!v->is_string())
        *st = bad(key, "is not a string");
      else
        *out = v->get<std::string>();
    } else if constexpr (std::is_unsigned_v<T>) {
      if (!v->is_number_unsigned())
        *st = bad(key, "is not an unsigned integer");
      else if (v->get<std::uint64_t>() > std::numeric_limits<T>::max())
        *st = bad(key, "is too large");
      else
        *out = static_cast<T>(v->get<std::uint64_t>());
    } else {
      if (!v->is_number_integer())
        *st = bad(key, "is not an integer");
      else if (v->get<std::int64_t>() > std::numeric_limits<T>::max() ||
               v->get<std::int64_t>() < std::numeric_limits<T>::min()) {
        *st = bad(key, "is out of range");
      } else {
        *out = static_cast<T>(v->get<std::int64_t>());
      }
    }
  }
  // A 64-bit value written as 16 hex digits.
  void get_hex(const Json& obj, std::string_view key, std::uint64_t* out, Status* st) const {
    std::string text;
    get(obj, key, &text, st);
    if (!st->is_ok()) return;
    if (text.size() != 16 ||
        !std::all_of(text.begin(), text.end(), [](char c) { return std::isxdigit(c) != 0; })) {
      *st = bad(key, "is not 16 hex digits");
      return;
    }
    *out = std::stoull(text, nullptr, 16);
  }
  const Json* array(const Json& obj, std::string_view key, Status* st) const {
    const Json* v = find(obj, key, st);
    if (v != nullptr && !v->is_array()) {
      *st = bad(key, "is not an array");
      return nullptr;
    }
    return v;
  }

 private:
  std::string_view path_;
};

void files_from(const Reader& r, const Json& arr, std::string_view key,
                std::vector<ManifestFile>* out, Status* st) {
  for (const Json& e : arr) {
    ManifestFile f;
    r.get(e, "file", &f.file, st);
    if (st->is_ok()) {
      if (f.file.empty() || f.file.find('/') != std::string::npos || f.file[0] == '.') {
        *st = r.bad(fmt::format("{}[].file", key), "is not a plain file name");
      }
    }
    if (st->is_ok()) r.get(e, "bytes", &f.bytes, st);
    if (st->is_ok()) r.get_hex(e, "xxh3", &f.xxh3, st);
    // A rank file linked from the swap space has its checksums per block in a file of their own.
    if (st->is_ok() && e.is_object() && e.contains("blocks")) {
      const Json& b = e["blocks"];
      r.get(b, "file", &f.blocks, st);
      if (st->is_ok() &&
          (f.blocks.empty() || f.blocks.find('/') != std::string::npos || f.blocks[0] == '.')) {
        *st = r.bad(fmt::format("{}[].blocks.file", key), "is not a plain file name");
      }
      if (st->is_ok()) r.get(b, "bytes", &f.blocks_bytes, st);
      if (st->is_ok()) r.get_hex(b, "xxh3", &f.blocks_xxh3, st);
    }
    if (!st->is_ok()) return;
    out->push_back(std::move(f));
  }
}

}  // namespace

std::string encode_checkpoint_manifest(const CheckpointManifest& m) {
  Json params = Json::array();
  for (const ManifestParam& p : m.params) {
    Json e = {{"name", p.name},
              {"shape", p.shape},
              {"dtype", std::string(dtype_name(p.dtype))},
              {"group", p.group},
              {"group_offset", p.group_offset}};
    if (!p.trainable) e["trainable"] = false;
    params.push_back(std::move(e));
  }
  Json groups = Json::array();
  for (const ManifestGroup& g : m.groups) {
    groups.push_back(
        {{"shard_elements", g.shard_elements}, {"partition_offset", g.partition_offset}});
  }
  const auto files = [](const std::vector<ManifestFile>& list) {
    Json out = Json::array();
    for (const ManifestFile& f : list) {
      Json e = {{"file", f.file}, {"bytes", f.bytes}, {"xxh3", fmt::format("{:016x}", f.xxh3)}};
      if (!f.blocks.empty()) {
        e["blocks"] = {{"file", f.blocks},
                       {"bytes", f.blocks_bytes},
                       {"xxh3", fmt::format("{:016x}", f.blocks_xxh3)}};
      }
      out.push_back(std::move(e));
    }
    return out;
  };
  Json j = {{"format", "zinf-checkpoint"},
            {"version", m.version},
            {"tag", m.tag},
            {"serial", m.serial},
            {"world_size", m.world_size},
            {"stage", m.stage},
            {"optimizer", m.optimizer},
            {"fingerprint", fmt::format("{:016x}", m.fingerprint)},
            {"partition_elements", m.partition_elements},
            {"step", m.resume.step},
            {"lr", m.resume.lr},
            {"lr_override", m.resume.lr_override},
            {"lr_schedule", schedule_to_json(m.resume.schedule)},
            {"gather_order", m.resume.gather_order},
            {"params", params},
            {"groups", groups},
            {"ranks", files(m.ranks)},
            {"client_state", files(m.client_state)},
            {"checksum", std::string(16, '0')}};
  if (m.resume.previous_clip_coef.has_value()) {
    j["previous_clip_coef"] = *m.resume.previous_clip_coef;
  }
  if (m.loss_scaler.has_value()) j["loss_scaler"] = loss_scaler_mode_name(*m.loss_scaler);
  // The text's own xxh3-64, with the checksum's 16 digits as zeros, then written into them: a
  // flipped bit anywhere in the manifest (a digit of the learning rate, say) is caught, and the
  // file stays plain JSON.
  std::string text = j.dump(1) + "\n";
  const std::size_t at = text.find(kChecksumKey);
  ZINF_ASSERT(at != std::string::npos);
  const std::string digits = fmt::format("{:016x}", XXH3_64bits(text.data(), text.size()));
  text.replace(at + kChecksumKey.size(), 16, digits);
  return text;
}

namespace {

// The manifest's own checksum: the xxh3-64 of its text with the checksum's 16 digits as zeros.
Status check_manifest_checksum(std::string_view text, std::string_view path) {
  const std::size_t at = text.find(kChecksumKey);
  if (at == std::string_view::npos || text.size() - at - kChecksumKey.size() < 16) {
    return Status::corruption(fmt::format("checkpoint manifest '{}': no checksum", path));
  }
  const std::size_t digits_at = at + kChecksumKey.size();
  const std::string_view stored = text.substr(digits_at, 16);
  // The text in three runs, the digits as zeros, with no copy of the whole text.
  XXH3_state_t* state = XXH3_createState();
  ZINF_ASSERT(state != nullptr);
  XXH3_64bits_reset(state);
  XXH3_64bits_update(state, text.data(), digits_at);
  constexpr char kZeros[16] = {'0', '0', '0', '0', '0', '0', '0', '0',
                               '0', '0', '0', '0', '0', '0', '0', '0'};
  XXH3_64bits_update(state, kZeros, sizeof(kZeros));
  XXH3_64bits_update(state, text.data() + digits_at + 16, text.size() - digits_at - 16);
  const std::string computed = fmt::format("{:016x}", XXH3_64bits_digest(state));
  XXH3_freeState(state);
  if (stored != computed) {
    return Status::corruption(
        fmt::format("checkpoint manifest '{}' does not match its checksum (xxh3 {}, it says {})",
                    path, computed, stored));
  }
  return Status::ok();
}

// The version of manifest `j`, once its format is checked; kInvalidArgument naming `path` for a
// version this build does not read.
Result<std::uint32_t> manifest_version(const Json& j, const Reader& r, std::string_view path) {
  Status st;
  std::string format;
  std::uint32_t version = 0;
  r.get(j, "format", &format, &st);
  if (st.is_ok() && format != "zinf-checkpoint") st = r.bad("format", "is not \"zinf-checkpoint\"");
  r.get(j, "version", &version, &st);
  if (!st.is_ok()) return st;
  if (version < kCheckpointOldestVersion || version > kCheckpointVersion) {
    return Status::invalid_argument(fmt::format(
        "checkpoint manifest '{}': format version {}; this build reads versions {} to {}", path,
        version, kCheckpointOldestVersion, kCheckpointVersion));
  }
  return version;
}

// SAX events of a manifest (nlohmann::json::sax_parse) that keep its top-level values under the
// keys asked for, in `top`, and pass over every other value without building it: the
// parameters, groups and file lists, most of a manifest's bytes. A container under a key asked
// for is kept as an empty one of its kind, so that the Reader names its type.
class TopLevelValues {
 public:
  explicit TopLevelValues(std::initializer_list<std::string_view> keys) : keys_(keys) {}

  Json top = Json::object();
  bool root_is_object = false;

  bool null() { return put(Json(nullptr)); }
  bool boolean(bool v) { return put(Json(v)); }
  bool number_integer(Json::number_integer_t v) { return put(Json(v)); }
  bool number_unsigned(Json::number_unsigned_t v) { return put(Json(v)); }
  bool number_float(Json::number_float_t v, const std::string&) { return put(Json(v)); }
  bool string(std::string& v) { return put(Json(v)); }
  bool binary(Json::binary_t&) { return put(Json(nullptr)); }
  bool start_object(std::size_t) {
    if (depth_ == 0) root_is_object = true;
    return open(Json::object());
  }
  bool end_object() { return close(); }
  bool start_array(std::size_t) { return open(Json::array()); }
  bool end_array() { return close(); }
  bool key(std::string& k) {
    if (depth_ == 1) {
      wanted_ = std::find(keys_.begin(), keys_.end(), k) != keys_.end();
      if (wanted_) key_ = k;
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    return false;
  }

 private:
  bool put(Json v) {
    if (depth_ == 1 && wanted_) top[key_] = std::move(v);
    return true;
  }
  bool open(Json empty) {
    put(std::move(empty));
    ++depth_;
    return true;
  }
  bool close() {
    --depth_;
    return true;
  }

  std::vector<std::string_view> keys_;
  std::size_t depth_ = 0;
  bool wanted_ = false;
  std::string key_;
};

}  // namespace

Result<CheckpointTagSummary> parse_checkpoint_manifest_summary(std::string_view text,
                                                               std::string_view path) {
  ZINF_RETURN_IF_ERROR(check_manifest_checksum(text, path));
  TopLevelValues values({"format", "version", "tag", "serial", "step"});
  if (!Json::sax_parse(text.begin(), text.end(), &values) || !values.root_is_object) {
    return Status::corruption(fmt::format("checkpoint manifest '{}': not a JSON object", path));
  }
  const Json& j = values.top;
  const Reader r(path);
  ZINF_RETURN_IF_ERROR(manifest_version(j, r, path).status());
  Status st;
  CheckpointTagSummary s;
  r.get(j, "tag", &s.tag, &st);
  r.get(j, "serial", &s.serial, &st);
  r.get(j, "step", &s.step, &st);
  if (st.is_ok() && s.step < 0) st = r.bad("step", "is negative");
  if (!st.is_ok()) return st;
  return s;
}

Result<CheckpointManifest> parse_checkpoint_manifest(std::string_view text, std::string_view path) {
  ZINF_RETURN_IF_ERROR(check_manifest_checksum(text, path));
  const Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::corruption(fmt::format("checkpoint manifest '{}': not a JSON object", path));
  }
  const Reader r(path);
  Status st;
  ZINF_ASSIGN_OR_RETURN(const std::uint32_t version, manifest_version(j, r, path));
  CheckpointManifest m;
  m.version = version;
  r.get(j, "tag", &m.tag, &st);
  r.get(j, "serial", &m.serial, &st);
  r.get(j, "world_size", &m.world_size, &st);
  if (st.is_ok() && (m.world_size < 1 || m.world_size > 65536)) {
    st = r.bad("world_size", "is not in 1..65536");
  }
  r.get(j, "stage", &m.stage, &st);
  if (st.is_ok() && (m.stage < 1 || m.stage > 3)) st = r.bad("stage", "is not 1, 2 or 3");
  r.get(j, "optimizer", &m.optimizer, &st);
  r.get_hex(j, "fingerprint", &m.fingerprint, &st);
  r.get(j, "partition_elements", &m.partition_elements, &st);
  r.get(j, "step", &m.resume.step, &st);
  if (st.is_ok() && m.resume.step < 0) st = r.bad("step", "is negative");
  r.get(j, "lr", &m.resume.lr, &st);
  r.get(j, "lr_override", &m.resume.lr_override, &st);
  if (st.is_ok() && j.contains("previous_clip_coef")) {
    double coef = 0.0;
    r.get(j, "previous_clip_coef", &coef, &st);
    if (st.is_ok() && !(coef > 0.0 && coef <= 1.0)) {
      st = r.bad("previous_clip_coef", "is not in (0, 1]");
    }
    if (st.is_ok()) m.resume.previous_clip_coef = coef;
  }
  if (st.is_ok() && j.contains("loss_scaler")) {
    std::string mode;
    r.get(j, "loss_scaler", &mode, &st);
    for (LossScalerMode k : kLossScalerModes) {
      if (st.is_ok() && loss_scaler_mode_name(k) == mode) m.loss_scaler = k;
    }
    if (st.is_ok() && !m.loss_scaler.has_value()) {
      st = r.bad("loss_scaler", "is not \"off\", \"static\" or \"dynamic\"");
    }
  }
  const Json* sched = r.find(j, "lr_schedule", &st);
  if (sched != nullptr) {
    ScheduleConfig& s = m.resume.schedule;
    std::string type;
    r.get(*sched, "type", &type, &st);
    if (st.is_ok()) {
      bool known = false;
      for (ScheduleKind k :
           {ScheduleKind::kNone, ScheduleKind::kWarmupLR, ScheduleKind::kWarmupDecayLR,
            ScheduleKind::kWarmupCosineLR, ScheduleKind::kOneCycle}) {
        if (schedule_name(k) == type) {
          s.kind = k;
          known = true;
        }
      }
      if (!known) st = r.bad("lr_schedule.type", "is not a schedule zinf knows");
    }
    r.get(*sched, "warmup_num_steps", &s.warmup_num_steps, &st);
    r.get(*sched, "warmup_linear", &s.warmup_linear, &st);
    r.get(*sched, "warmup_min_lr", &s.warmup_min_lr, &st);
    r.get(*sched, "warmup_max_lr", &s.warmup_max_lr, &st);
    r.get(*sched, "total_num_steps", &s.total_num_steps, &st);
    r.get(*sched, "warmup_min_ratio", &s.warmup_min_ratio, &st);
    r.get(*sched, "cos_min_ratio", &s.cos_min_ratio, &st);
    r.get(*sched, "cycle_min_lr", &s.cycle_min_lr, &st);
    r.get(*sched, "cycle_max_lr", &s.cycle_max_lr, &st);
    r.get(*sched, "decay_lr_rate", &s.decay_lr_rate, &st);
    r.get(*sched, "cycle_first_step_size", &s.cycle_first_step_size, &st);
    r.get(*sched, "cycle_second_step_size", &s.cycle_second_step_size, &st);
    r.get(*sched, "cycle_first_stair_count", &s.cycle_first_stair_count, &st);
    r.get(*sched, "cycle_second_stair_count", &s.cycle_second_stair_count, &st);
    r.get(*sched, "decay_step_size", &s.decay_step_size, &st);
    r.get(*sched, "cycle_momentum", &s.cycle_momentum, &st);
    r.get(*sched, "cycle_min_mom", &s.cycle_min_mom, &st);
    r.get(*sched, "cycle_max_mom", &s.cycle_max_mom, &st);
    r.get(*sched, "decay_mom_rate", &s.decay_mom_rate, &st);
    r.get(*sched, "last_batch_iteration", &s.last_batch_iteration, &st);
  }
  if (const Json* order = r.array(j, "gather_order", &st)) {
    for (const Json& e : *order) {
      if (!e.is_string()) {
        st = r.bad("gather_order[]", "is not a string");
        break;
      }
      m.resume.gather_order.push_back(e.get<std::string>());
    }
  }
  if (const Json* groups = r.array(j, "groups", &st)) {
    for (const Json& e : *groups) {
      ManifestGroup g;
      r.get(e, "shard_elements", &g.shard_elements, &st);
      r.get(e, "partition_offset", &g.partition_offset, &st);
      if (st.is_ok() && (g.shard_elements > m.partition_elements ||
                         g.partition_offset > m.partition_elements - g.shard_elements)) {
        st = r.bad("groups[].partition_offset", "puts a slice past partition_elements");
      }
      if (!st.is_ok()) break;
      m.groups.push_back(g);
    }
  }
  if (const Json* params = r.array(j, "params", &st)) {
    for (const Json& e : *params) {
      ManifestParam p;
      std::string dtype;
      r.get(e, "name", &p.name, &st);
      r.get(e, "dtype", &dtype, &st);
      if (st.is_ok()) {
        const std::optional<DType> parsed = parse_dtype(dtype);
        if (parsed.has_value())
          p.dtype = *parsed;
        else
          st = r.bad("params[].dtype", "is unknown");
      }
      r.get(e, "group", &p.group, &st);
      r.get(e, "group_offset", &p.group_offset, &st);
      if (e.is_object() && e.contains("trainable")) r.get(e, "trainable", &p.trainable, &st);
      std::uint64_t elements = 1;
      if (const Json* shape = r.array(e, "shape", &st)) {
        for (const Json& d : *shape) {
          if (!d.is_number_integer() || d.get<std::int64_t>() <= 0 ||
              d.get<std::int64_t>() > (std::int64_t{1} << 40)) {
            st = r.bad("params[].shape", "has a dimension that is not in 1..2^40");
            break;
          }
          p.shape.push_back(d.get<std::int64_t>());
          elements *= static_cast<std::uint64_t>(d.get<std::int64_t>());
          if (elements > (std::uint64_t{1} << 48)) {
            st = r.bad("params[].shape", "has more than 2^48 elements");
            break;
          }
        }
      }
      if (!st.is_ok()) break;
      if (p.group >= m.groups.size()) {
        st = r.bad("params[].group", fmt::format("of '{}' is not a group", p.name));
        break;
      }
      // The parameter must lie inside its group's slices, so a load never reads outside them.
      const std::uint64_t group_elements =
          m.groups[p.group].shard_elements * static_cast<std::uint64_t>(m.world_size);
      if (p.group_offset > group_elements || elements > group_elements - p.group_offset) {
        st = r.bad("params[].group_offset", fmt::format("puts '{}' past its group", p.name));
        break;
      }
      m.params.push_back(std::move(p));
    }
  }
  if (const Json* ranks = r.array(j, "ranks", &st)) files_from(r, *ranks, "ranks", &m.ranks, &st);
  if (st.is_ok() && m.ranks.size() != static_cast<std::size_t>(m.world_size)) {
    st = r.bad("ranks",
               fmt::format("has {} entries, not world_size {}", m.ranks.size(), m.world_size));
  }
  if (const Json* cs = r.array(j, "client_state", &st)) {
    files_from(r, *cs, "client_state", &m.client_state, &st);
  }
  if (st.is_ok() && m.client_state.size() > 1)
    st = r.bad("client_state", "has more than one entry");
  if (!st.is_ok()) return st;
  return m;
}

std::string encode_block_sums(const std::vector<FileBlockSum>& sums) {
  std::string out(sums.size() * 16, '\0');
  for (std::size_t i = 0; i < sums.size(); ++i) {
    for (int byte = 0; byte < 8; ++byte) {
      out[16 * i + byte] = static_cast<char>((sums[i].end_offset >> (8 * byte)) & 0xff);
      out[16 * i + 8 + byte] = static_cast<char>((sums[i].xxh3 >> (8 * byte)) & 0xff);
    }
  }
  return out;
}

Result<std::vector<FileBlockSum>> decode_block_sums(std::string_view bytes, std::string_view path,
                                                    std::uint64_t file_bytes) {
  if (bytes.empty() || bytes.size() % 16 != 0) {
    return Status::corruption(
        fmt::format("'{}': {} bytes is not a list of 16-byte block checksums", path, bytes.size()));
  }
  std::vector<FileBlockSum> sums(bytes.size() / 16);
  std::uint64_t last = 0;
  for (std::size_t i = 0; i < sums.size(); ++i) {
    for (int byte = 0; byte < 8; ++byte) {
      sums[i].end_offset |= std::uint64_t{static_cast<unsigned char>(bytes[16 * i + byte])}
                            << (8 * byte);
      sums[i].xxh3 |= std::uint64_t{static_cast<unsigned char>(bytes[16 * i + 8 + byte])}
                      << (8 * byte);
    }
    if (sums[i].end_offset <= last) {
      return Status::corruption(
          fmt::format("'{}': block {} ends at {}, not after the previous block's end {}", path, i,
                      sums[i].end_offset, last));
    }
    last = sums[i].end_offset;
  }
  if (last != file_bytes) {
    return Status::corruption(fmt::format(
        "'{}': the blocks cover {} bytes, the rank file's layout {}", path, last, file_bytes));
  }
  return sums;
}

}  // namespace zinf
