// Config parsing and writing: the one schema of the engine, the planner and the CLI.
//
// Every key zinf knows is in a table (config_keys.cpp) with what zinf does with it: used (read into
// Config), accepted with no effect in zinf (and why), or refused (and why). A key that is in no
// table is refused as unknown; keys are case-sensitive, as DeepSpeed's are, and a key that differs
// from a known one of its section only in case, or by a slip of a few letters, is refused naming
// that key, and one that is a key of other sections (written under the wrong parent) naming them.
// The walk over a JSON object reports every
// key in file order (check_config); parse_config() fails with the first refused key's report, so
// the engine, the planner and `zinf config check` give the same message for the same file. After
// the walk, walk_text() refuses what DeepSpeed refuses about the file as a whole: a key given twice
// in one object, one setting under two of its names (kSameSettings), and "auto" batch sizes with
// no train_batch_size or train_micro_batch_size_per_gpu written (refuse_unfilled_batch_sizes); and
// what depends on another key, named as the file names it: cpu_offload_param below stage 3
// (refuse_param_offload_switch).
//
// To add a section (say "monitor"), give it a table of its keys and a row in kRootKeys that
// points at it (config_keys.cpp; or a walk function here, as the optimizer has, when one key
// decides what the others mean), and read its values into Config in the readers. The walk's state
// and a table row are in config_walk.hpp; this file holds the value readers, the walk, the
// optimizer's and scheduler's walks and the public calls.
#include "zinf/config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <sstream>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/config_names.hpp"
#include "engine/config_walk.hpp"
#include "engine/schedule.hpp"

namespace zinf {
namespace config_detail {

// --- value readers --------------------------------------------------------------------------

Why not_a(const Json& v, std::string_view what) {
  return fmt::format("{} is not {}", v.dump(), what);
}

Why too_large(const Json& v, std::uint64_t max) {
  return fmt::format("{} is larger than the largest allowed, {}", v.dump(), max);
}

// A non-negative count; DeepSpeed configs often write counts as floats (1e9).
Why count_of(const Json& v, std::uint64_t* out, std::uint64_t max) {
  // 2^64, exactly. A whole double below it converts to an std::uint64_t; one at or above it (1e30,
  // or an integer past 2^64 - 1, which the JSON reader holds as a double) is too large.
  constexpr double kTwoTo64 = 18446744073709551616.0;
  std::uint64_t value = 0;
  if (v.is_number_unsigned()) {
    value = v.get<std::uint64_t>();
  } else if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    value = static_cast<std::uint64_t>(v.get<std::int64_t>());
  } else if (v.is_number_float() && v.get<double>() >= kTwoTo64) {
    // Every double this large is whole: the count is too large, not a fraction.
    return too_large(v, max);
  } else if (v.is_number_float() && v.get<double>() >= 0 &&
             std::floor(v.get<double>()) == v.get<double>()) {
    value = static_cast<std::uint64_t>(v.get<double>());
  } else {
    return not_a(v, "a non-negative whole number");
  }
  if (value > max) return too_large(v, max);
  *out = value;
  return std::nullopt;
}

Why number_of(const Json& v, double* out) {
  if (!v.is_number()) return not_a(v, "a number");
  *out = v.get<double>();
  return std::nullopt;
}

Why number_opt(const Json& v, std::optional<double>* out) {
  double x = 0;
  if (Why why = number_of(v, &x)) return why;
  *out = x;
  return std::nullopt;
}

Why bool_of(const Json& v, bool* out) {
  if (!v.is_boolean()) return not_a(v, "true or false");
  *out = v.get<bool>();
  return std::nullopt;
}

Why string_of(const Json& v, std::string* out) {
  if (!v.is_string()) return not_a(v, "a string");
  *out = v.get<std::string>();
  return std::nullopt;
}

// A directory: a string, or null (DeepSpeed's Optional[Path] nvme_path), which is "not given".
Why path_of(const Json& v, std::string* out) {
  if (v.is_null()) {
    out->clear();
    return std::nullopt;
  }
  if (!v.is_string()) return not_a(v, "a string or null");
  *out = v.get<std::string>();
  return std::nullopt;
}

// A boolean that zinf supports only at `supported`: the other value is refused with `why`.
Why only_bool(const Json& v, bool supported, std::string_view why) {
  bool b = supported;
  if (Why bad = bool_of(v, &b)) return bad;
  if (b != supported) return fmt::format("{} is not supported: {}", v.dump(), why);
  return std::nullopt;
}

Why device_of(const Json& v, OffloadDevice* out) {
  if (!v.is_string() || !parse_offload_device(v.get<std::string>(), out)) {
    return not_a(v, "\"none\", \"cpu\" or \"nvme\"");
  }
  return std::nullopt;
}

}  // namespace config_detail

// --- "did you mean" --------------------------------------------------------------------------

namespace {

bool equal_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

// The optimal string alignment distance from `a` to `b`: the fewest insertions, deletions,
// substitutions and swaps of two adjacent characters that turn one into the other, no character
// edited twice (Damerau-Levenshtein with that restriction; Damerau 1964, "A technique for
// computer detection and correction of spelling errors"). A swap is one edit, so "devcie" is one
// edit from "device". Row i of the table holds the distances from a's first i characters to each
// prefix of b; only the last three rows are kept.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  const std::size_t columns = b.size() + 1;
  std::vector<std::size_t> before(columns), last(columns), row(columns);
  for (std::size_t j = 0; j < columns; ++j) last[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    row[0] = i;
    for (std::size_t j = 1; j < columns; ++j) {
      const std::size_t substitute = last[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      row[j] = std::min({last[j] + 1, row[j - 1] + 1, substitute});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        row[j] = std::min(row[j], before[j - 2] + 1);
      }
    }
    std::swap(before, last);
    std::swap(last, row);
  }
  return last[b.size()];
}

}  // namespace

