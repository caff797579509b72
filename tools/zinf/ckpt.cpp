// zinf ckpt: checkpoints outside a training job.
//   zinf ckpt inspect DIR [--json] [--no-verify]   the tags, world size, stage, parameters,
//                                                   sizes and whether every checksum matches;
//                                                   problems (a `latest` that names no complete
//                                                   tag, a tag whose manifest does not read)
//                                                   below, exit 1 on any; saves in progress or
//                                                   cut short as notes
//   zinf ckpt export DIR [--tag T] --out FILE [--dtype fp32|f32|bf16]
//                                                   every parameter's full fp32 master (from
//                                                   any world size) as one safetensors file
#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

#include "command.hpp"
#include "engine/checkpoint.hpp"
#include "zinf/dtype.hpp"

namespace zinf::cli {
namespace {

struct InspectOptions {
  std::string dir;
  bool json = false;
  bool no_verify = false;
};

void run_inspect(const InspectOptions& o) {
  Result<nlohmann::json> info = inspect_checkpoints(o.dir, !o.no_verify);
  if (!info.is_ok()) return fail(info.status().to_string());
  const nlohmann::json& j = *info;
  // Exit 1 on any problem, in either form of the output.
  if (!j["problems"].empty()) set_exit_code(1);
  if (o.json) return print_json(j);
  fmt::print("{}: latest {}\n", o.dir,
             j["latest"].is_null() ? std::string("(none)") : j["latest"].get<std::string>());
  Table table({"tag", "step", "world", "stage", "optimizer", "params", "elements", "state",
               "on disk", "checksums"});
  for (const nlohmann::json& t : j["tags"]) {
    std::string checksums = t["checksums"].get<std::string>();
    // The check's message is among the problems, below the table.
    if (checksums != "ok" && !o.no_verify) checksums = "FAILED (below)";
    // A tag read where a replacing save moved it aside (a note below says so).
    std::string tag = t["tag"].get<std::string>();
    if (t["dir"].get<std::string>() != o.dir + "/" + tag) tag += " (." + tag + ".old)";
    table.add_row({tag, std::to_string(t["step"].get<std::int64_t>()),
                   std::to_string(t["world_size"].get<int>()),
                   std::to_string(t["stage"].get<int>()), t["optimizer"].get<std::string>(),
                   std::to_string(t["parameters"].get<std::size_t>()),
                   std::to_string(t["parameter_elements"].get<std::uint64_t>()),
                   format_bytes(t["bytes"].get<double>()),
                   format_bytes(t["disk_bytes"].get<double>()), checksums});
  }
  table.print();
  for (const nlohmann::json& p : j["problems"]) fmt::print("problem: {}\n", p.get<std::string>());
  for (const nlohmann::json& n : j["notes"]) fmt::print("note: {}\n", n.get<std::string>());
}

struct ExportOptions {
  std::string dir;
  std::string tag;
  std::string out;
  std::string dtype = "fp32";
};

void run_export(const ExportOptions& o) {
  const DType dtype = *parse_dtype(o.dtype);  // one of --dtype's names (IsMember)
  const Status st = export_checkpoint_safetensors(o.dir, o.tag, o.out, dtype);
  if (!st.is_ok()) return fail(st.to_string());
  // The tag exported: the one given, or the one `latest` named.
  std::string tag = o.tag;
  if (tag.empty()) {
    Result<std::unique_ptr<IoEngine>> io = open_checkpoint_io(nullptr);
    Result<std::string> latest =
        io.is_ok() ? read_latest_tag(**io, o.dir) : Result<std::string>(io.status());
    tag = latest.is_ok() ? *latest : "latest";
  }
  fmt::print("wrote {} (tag {}, {})\n", o.out, tag, o.dtype);
}

void setup_ckpt(CLI::App& app) {
  CLI::App* ckpt = group(app, "ckpt", "Inspect and export checkpoints");
  auto inspect = std::make_shared<InspectOptions>();
  CLI::App* sub = ckpt->add_subcommand(
      "inspect", "List a checkpoint directory's tags and check every file's checksum");
  sub->add_option("dir", inspect->dir, "Checkpoint directory")->required();
  sub->add_flag("--json", inspect->json, "Print one JSON object");
  sub->add_flag("--no-verify", inspect->no_verify, "Skip reading the files for their checksums");
  sub->callback([inspect] { run_inspect(*inspect); });

  auto exp = std::make_shared<ExportOptions>();
  sub = ckpt->add_subcommand("export",
                             "Write every parameter's full fp32 master as one safetensors file");
  sub->add_option("dir", exp->dir, "Checkpoint directory")->required();
  sub->add_option("--tag", exp->tag, "Tag (default: the one `latest` names)");
  sub->add_option("--out", exp->out, "safetensors file to write")->required();
  // f32 is DType's own name for fp32 (dtype_name(DType::kF32)), so both are taken.
  sub->add_option("--dtype", exp->dtype, "fp32 (or f32) or bf16 (rounded to nearest even)")
      ->check(CLI::IsMember({"fp32", "f32", "bf16"}))
      ->capture_default_str();
  sub->callback([exp] { run_export(*exp); });
}

}  // namespace

ZINF_COMMAND("ckpt", setup_ckpt);

}  // namespace zinf::cli
