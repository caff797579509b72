// The config reader's inside, shared by the walk and the readers (config.cpp) and the key tables
// (config_keys.cpp): the walk's state, a table row, and the value readers the tables call.
// Internal to the config's reader; config.cpp's header comment says how the pieces fit.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/config.hpp"

namespace zinf::config_detail {

// Keeps the file's key order, so "the first key" of a report is the first in the file.
using Json = nlohmann::ordered_json;

inline std::string join(std::string_view path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

// The optimizer's keys as read, before the type's defaults are filled in.
struct OptimizerInput {
  std::optional<double> lr, beta1, beta2, eps, weight_decay, lr_decay;
  std::optional<bool> bias_correction;
  bool adam_w_mode = true;
  bool torch_adam = false;
};

// The state of one walk: the config being filled and the report of every key seen.
struct Walk {
  Config* config = nullptr;
  std::vector<KeyReport>* reports = nullptr;
  OptimizerInput optimizer;
  // Set by a reader whose value is read other than at its face; the key's report carries it.
  std::string note;

  void used(const std::string& key) {
    reports->push_back({key, KeyUse::kUsed, std::move(note)});
    note.clear();
  }
  void no_effect(const std::string& key, std::string why) {
    note.clear();
    reports->push_back({key, KeyUse::kNoEffect, std::move(why)});
  }
  void refuse(const std::string& key, std::string why) {
    reports->push_back({key, KeyUse::kRefused, std::move(why)});
  }
};

// A reader checks one value and stores it; it returns the reason when the value is refused
// (the caller prefixes the key).
using Why = std::optional<std::string>;
using Reader = Why (*)(const Json& value, Walk& w);

struct Key;
using WalkFn = void (*)(const Json& value, const std::string& key, Walk& w);

// One key of a section. Exactly one of read, keys, walk is set for a used key; a key with
// no_effect or refused set is accepted (or refused) whatever its value, unless it also has a
// reader that refuses some values (aio.use_gds: false is fine, true is refused).
struct Key {
  std::string_view name;
  Reader read = nullptr;
  std::span<const Key> keys = {};  // a section: its keys
  WalkFn walk = nullptr;           // a section with its own walk
  std::string_view no_effect = {};
  std::string_view refused = {};
  // For a refused section that DeepSpeed turns on with its "enabled" (false by default): an
  // object whose "enabled" is absent or false is accepted with no effect, as DeepSpeed does
  // nothing with it.
  bool refused_when_enabled = false;
  // For a used key: "auto" is accepted with no effect, for this reason (train_batch_size, which
  // the Hugging Face Trainer computes from the other batch keys), instead of refused.
  std::string_view auto_no_effect = {};
};

// --- value readers (config.cpp) ---------------------------------------------------------------

Why not_a(const Json& v, std::string_view what);
// A non-negative count; DeepSpeed configs often write counts as floats (1e9). A whole number
// beyond `max` is refused as too large (too_large), naming `max`; a fraction or a negative number
// is refused as not a non-negative whole number.
Why count_of(const Json& v, std::uint64_t* out,
             std::uint64_t max = std::numeric_limits<std::uint64_t>::max());
// "<v> is larger than the largest allowed, <max>".
Why too_large(const Json& v, std::uint64_t max);
// A count into a field of type T, up to T's largest value.
template <typename T>
Why count_as(const Json& v, T* out) {
  std::uint64_t value = 0;
  if (Why why = count_of(v, &value, static_cast<std::uint64_t>(std::numeric_limits<T>::max()))) {
    return why;
  }
  *out = static_cast<T>(value);
  return std::nullopt;
}
Why number_of(const Json& v, double* out);
Why number_opt(const Json& v, std::optional<double>* out);
Why bool_of(const Json& v, bool* out);
Why string_of(const Json& v, std::string* out);
// A directory: a string, or null ("not given", as DeepSpeed's Optional[Path] nvme_path reads it).
Why path_of(const Json& v, std::string* out);
// A boolean that zinf supports only at `supported`: the other value is refused with `why`.
Why only_bool(const Json& v, bool supported, std::string_view why);
Why device_of(const Json& v, OffloadDevice* out);

// The reason an unknown key `name` of the section at dotted `path` ("" for the top level) is
// refused: "unknown key (<misspelling_hint>)" against `keys` (misspelling_hint() is in
// config_names.hpp); else, for a key of other sections, "unknown key here (a key of <sections>,
// not of <path>: move it there)"; else "unknown key (misspelt, or not supported by zinf)".
std::string unknown_key_why(std::span<const Key> keys, std::string_view path,
                            std::string_view name);

inline constexpr std::string_view kAutoWhy =
    "\"auto\" is a placeholder that the Hugging Face Trainer fills in before DeepSpeed reads the "
    "config; zinf has no trainer to fill it: write the value";

// Status::invalid_argument("<key>: <why>"), the config's refusal of a key (config.cpp).
Status invalid(std::string_view key, std::string_view why);

// The sections with their own walk (config.cpp).
void walk_optimizer(const Json& section, const std::string& path, Walk& w);
void walk_scheduler(const Json& section, const std::string& path, Walk& w);

// --- the tables (config_keys.cpp) -------------------------------------------------------------

// The keys of the config's root object, each pointing at its section's table.
std::span<const Key> root_keys();

}  // namespace zinf::config_detail
