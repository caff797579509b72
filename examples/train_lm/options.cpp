#include "options.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <sstream>
#include <utility>
#include <vector>

#include "zinf/config.hpp"

namespace train_lm {
namespace {

// The variables a launcher that started several processes sets to their count, after torchrun's
// WORLD_SIZE: mpirun's (Open MPI), the PMI ones (MPICH, srun's plugins) and srun's own.
constexpr const char* kLauncherSizeVariables[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE",
                                                  "SLURM_STEP_NUM_TASKS"};

bool parse_scaled(const std::string& text, bool binary, std::uint64_t* value) {
  std::size_t used = 0;
  double number = 0;
  try {
    number = std::stod(text, &used);
  } catch (...) {
    return false;
  }
  if (!(number >= 0) || !std::isfinite(number)) return false;
  std::string suffix = text.substr(used);
  for (char& c : suffix) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (binary && !suffix.empty() && suffix.back() == 'b') suffix.pop_back();  // "gib", "gb"
  if (binary && !suffix.empty() && suffix.back() == 'i') suffix.pop_back();  // "gi"
  double scale = 1;
  const double k = binary ? 1024.0 : 1000.0;
  if (suffix.empty()) {
    scale = 1;
  } else if (suffix == "k") {
    scale = k;
  } else if (suffix == "m") {
    scale = k * k;
  } else if (suffix == "g" || (!binary && suffix == "b")) {
    scale = k * k * k;
  } else if (suffix == "t") {
    scale = k * k * k * k;
  } else {
    return false;
  }
  const double result = number * scale;
  if (result > 1.8e19) return false;
  *value = static_cast<std::uint64_t>(std::llround(result));
  return true;
}

// A CLI11 option whose text is a count or a byte size with a suffix.
CLI::Option* add_scaled(CLI::App& app, const std::string& name, std::uint64_t* target, bool binary,
                        const std::string& help) {
  return app
      .add_option_function<std::string>(
          name,
          [=](const std::string& text) {
            if (!parse_scaled(text, binary, target)) {
              throw CLI::ValidationError(
                  name, "'" + text + "' is not a " +
                            (binary ? "byte size like 4GiB" : "count like 10M or 1B"));
            }
          },
          help)
      ->default_str(binary ? format_bytes(double(*target)) : format_count(double(*target)));
}

// Options::schedule: the --config file's scheduler section, or the flags' WarmupCosineLR, built
// at last_batch_iteration -1 as DeepSpeed builds it by default, so that step k runs at
// DeepSpeed's iteration k - 2: steps 1 and 2 at rate 0, then --lr * (k - 2) / --warmup while
// warming up, then the cosine towards 10% at iteration --steps. (A start at 0 or above would run
// step 1 at --lr itself: DeepSpeed's schedulers set the rate when built only at -1.)
int schedule_from(Options* o, std::string* error) {
  zinf::ScheduleConfig& s = o->schedule;
  s = zinf::ScheduleConfig{};
  s.kind = zinf::ScheduleKind::kWarmupCosineLR;
  s.total_num_steps = o->steps;
  s.warmup_num_steps = std::max<std::int64_t>(1, o->warmup_steps);
  s.warmup_linear = true;
  s.warmup_min_ratio = 0.0;
  s.cos_min_ratio = 0.1;
  s.last_batch_iteration = -1;
  if (!o->config_path.empty()) {
    zinf::Result<zinf::Config> config = zinf::load_config(o->config_path);
    if (!config.is_ok()) {
      *error = "--config: " + std::string(config.status().message());
      return 2;
    }
    if (config->scheduler.kind != zinf::ScheduleKind::kNone) s = config->scheduler;
  }
  zinf::Result<zinf::LrSchedule> checked = zinf::LrSchedule::create(s, o->lr);
  if (!checked.is_ok()) {
    *error = (o->config_path.empty() ? "--warmup/--steps: " : "--config: ") +
             std::string(checked.status().message());
    return 2;
  }
  return 0;
}

// The shortest text that reads back as the same double ("0.003", "1e-05").
std::string exact(double value) {
  char buffer[32];
  const std::to_chars_result end = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, end.ptr);
}

// The schedule as text, every field, so that two --config files agree when their scheduler
// sections do, whatever their paths.
std::string schedule_text(const zinf::ScheduleConfig& s) {
  std::string text(zinf::schedule_name(s.kind));
  auto add = [&](const char* name, const std::string& value) {
    text += std::string(" ") + name + "=" + value;
  };
  add("warmup_num_steps", std::to_string(s.warmup_num_steps));
  add("warmup_type", s.warmup_linear ? "linear" : "log");
  add("warmup_min_lr", exact(s.warmup_min_lr));
  add("warmup_max_lr", exact(s.warmup_max_lr));
  add("total_num_steps", std::to_string(s.total_num_steps));
  add("warmup_min_ratio", exact(s.warmup_min_ratio));
  add("cos_min_ratio", exact(s.cos_min_ratio));
  add("cycle_min_lr", exact(s.cycle_min_lr));
  add("cycle_max_lr", exact(s.cycle_max_lr));
  add("decay_lr_rate", exact(s.decay_lr_rate));
  add("cycle_first_step_size", std::to_string(s.cycle_first_step_size));
  add("cycle_second_step_size", std::to_string(s.cycle_second_step_size));
  add("cycle_first_stair_count", std::to_string(s.cycle_first_stair_count));
  add("cycle_second_stair_count", std::to_string(s.cycle_second_stair_count));
  add("decay_step_size", std::to_string(s.decay_step_size));
  add("cycle_momentum", s.cycle_momentum ? "true" : "false");
  add("cycle_min_mom", exact(s.cycle_min_mom));
  add("cycle_max_mom", exact(s.cycle_max_mom));
  add("decay_mom_rate", exact(s.decay_mom_rate));
  add("last_batch_iteration", std::to_string(s.last_batch_iteration));
  return text;
}

// `text` as (flag, value) pairs, one a line: the flag before the line's first space, the value
// after it.
std::vector<std::pair<std::string, std::string>> option_lines(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const std::size_t space = line.find(' ');
    lines.emplace_back(line.substr(0, space),
                       space == std::string::npos ? std::string() : line.substr(space + 1));
  }
  return lines;
}

}  // namespace