std::optional<std::string> misspelling_hint(std::span<const std::string_view> known,
                                            std::string_view name) {
  for (std::string_view k : known) {
    if (equal_ignoring_case(k, name)) {
      return fmt::format("keys are case-sensitive: \"{}\"", k);
    }
  }
  // A slip is at most two edits: one in a name of three to five characters, none in a shorter
  // one (every one-letter key is one edit from "x", and it is a slip of none of them), and one in
  // ten characters of a long name. Not more: whole words differ at a third of a name, and one
  // DeepSpeed key would be taken for a slip of another (gradient_accumulation_dtype is 3 edits
  // from gradient_accumulation_steps, offload_optimizer_states 7 from offload_optimizer).
  const std::size_t limit = std::max(std::min<std::size_t>(2, name.size() / 3), name.size() / 10);
  std::optional<std::string_view> nearest;
  std::size_t nearest_distance = limit + 1;
  for (std::string_view k : known) {
    // The lengths' difference is a floor on the distance; skipping on it also bounds the work
    // for a long key to the length of a known one.
    const std::size_t length_difference =
        name.size() > k.size() ? name.size() - k.size() : k.size() - name.size();
    if (length_difference > limit) continue;
    const std::size_t d = edit_distance(name, k);
    if (d < nearest_distance) {
      nearest = k;
      nearest_distance = d;
    }
  }
  if (!nearest) return std::nullopt;
  return fmt::format("did you mean \"{}\"?", *nearest);
}

namespace config_detail {

// --- the walk ---------------------------------------------------------------------------------

const Key* find_key(std::span<const Key> keys, std::string_view name) {
  for (const Key& k : keys) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

bool is_optimizer_param(std::string_view name);

// The sections under `path` (dotted) whose tables have a key `name`, each named once (bf16 and
// its older name bfloat16 share a table: the first is named).
void sections_with_key(std::span<const Key> keys, const std::string& path, std::string_view name,
                       std::vector<std::string>* out, std::vector<const Key*>* tables) {
  for (const Key& k : keys) {
    if (k.keys.empty()) continue;
    const std::string section = join(path, k.name);
    const bool seen = std::find(tables->begin(), tables->end(), k.keys.data()) != tables->end();
    if (!seen && find_key(k.keys, name) != nullptr) out->push_back(section);
    tables->push_back(k.keys.data());
    sections_with_key(k.keys, section, name, out, tables);
  }
}

// A key written under the wrong parent ("stage3_max_live_parameters" at the top level, "lr"
// beside the optimizer's "type", "pin_memory" directly under zero_optimization) is named with
// the section it belongs to: DeepSpeed ignores such a key at the top level and its sections
// refuse it, so either way the value never reaches the setting it was written for.
std::optional<std::string> wrong_parent_hint(std::string_view path, std::string_view name) {
  std::vector<std::string> sections;
  std::vector<const Key*> tables;
  if (!path.empty() && find_key(root_keys(), name) != nullptr) sections.push_back("the top level");
  sections_with_key(root_keys(), "", name, &sections, &tables);
  if (is_optimizer_param(name)) sections.push_back("optimizer.params");
  std::erase(sections, std::string(path));
  if (sections.empty()) return std::nullopt;
  std::string where = sections[0];
  for (std::size_t i = 1; i < sections.size(); ++i) {
    where += fmt::format("{}{}", i + 1 == sections.size() ? " or " : ", ", sections[i]);
  }
  return fmt::format("a key of {}, not of {}: move it there", where,
                     path.empty() ? "the top level" : path);
}

std::string unknown_key_why(std::span<const Key> keys, std::string_view path,
                            std::string_view name) {
  std::vector<std::string_view> known;
  for (const Key& k : keys) known.push_back(k.name);
  if (std::optional<std::string> hint = misspelling_hint(known, name)) {
    return fmt::format("unknown key ({})", *hint);
  }
  if (std::optional<std::string> hint = wrong_parent_hint(path, name)) {
    return fmt::format("unknown key here ({})", *hint);
  }
  return "unknown key (misspelt, or not supported by zinf)";
}

void walk_keys(const Json& object, const std::string& path, std::span<const Key> keys, Walk& w);

// Why a section's value that is not an object is refused. DeepSpeed still reads the form of
// zero_optimization its first releases documented, a boolean (its Getting Started tutorial's
// sample config has "zero_optimization": true): true is stage 1, false stage 0
// (deepspeed/runtime/zero/config.py, read_zero_config_deprecated). zinf reads only the object,
// so the refusal names the object that means the same.
std::string not_a_section_why(const std::string& key, const Json& value) {
  if (key == "zero_optimization" && value.is_boolean()) {
    const int stage = value.get<bool>() ? 1 : 0;
    return fmt::format(
        "{} is DeepSpeed's older form of {{\"stage\": {}}}{}; write the section as an object: "
        "\"zero_optimization\": {{\"stage\": {}}}",
        value.dump(), stage, stage == 0 ? " (ZeRO off)" : "", stage);
  }
  return not_a(value, "an object").value();
}

void walk_key(const Key& k, const Json& value, const std::string& key, Walk& w) {
  if (!k.refused.empty()) {
    if (k.refused_when_enabled && value.is_object()) {
      const auto enabled = value.find("enabled");
      if (enabled == value.end() || *enabled == false) {
        return w.no_effect(key,
                           fmt::format("disabled (\"enabled\" is {}): {}, and DeepSpeed "
                                       "does nothing with it either",
                                       enabled == value.end() ? "absent" : "false", k.refused));
      }
      return w.refuse(key, fmt::format("enabled: {}; \"enabled\": false has no effect", k.refused));
    }
    return w.refuse(key, std::string(k.refused));
  }
  if (value.is_string() && value.get<std::string>() == "auto") {
    // A key whose every value is accepted with no effect (it has no reader) takes "auto" as any
    // other value, for the same reason.
    const bool reads_value = k.read != nullptr || k.walk != nullptr || !k.keys.empty();
    if (!reads_value && !k.no_effect.empty()) return w.no_effect(key, std::string(k.no_effect));
    // DeepSpeed's ZeRO config models drop "auto" values (config_utils.py,
    // DeepSpeedConfigModel), so a field left "auto" (one the Trainer does not fill, such as
    // the short stage-3 names) has its default, readers or not. Not the stage: DeepSpeed's
    // default, 0, is not zinf's (3), and a config should say which it means.
    if (key.starts_with("zero_optimization.") && key != "zero_optimization.stage") {
      return w.no_effect(key, "\"auto\": the field's default, as DeepSpeed's ZeRO config reads it");
    }
    if (!k.auto_no_effect.empty()) return w.no_effect(key, std::string(k.auto_no_effect));
    // Elsewhere a key with a reader has values that matter, even where one of them has no
    // effect in zinf (aio.use_gds true, a 16-bit communication_data_type): DeepSpeed reads
    // "auto" there as the string itself (a truthy use_gds) or refuses it, and zinf, with no
    // value to take, refuses it rather than report a value the file does not hold.
    return w.refuse(key, std::string(kAutoWhy));
  }
  if (k.walk != nullptr || !k.keys.empty()) {
    if (!value.is_object()) return w.refuse(key, not_a_section_why(key, value));
    if (k.walk != nullptr) return k.walk(value, key, w);
    return walk_keys(value, key, k.keys, w);
  }
  if (k.read != nullptr) {
    if (Why why = k.read(value, w)) {
      w.note.clear();
      return w.refuse(key, *why);
    }
  }
  if (!k.no_effect.empty()) return w.no_effect(key, std::string(k.no_effect));
  w.used(key);
}

void walk_keys(const Json& object, const std::string& path, std::span<const Key> keys, Walk& w) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    const std::string key = join(path, it.key());
    const Key* k = find_key(keys, it.key());
    if (k == nullptr) {
      w.refuse(key, unknown_key_why(keys, path, it.key()));
      continue;
    }
    walk_key(*k, it.value(), key, w);
  }
}

