// The training run: checks the options against the machine and the budgets, then trains the
// model through zinf's Engine (one Engine per rank, ranks as LocalComm threads) or, with
// --engine off, through a plain fp32 AdamW loop in this program, and reports what happened.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model.hpp"
#include "options.hpp"
#include "report.hpp"

namespace train_lm {

// Seconds spent in each part of the step, summed over the run on rank 0.
struct TimeSplit {
  double forward_s = 0;    // forward compute
  double backward_s = 0;   // backward compute
  double gather_s = 0;     // Engine::gather / release and the bf16 -> fp32 cast of the weights
  double reduce_s = 0;     // Engine::reduce_gradients (averaged over ranks into the owners)
  double step_s = 0;       // Engine::step (or the plain AdamW): norm, optimizer, publish
  double optimizer_s = 0;  //   of which the optimizer over the rank's slice (NVMe I/O included)
  double io_wait_s = 0;    //     of which waiting for reads and writes (not updating)
  // Overlapped step (--overlap-step on): of the optimizer's time, the part hidden behind compute;
  // and the gathers' waits for parameters not yet written (part of gather_s).
  double hidden_s = 0;
  double gather_wait_s = 0;
  double eval_s = 0;   // validation
  double total_s = 0;  // the steps' wall time, all of the above and the rest (batches)
};

struct RunSummary {
  // This process's (first) rank; only rank 0's process writes outputs (--comm mpi, nccl).
  int rank = 0;
  bool writes_outputs = true;
  ModelShape shape;
  std::uint64_t param_count = 0;
  std::int64_t steps_done = 0;  // steps this run trained (a resumed run's only)
  std::int64_t first_step = 1;  // the first of them: the checkpoint's step + 1 with --resume
  std::uint64_t tokens_seen = 0;
  double first_val_loss = 0;
  double final_val_loss = 0;
  double final_train_loss = 0;
  double wall_s = 0;
  TimeSplit time;
  // Bytes of state on each tier, all ranks together, from the engines' MemoryReports.
  std::uint64_t device_bytes = 0;
  std::uint64_t host_bytes = 0;
  std::uint64_t nvme_bytes = 0;
  std::uint64_t nvme_read_bytes = 0;  // optimizer + parameter traffic, all ranks, whole run
  std::uint64_t nvme_write_bytes = 0;
  // Activations (MemoryReport): the device peak summed over ranks (with --engine off, the
  // model's own figure), and the checkpoints' NVMe traffic.
  std::uint64_t activation_device_bytes_peak = 0;
  std::uint64_t activation_host_bytes = 0;
  std::uint64_t activation_nvme_write_bytes = 0;
  std::uint64_t activation_nvme_read_bytes = 0;
  // The process's peak resident set (with --comm mpi, nccl: every rank's process's, summed).
  std::uint64_t setup_peak_rss_bytes = 0;  // until the first validation (registration, finalize)
  std::uint64_t peak_rss_bytes = 0;        // during the training steps
  std::vector<CurvePoint> curve;
};

// Everything the run would need, estimated before anything is allocated.
struct Footprint {
  std::uint64_t device_bytes_per_rank = 0;
  std::uint64_t host_bytes = 0;  // the whole process, HostDevice memory included
  std::uint64_t nvme_bytes = 0;  // the swap files in --nvme-path, all ranks
  std::uint64_t swap_bytes = 0;  //   of which the optimizer state's and parameters'
  // One checkpoint in --save-dir: the master and moments. A linked save (the state on NVMe, the
  // checkpoint on the same filesystem) keeps the swap file it froze instead (swap_bytes), and the
  // run goes on in a new one.
  std::uint64_t checkpoint_bytes = 0;
};
Footprint estimate_footprint(const Options& options, const ModelShape& shape);

// The rate of step `step` (from 1) without the engine (--engine off): the schedule's, indexed as
// the engine indexes it (DeepSpeed's lr_at(last_batch_iteration + step - 1)), except the first
// step of a schedule started at last_batch_iteration >= 0, which runs at the optimizer's own lr
// (DeepSpeed's schedulers set the rate when built only at -1; docs/OPTIM.md).
double plain_learning_rate(const Options& options, std::int64_t step);

// Trains, after printing `banner` on stderr once the checks have passed. Returns 0; or 1 with
// `error` set to one line (nothing created is left behind); or 2 the same way when the ranks of a
// job (--comm mpi, nccl) were given different options (options_every_rank_shares). A failure once
// the communicator is open aborts it, so that the other ranks fail at once, naming this one.
int run_training(const Options& options, const ModelShape& shape, const std::string& banner,
                 RunSummary* summary, std::string* error);

}  // namespace train_lm
