// zinf config check FILE: what zinf does with each key of a DeepSpeed config. Every key (the
// keys of sections, not the sections) is printed in file order with "used", "accepted, no effect
// in zinf (why)" or "refused (why)"; the exit code is 0 when the engine would accept the file, 1
// otherwise (a refused key, or a file that cannot be read or is not a JSON object). The reports
// come from zinf::check_config(), the walk parse_config() makes: every key refused, and, when none
// is, every value validate() refuses (parse_config() names the first of those it finds). An
// accepted file that still lacks what Engine::open needs (an nvme_path for state offloaded to nvme)
// gets a "note:" line naming the key.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <string>
#include <vector>

#include "command.hpp"
#include "zinf/config.hpp"
#include "zinf/status.hpp"

namespace zinf::cli {
namespace {

// What a file the walk accepts still lacks for Engine::open: the NVMe directories, which a C++
// program may give through Env::nvme_paths instead.
std::vector<std::string> open_notes(std::string_view text) {
  std::vector<std::string> notes;
  Result<Config> config = parse_config(text);
  if (!config.is_ok()) return notes;
  const ZeroConfig& z = config->zero;
  const bool opt_nvme = z.offload_optimizer.device == OffloadDevice::kNvme;
  const bool param_nvme = z.stage == 3 && z.offload_param.device == OffloadDevice::kNvme;
  const char* unless = "Engine::open refuses it unless the program gives Env::nvme_paths";
  if (opt_nvme && z.offload_optimizer.nvme_path.empty()) {
    notes.push_back(fmt::format(
        "zero_optimization.offload_optimizer.nvme_path: empty, and the optimizer state is "
        "offloaded to nvme: {}",
        unless));
  }
  if (param_nvme && z.offload_param.nvme_path.empty() && z.offload_optimizer.nvme_path.empty()) {
    notes.push_back(fmt::format(
        "zero_optimization.offload_param.nvme_path: empty, and the parameters are offloaded to "
        "nvme: {}",
        unless));
  }
  return notes;
}

// Where a config leaves to zinf's defaults what a DeepSpeed user might expect otherwise: the
// optimizer and the stage.
std::vector<std::string> default_notes(const std::vector<KeyReport>& reports) {
  const auto given = [&](std::string_view key) {
    return std::any_of(reports.begin(), reports.end(), [&](const KeyReport& r) {
      return r.key == key || (r.key.starts_with(key) && r.key[key.size()] == '.');
    });
  };
  std::vector<std::string> notes;
  if (!given("optimizer")) {
    const OptimizerParams o;
    notes.push_back(fmt::format(
        "no \"optimizer\" section: the engine runs AdamW with torch's defaults (lr {}, "
        "weight_decay {}), where DeepSpeed would use the program's own optimizer object: write "
        "the section to choose",
        o.lr, o.weight_decay));
  }
  // A zero_optimization that is itself reported (refused: not an object) has a verdict of its
  // own; for `true` or `false`, DeepSpeed's older form, it says what to write.
  const bool section_reported = std::any_of(reports.begin(), reports.end(), [](const KeyReport& r) {
    return r.key == "zero_optimization";
  });
  if (!given("zero_optimization.stage") && !section_reported) {
    notes.push_back(
        "no zero_optimization.stage: zinf runs stage 3 (DeepSpeed's default is 0, ZeRO off; "
        "the numbers are the same)");
  }
  return notes;
}

struct CheckOptions {
  std::string file;
  bool json = false;
};

void run_check(const CheckOptions& o) {
  Result<std::string> text = read_config_file(o.file);
  if (!text.is_ok()) {
    fail(text.status().to_string());
    return;
  }
  Result<std::vector<KeyReport>> reports = check_config(*text);
  if (!reports.is_ok()) {
    fail(fmt::format("{}: {}", o.file, reports.status().message()));
    return;
  }
  int refused = 0;
  for (const KeyReport& r : *reports) refused += r.use == KeyUse::kRefused ? 1 : 0;
  std::vector<std::string> notes = default_notes(*reports);
  if (refused == 0) {
    for (std::string& note : open_notes(*text)) notes.push_back(std::move(note));
  }
  if (o.json) {
    nlohmann::json keys = nlohmann::json::array();
    for (const KeyReport& r : *reports) {
      keys.push_back({{"key", r.key}, {"use", std::string(key_use_name(r.use))}, {"why", r.why}});
    }
    print_json({{"file", o.file}, {"accepted", refused == 0}, {"keys", keys}, {"notes", notes}});
  } else {
    std::size_t width = 0;
    for (const KeyReport& r : *reports) width = std::max(width, r.key.size());
    for (const KeyReport& r : *reports) {
      if (r.use == KeyUse::kUsed && r.why.empty()) {
        fmt::print("{:<{}}  used\n", r.key, width);
      } else {
        // A used key with a why is read other than at its face.
        fmt::print("{:<{}}  {} ({})\n", r.key, width, key_use_name(r.use), r.why);
      }
    }
    for (const std::string& note : notes) fmt::print("note: {}\n", note);
    if (refused == 0) {
      fmt::print("{}: accepted ({} keys)\n", o.file, reports->size());
    } else {
      fmt::print("{}: refused ({} of {} keys refused)\n", o.file, refused, reports->size());
    }
  }
  set_exit_code(refused == 0 ? 0 : 1);
}

void setup_config(CLI::App& app) {
  CLI::App* config = group(app, "config", "Read a DeepSpeed config as zinf does");
  auto o = std::make_shared<CheckOptions>();
  CLI::App* sub = config->add_subcommand(
      "check", "Print what zinf does with each key of FILE: used, no effect, or refused");
  sub->add_option("FILE", o->file, "The config (JSON)")->required();
  sub->add_flag("--json", o->json, "Print one JSON object");
  sub->callback([o] { run_check(*o); });
}

}  // namespace

ZINF_COMMAND("config", setup_config);

}  // namespace zinf::cli