// --- the optimizer ----------------------------------------------------------------------------
//
// DeepSpeed builds the optimizer in deepspeed/runtime/engine.py (_configure_basic_optimizer):
// "params" are passed as keyword arguments to DeepSpeedCPUAdam / FusedAdam (or torch.optim.Adam
// and AdamW with torch_adam), DeepSpeedCPUAdagrad (torch.optim.Adagrad without offload) and
// DeepSpeedCPULion / FusedLion, so a key that optimizer has no argument for is a TypeError there
// and refused here. docs/ENGINE.md tables the defaults and where each comes from.

struct ParamKey {
  std::string_view name;
  bool adam, adagrad, lion;  // which types take it
};

const ParamKey kOptimizerParamKeys[] = {
    {"lr", true, true, true},
    {"betas", true, false, true},
    {"eps", true, true, false},
    {"weight_decay", true, true, true},
    {"bias_correction", true, false, false},
    {"amsgrad", true, true, false},
    {"adam_w_mode", true, false, false},
    {"torch_adam", true, false, false},
    {"fp32_optimizer_states", true, true, true},
    {"lr_decay", false, true, false},
    {"initial_accumulator_value", false, true, false},
};

bool is_optimizer_param(std::string_view name) {
  for (const ParamKey& k : kOptimizerParamKeys) {
    if (k.name == name) return true;
  }
  return false;
}

Why read_optimizer_param(std::string_view name, const Json& v, Walk& w) {
  OptimizerInput& in = w.optimizer;
  if (name == "lr") return number_opt(v, &in.lr);
  if (name == "eps") return number_opt(v, &in.eps);
  if (name == "weight_decay") return number_opt(v, &in.weight_decay);
  if (name == "lr_decay") return number_opt(v, &in.lr_decay);
  if (name == "bias_correction") {
    bool b = true;
    if (Why bad = bool_of(v, &b)) return bad;
    if (in.torch_adam) {
      return std::string("is not an argument of torch.optim.Adam (torch_adam is true)");
    }
    in.bias_correction = b;
    return std::nullopt;
  }
  if (name == "betas") {
    if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number()) {
      return not_a(v, "a pair of numbers");
    }
    in.beta1 = v[0].get<double>();
    in.beta2 = v[1].get<double>();
    return std::nullopt;
  }
  if (name == "amsgrad") return only_bool(v, false, "AMSGrad is not implemented");
  if (name == "adam_w_mode") return bool_of(v, &in.adam_w_mode);
  if (name == "torch_adam") return bool_of(v, &in.torch_adam);
  if (name == "fp32_optimizer_states") {
    return only_bool(v, true, "zinf keeps the optimizer state in fp32");
  }
  if (name == "initial_accumulator_value") {
    double x = 0;
    if (Why bad = number_of(v, &x)) return bad;
    if (x != 0.0) return fmt::format("{} is not supported: the state sum starts at 0", v.dump());
    return std::nullopt;
  }
  return std::string("unknown key");
}