int launcher_world_size(const std::string& comm, std::string* variable) {
  // torchrun's first for nccl. Not Slurm's SLURM_NTASKS: a batch allocation sets it around a
  // program started without srun, which is then one process.
  std::vector<const char*> names(std::begin(kLauncherSizeVariables),
                                 std::end(kLauncherSizeVariables));
  if (comm == "nccl") names.insert(names.begin(), "WORLD_SIZE");
  if (variable != nullptr) variable->clear();
  for (const char* name : names) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::atoi(value) > 0) {
      if (variable != nullptr) *variable = std::string(name) + "=" + value;
      return std::atoi(value);
    }
  }
  return 1;  // no launcher: a job of one process
}

int launcher_rank(const std::string& comm) {
  std::vector<const char*> names = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK",
                                    "SLURM_PROCID"};
  if (comm == "nccl") names.insert(names.begin(), "RANK");
  for (const char* name : names) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::atoi(value) >= 0) return std::atoi(value);
  }
  return 0;
}

bool parse_count(const std::string& text, std::uint64_t* value) {
  return parse_scaled(text, false, value);
}
bool parse_bytes(const std::string& text, std::uint64_t* value) {
  return parse_scaled(text, true, value);
}

std::string format_count(double value) {
  char buffer[32];
  if (value >= 1e9) {
    std::snprintf(buffer, sizeof(buffer), "%.2fB", value / 1e9);
  } else if (value >= 1e6) {
    std::snprintf(buffer, sizeof(buffer), "%.2fM", value / 1e6);
  } else if (value >= 1e3) {
    std::snprintf(buffer, sizeof(buffer), "%.1fk", value / 1e3);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.0f", value);
  }
  return buffer;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), unit == 0 ? "%.0f %s" : "%.1f %s", bytes, units[unit]);
  return buffer;
}

