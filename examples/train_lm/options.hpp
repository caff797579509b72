// train_lm's command line: every option with its default, parsed into Options, and checked so
// that a bad value is one line of error before anything is created on disk.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zinf/schedule.hpp"

namespace train_lm {

struct Options {
  // Model.
  std::uint64_t params = 500'000;  // --params: 1M, 10M, 1B, ... (the hidden width follows)
  std::size_t layers = 4;          // --layers: hidden blocks
  std::size_t context_bytes = 16;  // --context: bytes the model sees before each target
  std::size_t embed_dim = 16;      // --embed
  // Training.
  std::int64_t steps = 400;  // --steps
  std::size_t batch = 16;    // --batch: sequences a step, over all ranks
  std::size_t seq_len = 64;  // --seq-len: targets a sequence
  // --micro-batches: forward/backward passes a rank makes per step (gradient accumulation).
  // 0 (auto): 4 / world_size when the world size divides 4, else 1, so that runs on 1, 2 and 4
  // ranks cut the batch into the same 4 slices and add the same gradients in the same order.
  std::size_t micro_batches = 0;
  double lr = 3e-3;                // --lr: peak learning rate
  std::int64_t warmup_steps = 30;  // --warmup
  // --config FILE: a DeepSpeed config. Its `scheduler` section, when it has one, is the run's
  // learning-rate schedule (base lr --lr); its other keys are checked as the engine reads them,
  // but train_lm's options set the engine.
  std::string config_path;
  // The run's schedule (parse_options fills it): the config's scheduler section, or --lr, --warmup
  // and --steps as DeepSpeed's WarmupCosineLR (linear warm-up, cosine to 10% of --lr at the last
  // step). The engine steps it; the plain loop evaluates the same formulas.
  zinf::ScheduleConfig schedule;
  double weight_decay = 0.01;         // --weight-decay (AdamW, decoupled)
  double grad_clip = 1.0;             // --grad-clip (0: off)
  bool clip_previous = false;         // --clip-previous: zinf.clip_from_previous_step
  int optimizer_threads = 0;          // --optimizer-threads: zinf.cpu_threads (0: every core)
  std::size_t optimizer_buffers = 4;  // --optimizer-buffers: offload_optimizer.buffer_count
  std::uint64_t seed = 1;             // --seed
  std::int64_t eval_every = 25;       // --eval-every: steps between validation losses
  std::size_t eval_tokens = 8192;     // --eval-tokens
  double time_limit_s = 0;            // --time-limit: stop early after this many seconds (0: none)
  // zinf.
  bool use_engine = true;  // --engine on|off (off: a plain fp32 loop, no zinf)
  // --overlap-step on|off: zinf.overlap_step (off: step() returns with every parameter published)
  bool overlap_step = true;
  // --world-size: ranks (LocalComm threads; with mpi/nccl the launcher's, which an explicit
  // --world-size overrides: the communicator checks it when it opens).
  int world_size = 1;
  // Where world_size came from with --comm mpi or nccl (parse_options fills it): "--world-size",
  // the launcher's variable ("OMPI_COMM_WORLD_SIZE=4"), or empty when no launcher set one.
  std::string world_size_from;
  // --comm local|mpi|nccl: local runs the ranks as LocalComm threads of this process; mpi and
  // nccl run one process per rank, started by mpirun/srun (mpi, nccl) or torchrun (nccl), each
  // opening its rank through the public constructors (make_mpi_comm, make_nccl_comm).
  std::string comm = "local";
  // --collective-timeout-ms: zinf.collective_timeout_ms, and MpiComm's timeout: how long a rank
  // waits for the others in a collective before the run fails naming the rank it waited for.
  std::int64_t collective_timeout_ms = 300'000;
  // --device host|opaque|cuda: the engine's device. host: a HostDevice, whose memory the model
  // reads and writes in place; opaque: a HostDevice whose pointers host code cannot dereference,
  // and cuda: the GPU (one rank, NCCL), where the model (still on the CPU) copies each parameter
  // down from device memory and each gradient up into it.
  std::string device = "host";
  int stage = 3;                              // --stage 1|2|3
  std::string offload_optimizer = "nvme";     // --offload-optimizer none|cpu|nvme
  std::string offload_param = "none";         // --offload-param none|cpu|nvme (stage 3)
  std::string param_dtype = "bf16";           // --param-dtype bf16|f32 (the device copy)
  std::string nvme_path = "build/demo/nvme";  // --nvme-path
  bool gradients_on_nvme = false;             // --gradients-on-nvme (zinf.gradients_on_nvme)
  // --checkpoint-activations: keep only each block's input for the backward pass and recompute
  // the block there (docs/ACTIVATIONS.md); through the engine's activation store with --engine
  // on. --offload-activations none|cpu|nvme: where the engine keeps those inputs (none: on the
  // device; cpu: pinned host memory; nvme: the swap directory, through pinned staging blocks).
  bool checkpoint_activations = false;
  std::string offload_activations = "none";
  std::uint64_t device_memory_bytes = 0;  // --device-memory: per-rank budget (0: 16 GiB)
  std::uint64_t host_memory_bytes = 0;    // --host-memory: process budget (0: 90% of RAM)
  std::uint64_t sub_group_size = 0;       // --sub-group-size (params; 0: chosen)
  // --persistence-threshold: stage 3 keeps parameters of at most this many elements gathered on
  // every rank (DeepSpeed's stage3_param_persistence_threshold, 1e5 there). 0 here, so that even
  // the demo's small model is gathered, released and offloaded module by module.
  std::uint64_t persistence_threshold = 0;
  // Checkpoints (through the engine; --engine on).
  std::int64_t save_every = 0;  // --save-every N: a checkpoint every N steps (0: none)
  std::string save_dir;         // --save-dir: where (default <out>/checkpoints)
  int keep_last = 2;            // --keep-last: zinf.keep_last (0: every tag)
  std::string resume_dir;       // --resume DIR: continue from DIR's latest checkpoint
  std::int64_t stop_after = 0;  // --stop-after N: end after step N, as a killed run (0: no)
  // Output.
  std::string out_dir = "build/demo";  // --out: loss.csv, loss.svg, summary.txt
  std::string trace_path;              // --trace FILE: Perfetto/Chrome trace JSON
  std::string data_path;               // --data (default: the bundled text)
  bool progress = true;                // --no-progress turns the bar off
  bool quiet = false;                  // --quiet: only the summary
  bool step_times = false;             // --step-times: a line per step with its time split
                                       // (automatic for steps over 2 s)
  // --verify-swap-on-error: a rank whose training fails reads its swap files back and checks
  // them against their checksums (Engine::verify_swap) before it exits, and says so.
  bool verify_swap_on_error = false;
};

// Parses argv. On success returns 0 and fills `options`; for --help prints the usage and
// returns -1 (the caller exits 0); on a bad argument sets `error` to one line and returns 2.
int parse_options(int argc, char** argv, Options* options, std::string* error);

// "1M", "10M", "1.5B", "350k", "4096" -> count; "4GiB", "512MiB", "16G" -> bytes (G = 2^30 for
// byte sizes, 10^9 for counts). Returns false on anything else.
bool parse_count(const std::string& text, std::uint64_t* value);
bool parse_bytes(const std::string& text, std::uint64_t* value);

// With --comm mpi or nccl: the world size and this process's rank as the launcher's environment
// gives them (torchrun's WORLD_SIZE/RANK for nccl, then Open MPI's, PMI's and srun's); 1 and 0
// when no launcher set them. `variable`, when given, gets the variable read ("PMI_SIZE=4"),
// or is cleared when none was set.
int launcher_world_size(const std::string& comm, std::string* variable = nullptr);
int launcher_rank(const std::string& comm);

// The options every rank of a job (--comm mpi, nccl) must be given alike, one "--flag value" line
// each in the order of the usage text, with the values parse_options resolved (--micro-batches,
// --world-size, the schedule of --config): those that shape the model, the batches, the
// optimizer, the engine's layout and the collectives each step issues. Left out are the options
// that are a rank's own by design: its paths (--nvme-path, --out, --trace, --data, --save-dir,
// and --resume's, which may be each node's own disk; whether it resumes is compared, and
// run_training compares the training text itself), its memory budgets, its optimizer threads and
// buffers, its collective timeout, --time-limit (rank 0's decides for every rank) and what it
// prints.
std::string options_every_rank_shares(const Options& options);

// Given each rank's options_every_rank_shares() text (with any lines the caller added), in rank
// order: empty when they are the same, else one line naming the first option that differs, the
// first rank whose value differs from rank 0's, and both values.
std::string first_option_ranks_disagree_on(const std::vector<std::string>& rank_texts);

// "1.0M", "1.2B"; "512 MiB", "11.2 GiB".
std::string format_count(double value);
std::string format_bytes(double bytes);

}  // namespace train_lm