// The keys of the optimizer section itself (walk_optimizer reads them; this names them for the
// case hint).
const Key kOptimizerKeys[] = {{.name = "type"}, {.name = "params"}};

void walk_optimizer(const Json& section, const std::string& path, Walk& w) {
  // The type decides the defaults and which params keys mean anything, wherever it is written.
  OptimizerKind kind = w.config->optimizer.kind;
  bool typed = false;
  bool type_ok = true;
  if (section.contains("type")) {
    const Json& t = section.at("type");
    std::string text = t.is_string() ? t.get<std::string>() : "";
    for (char& ch : text) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    type_ok = t.is_string() && parse_optimizer(text, &kind);
    typed = type_ok;
  }
  const Json* params = nullptr;
  for (auto it = section.begin(); it != section.end(); ++it) {
    const std::string key = join(path, it.key());
    if (it.key() == "type") {
      if (type_ok) {
        w.used(key);
      } else {
        w.refuse(key, not_a(it.value(), "\"Adam\", \"AdamW\", \"Adagrad\" or \"Lion\"").value());
      }
    } else if (it.key() == "params") {
      if (!it.value().is_object()) {
        w.refuse(key, not_a(it.value(), "an object").value());
        continue;
      }
      params = &it.value();
      // torch_adam changes which other keys torch accepts: read it first.
      if (params->contains("torch_adam") && params->at("torch_adam").is_boolean()) {
        w.optimizer.torch_adam = params->at("torch_adam").get<bool>();
      }
      const bool adam = kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW;
      auto takes = [adam, kind](const ParamKey& c) {
        return adam ? c.adam : kind == OptimizerKind::kAdagrad ? c.adagrad : c.lion;
      };
      for (auto p = params->begin(); p != params->end(); ++p) {
        const std::string pkey = join(key, p.key());
        const ParamKey* pk = nullptr;
        for (const ParamKey& c : kOptimizerParamKeys) {
          if (c.name == p.key()) pk = &c;
        }
        if (p.key() == "max_grad_norm") {
          w.refuse(pkey, "DeepSpeed refuses it too: use the top-level gradient_clipping");
          continue;
        }
        if (pk == nullptr || !takes(*pk)) {
          // A slip of a parameter this type takes is named; a parameter of another type is not.
          std::optional<std::string> hint;
          if (pk == nullptr) {
            std::vector<std::string_view> known;
            for (const ParamKey& c : kOptimizerParamKeys) {
              if (takes(c)) known.push_back(c.name);
            }
            hint = misspelling_hint(known, p.key());
          }
          w.refuse(pkey,
                   fmt::format("unknown key (not a parameter of DeepSpeed's {}{}{})",
                               deepspeed_type_name(kind), hint ? "; " : "", hint ? *hint : ""));
          continue;
        }
        if (p.value().is_string() && p.value().get<std::string>() == "auto") {
          w.refuse(pkey, std::string(kAutoWhy));
          continue;
        }
        if (Why why = read_optimizer_param(p.key(), p.value(), w)) {
          w.refuse(pkey, *why);
        } else if (p.key() == "adam_w_mode" && kind == OptimizerKind::kAdamW) {
          w.no_effect(pkey, "type AdamW always decays decoupled (DeepSpeed: AdamW or adam_w_mode)");
        } else if (p.key() == "fp32_optimizer_states" || p.key() == "amsgrad" ||
                   p.key() == "initial_accumulator_value") {
          w.no_effect(pkey, "its value is zinf's only behaviour");
        } else {
          w.used(pkey);
        }
      }
    } else {
      w.refuse(key, unknown_key_why(kOptimizerKeys, path, it.key()));
    }
  }
  // DeepSpeed settles Adam's decay mode before it picks the class, so type "Adam" with
  // adam_w_mode (its default) and torch_adam is torch.optim.AdamW, with AdamW's defaults
  // (weight_decay 0.01). No type: zinf's default optimizer (Config's, torch.optim.AdamW's
  // defaults) with these params.
  const OptimizerInput& in = w.optimizer;
  if (kind == OptimizerKind::kAdam && in.adam_w_mode) kind = OptimizerKind::kAdamW;
  OptimizerParams o =
      typed ? deepspeed_optimizer_defaults(kind, in.torch_adam) : w.config->optimizer;
  o.kind = kind;
  if (in.lr) o.lr = *in.lr;
  if (in.beta1) o.beta1 = *in.beta1;
  if (in.beta2) o.beta2 = *in.beta2;
  if (in.eps) o.eps = *in.eps;
  if (in.weight_decay) o.weight_decay = *in.weight_decay;
  if (in.lr_decay) o.lr_decay = *in.lr_decay;
  if (in.bias_correction) o.bias_correction = *in.bias_correction;
  w.config->optimizer = o;
}