std::string options_every_rank_shares(const Options& o) {
  std::string text;
  auto add = [&](const char* flag, const std::string& value) {
    text += std::string(flag) + " " + value + "\n";
  };
  auto on_off = [](bool on) { return std::string(on ? "on" : "off"); };
  add("--params", std::to_string(o.params));
  add("--layers", std::to_string(o.layers));
  add("--context", std::to_string(o.context_bytes));
  add("--embed", std::to_string(o.embed_dim));
  add("--steps", std::to_string(o.steps));
  add("--batch", std::to_string(o.batch));
  add("--seq-len", std::to_string(o.seq_len));
  add("--micro-batches", std::to_string(o.micro_batches));
  add("--lr", exact(o.lr));
  add("--warmup", std::to_string(o.warmup_steps));
  // The schedule the config gave; without --config it follows from the three options above.
  add("--config", o.config_path.empty() ? "none" : "scheduler " + schedule_text(o.schedule));
  add("--weight-decay", exact(o.weight_decay));
  add("--grad-clip", exact(o.grad_clip));
  add("--clip-previous", on_off(o.clip_previous));
  add("--seed", std::to_string(o.seed));
  add("--eval-every", std::to_string(o.eval_every));
  add("--eval-tokens", std::to_string(o.eval_tokens));
  add("--engine", on_off(o.use_engine));
  add("--overlap-step", on_off(o.overlap_step));
  add("--world-size", std::to_string(o.world_size));
  add("--comm", o.comm);
  add("--device", o.device);
  add("--stage", std::to_string(o.stage));
  add("--offload-optimizer", o.offload_optimizer);
  add("--offload-param", o.offload_param);
  add("--param-dtype", o.param_dtype);
  add("--gradients-on-nvme", on_off(o.gradients_on_nvme));
  add("--checkpoint-activations", on_off(o.checkpoint_activations));
  add("--offload-activations", o.offload_activations);
  add("--sub-group-size", std::to_string(o.sub_group_size));
  add("--persistence-threshold", std::to_string(o.persistence_threshold));
  add("--save-every", std::to_string(o.save_every));
  add("--keep-last", std::to_string(o.keep_last));
  add("--resume", o.resume_dir.empty() ? "none" : "a checkpoint directory");
  add("--stop-after", std::to_string(o.stop_after));
  return text;
}

std::string first_option_ranks_disagree_on(const std::vector<std::string>& rank_texts) {
  std::vector<std::vector<std::pair<std::string, std::string>>> ranks;
  std::size_t line_count = 0;
  for (const std::string& text : rank_texts) {
    ranks.push_back(option_lines(text));
    line_count = std::max(line_count, ranks.back().size());
  }
  // A line a rank lacks reads as nothing given.
  auto line_of = [&](std::size_t r, std::size_t i) {
    return i < ranks[r].size() ? ranks[r][i] : std::pair<std::string, std::string>();
  };
  auto shown = [](const std::string& value) { return value.empty() ? "nothing" : value; };
  for (std::size_t i = 0; i < line_count; ++i) {
    const auto [flag, value] = line_of(0, i);
    for (std::size_t r = 1; r < ranks.size(); ++r) {
      const auto [their_flag, their_value] = line_of(r, i);
      if (their_flag == flag && their_value == value) continue;
      const std::string name = flag.empty() ? their_flag : flag;
      return name + " differs between the ranks: rank 0 has " + shown(value) + ", rank " +
             std::to_string(r) + " has " + shown(their_flag == name ? their_value : "") +
             " (every rank of a job must be given the same " + name + ")";
    }
  }
  return "";
}

