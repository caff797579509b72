// zinf plan: does this model fit these machines, where does each byte go, and what does a step
// cost in time. See docs/PLAN.md; the formulas are in lib/plan/{estimate,time_model,planner}.hpp.
//
// Exit codes: 0 a plan fits (or --step-only predicted); 1 bad options or a failed measurement;
// 2 nothing fits the budgets (stderr names the short tier and the shortfall).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "base/cpu.hpp"
#include "command.hpp"
#include "plan/config.hpp"
#include "plan/estimate.hpp"
#include "plan/model.hpp"
#include "plan/planner.hpp"
#include "plan/profile.hpp"
#include "plan/time_model.hpp"

namespace zinf::cli {
namespace {

// --tier, --grads-tier, --half-tier: "nvme" or "host" ("cpu" too, DeepSpeed's word for host).
bool parse_tier_flag(std::string_view text, OffloadDevice* device) {
  if (text == "host") {
    *device = OffloadDevice::kHost;
    return true;
  }
  return parse_offload_device(text, device) && *device != OffloadDevice::kNone;
}

using namespace zinf::plan;

struct PlanOptions {
  std::string model;
  std::string params;
  std::uint64_t layers = 0;
  std::uint64_t hidden = 0;
  std::uint64_t vocab = 32000;
  std::uint64_t seq = 2048;
  std::uint64_t micro_batch = 1;
  std::uint64_t grad_accum = 1;
  bool checkpoint_activations = false;
  bool offload_activations = false;
  bool no_flash_attention = false;
  bool no_overlap_step = false;
  double overlap_fraction = 2.0 / 3.0;
  bool gradient_clipping = false;
  bool fp16 = false;
  std::string trainable;  // "": every parameter trains
  // Text, parsed in run_plan: CLI11 reads "-1" into an unsigned option as 2^64 - 1.
  std::string lora_rank_text;
  std::uint64_t lora_rank = 0;
  bool lora_rank_given = false;  // --lora-rank 0 is refused, not taken as absent
  std::string lora_targets = "q,v";
  bool lora_targets_given = false;
  bool frozen_exact = false;  // the frozen values are exact in the half dtype
  std::string arch = "transformer";
  std::uint64_t context_bytes = 16;
  std::uint64_t embed_dim = 16;
  std::uint64_t gpus = 1;
  std::uint64_t gpus_per_machine = 0;
  std::string gpu_mem;
  std::string host_mem;
  std::string device_reserved;  // "": the engine's default (zinf.device_reserved_bytes)
  std::string nvme_capacity = "0";
  std::string nvme_path;
  double headroom = 0.10;
  int stage = 0;
  std::string offload_optimizer;
  std::string offload_param;
  std::string machine_profile;
  std::string io_profile;
  std::string save_profile;
  bool measure = false;
  bool no_gradient_spill = false;
  std::string measure_bytes = "auto";
  double mem_adam_gbps = 0;
  double nvme_read_gbps = 0;
  double nvme_write_gbps = 0;
  double nvme_duplex_gbps = 0;
  double h2d_gbps = 0;
  double gpu_mem_gbps = 0;
  double gpu_tflops = 0;
  double gpu_link_gbps = 0;
  std::string out;
  bool json = false;
  bool list_models = false;
  // --step-only: the flags of `zinf bench step`.
  bool step_only = false;
  std::string tier = "nvme";
  std::string path;
  std::string sub_group = "64MiB";
  std::string pool = "1GiB";
  std::string grads_tier = "nvme";
  std::string half_tier = "nvme";
  bool half_tier_given = false;
  double compute_s = 0;
  bool host_compute = false;
};

std::string gib(double bytes) { return format_bytes(bytes); }
std::string secs(double s) { return s > 0 ? fmt::format("{:.3f} s", s) : "-"; }

bool parse_size_option(const std::string& flag, const std::string& text, std::uint64_t* out,
                       bool decimal = false) {
  std::size_t value = 0;
  if (!parse_size(text, &value, decimal)) {
    fail(fmt::format("{} {}: not a size (e.g. 48GB, 256GiB, 4TB)", flag, text));
    return false;
  }
  *out = value;
  return true;
}

// Builds the machine profile: defaults, then the profile file, then command-line figures, then
// measures now whatever is still missing and needed. Returns false after fail() on error.
// `working_set_bytes`: the NVMe bytes the predicted run touches, the size the disk is measured
// at under --measure-bytes auto (caches below O_DIRECT, of a virtual disk's host or a drive's
// SLC, hold a small test file but not a large working set).
bool resolve_profile(const PlanOptions& o, bool need_nvme, const std::string& nvme_dir,
                     std::uint64_t working_set_bytes, MachineProfile* p, nlohmann::json* notes) {
  const bool explicit_file = !o.machine_profile.empty();
  const std::string path = explicit_file ? o.machine_profile : default_profile_path();
  if (!o.measure) {
    const Status s = load_machine_profile(path, 1 << 20, 32, p);
    if (!s.is_ok() && (explicit_file || s.code() != Code::kNotFound)) {
      fail(fmt::format("--machine-profile: {}", s.to_string()));
      return false;
    }
    if (!s.is_ok()) notes->push_back(fmt::format("no machine profile at {}", path));
    if (need_nvme && (p->nvme_read_gbps <= 0 || p->nvme_write_gbps <= 0)) {
      const bool explicit_tune = !o.io_profile.empty();
      const std::string tune = explicit_tune ? o.io_profile : default_io_tune_path();
      const Status t = load_machine_profile(tune, 1 << 20, 32, p);
      if (!t.is_ok() && (explicit_tune || t.code() != Code::kNotFound)) {
        fail(fmt::format("--io-profile: {}", t.to_string()));
        return false;
      }
      if (!t.is_ok()) notes->push_back(fmt::format("no zinf io tune results at {}", tune));
    }
  }
  // One direction's rate alone cannot be used (the model needs both); say so rather than drop it.
  if ((o.nvme_read_gbps > 0) != (o.nvme_write_gbps > 0)) {
    fail(o.nvme_read_gbps > 0
             ? fmt::format("--nvme-read-gbps {} needs --nvme-write-gbps too", o.nvme_read_gbps)
             : fmt::format("--nvme-write-gbps {} needs --nvme-read-gbps too", o.nvme_write_gbps));
    return false;
  }
  if (o.nvme_duplex_gbps > 0 && o.nvme_read_gbps <= 0) {
    fail(fmt::format("--nvme-duplex-gbps {} needs --nvme-read-gbps and --nvme-write-gbps too",
                     o.nvme_duplex_gbps));
    return false;
  }
  auto given = [](double v, double* field, std::string* source, const char* flag) {
    if (v > 0) {
      *field = v;
      if (source != nullptr) *source = flag;
    }
  };
  given(o.mem_adam_gbps, &p->mem_adam_gbps, &p->memory_source, "--mem-adam-gbps");
  if (o.nvme_read_gbps > 0 && o.nvme_write_gbps > 0) {
    p->nvme_read_gbps = o.nvme_read_gbps;
    p->nvme_write_gbps = o.nvme_write_gbps;
    p->nvme_duplex_gbps = o.nvme_duplex_gbps;
    p->nvme_source = "--nvme-read-gbps/--nvme-write-gbps";
  }
  std::string gpu_flags;
  given(o.h2d_gbps, &p->h2d_gbps, &gpu_flags, "options");
  given(o.gpu_mem_gbps, &p->gpu_mem_gbps, &gpu_flags, "options");
  given(o.gpu_tflops, &p->gpu_tflops, &gpu_flags, "options");
  given(o.gpu_link_gbps, &p->gpu_link_gbps, &gpu_flags, "options");
  if (!gpu_flags.empty()) p->gpu_source = "options (--h2d-gbps etc.), defaults for the rest";

  if (p->mem_adam_gbps <= 0) {
    p->mem_adam_gbps = measure_adam_gbps(std::uint64_t{128} << 20, 3);
    p->memory_source = "measured now (Adam pattern, 30 B/param, 128 MiB streams, median of 3)";
    notes->push_back("memory bandwidth measured now: --save-profile " + path +
                     " (or zinf probe --json saved there) skips this next time");
  }
  if (need_nvme && (p->nvme_read_gbps <= 0 || p->nvme_write_gbps <= 0)) {
    if (nvme_dir.empty()) {
      fail(
          "no NVMe rates: give --nvme-path DIR to measure them now, --nvme-read-gbps and "
          "--nvme-write-gbps, or a machine profile with nvme_read_gbps/nvme_write_gbps");
      return false;
    }
    std::uint64_t measure_bytes = 0;
    if (o.measure_bytes == "auto") {
      measure_bytes = std::clamp<std::uint64_t>(working_set_bytes, std::uint64_t{2} << 30,
                                                std::uint64_t{32} << 30);
    } else if (!parse_size_option("--measure-bytes", o.measure_bytes, &measure_bytes)) {
      return false;
    }
    Result<DiskRates> rates = measure_disk(nvme_dir, measure_bytes, 1 << 20, 32);
    if (!rates.is_ok()) {
      fail(fmt::format("measuring NVMe rates: {}", rates.status().to_string()));
      return false;
    }
    p->nvme_read_gbps = rates->read_gbps;
    p->nvme_write_gbps = rates->write_gbps;
    p->nvme_duplex_gbps = rates->duplex_gbps;
    p->nvme_block_bytes = 1 << 20;
    p->nvme_queue_depth = 32;
    p->nvme_source = fmt::format(
        "measured now on {} (a swap space through the I/O engine: writes, reads, both at once; "
        "{}, 1 MiB pieces, depth 32)",
        nvme_dir, format_bytes(static_cast<double>(measure_bytes)));
    notes->push_back(
        "NVMe rates measured now with a short simple test: `zinf io tune` gives better ones");
  }
  if (p->cpu_cores <= 0) p->cpu_cores = cpu_count();
  if (!o.save_profile.empty()) {
    const Status s = save_machine_profile(o.save_profile, *p);
    if (!s.is_ok()) {
      fail(fmt::format("--save-profile: {}", s.to_string()));
      return false;
    }
    notes->push_back(fmt::format("machine profile saved to {}", o.save_profile));
  }
  return true;
}

nlohmann::json profile_json(const MachineProfile& p) {
  return {{"mem_adam_gbps", p.mem_adam_gbps},
          {"nvme_read_gbps", p.nvme_read_gbps},
          {"nvme_block_bytes", p.nvme_block_bytes},
          {"nvme_queue_depth", p.nvme_queue_depth},
          {"nvme_write_gbps", p.nvme_write_gbps},
          {"nvme_duplex_gbps", p.nvme_duplex_gbps},
          {"h2d_gbps", p.h2d_gbps},
          {"gpu_mem_gbps", p.gpu_mem_gbps},
          {"gpu_tflops", p.gpu_tflops},
          {"gpu_link_gbps", p.gpu_link_gbps},
          {"memory_source", p.memory_source},
          {"nvme_source", p.nvme_source},
          {"gpu_source", p.gpu_source}};
}

nlohmann::json parts_json(const StepPrediction& t) {
  return {{"forward_backward_s", t.forward_backward_s},
          {"compute_s", t.compute_s},
          {"collectives_s", t.collectives_s},
          {"param_fetch_s", t.param_fetch_s},
          {"grad_offload_s", t.grad_offload_s},
          {"optimizer_step_s", t.optimizer_step_s},
          {"optimizer_hidden_s", t.optimizer_hidden_s},
          {"pipeline_s", t.pipeline_s},
          {"io_alone_s", t.io_alone_s},
          {"io_read_s", t.io_read_s},
          {"io_write_s", t.io_write_s},
          {"update_alone_s", t.update_alone_s},
          {"param_upload_s", t.param_upload_s},
          {"publish_gather_s", t.publish_gather_s},
          {"step_reduce_s", t.step_reduce_s},
          {"reduce_scatter_bytes", t.reduce_scatter_bytes},
          {"all_gather_bytes", t.all_gather_bytes},
          {"sub_groups", t.sub_groups},
          {"buffers", t.buffers},
          {"nvme_read_bytes", t.nvme_read_bytes},
          {"nvme_write_bytes", t.nvme_write_bytes},
          {"adam_memory_bytes", t.adam_memory_bytes}};
}

// Whether every count is at least 1; fails naming the first flag that is 0.
bool counts_positive(std::initializer_list<std::pair<const char*, std::uint64_t>> counts) {
  for (const auto& [flag, value] : counts) {
    if (value == 0) {
      fail(fmt::format("{} 0: must be at least 1", flag));
      return false;
    }
  }
  return true;
}

void run_step_only(const PlanOptions& o) {
  StepOnlySpec spec;
  if (o.params.empty()) {
    fail("--step-only needs --params N (e.g. 1G)");
    return;
  }
  if (!parse_size_option("--params", o.params, &spec.params, /*decimal=*/true) ||
      !parse_size_option("--sub-group", o.sub_group, &spec.sub_group_bytes) ||
      !parse_size_option("--pool", o.pool, &spec.pool_bytes)) {
    return;
  }
  if (!parse_tier_flag(o.tier, &spec.tier)) {
    fail(fmt::format("--tier {}: must be nvme or host", o.tier));
    return;
  }
  for (auto [flag, text, field] : {std::tuple{"--grads-tier", &o.grads_tier, &spec.grads_on_nvme},
                                   std::tuple{"--half-tier", &o.half_tier, &spec.half_on_nvme}}) {
    OffloadDevice t = OffloadDevice::kNone;
    if (!parse_tier_flag(*text, &t)) {
      fail(fmt::format("{} {}: must be nvme or host", flag, *text));
      return;
    }
    *field = spec.tier == OffloadDevice::kNvme && t == OffloadDevice::kNvme;
  }
  // --stage and --offload-param say where the engine's pass publishes from, as for a plan
  // (streams_half; lib/engine/store_state.cpp): with the state on NVMe it streams the half output
  // from its pool blocks, except at stage 3 with the params in host memory, where the store keeps
  // a host half array that the whole pass fills before the shards are copied from it.
  EngineSetup placement;
  placement.optimizer = spec.tier;
  if (o.stage != 0) {
    if (o.stage < 1 || o.stage > 3) {
      fail(fmt::format("--stage {}: must be 1, 2 or 3", o.stage));
      return;
    }
    placement.stage = o.stage;
  }
  if (!o.offload_param.empty() && !parse_offload_device(o.offload_param, &placement.params)) {
    fail(fmt::format("--offload-param {}: must be none, cpu or nvme", o.offload_param));
    return;
  }
  if (placement.params != OffloadDevice::kNone && placement.stage != 3) {
    fail("--offload-param needs --stage 3");
    return;
  }
  spec.stage = placement.stage;
  spec.streams_half = streams_half(placement);
  // Given a placement, the half copy is the engine's: streamed it stays in the pool block (a slot
  // in each block, as the StateStore's NVMe half piece has), and only the params' NVMe home gets
  // the new half shards (a plan's half_write_per_param), wherever --half-tier would put it; so
  // --half-tier host, which would leave the slot and those writes out, is refused there.
  if (o.stage != 0 || !o.offload_param.empty()) {
    spec.half_written = placement.params == OffloadDevice::kNvme;
    if (spec.tier == OffloadDevice::kNvme && spec.streams_half && o.half_tier_given &&
        !spec.half_on_nvme) {
      fail(
          "--half-tier host: with --stage or --offload-param the engine's pass streams the half "
          "copy from its pool blocks (a slot in each) and writes new half shards only to the "
          "params' NVMe home (--offload-param nvme); leave --half-tier out");
      return;
    }
  }
  if (spec.tier == OffloadDevice::kNvme && !spec.streams_half) {
    if (o.half_tier_given && spec.half_on_nvme) {
      fail(
          "--half-tier nvme: at --stage 3 with --offload-param cpu the engine keeps the half "
          "copy in host memory (the store's half array the shards are copied from)");
      return;
    }
    spec.half_on_nvme = false;
  }
  const bool nvme = spec.tier == OffloadDevice::kNvme;
  const StepOnlyLayout layout = step_only_layout(spec);
  if (spec.params == 0 || layout.sub_group_params == 0) {
    fail(
        fmt::format("--params and --sub-group must be positive; --sub-group {} is under one "
                    "sub-group of 2048 params (36 KiB)",
                    o.sub_group));
    return;
  }
  if (nvme && layout.blocks < 2) {
    fail(
        fmt::format("--pool {} holds {} blocks of {} (one sub-group's NVMe pieces); the step "
                    "needs at least 2",
                    o.pool, layout.blocks, format_bytes(static_cast<double>(layout.block_bytes))));
    return;
  }
  if (!(o.compute_s >= 0)) {
    fail(fmt::format("--compute-s {}: must be 0 or more seconds", o.compute_s));
    return;
  }
  if (o.host_compute && o.compute_s == 0) {
    fail("--host-compute needs --compute-s, the measured compute of a step");
    return;
  }
  if (!counts_positive({{"--grad-accum", o.grad_accum}})) return;
  spec.compute_s = o.compute_s;
  spec.micro_batches = o.grad_accum;
  spec.host_compute = o.host_compute;
  spec.overlap = !o.no_overlap_step;
  spec.overlap_fraction = o.overlap_fraction;
  spec.exact_clipping_or_loss_scaling = o.gradient_clipping || o.fp16;
  spec.checkpoint_activations = o.checkpoint_activations;
  nlohmann::json notes = nlohmann::json::array();
  MachineProfile profile;
  const std::uint64_t working_set =
      layout.sub_groups > 0 ? (layout.read_per_param + (spec.half_on_nvme ? 2 : 0)) * spec.params
                            : 0;
  if (!resolve_profile(o, nvme, o.path.empty() ? o.nvme_path : o.path, working_set, &profile,
                       &notes)) {
    return;
  }
  const StepPrediction t = predict_optimizer_step(spec, profile);
  // Host memory of the run: the pieces kept on the host, plus the pool on the NVMe tier.
  const double p = static_cast<double>(spec.params);
  double host_bytes = 18.0 * p;
  if (nvme) {
    host_bytes = static_cast<double>(layout.blocks * layout.block_bytes) +
                 (spec.grads_on_nvme ? 0.0 : 4.0 * p) + (spec.half_on_nvme ? 0.0 : 2.0 * p);
  }
  const nlohmann::json out = {{"params", spec.params},
                              {"tier", std::string(memory_tier_name(memory_tier(spec.tier)))},
                              {"grads_on_nvme", spec.grads_on_nvme},
                              {"half_on_nvme", spec.half_on_nvme},
                              {"streams_half", nvme && spec.streams_half},
                              {"sub_group_params", layout.sub_group_params},
                              {"sub_groups", t.sub_groups},
                              {"block_bytes", layout.block_bytes},
                              {"blocks", layout.blocks},
                              {"pool_bytes", spec.pool_bytes},
                              {"step_s", t.step_s},
                              {"optimizer_step_s", t.optimizer_step_s},
                              {"compute_s", t.forward_backward_s},
                              {"micro_batches", spec.micro_batches},
                              {"host_compute", spec.host_compute},
                              {"overlap", spec.overlap},
                              {"optimizer_hidden_s", t.optimizer_hidden_s},
                              {"io_alone_s", t.io_alone_s},
                              {"update_alone_s", t.update_alone_s},
                              {"read_gbps", nvme ? profile.nvme_read_gbps : 0.0},
                              {"write_gbps", nvme ? profile.nvme_write_gbps : 0.0},
                              {"nvme_read_bytes", t.nvme_read_bytes},
                              {"nvme_write_bytes", t.nvme_write_bytes},
                              {"host_bytes", host_bytes},
                              {"profile", profile_json(profile)},
                              {"notes", notes}};
  if (o.json) {
    print_json(out);
    return;
  }
  fmt::print("predicted optimizer step: {} params, state on {}, {} sub-groups of {} params, {}\n",
             spec.params, memory_tier_name(memory_tier(spec.tier)), t.sub_groups,
             layout.sub_group_params,
             nvme ? fmt::format("{} blocks of {}", layout.blocks,
                                format_bytes(static_cast<double>(layout.block_bytes)))
                  : std::string("no I/O"));
  Table table({"part", "predicted", "from"});
  const char* pass_formula = nvme ? "(n-1)*max(r+w, u, (r+u+w)/B) + r+u+w" : "the update alone";
  if (spec.compute_s > 0) {
    // The max forms hold only where the pass may hide behind the whole compute: one
    // micro-batch, all of it (c = 1), updates during the backward (not at stage 1, with spilled
    // gradients, exact clipping or loss scaling), on the NVMe tier where the pass streams (on
    // the host tier, and at stage 3 with the params in host memory, the update hides behind the
    // backward only). Otherwise the figure is compute + optimizer step less the part hidden
    // (with one micro-batch and c = 2/3, S/3 + max(2S/3 + H, optimizer step)).
    const bool behind_part = spec.micro_batches > 1 || step_only_starts_at_step(spec) ||
                             spec.overlap_fraction < 1.0 || !(nvme && spec.streams_half);
    const char* how = !spec.overlap       ? "compute + optimizer step (sequential)"
                      : behind_part       ? "compute + optimizer step - the part hidden behind one "
                                            "micro-batch's compute: overlapped"
                      : spec.host_compute ? "max(compute + update, optimizer step): overlapped, "
                                            "the update on the cores that compute"
                                          : "max(compute, optimizer step): overlapped";
    table.add_row({"step", secs(t.step_s), how});
    table.add_row({"compute", secs(t.forward_backward_s), "--compute-s"});
    table.add_row({"optimizer step", secs(t.optimizer_step_s), pass_formula});
  } else {
    table.add_row({"step", secs(t.step_s), pass_formula});
  }
  if (nvme) {
    table.add_row(
        {"io alone", secs(t.io_alone_s),
         fmt::format("{} read at {:.2f} GB/s + {} written at {:.2f} GB/s",
                     format_bytes(static_cast<double>(t.nvme_read_bytes)), profile.nvme_read_gbps,
                     format_bytes(static_cast<double>(t.nvme_write_bytes)),
                     profile.nvme_write_gbps)});
  }
  table.add_row({"update alone", secs(t.update_alone_s),
                 fmt::format("30 B/param at {:.1f} GB/s", profile.mem_adam_gbps)});
  table.add_row({"host memory", format_bytes(host_bytes),
                 nvme ? "pool + host-resident pieces" : "18 B/param"});
  table.print();
  fmt::print("memory: {}\n", profile.memory_source);
  if (nvme) fmt::print("nvme:   {}\n", profile.nvme_source);
  for (const auto& n : notes) fmt::print("note: {}\n", n.get<std::string>());
}

void list_models() {
  Table table({"model", "params", "published", "layers", "hidden", "heads/kv", "vocab"});
  for (const ModelShape& m : model_presets()) {
    table.add_row({m.name, fmt::format("{:.3f}e9", static_cast<double>(param_count(m)) / 1e9),
                   fmt::format("{:.3f}e9", static_cast<double>(m.published_param_count) / 1e9),
                   std::to_string(m.layers), std::to_string(m.hidden),
                   fmt::format("{}/{}", m.heads, m.kv_heads), std::to_string(m.vocab)});
  }
  table.print();
}

std::string placement_line(const EngineSetup& s) {
  std::string line = fmt::format("stage {}, optimizer state on {}", s.stage,
                                 memory_tier_name(memory_tier(s.optimizer)));
  if (s.optimizer == OffloadDevice::kNvme) {
    line += fmt::format(" (sub-group {} params, {} buffers, pinned pool {} per GPU)",
                        s.sub_group_params, s.buffer_count,
                        format_bytes(static_cast<double>(pinned_pool_bytes(s))));
  }
  line += fmt::format(", half params on {}", s.stage == 3 ? memory_tier_name(memory_tier(s.params))
                                                          : "device (replicated)");
  if (s.optimizer != OffloadDevice::kNone) {
    line += fmt::format(", gradients on {}", s.gradients_on_nvme ? "nvme" : "host");
  }
  return line;
}

void run_plan(const PlanOptions& o) {
  if (o.list_models) {
    list_models();
    return;
  }
  if (o.step_only) {
    if (!o.trainable.empty() || o.lora_rank_given || o.lora_targets_given || o.frozen_exact) {
      fail(
          "--trainable, --lora-rank, --lora-targets and --frozen-exact do not apply to "
          "--step-only (it predicts `zinf bench step`, which steps every parameter)");
      return;
    }
    run_step_only(o);
    return;
  }
  ModelShape model;
  if (o.arch == "train_lm") {
    if (!o.model.empty() || !o.params.empty() || o.layers == 0 || o.hidden == 0) {
      fail(
          "--arch train_lm: give --layers L --hidden H (and --context, --embed as train_lm's), "
          "not --model or --params");
      return;
    }
    model = train_lm_model(o.layers, o.hidden, o.context_bytes, o.embed_dim);
  } else if (o.arch != "transformer") {
    fail(fmt::format("--arch {}: must be transformer or train_lm", o.arch));
    return;
  } else if (!o.model.empty()) {
    auto preset = find_model_preset(o.model);
    if (!preset) {
      std::string names;
      for (const ModelShape& m : model_presets()) names += " " + m.name;
      fail(fmt::format("--model {}: no such preset; one of:{}", o.model, names));
      return;
    }
    model = *preset;
  } else {
    std::uint64_t params = 0;
    if (o.params.empty()) {
      fail("give --model NAME, or --params N --layers L --hidden H");
      return;
    }
    if (o.layers == 0 || o.hidden == 0) {
      fail(fmt::format(
          "--params {} needs --layers L and --hidden H too (they size the activations and the "
          "gathered layers), or give --model NAME",
          o.params));
      return;
    }
    if (!parse_size_option("--params", o.params, &params, /*decimal=*/true)) return;
    if (params == 0) {
      // custom_model() would take 0 as "count the shape's parameters".
      fail(fmt::format("--params {}: must be at least 1", o.params));
      return;
    }
    model = custom_model(params, o.layers, o.hidden);
    model.vocab = o.vocab;
  }
  if (!o.trainable.empty() && o.lora_rank_given) {
    fail(
        "--trainable and --lora-rank: give one (--lora-rank adds its adapters to the model and "
        "trains them alone)");
    return;
  }
  if (o.lora_targets_given && !o.lora_rank_given) {
    fail(fmt::format("--lora-targets {}: needs --lora-rank (the adapters' rank)", o.lora_targets));
    return;
  }
  if (o.frozen_exact && o.trainable.empty() && !o.lora_rank_given) {
    fail(
        "--frozen-exact: needs --trainable or --lora-rank (it says the frozen parameters' values "
        "are exact in the half dtype; without them nothing is frozen)");
    return;
  }
  model.frozen_exact_in_half = o.frozen_exact;
  if (o.lora_rank_given) {
    const Status lora = apply_lora(&model, o.lora_rank, o.lora_targets);
    if (!lora.is_ok()) {
      fail(std::string(lora.message()));
      return;
    }
  } else if (!o.trainable.empty()) {
    Result<std::uint64_t> trainable = parse_trainable(o.trainable, param_count(model));
    if (!trainable.is_ok()) {
      fail(std::string(trainable.status().message()));
      return;
    }
    model.trainable_params = *trainable;
  }
  if (!counts_positive(
          {{"--seq", o.seq}, {"--micro-batch", o.micro_batch}, {"--grad-accum", o.grad_accum}})) {
    return;
  }
  TrainingShape training;
  training.seq_len = o.seq;
  training.micro_batch = o.micro_batch;
  training.grad_accum_steps = o.grad_accum;
  training.checkpoint_activations = o.checkpoint_activations;
  training.offload_activations = o.offload_activations;
  training.flash_attention = !o.no_flash_attention;
  if (o.offload_activations && !o.checkpoint_activations) {
    fail("--offload-activations needs --checkpoint-activations");
    return;
  }

  Budgets budgets;
  budgets.gpus = o.gpus;
  budgets.gpus_per_machine = o.gpus_per_machine;
  budgets.headroom = o.headroom;
  if (o.gpu_mem.empty()) {
    fail("--gpu-mem: missing; give the memory of each GPU (e.g. --gpu-mem 80GB)");
    return;
  }
  if (o.host_mem.empty()) {
    fail("--host-mem: missing; give the host memory of each machine (e.g. --host-mem 256GB)");
    return;
  }
  if (!parse_size_option("--gpu-mem", o.gpu_mem, &budgets.gpu_mem_bytes) ||
      !parse_size_option("--host-mem", o.host_mem, &budgets.host_mem_bytes) ||
      !parse_size_option("--nvme-capacity", o.nvme_capacity, &budgets.nvme_bytes)) {
    return;
  }
  PlanConstraints constraints;
  constraints.allow_gradient_spill = !o.no_gradient_spill;
  constraints.overlap_step = !o.no_overlap_step;
  constraints.overlap_compute_fraction = o.overlap_fraction;
  constraints.exact_clipping_or_loss_scaling = o.gradient_clipping || o.fp16;
  if (o.stage != 0) constraints.stage = o.stage;
  if (!o.device_reserved.empty()) {
    std::uint64_t reserved = 0;
    if (!parse_size_option("--device-reserved", o.device_reserved, &reserved)) return;
    constraints.device_reserved_bytes = reserved;
  }
  for (auto [flag, text, field] :
       {std::tuple{"--offload-optimizer", &o.offload_optimizer, &constraints.optimizer},
        std::tuple{"--offload-param", &o.offload_param, &constraints.params}}) {
    if (text->empty()) continue;
    OffloadDevice value = OffloadDevice::kNone;
    if (!parse_offload_device(*text, &value)) {
      fail(fmt::format("{} {}: must be none, cpu or nvme", flag, *text));
      return;
    }
    *field = value;
  }

  nlohmann::json notes = nlohmann::json::array();
  if (model.param_count_override != 0) {
    // --params sizes the state; --layers and --hidden the activations and the gathered modules.
    ModelShape shape = model;
    shape.param_count_override = 0;
    const double held = static_cast<double>(param_count(shape));
    const double given = static_cast<double>(model.param_count_override);
    if (given * 4 < held || given > held * 4) {
      notes.push_back(fmt::format(
          "--params {} is far from the {:.3g} parameters that {} layers of hidden {} (vocab {}) "
          "hold as a transformer: the state is sized by --params, the activations and gathered "
          "modules by the shape",
          o.params, held, model.layers, model.hidden, model.vocab));
    }
  }
  MachineProfile profile;
  // The plan's NVMe working set is unknown until it is made; a drive serving training state
  // holds far more than any cache, so the default measures 2 GiB.
  if (!resolve_profile(o, budgets.nvme_bytes > 0, o.nvme_path, 0, &profile, &notes)) return;
  // Without these the forward+backward holds only the offload traffic, and a plan with nothing
  // offloaded predicts the optimizer step alone (milliseconds on GPUs): say what is left out.
  if (profile.gpu_tflops <= 0 || profile.gpu_link_gbps <= 0) {
    notes.push_back(fmt::format(
        "the predicted step leaves out the GPUs' {}: pass {}",
        profile.gpu_tflops <= 0 && profile.gpu_link_gbps <= 0 ? "compute and collectives"
        : profile.gpu_tflops <= 0                             ? "compute"
                                                              : "collectives",
        profile.gpu_tflops <= 0 && profile.gpu_link_gbps <= 0 ? "--gpu-tflops and --gpu-link-gbps"
        : profile.gpu_tflops <= 0                             ? "--gpu-tflops"
                                                              : "--gpu-link-gbps"));
  }
  Result<PlanResult> planned = make_plan(model, training, budgets, profile, constraints);
  if (!planned.is_ok()) {
    fail(planned.status().to_string());
    return;
  }
  const PlanResult& plan = *planned;
  const Candidate& c = plan.best;
  const std::uint64_t per_machine = c.setup.ranks_per_machine;

  nlohmann::json by_state = nlohmann::json::object();
  for (int k = 0; k < kMemoryUseCount; ++k) {
    const auto kind = static_cast<MemoryUse>(k);
    nlohmann::json row = nlohmann::json::object();
    for (int t = 0; t < kMemoryTierCount; ++t) {
      row[std::string(memory_tier_name(static_cast<MemoryTier>(t)))] =
          c.memory.bytes(kind, static_cast<MemoryTier>(t));
    }
    by_state[std::string(memory_use_name(kind))] = row;
  }
  nlohmann::json tiers = nlohmann::json::object();
  nlohmann::json budget_json = nlohmann::json::object();
  nlohmann::json shortfall = nlohmann::json::array();
  for (const TierUse& u : c.use) {
    const std::string name(memory_tier_name(u.tier));
    tiers[name] = u.need_bytes;
    budget_json[name] = {
        {"budget_bytes", u.budget_bytes}, {"usable_bytes", u.usable_bytes}, {"fits", u.fits()}};
  }
  for (const Shortfall& f : plan.shortfalls) {
    shortfall.push_back({{"tier", std::string(memory_tier_name(f.tier))},
                         {"shortfall_bytes", f.shortfall_bytes()},
                         {"need_bytes", f.need_bytes},
                         {"usable_bytes", f.usable_bytes},
                         {"every_placement", f.every_placement}});
  }
  if (!plan.fits && plan.shortfalls.empty()) {
    for (const TierUse& u : c.use) {
      if (u.fits()) continue;
      shortfall.push_back({{"tier", std::string(memory_tier_name(u.tier))},
                           {"shortfall_bytes", u.shortfall_bytes()},
                           {"need_bytes", u.need_bytes},
                           {"usable_bytes", u.usable_bytes},
                           {"every_placement", false}});
    }
  }
  nlohmann::json out = {
      {"fits", plan.fits},
      {"model",
       {{"name", model.name},
        {"params", c.memory.param_count},
        {"layers", model.layers},
        {"hidden", model.hidden}}},
      {"placement",
       {{"stage", c.setup.stage},
        {"offload_optimizer", std::string(offload_device_name(c.setup.optimizer))},
        {"offload_param", std::string(offload_device_name(c.setup.params))},
        {"gradients_on_nvme", c.setup.gradients_on_nvme},
        {"sub_group_size", c.setup.sub_group_params},
        {"buffer_count", c.setup.buffer_count},
        {"pinned_pool_bytes", pinned_pool_bytes(c.setup)}}},
      {"bytes_per_tier", tiers},
      {"bytes_per_tier_unit", "device: per GPU; host, nvme: per machine"},
      {"bytes_per_state_per_rank", by_state},
      {"budget_per_tier", budget_json},
      {"shortfall", shortfall},
      {"predicted_step_s", c.time.step_s},
      {"parts", parts_json(c.time)},
      {"no_offload",
       {{"gpus_needed", plan.no_offload.gpus_needed},
        {"state_bytes", plan.no_offload.state_bytes},
        {"per_gpu_fixed_bytes", plan.no_offload.fixed_bytes},
        {"per_gpu_usable_bytes", plan.no_offload.usable_bytes},
        {"arithmetic", plan.no_offload.arithmetic}}},
      {"candidates_considered", plan.candidates_considered},
      {"candidates_fitting", plan.candidates_fitting},
      {"profile", profile_json(profile)},
      {"notes", notes}};
  const bool frozen_asked = !o.trainable.empty() || o.lora_rank_given;
  const std::uint64_t trainable = trainable_param_count(model);
  const double trainable_share =
      static_cast<double>(trainable) / static_cast<double>(param_count(model));
  if (frozen_asked) {
    out["model"]["trainable_params"] = trainable;
    out["model"]["frozen_params"] = frozen_param_count(model);
    out["model"]["trainable_fraction"] = trainable_share;
    out["model"]["frozen_exact_in_half"] = model.frozen_exact_in_half;
    if (o.lora_rank_given) {
      out["model"]["lora"] = {{"rank", o.lora_rank},
                              {"targets", o.lora_targets},
                              {"adapter_params", model.adapter_params}};
    }
  }

  if (o.json) {
    print_json(out);
  } else {
    fmt::print("model     {}: {} params, {} layers, hidden {}\n", model.name,
               format_param_count(c.memory.param_count), model.layers, model.hidden);
    if (frozen_asked) {
      fmt::print("trainable {} params ({:.3g}% of the model), {} frozen{}{}\n",
                 format_param_count(trainable), 100.0 * trainable_share,
                 format_param_count(frozen_param_count(model)),
                 o.lora_rank_given
                     ? fmt::format(": LoRA rank {} adapters on {} in each of {} layers",
                                   o.lora_rank, o.lora_targets, model.layers)
                     : std::string(),
                 model.frozen_exact_in_half ? " (frozen values exact in the half dtype)" : "");
    }
    fmt::print("training  seq {}, micro-batch {}, grad accumulation {}, checkpointing {}\n",
               training.seq_len, training.micro_batch, training.grad_accum_steps,
               training.checkpoint_activations ? "on" : "off");
    fmt::print(
        "budgets   {} {} ({} per machine) x {}, host {} and NVMe {} per machine, "
        "{:.0f}% headroom\n",
        budgets.gpus, budgets.gpus == 1 ? "GPU" : "GPUs", per_machine,
        gib(static_cast<double>(budgets.gpu_mem_bytes)),
        gib(static_cast<double>(budgets.host_mem_bytes)),
        gib(static_cast<double>(budgets.nvme_bytes)), budgets.headroom * 100);
    fmt::print("{}      {}\n", plan.fits ? "plan" : "closest", placement_line(c.setup));
    Table table({"state", "device/GPU", "host/machine", "nvme/machine"});
    auto cell = [&](std::uint64_t bytes) {
      return bytes == 0 ? std::string("-") : gib(static_cast<double>(bytes));
    };
    for (int k = 0; k < kMemoryUseCount; ++k) {
      const auto kind = static_cast<MemoryUse>(k);
      const std::uint64_t d = c.memory.bytes(kind, MemoryTier::kDevice);
      const std::uint64_t h = c.memory.bytes(kind, MemoryTier::kHost) * per_machine;
      const std::uint64_t n = c.memory.bytes(kind, MemoryTier::kNvme) * per_machine;
      if (d + h + n == 0) continue;
      table.add_row({std::string(memory_use_name(kind)), cell(d), cell(h), cell(n)});
    }
    table.add_row({"total", gib(static_cast<double>(c.use[0].need_bytes)),
                   gib(static_cast<double>(c.use[1].need_bytes)),
                   gib(static_cast<double>(c.use[2].need_bytes))});
    table.add_row({"usable (budget less headroom)", gib(static_cast<double>(c.use[0].usable_bytes)),
                   gib(static_cast<double>(c.use[1].usable_bytes)),
                   gib(static_cast<double>(c.use[2].usable_bytes))});
    auto fit_cell = [](const TierUse& u) {
      return u.fits() ? std::string("yes")
                      : "SHORT " + gib(static_cast<double>(u.shortfall_bytes()));
    };
    table.add_row({"fits", fit_cell(c.use[0]), fit_cell(c.use[1]), fit_cell(c.use[2])});
    table.print();
    const StepPrediction& t = c.time;
    const std::string step_reduce =
        t.step_reduce_s > 0 ? fmt::format(" + step reduce {}", secs(t.step_reduce_s)) : "";
    if (t.optimizer_hidden_s > 0) {
      fmt::print(
          "\npredicted step {} = forward+backward {}{} + optimizer step {} - {} of it hidden "
          "behind compute (zinf.overlap_step)\n",
          secs(t.step_s), secs(t.forward_backward_s), step_reduce, secs(t.optimizer_step_s),
          secs(t.optimizer_hidden_s));
    } else {
      fmt::print("\npredicted step {} = forward+backward {}{} + optimizer step {}\n",
                 secs(t.step_s), secs(t.forward_backward_s), step_reduce, secs(t.optimizer_step_s));
    }
    Table time({"part", "time", "what"});
    time.add_row(
        {"forward+backward", secs(t.forward_backward_s),
         fmt::format("{} x max of the four below (overlapped)", training.grad_accum_steps)});
    time.add_row({"  compute", secs(t.compute_s),
                  profile.gpu_tflops > 0 ? fmt::format("at {:.0f} TFLOP/s", profile.gpu_tflops)
                                         : "not modelled: pass --gpu-tflops"});
    time.add_row({"  collectives", secs(t.collectives_s),
                  profile.gpu_link_gbps > 0 ? fmt::format("at {:.0f} GB/s", profile.gpu_link_gbps)
                                            : "not modelled: pass --gpu-link-gbps"});
    time.add_row({"  param fetch", secs(t.param_fetch_s), "offloaded params to the GPU, twice"});
    time.add_row({"  grad offload", secs(t.grad_offload_s), "gradients to the host / NVMe"});
    if (c.setup.stage == 1) {
      time.add_row(
          {"step reduce", secs(t.step_reduce_s), "accumulated gradients reduced at step()"});
    }
    // Where the half output does not stream with the pass the new half params go to their home
    // after the whole update; stages 1-2 all-gather them after that, in every placement.
    const std::string sends =
        streams_half(c.setup) ? "max(pipeline, param upload)" : "pipeline, then param upload";
    time.add_row({"optimizer step", secs(t.optimizer_step_s),
                  c.setup.stage == 3 ? sends : sends + ", then publish"});
    time.add_row({"  pipeline", secs(t.pipeline_s),
                  c.setup.optimizer == OffloadDevice::kNvme
                      ? fmt::format("{} sub-groups, {} buffers", t.sub_groups, t.buffers)
                      : "the update alone"});
    time.add_row({"  io alone", secs(t.io_alone_s),
                  fmt::format("NVMe {} read, {} written",
                              format_bytes(static_cast<double>(t.nvme_read_bytes)),
                              format_bytes(static_cast<double>(t.nvme_write_bytes)))});
    time.add_row(
        {"  update alone", secs(t.update_alone_s),
         fmt::format("{} through memory", format_bytes(static_cast<double>(t.adam_memory_bytes)))});
    time.add_row({"  param upload", secs(t.param_upload_s), "new half params to their home"});
    if (c.setup.stage != 3) {
      time.add_row({"  publish", secs(t.publish_gather_s), "new half params all-gathered"});
    }
    time.print();
    fmt::print("\nwithout offload: {}\n",
               plan.no_offload.gpus_needed > 0
                   ? fmt::format("{} {}", plan.no_offload.gpus_needed,
                                 plan.no_offload.gpus_needed == 1 ? "GPU" : "GPUs")
                   : std::string("not possible"));
    fmt::print("  {}\n", plan.no_offload.arithmetic);
    fmt::print("\nmemory:  {} ({:.1f} GB/s)\n", profile.memory_source, profile.mem_adam_gbps);
    if (profile.nvme_read_gbps > 0) {
      fmt::print("nvme:    {} (read {:.2f}, write {:.2f} GB/s)\n", profile.nvme_source,
                 profile.nvme_read_gbps, profile.nvme_write_gbps);
    }
    fmt::print("gpu:     {} (h2d {:.0f} GB/s, device memory {:.0f} GB/s)\n", profile.gpu_source,
               profile.h2d_gbps, profile.gpu_mem_gbps);
    for (const auto& n : notes) fmt::print("note:    {}\n", n.get<std::string>());
  }

  if (!plan.fits) {
    std::string message = shortfall_message(plan);
    if (budgets.nvme_bytes == 0) {
      message += "\n  (no --nvme-capacity given: placements on NVMe were not considered)";
    }
    std::fprintf(stderr, "zinf: %s\n", message.c_str());
    set_exit_code(2);
    return;
  }
  if (!o.out.empty()) {
    PlanConfig config;
    config.setup = c.setup;
    config.micro_batch = training.micro_batch;
    config.grad_accum_steps = training.grad_accum_steps;
    config.nvme_path = o.nvme_path.empty() && (c.setup.optimizer == OffloadDevice::kNvme ||
                                               c.setup.params == OffloadDevice::kNvme)
                           ? "/local_nvme"
                           : o.nvme_path;
    config.pinned_pool_bytes = pinned_pool_bytes(c.setup);
    config.activation_host_bytes = activation_arena_bytes(model, training);
    // The prediction assumed these; the config says so, so the engine runs what was timed. The
    // clipping norm is 1.0 (the Hugging Face Trainer's max_grad_norm): the step time does not
    // depend on it, only on clipping being on.
    config.gradient_clipping = o.gradient_clipping ? 1.0 : 0.0;
    config.fp16 = o.fp16;
    const Status s = write_config(config, o.out);
    if (!s.is_ok()) {
      fail(s.to_string());
      return;
    }
    if (!o.json) fmt::print("config:  written to {}\n", o.out);
  }
}

void setup_plan(CLI::App& app) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* sub = app.add_subcommand(
      "plan", "Does a model fit these machines: bytes per tier, predicted step time, config");
  sub->add_option("--model", o->model, "Preset (see --list-models)");
  sub->add_flag("--list-models", o->list_models, "List the presets and their parameter counts");
  sub->add_option("--params", o->params,
                  "Parameter count (1.5G or 1.5B = 1.5e9), without --model; needs --layers and "
                  "--hidden too (they size the activations and the gathered layers), except "
                  "with --step-only");
  sub->add_option("--layers", o->layers,
                  "Layers, without --model (with --params or --arch train_lm)");
  sub->add_option("--hidden", o->hidden,
                  "Hidden size, without --model (with --params or --arch train_lm)");
  sub->add_option("--vocab", o->vocab, "Vocabulary, without --model")->capture_default_str();
  sub->add_option("--seq", o->seq, "Sequence length")->capture_default_str();
  sub->add_option("--micro-batch", o->micro_batch, "Micro-batch per GPU")->capture_default_str();
  sub->add_option("--grad-accum", o->grad_accum,
                  "Micro-batches per step (with --step-only: the micro-batches --compute-s spans)")
      ->capture_default_str();
  sub->add_flag("--checkpoint-activations", o->checkpoint_activations,
                "Activation checkpointing (recompute each layer in backward)");
  sub->add_flag("--offload-activations", o->offload_activations,
                "With --checkpoint-activations: the checkpoints live in host memory");
  sub->add_flag("--no-overlap-step", o->no_overlap_step,
                "Predict the sequential step (zinf.overlap_step false): compute + optimizer");
  sub->add_option("--overlap-fraction", o->overlap_fraction,
                  "Part of one micro-batch's forward + backward the overlapped optimizer pass "
                  "hides behind (the backward, 2/3: updates during the backward; 1: both). A "
                  "plan's pass that updates in the backward has at most the backward's share of "
                  "it, then runs on into the next forward module by module. With "
                  "the optimizer state on NVMe, where the updates start at step() (stage 1, "
                  "spilled gradients, --gradient-clipping, --fp16), at most the next forward's "
                  "share. With it in host memory the update hides in the backward only, at most "
                  "its share, and behind nothing where it starts at step(); the writes and "
                  "all-gather after it hide behind the next forward")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  sub->add_flag("--gradient-clipping", o->gradient_clipping,
                "The config clips gradients exactly (gradient_clipping > 0, without "
                "zinf.clip_from_previous_step): the pass waits for the global norm at step() and "
                "hides behind the next forward only (a third of a micro-batch, a quarter with "
                "checkpointing) with the optimizer state on NVMe; in host memory the update "
                "hides behind nothing, its writes behind the next forward; --out writes "
                "gradient_clipping 1.0");
  sub->add_flag("--fp16", o->fp16,
                "The config trains in fp16 with loss scaling (fp16.enabled): the pass waits for "
                "the overflow check at step() and hides behind the next forward only, as with "
                "--gradient-clipping; --out writes fp16.enabled true in place of bf16");
  sub->add_option("--trainable", o->trainable,
                  "Fine-tuning with the rest frozen: the parameters that train, a count (40M, "
                  "1.2B) or a share of the model (0.5%, 0.005); frozen ones cost what the engine "
                  "charges them (no moments in memory, no optimizer pass)");
  CLI::Option* lora_rank =
      sub->add_option("--lora-rank", o->lora_rank_text,
                      "LoRA adapters of this rank on --lora-targets in every layer, added to the "
                      "model and trained alone (the base frozen)");
  CLI::Option* lora_targets =
      sub->add_option("--lora-targets", o->lora_targets,
                      "With --lora-rank: projections adapted, of q,k,v,o,gate,up,down (PEFT's "
                      "default for Llama: q,v; on GPT-2 q,v counts its fused c_attn's adapter)")
          ->capture_default_str();
  sub->add_flag("--frozen-exact", o->frozen_exact,
                "With --trainable or --lora-rank: the frozen parameters' values are exact in the "
                "run's half dtype (a bf16 checkpoint with bf16, an fp16 one with --fp16: a bf16 "
                "checkpoint is not exact in fp16); counts what the engine then keeps: no fp32 "
                "master of them with offload_optimizer cpu (2 bytes an element of host memory at "
                "stage 3 with offload_param cpu) or none on a GPU (4 bytes an element less device "
                "memory). Without it they are counted as any values (an upper bound)");
  sub->add_option("--arch", o->arch,
                  "transformer, or train_lm (examples/train_lm's MLP blocks: --layers, --hidden, "
                  "--context, --embed)")
      ->capture_default_str();
  sub->add_option("--context", o->context_bytes, "--arch train_lm: its --context")
      ->capture_default_str();
  sub->add_option("--embed", o->embed_dim, "--arch train_lm: its --embed")->capture_default_str();
  sub->add_flag("--no-flash-attention", o->no_flash_attention,
                "Attention keeps its a*s^2 score matrices for backward");
  sub->add_option("--gpus", o->gpus, "GPUs in the job")->capture_default_str();
  sub->add_option("--gpus-per-machine", o->gpus_per_machine, "GPUs per machine (0: all on one)");
  sub->add_option("--gpu-mem", o->gpu_mem, "Memory per GPU (48GB, 80GiB)");
  sub->add_option("--host-mem", o->host_mem, "Host memory per machine");
  sub->add_option("--nvme-capacity", o->nvme_capacity, "NVMe space per machine (0: none)")
      ->capture_default_str();
  sub->add_option("--device-reserved", o->device_reserved,
                  "Memory per GPU left to the runtime (CUDA context, workspaces) in every "
                  "placement, zinf.device_reserved_bytes in --out's config (default 1GiB)");
  sub->add_option("--nvme-path", o->nvme_path,
                  "NVMe directory: measured when no rates are known, "
                  "written into the config");
  sub->add_option("--headroom", o->headroom, "Fraction of each budget left unplanned")
      ->capture_default_str();
  sub->add_option("--stage", o->stage, "Fix the ZeRO stage (1-3) instead of searching");
  sub->add_option("--offload-optimizer", o->offload_optimizer, "Fix it: none, cpu or nvme");
  sub->add_option("--offload-param", o->offload_param,
                  "Fix it: none, cpu or nvme (with --step-only and --stage: where the engine's "
                  "pass publishes from; cpu at stage 3 does not stream it; only nvme writes the "
                  "new half shards to the drive)");
  sub->add_flag("--no-gradient-spill", o->no_gradient_spill,
                "Keep the fp32 gradients in host memory (no zinf.gradients_on_nvme)");
  sub->add_option("--machine-profile", o->machine_profile,
                  "Profile JSON (default $ZINF_MACHINE_PROFILE, $XDG_CACHE_HOME/zinf/machine.json "
                  "or ~/.cache/zinf/machine.json)");
  sub->add_option(
      "--io-profile", o->io_profile,
      "zinf io tune results (default $ZINF_IO_TUNE_FILE, $XDG_CACHE_HOME/zinf/io-tune.json "
      "or ~/.cache/zinf/io-tune.json)");
  sub->add_option("--save-profile", o->save_profile,
                  "Write the figures used (measured or given) into this profile file");
  sub->add_flag("--measure", o->measure,
                "Ignore any profile file: measure now what the options do not give");
  sub->add_option("--measure-bytes", o->measure_bytes, "File size for measuring the disk now")
      ->capture_default_str();
  sub->add_option("--mem-adam-gbps", o->mem_adam_gbps, "CPU Adam-pattern memory bandwidth");
  sub->add_option("--nvme-read-gbps", o->nvme_read_gbps, "NVMe read rate per machine");
  sub->add_option("--nvme-write-gbps", o->nvme_write_gbps, "NVMe write rate per machine");
  sub->add_option("--nvme-duplex-gbps", o->nvme_duplex_gbps,
                  "NVMe bytes read + written per second with both at once (default: their "
                  "rates share one budget)");
  sub->add_option("--h2d-gbps", o->h2d_gbps, "Host-device rate per GPU (default 20)");
  sub->add_option("--gpu-mem-gbps", o->gpu_mem_gbps, "GPU memory bandwidth (default 1000)");
  sub->add_option("--gpu-tflops", o->gpu_tflops, "Achieved half-precision TFLOP/s per GPU");
  sub->add_option("--gpu-link-gbps", o->gpu_link_gbps, "Collective bus bandwidth per GPU");
  sub->add_option("--out", o->out, "Write the plan as an engine config (JSON)");
  sub->add_flag("--json", o->json, "Print one JSON object");
  sub->add_flag("--step-only", o->step_only,
                "Predict `zinf bench step` with the same flags (--params --tier --path "
                "--sub-group --pool)");
  sub->add_option("--tier", o->tier, "--step-only: nvme or host")->capture_default_str();
  sub->add_option("--path", o->path, "--step-only: NVMe directory (measured if no rates)");
  sub->add_option("--sub-group", o->sub_group,
                  "--step-only: bytes of all pieces of a sub-group (18 B/param)")
      ->capture_default_str();
  sub->add_option("--pool", o->pool, "--step-only: pinned pool bytes")->capture_default_str();
  sub->add_option("--grads-tier", o->grads_tier, "--step-only: gradients on nvme or host")
      ->capture_default_str();
  CLI::Option* half_tier =
      sub->add_option("--half-tier", o->half_tier,
                      "--step-only: half params on nvme or host (host where the engine keeps "
                      "them there: --stage 3 --offload-param cpu; with --stage or "
                      "--offload-param otherwise nvme, the pool block's slot)")
          ->capture_default_str();
  sub->add_option("--compute-s", o->compute_s,
                  "--step-only: predict a training step around it, whose compute (forward, "
                  "backward, gathers, reductions of all --grad-accum micro-batches) takes this "
                  "many seconds (measured); the pass hides behind one micro-batch's share; "
                  "--no-overlap-step: the sequential step");
  sub->add_flag("--host-compute", o->host_compute,
                "--step-only with --compute-s: the compute runs on this machine's CPU cores "
                "(HostDevice), which the optimizer's update then shares");
  sub->callback([o, lora_rank, lora_targets, half_tier] {
    o->half_tier_given = half_tier->count() > 0;
    o->lora_rank_given = lora_rank->count() > 0;
    o->lora_targets_given = lora_targets->count() > 0;
    if (o->lora_rank_given) {
      Result<std::uint64_t> rank = parse_lora_rank(o->lora_rank_text);
      if (!rank.is_ok()) {
        fail(std::string(rank.status().message()));
        return;
      }
      o->lora_rank = *rank;
    }
    run_plan(*o);
  });
}

}  // namespace

ZINF_COMMAND("plan", setup_plan);

}  // namespace zinf::cli