// --- the scheduler ----------------------------------------------------------------------------
//
// parse_scheduler_section() (engine/schedule.cpp) reads the section and names the first key it
// refuses; validate() checks the values against the optimizer's lr (LrSchedule::create()).
void walk_scheduler(const Json& section, const std::string& path, Walk& w) {
  const Json& params = section.contains("params") ? section.at("params") : Json::object();
  for (auto it = params.begin(); params.is_object() && it != params.end(); ++it) {
    if (it.value() == "auto") return w.refuse(path + ".params." + it.key(), std::string(kAutoWhy));
  }
  if (const Status s = parse_scheduler_section(section, &w.config->scheduler); !s.is_ok()) {
    const std::string message(s.message());
    const std::size_t colon = message.find(": ");
    return w.refuse(message.substr(0, colon), message.substr(colon + 2));
  }
  for (auto it = section.begin(); it != section.end(); ++it) {
    if (it.key() != "params") w.used(join(path, it.key()));
    for (auto p = params.begin(); it.key() == "params" && p != params.end(); ++p) {
      w.used(path + ".params." + p.key());
    }
  }
}

Status invalid(std::string_view key, std::string_view why) {
  return Status::invalid_argument(fmt::format("{}: {}", key, why));
}

// Marks `key` refused in `reports` with `why`: its own report, or, for a section (whose keys are
// reported, not itself), a report put before its first key's; else one at the end.
void refuse_report(std::vector<KeyReport>* reports, const std::string& key,
                   const std::string& why) {
  for (KeyReport& r : *reports) {
    if (r.key == key) {
      r.use = KeyUse::kRefused;
      r.why = why;
      return;
    }
  }
  const std::string prefix = key + ".";
  auto at = reports->begin();
  while (at != reports->end() && at->key.rfind(prefix, 0) != 0) ++at;
  reports->insert(at, {key, KeyUse::kRefused, why});
}

// DeepSpeed reads a config file with object_pairs_hook=dict_raise_error_on_duplicate_keys
// (deepspeed/runtime/config.py, DeepSpeedConfig.__init__): a key given twice in one object is an
// error there, where a JSON parser keeps one of the values. The parser calls this for every
// event; it collects the dotted name of each key seen twice in one object (an object inside an
// array is named by the array's key).
struct DuplicateKeys {
  struct Frame {
    std::string path;
    bool array = false;
    std::vector<std::string> keys;
    std::string last_key;
  };
  std::vector<Frame> frames;
  std::vector<std::string> duplicates;

  std::string child_path() const {
    if (frames.empty()) return "";
    const Frame& f = frames.back();
    return f.array ? f.path : join(f.path, f.last_key);
  }

  void on(Json::parse_event_t event, const Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        frames.push_back({child_path(), event == Json::parse_event_t::array_start, {}, ""});
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!frames.empty()) frames.pop_back();
        break;
      case Json::parse_event_t::key: {
        if (frames.empty() || !parsed.is_string()) break;
        Frame& f = frames.back();
        std::string key = parsed.get<std::string>();
        if (std::find(f.keys.begin(), f.keys.end(), key) != f.keys.end()) {
          const std::string dotted = join(f.path, key);
          if (std::find(duplicates.begin(), duplicates.end(), dotted) == duplicates.end()) {
            duplicates.push_back(dotted);
          }
        } else {
          f.keys.push_back(key);
        }
        f.last_key = std::move(key);
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
  }
};

// Names DeepSpeed reads as one setting: a field and its alias (DeepSpeedZeroConfig declares the
// stage-3 fields under short names with the "stage3_" spellings as aliases, and its model also
// takes the field names: deepspeed/runtime/zero/config.py, runtime/config_utils.py), a deprecated
// key and the key that replaces it (config_utils.py, _process_deprecated_field: "Cannot provide
// deprecated parameter ... and replacing parameter ... together"), and the bf16 section under its
// old name (precision_config.py, get_bfloat16_config reads "bfloat16" only without "bf16"). Two of
// one set in a file are refused, naming the later one: DeepSpeed refuses them or ignores one.
struct SameSetting {
  std::string_view section;  // "" for the root
  std::array<std::string_view, 2> names;
  std::string_view why;
};

constexpr std::string_view kAliasWhy = "DeepSpeed's other name for the same setting; give one";
constexpr std::string_view kDeprecatedWhy =
    "a deprecated key and the key that replaces it, which DeepSpeed refuses together";