int parse_options(int argc, char** argv, Options* o, std::string* error) {
  CLI::App app(
      "train_lm: trains a byte-level language model with zinf (ZeRO-3, AdamW, optimizer state on "
      "NVMe) and writes its loss curve.",
      "train_lm");
  // A later value wins, so that a script's defaults (scripts/demo) can be overridden by its
  // caller's arguments.
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  add_scaled(app, "--params", &o->params, false,
             "model size in parameters: 1M, 10M, 1B, ...; the hidden width follows");
  app.add_option("--layers", o->layers, "hidden blocks")->check(CLI::Range(1, 64));
  app.add_option("--context", o->context_bytes, "bytes before each target the model sees")
      ->check(CLI::Range(1, 256));
  app.add_option("--embed", o->embed_dim, "byte embedding width")->check(CLI::Range(1, 4096));
  app.add_option("--steps", o->steps, "optimizer steps")->check(CLI::Range(1, 100'000'000));
  app.add_option("--batch", o->batch, "sequences a step, over all ranks")
      ->check(CLI::Range(1, 1'000'000));
  app.add_option("--seq-len", o->seq_len, "targets a sequence")->check(CLI::Range(1, 1'000'000));
  app.add_option("--micro-batches", o->micro_batches,
                 "forward/backward passes per rank and step (0: 4 / world size, or 1)")
      ->check(CLI::Range(0, 1'000'000));
  app.add_option("--lr", o->lr, "peak learning rate (linear warmup, cosine decay to 10%)")
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("--warmup", o->warmup_steps, "learning-rate warmup steps")
      ->check(CLI::Range(0, 100'000'000));
  app.add_option("--config", o->config_path,
                 "DeepSpeed config whose scheduler section replaces the --lr/--warmup schedule");
  app.add_option("--weight-decay", o->weight_decay, "AdamW decoupled weight decay")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--grad-clip", o->grad_clip, "clip the global gradient norm (0: off)")
      ->check(CLI::Range(0.0, 1e9));
  app.add_flag("--clip-previous", o->clip_previous,
               "clip each step by the previous step's coefficient (zinf.clip_from_previous_step), "
               "so the optimizer pass can begin during the backward");
  app.add_option("--optimizer-threads", o->optimizer_threads,
                 "threads of the engine's CPU optimizer (zinf.cpu_threads; 0: every core)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--optimizer-buffers", o->optimizer_buffers,
                 "pinned blocks of one sub-group each for the optimizer's NVMe reads and writes "
                 "(offload_optimizer.buffer_count): how far its reads run ahead")
      ->check(CLI::Range(2, 4096));
  app.add_option("--seed", o->seed, "seed of the initial weights and of the batches");
  app.add_option("--eval-every", o->eval_every, "steps between validation losses")
      ->check(CLI::Range(1, 100'000'000));
  app.add_option("--eval-tokens", o->eval_tokens, "validation targets")
      ->check(CLI::Range(64, 10'000'000));
  app.add_option("--time-limit", o->time_limit_s,
                 "stop after this many seconds of training, with a final validation (0: none)")
      ->check(CLI::Range(0.0, 1e9));
  std::string engine = o->use_engine ? "on" : "off";
  app.add_option("--engine", engine, "on: train through zinf's Engine; off: a plain fp32 loop")
      ->check(CLI::IsMember({"on", "off"}));
  std::string overlap = o->overlap_step ? "on" : "off";
  app.add_option("--overlap-step", overlap,
                 "on: the optimizer step runs on behind the next forward pass (zinf.overlap_step); "
                 "off: sequential")
      ->check(CLI::IsMember({"on", "off"}));
  CLI::Option* world_option =
      app.add_option("--world-size", o->world_size,
                     "ranks: LocalComm threads (--comm local); with mpi or nccl the launcher's "
                     "world size, which it must equal when given")
          ->check(CLI::Range(1, 64));
  app.add_option("--comm", o->comm,
                 "local: ranks as threads of this process; mpi: one process per rank under "
                 "mpirun/srun (MpiComm); nccl: one GPU process per rank under torchrun, mpirun "
                 "or srun (NcclComm, --device cuda)")
      ->check(CLI::IsMember({"local", "mpi", "nccl"}));
  app.add_option("--device", o->device,
                 "the engine's device: host (HostDevice, read in place), opaque (a HostDevice "
                 "read through copies, as a GPU), cuda (one GPU; the model computes on the CPU)")
      ->check(CLI::IsMember({"host", "opaque", "cuda"}));
  app.add_option("--collective-timeout-ms", o->collective_timeout_ms,
                 "how long a rank waits in a collective for the others before the run fails "
                 "naming the rank it waited for (zinf.collective_timeout_ms)")
      ->check(CLI::Range(1, 86'400'000));
  app.add_option("--stage", o->stage, "ZeRO stage")->check(CLI::IsMember({1, 2, 3}));
  app.add_option("--offload-optimizer", o->offload_optimizer,
                 "where fp32 master weights and Adam moments live")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}));
  app.add_option("--offload-param", o->offload_param,
                 "where each rank's parameter shards live between gathers (stage 3)")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}));
  app.add_option("--param-dtype", o->param_dtype, "dtype of the parameters the model computes with")
      ->check(CLI::IsMember({"bf16", "f32"}));
  app.add_option("--nvme-path", o->nvme_path, "directory for the NVMe swap files");
  app.add_flag("--gradients-on-nvme", o->gradients_on_nvme,
               "accumulate the fp32 gradients on NVMe (stages 2-3, --offload-optimizer nvme)");
  app.add_flag("--checkpoint-activations", o->checkpoint_activations,
               "keep only each block's input for the backward pass, which recomputes the block");
  app.add_option("--offload-activations", o->offload_activations,
                 "where the engine keeps the checkpointed block inputs (with "
                 "--checkpoint-activations)")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}));
  add_scaled(app, "--device-memory", &o->device_memory_bytes, true,
             "device memory budget per rank (0: 16 GiB)");
  add_scaled(app, "--host-memory", &o->host_memory_bytes, true,
             "host memory budget of the process (0: 90% of physical memory)");
  add_scaled(app, "--sub-group-size", &o->sub_group_size, false,
             "parameters the optimizer moves and steps at once (0: chosen)");
  add_scaled(app, "--persistence-threshold", &o->persistence_threshold, false,
             "stage 3: parameters of at most this many elements stay gathered (0: none)");
  app.add_option("--save-every", o->save_every,
                 "save a checkpoint (tag global_step<N>) every this many steps (0: none)")
      ->check(CLI::Range(0, 100'000'000));
  app.add_option("--save-dir", o->save_dir, "checkpoint directory (default: <out>/checkpoints)");
  app.add_option("--keep-last", o->keep_last,
                 "checkpoint tags kept in --save-dir, the newest (zinf.keep_last; 0: every tag)")
      ->check(CLI::Range(0, 1'000'000))
      ->capture_default_str();
  app.add_option("--resume", o->resume_dir,
                 "continue from the latest checkpoint in this directory: the engine's state, the "
                 "batch sampler and the loss curve so far");
  app.add_option("--stop-after", o->stop_after,
                 "end after this step without the final validation, as a run killed there would "
                 "(0: run all --steps)")
      ->check(CLI::Range(0, 100'000'000));
  app.add_option("--out", o->out_dir, "directory for loss.csv, loss.svg and summary.txt");
  app.add_option("--trace", o->trace_path, "write the run as a Perfetto (Chrome JSON) trace");
  app.add_option("--data", o->data_path, "training text (default: the bundled KJV Pentateuch)");
  bool no_progress = false;
  app.add_flag("--no-progress", no_progress, "no progress bar (one line per validation instead)");
  app.add_flag("--quiet", o->quiet,
               "print nothing while training (no banner, progress or step lines), only the report "
               "at the end: the time, state and summary tables and the key=value lines (warnings "
               "and errors still show)");
  app.add_flag("--step-times", o->step_times,
               "a line per step saying where its time went (automatic for steps over 2 s)");
  app.add_flag("--verify-swap-on-error", o->verify_swap_on_error,
               "when training fails, each rank checks its swap files against their checksums "
               "before it exits");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    std::fputs(app.help().c_str(), stdout);
    return -1;
  } catch (const CLI::ParseError& e) {
    std::string message = e.what();
    // CLI11 may spread one error over lines; the user gets one.
    for (char& c : message) {
      if (c == '\n') c = ' ';
    }
    *error = message;
    return 2;
  }
  o->use_engine = engine == "on";
  o->overlap_step = overlap == "on";
  if (!o->use_engine && (o->save_every > 0 || !o->resume_dir.empty())) {
    *error = "--save-every and --resume need --engine on (checkpoints are the engine's)";
    return 2;
  }
  if (o->save_dir.empty()) o->save_dir = o->out_dir + "/checkpoints";
  // A GPU rank is a process of its own: --device cuda runs as a job of NcclComm processes (of one
  // process when no launcher started it).
  if (o->device == "cuda" && o->comm == "local") o->comm = "nccl";
  if (o->comm == "local") {
    // LocalComm's ranks are threads of this one process. A launcher that started several
    // processes (mpirun -np 4 train_lm) would otherwise get as many separate one-process jobs,
    // each training the whole model alone and writing the same outputs.
    for (const char* name : kLauncherSizeVariables) {
      const char* value = std::getenv(name);
      if (value != nullptr && std::atoi(value) > 1) {
        // --comm mpi runs on the engine only.
        *error = std::string("started as one of ") + value + " processes by a launcher (" + name +
                 "=" + value +
                 ") with --comm local, whose ranks are threads of one process; pass --comm mpi" +
                 (o->use_engine ? "" : " and --engine on") + " for one rank per process";
        return 2;
      }
    }
    // torchrun sets only WORLD_SIZE and RANK. Its processes are train_lm's GPU ranks (--device
    // cuda, which runs --comm nccl and never reaches here); CPU ranks are MPI's, started by
    // mpirun, which torchrun is not.
    const char* torch_world = std::getenv("WORLD_SIZE");
    const char* torch_rank = std::getenv("RANK");
    if (torch_rank != nullptr && torch_world != nullptr && std::atoi(torch_world) > 1) {
      *error = std::string("started as one of ") + torch_world +
               " processes by torchrun (WORLD_SIZE=" + torch_world + ", RANK=" + torch_rank +
               ") with --comm local, whose ranks are threads of one process; under torchrun "
               "pass --device cuda (--comm nccl, one GPU per process), or for CPU ranks start "
               "train_lm with mpirun and --comm mpi";
      return 2;
    }
  }
  if (o->comm != "local") {
    // One process per rank: the world is the launcher's. Its variables are a guess that may be
    // left over from another launch (a PMI_SIZE around a program started without a launcher), so
    // an explicit --world-size wins over them; the communicator, which knows, checks it
    // when it opens. Without any of them no launcher started this process, and it is one rank.
    std::string variable;
    const int launched = launcher_world_size(o->comm, &variable);
    if (world_option->count() > 0 && variable.empty() && o->world_size != 1) {
      // One process per GPU: more ranks need a launcher (torchrun, mpirun) that starts them.
      *error = std::string(o->device == "cuda" ? "--device cuda: " : "") + "--world-size " +
               std::to_string(o->world_size) + " but the launcher started " +
               std::to_string(launched) + " process(es) for --comm " + o->comm +
               " (one process per rank: start them with mpirun, srun or torchrun)";
      return 2;
    }
    if (world_option->count() > 0) {
      o->world_size_from = "--world-size";
    } else {
      o->world_size = launched;
      o->world_size_from = variable;
    }
    if (!o->use_engine) {
      *error = "--comm " + o->comm + " needs --engine on";
      return 2;
    }
  }
  if (o->comm == "nccl" && o->device != "cuda") {
    *error = "--comm nccl needs --device cuda (NCCL moves GPU memory), not --device " + o->device;
    return 2;
  }
  o->progress = !no_progress;
  if (o->params < 1000) {
    *error = "--params: " + std::to_string(o->params) + " is below the smallest model (1k)";
    return 2;
  }
  if (o->micro_batches == 0) {
    o->micro_batches = 4 % o->world_size == 0 ? std::size_t(4 / o->world_size) : 1;
    if (o->batch % (std::size_t(o->world_size) * o->micro_batches) != 0) o->micro_batches = 1;
  }
  if (o->batch % (std::size_t(o->world_size) * o->micro_batches) != 0) {
    *error = "--batch " + std::to_string(o->batch) + " does not split evenly over --world-size " +
             std::to_string(o->world_size) + " ranks x --micro-batches " +
             std::to_string(o->micro_batches);
    return 2;
  }
  if (!o->use_engine && o->world_size != 1) {
    *error = "--engine off trains in one process: it takes --world-size 1 only";
    return 2;
  }
  if (!o->use_engine && o->device != "host") {
    *error = "--device " + o->device + " needs --engine on (--engine off trains without a device)";
    return 2;
  }
  if (o->stage != 3 && o->offload_param != "none") {
    *error = "--offload-param " + o->offload_param + " needs --stage 3 (stage " +
             std::to_string(o->stage) + " keeps all parameters on every rank's device)";
    return 2;
  }
  if (o->gradients_on_nvme && (o->stage == 1 || o->offload_optimizer != "nvme")) {
    *error = "--gradients-on-nvme needs --stage 2 or 3 and --offload-optimizer nvme";
    return 2;
  }
  if (o->offload_activations != "none" && !o->checkpoint_activations) {
    *error = "--offload-activations " + o->offload_activations + " needs --checkpoint-activations";
    return 2;
  }
  if (o->offload_activations != "none" && !o->use_engine) {
    *error = "--offload-activations " + o->offload_activations +
             " needs --engine on (the engine's activation store moves them)";
    return 2;
  }
  if (o->checkpoint_activations && o->use_engine && o->device != "host") {
    *error =
        "--checkpoint-activations with the engine needs --device host: the model computes "
        "on the CPU, and the engine saves its block inputs from device memory, which the "
        "model writes in place only on a host device";
    return 2;
  }
  if (o->out_dir.empty()) {
    *error = "--out: an empty directory name";
    return 2;
  }
  return schedule_from(o, error);
}

}  // namespace train_lm