const SameSetting kSameSettings[] = {
    {"zero_optimization", {"cpu_offload", "offload_optimizer"}, kDeprecatedWhy},
    {"zero_optimization", {"cpu_offload_param", "offload_param"}, kDeprecatedWhy},
    {"zero_optimization", {"cpu_offload_params", "offload_param"}, kDeprecatedWhy},
    {"zero_optimization",
     {"cpu_offload_param", "cpu_offload_params"},
     "two spellings of one deprecated key; give one"},
    {"zero_optimization",
     {"stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"},
     kDeprecatedWhy},
    {"zero_optimization",
     {"stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"},
     kDeprecatedWhy},
    {"zero_optimization",
     {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"},
     kAliasWhy},
    {"zero_optimization", {"stage3_prefetch_bucket_size", "prefetch_bucket_size"}, kAliasWhy},
    {"zero_optimization",
     {"stage3_param_persistence_threshold", "param_persistence_threshold"},
     kAliasWhy},
    {"zero_optimization",
     {"stage3_model_persistence_threshold", "model_persistence_threshold"},
     kAliasWhy},
    {"zero_optimization", {"stage3_max_live_parameters", "max_live_parameters"}, kAliasWhy},
    {"zero_optimization", {"stage3_max_reuse_distance", "max_reuse_distance"}, kAliasWhy},
    {"zero_optimization",
     {"stage3_module_granularity_threshold", "module_granularity_threshold"},
     kAliasWhy},
    {"zero_optimization",
     {"stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params"},
     kAliasWhy},
    {"zero_optimization", {"stage3_allgather_sequential", "allgather_sequential"}, kAliasWhy},
    {"", {"bf16", "bfloat16"}, "DeepSpeed reads \"bf16\" and ignores \"bfloat16\" beside it"},
};

void refuse_same_settings(const Json& root, std::vector<KeyReport>* reports) {
  for (const SameSetting& s : kSameSettings) {
    const Json* section = &root;
    if (!s.section.empty()) {
      const auto it = root.find(std::string(s.section));
      if (it == root.end() || !it->is_object()) continue;
      section = &*it;
    }
    // The later of the two in the file is refused, naming the earlier.
    std::string first;
    for (auto it = section->begin(); it != section->end(); ++it) {
      if (it.key() != s.names[0] && it.key() != s.names[1]) continue;
      if (first.empty()) {
        first = it.key();
        continue;
      }
      refuse_report(reports, join(s.section, it.key()),
                    fmt::format("given together with {}: {}", first, s.why));
    }
  }
}

// DeepSpeed needs a train_batch_size or a train_micro_batch_size_per_gpu ("Either train_batch_size
// or train_micro_batch_size_per_gpu needs to be provided": deepspeed/runtime/config.py,
// _set_batch_related_parameters). The Hugging Face Trainer writes both over their "auto" before
// DeepSpeed reads the file, so zinf takes "auto" there as not given and derives one from the
// other; but where neither has a number nothing gives the micro-batch size, and the default of 1
// would stand in for the value the Trainer would have written. Each "auto" of the two is refused
// then. A config with neither key keeps the default: it was not written for the Trainer.
void refuse_unfilled_batch_sizes(const Json& root, std::vector<KeyReport>* reports) {
  constexpr std::string_view kBatchKeys[] = {"train_batch_size", "train_micro_batch_size_per_gpu"};
  bool any_auto = false;
  for (std::string_view name : kBatchKeys) {
    const auto it = root.find(std::string(name));
    if (it == root.end()) continue;
    if (!it->is_string() || it->get<std::string>() != "auto") return;
    any_auto = true;
  }
  if (!any_auto) return;
  for (std::string_view name : kBatchKeys) {
    if (!root.contains(std::string(name))) continue;
    refuse_report(reports, std::string(name),
                  "\"auto\" is a placeholder that the Hugging Face Trainer fills in before "
                  "DeepSpeed reads the config, and with neither train_batch_size nor "
                  "train_micro_batch_size_per_gpu written nothing gives the micro-batch size: "
                  "write the value of one of them (DeepSpeed refuses a config with neither)");
  }
}

// DeepSpeed's deprecated switches for offload_param.device "cpu" (cpu_offload_param, and
// cpu_offload_params before it) ask, below stage 3, for what offload_param does there: DeepSpeed
// ignores both, and validate() refuses offload_param.device other than "none" (a config that
// asks for parameter offload where none happens is refused, not run without it). The switch is
// refused the same way, naming the key the file holds: validate() would name
// zero_optimization.offload_param.device, which the file does not contain.
void refuse_param_offload_switch(const Json& root, const Config& config,
                                 std::vector<KeyReport>* reports) {
  const auto zero = root.find("zero_optimization");
  if (zero == root.end() || !zero->is_object() || config.zero.stage == 3) return;
  for (const char* name : {"cpu_offload_param", "cpu_offload_params"}) {
    const auto it = zero->find(name);
    if (it == zero->end() || *it != true) continue;
    refuse_report(reports, join("zero_optimization", name),
                  fmt::format("true (parameters offloaded to the host) needs stage 3 (stage {} "
                              "keeps every parameter on the device; DeepSpeed ignores it below "
                              "stage 3, so it asks for nothing there: remove it)",
                              config.zero.stage));
  }
}

// Walks `text` into `config`, reporting every key; fails only when it is not a JSON object.
Status walk_text(std::string_view raw, Config* config, std::vector<KeyReport>* reports) {
  // The parser takes a NUL byte for the end of the text and would accept what comes before it.
  if (const std::size_t nul = raw.find('\0'); nul != std::string_view::npos) {
    return Status::invalid_argument(fmt::format(
        "config: a NUL byte at offset {} of {} (a config is JSON text)", nul, raw.size()));
  }
  const std::string text = strip_config_comments(raw);
  DuplicateKeys duplicates;
  Json root;
  try {
    root = Json::parse(text, [&duplicates](int, Json::parse_event_t event, Json& parsed) {
      duplicates.on(event, parsed);
      return true;
    });
  } catch (const Json::exception& error) {
    // Where the text stops being JSON: the parser's line, column and reason ("parse error at
    // line 3, column 5: syntax error while parsing ..."), or a number past a double's range
    // (out_of_range, not parse_error).
    std::string_view what = error.what();
    const std::size_t at = what.find("parse error");
    const std::size_t after_id = what.find("] ");
    what = at != std::string_view::npos         ? what.substr(at)
           : after_id != std::string_view::npos ? what.substr(after_id + 2)
                                                : what;
    return Status::invalid_argument(fmt::format("config: not valid JSON: {}", what));
  }
  if (!root.is_object()) return Status::invalid_argument("config: not a JSON object");
  Walk w;
  w.config = config;
  w.reports = reports;
  walk_keys(root, "", root_keys(), w);
  refuse_same_settings(root, reports);
  refuse_unfilled_batch_sizes(root, reports);
  refuse_param_offload_switch(root, *config, reports);
  for (const std::string& key : duplicates.duplicates) {
    refuse_report(reports, key,
                  "given twice in one object, which DeepSpeed refuses; a JSON reader would keep "
                  "only one of the values");
  }
  return Status::ok();
}

}  // namespace config_detail

namespace {

// Where the comment that starts at `i` of `s` ends (one past it; a line comment ends before its
// line break), or npos when none starts there. An unterminated /* is no comment: left as it is,
// the JSON error points at it.
std::size_t comment_end(std::string_view s, std::size_t i) {
  if (s[i] == '#' || s.substr(i, 2) == "//") {
    const std::size_t end = s.find('\n', i);
    return end == std::string_view::npos ? s.size() : end;
  }
  if (s.substr(i, 2) == "/*") {
    const std::size_t end = s.find("*/", i + 2);
    return end == std::string_view::npos ? std::string_view::npos : end + 2;
  }
  return std::string_view::npos;
}

}  // namespace

std::string strip_config_comments(std::string_view text) {
  std::string out(text);
  const std::size_t n = text.size();
  bool in_string = false;
  char last = '\0';  // the last character outside comments and white space (a string's is '"')
  for (std::size_t i = 0; i < n; ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (const std::size_t end = comment_end(text, i); end != std::string_view::npos) {
      for (std::size_t k = i; k < end; ++k) {
        if (out[k] != '\n') out[k] = ' ';
      }
      i = end - 1;
      continue;
    }
    if (std::isspace(static_cast<unsigned char>(c)) != 0) continue;
    const char before = last;
    last = c;
    if (c == '"') {
      in_string = true;
    } else if (c == ',' && before != '[' && before != '{' && before != ',') {
      // A trailing comma after a value: only white space and comments before the bracket.
      std::size_t j = i + 1;
      while (j < n) {
        if (std::isspace(static_cast<unsigned char>(text[j])) != 0) {
          ++j;
        } else if (const std::size_t skip = comment_end(text, j); skip != std::string_view::npos) {
          j = skip;
        } else {
          break;
        }
      }
      if (j < n && (text[j] == '}' || text[j] == ']')) out[i] = ' ';
    }
  }
  return out;
}

OptimizerParams deepspeed_optimizer_defaults(OptimizerKind kind, bool torch_adam) {
  OptimizerParams o;
  o.kind = kind;
  o.lr = 1e-3;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.bias_correction = true;
  o.lr_decay = 0.0;
  switch (kind) {
    case OptimizerKind::kAdam:
      o.weight_decay = 0.0;  // DeepSpeedCPUAdam, FusedAdam, torch.optim.Adam
      break;
    case OptimizerKind::kAdamW:
      // DeepSpeedCPUAdam and FusedAdam: 0; torch.optim.AdamW (torch_adam): 0.01.
      o.weight_decay = torch_adam ? 1e-2 : 0.0;
      break;
    case OptimizerKind::kAdagrad:
      // DeepSpeedCPUAdagrad and torch.optim.Adagrad agree.
      o.lr = 1e-2;
      o.eps = 1e-10;
      o.weight_decay = 0.0;
      break;
    case OptimizerKind::kLion:
      // DeepSpeedCPULion and FusedLion.
      o.weight_decay = 0.0;
      break;
  }
  return o;
}

std::string_view key_use_name(KeyUse use) {
  switch (use) {
    case KeyUse::kUsed:
      return "used";
    case KeyUse::kNoEffect:
      return "accepted, no effect in zinf";
    case KeyUse::kRefused:
      return "refused";
  }
  return "?";
}

std::string_view offload_device_name(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kHost:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "?";
}

bool parse_offload_device(std::string_view text, OffloadDevice* device) {
  if (text == "none") {
    *device = OffloadDevice::kNone;
  } else if (text == "cpu") {
    *device = OffloadDevice::kHost;
  } else if (text == "nvme") {
    *device = OffloadDevice::kNvme;
  } else {
    return false;
  }
  return true;
}

namespace {

// Erases the key at dotted path `key` from `root`; false when there is none.
bool erase_key(config_detail::Json& root, const std::string& key) {
  config_detail::Json* at = &root;
  std::size_t begin = 0;
  for (;;) {
    const std::size_t dot = key.find('.', begin);
    const std::string part = key.substr(begin, dot == std::string::npos ? dot : dot - begin);
    if (!at->is_object() || !at->contains(part)) return false;
    if (dot == std::string::npos) return at->erase(part) == 1;
    at = &(*at)[part];
    begin = dot + 1;
  }
}

}  // namespace

Result<std::vector<KeyReport>> check_config(std::string_view json_text) {
  Config c;
  std::vector<KeyReport> reports;
  ZINF_RETURN_IF_ERROR(config_detail::walk_text(json_text, &c, &reports));
  for (const KeyReport& r : reports) {
    if (r.use == KeyUse::kRefused) return reports;  // the first of them is parse_config()'s
  }
  // Every key was read: the values validate() refuses (a value out of range, a combination),
  // each against the key it names. validate() stops at the first (parse_config()'s error), so the
  // file is read again without each key refused so far, until it passes: every such refusal
  // shows at once, not one per round of edits.
  config_detail::Json root = config_detail::Json::parse(strip_config_comments(json_text), nullptr,
                                                        /*allow_exceptions=*/false);
  for (std::size_t round = 0; round <= reports.size(); ++round) {
    const Status s = validate(c);
    if (s.is_ok()) break;
    const std::string message(s.message());
    const std::string key = message.substr(0, message.find(": "));
    const std::string why =
        message.size() > key.size() + 2 ? message.substr(key.size() + 2) : message;
    config_detail::refuse_report(&reports, key, why);
    if (root.is_discarded() || !erase_key(root, key)) break;
    c = Config();
    std::vector<KeyReport> again;
    if (!config_detail::walk_text(root.dump(), &c, &again).is_ok()) break;
  }
  // The stage-3 keys read at stages 1-2 change nothing there (nor in DeepSpeed): said so, so
  // that a user does not take them for a setting of the run.
  if (c.zero.stage < 3) {
    for (KeyReport& r : reports) {
      if (r.use != KeyUse::kUsed) continue;
      for (std::string_view key :
           {"zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.prefetch_bucket_size",
            "zero_optimization.stage3_max_live_parameters", "zero_optimization.max_live_parameters",
            "zero_optimization.stage3_param_persistence_threshold",
            "zero_optimization.param_persistence_threshold"}) {
        if (r.key == key) {
          r.use = KeyUse::kNoEffect;
          r.why = fmt::format(
              "read at stage 3 only (the parameters' gathers); this config runs "
              "stage {}",
              c.zero.stage);
        }
      }
    }
  }
  return reports;
}

Result<Config> parse_config(std::string_view json_text) {
  Config c;
  std::vector<KeyReport> reports;
  ZINF_RETURN_IF_ERROR(config_detail::walk_text(json_text, &c, &reports));
  for (const KeyReport& r : reports) {
    if (r.use == KeyUse::kRefused) return config_detail::invalid(r.key, r.why);
  }
  ZINF_RETURN_IF_ERROR(validate(c));
  if (c.world_size > 0) ZINF_RETURN_IF_ERROR(resolve_batch_sizes(c.world_size, &c));
  return c;
}

Status resolve_batch_sizes(int world_size, Config* config) {
  Config& c = *config;
  if (c.train_batch_size == 0 || world_size < 1) return Status::ok();
  const auto world = static_cast<std::size_t>(world_size);
  // DeepSpeed derives the missing count by floor division and then checks the product, so a
  // train_batch_size that the others do not divide is refused, not rounded.
  auto divide = [](std::size_t a, std::size_t b) { return b == 0 ? 0 : a / b; };
  // A count counts as given where the reader saw its key, or where it is not the default of 1:
  // a Config built in code sets the fields without the flags, and its micro-batch and steps are
  // as much the program's choice as a file's keys. (A count of 1 set in code without its flag is
  // derived like a missing one; where the three already agree, the derivation gives it back.)
  const bool micro_given = c.train_micro_batch_given || c.train_micro_batch_size_per_gpu != 1;
  const bool steps_given = c.gradient_accumulation_given || c.gradient_accumulation_steps != 1;
  // Which count was derived, for the message.
  std::string_view derived;
  if (micro_given && !steps_given) {
    c.gradient_accumulation_steps =
        divide(divide(c.train_batch_size, c.train_micro_batch_size_per_gpu), world);
    derived = "gradient_accumulation_steps";
  } else if (!micro_given && steps_given) {
    c.train_micro_batch_size_per_gpu =
        divide(divide(c.train_batch_size, world), c.gradient_accumulation_steps);
    derived = "train_micro_batch_size_per_gpu";
  } else if (!micro_given) {
    c.gradient_accumulation_steps = 1;
    c.train_micro_batch_size_per_gpu = divide(c.train_batch_size, world);
    derived = "train_micro_batch_size_per_gpu";
  }
  const std::size_t product =
      c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * world;
  if (product != c.train_batch_size) {
    const std::string how = derived.empty()
                                ? std::string()
                                : fmt::format(
                                      "; {} was derived from the others, rounded down as "
                                      "DeepSpeed does: give a train_batch_size they divide",
                                      derived);
    return config_detail::invalid(
        "train_batch_size", fmt::format("{} is not train_micro_batch_size_per_gpu {} x "
                                        "gradient_accumulation_steps {} x {} ranks ({}){}",
                                        c.train_batch_size, c.train_micro_batch_size_per_gpu,
                                        c.gradient_accumulation_steps, world_size, product, how));
  }
  c.train_micro_batch_given = true;
  c.gradient_accumulation_given = true;
  return Status::ok();
}

Result<std::string> read_config_file(const std::string& path) {
  // A directory opens for reading (open(2) allows it) and then reads as nothing, which the parser
  // would report as JSON that ends too early: say what it is instead.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return status_from_errno(fmt::format("config {}", path), EISDIR);
  }
  std::ifstream file(path);
  if (!file) return status_from_errno(fmt::format("config {}", path), errno);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

Result<Config> load_config(const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(const std::string text, read_config_file(path));
  Result<Config> c = parse_config(text);
  if (!c.is_ok()) return c.status().with_context(path);
  return c;
}

}  // namespace zinf
