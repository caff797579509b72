// Helpers for the engine tests: N ranks as threads on HostDevice + LocalComm, a small multi-module
// model, a training loop through the Engine, and a plain single-process reference that trains
// the same model with optimizer_step on whole parameters.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/run_ranks.hpp"
#include "common/scratch_dir.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

namespace zinf::engine_test {

using test::ScratchDir;

struct ParamDef {
  std::string name;
  std::string module;
  std::vector<std::int64_t> shape;
  DType dtype = DType::kF32;
  std::size_t element_count() const;
};

struct Model {
  std::vector<std::string> modules;  // forward order
  std::vector<ParamDef> params;      // registration order (grouped by module)
  std::vector<std::vector<float>> initial;
  // When set, this module's parameters register frozen (ParameterSpec::trainable false):
  // train_rank() gathers it but reduces no gradients for it, and run_reference() leaves it out
  // of the step (no gradient, no update, nothing in the norm).
  std::string frozen_module;
};

// Five modules; parameter counts that 2, 3 and 4 do not divide; small parameters (biases, a
// scalar) beside larger ones. All parameters of dtype `dtype`.
Model make_model(DType dtype, std::uint64_t seed);
// Three modules, every group a multiple of 2048 f32 elements, so that each rank's partition at
// world 1 or 2 and each sub-group of 1024 parameters is whole 4 KiB pages: the store's checkpoint
// layout, where a save links the NVMe swap file.
Model page_model(std::uint64_t seed);

// A LoRA-shaped bf16 model of 64 Mi frozen elements (module "base": 16 weights of 2048 x 2048)
// and 1 Mi trainable ones (module "lora": 8 adapters of 1024 x 128), seeded values in [-1, 1).
Model big_lora_model();

// Devices and a LocalComm group of `world` ranks (common/run_ranks.hpp).
using Ranks = test::HostRanks;
// With `opaque`, the HostDevices are opaque (HostDeviceOptions::opaque): not host-accessible,
// their pointers fault when host code dereferences them, as a GPU's would.
Ranks make_ranks(int world, std::chrono::milliseconds timeout = std::chrono::seconds(30),
                 std::uint32_t jitter_max_us = 0, bool opaque = false);

// Rank `rank`'s engine of `config` on `ranks`, with `faults` injected into its I/O when given.
Result<std::unique_ptr<Engine>> open_rank(Ranks& ranks, int rank, const Config& config,
                                          std::shared_ptr<FaultInjector> faults = nullptr);

// A fault injector that fails every read (`reads`) or every write with EIO once enabled; made
// disabled, so that an engine opens and finalizes before the test enables it (on one rank, say).
std::shared_ptr<FaultInjector> failing_io(bool reads);
// A fault injector that counts each read (`reads`) or write piece in FaultCounts::latency and
// neither delays nor fails any: how many pieces a call moves.
std::shared_ptr<FaultInjector> io_counter(bool reads);

// Runs fn(rank) on one thread per rank; returns each rank's Status (common/run_ranks.hpp).
using test::run_ranks;

// Opens an engine of `config` on each rank's device and communicator of `ranks` and runs
// fn(rank, engine) on one thread per rank; returns each rank's Status (a failed open is the
// rank's). Nothing is registered: fn does that (register_model(), train_rank()).
std::vector<Status> run_engines(const Config& config, Ranks& ranks,
                                const std::function<Status(int rank, Engine& engine)>& fn);

// XORs the byte at `offset` of the file at `path` with `mask` (a corruption a checksum must catch);
// false when the file cannot be opened or is shorter.
bool flip_bits(const std::string& path, std::uint64_t offset, unsigned char mask);

// Makes `world` ranks (make_ranks' defaults), opens an engine of `config` on each, registers
// `model` and finalizes, then runs fn(rank, engine); returns each rank's Status.
std::vector<Status> with_engines(const Config& config, const Model& model, int world,
                                 const std::function<Status(int rank, Engine& engine)>& fn);

// train_rank() of steps first_step .. last_step, the gathered values not checked.
Status train_steps(Engine& engine, const Model& model, int rank, int first_step, int last_step);

// Trains `model` with `config` on `world` fresh ranks (with_engines()) for `steps` steps, the
// gathered values not checked, and saves checkpoint `tag` in `dir`: moments, say, for another run
// to load.
Status train_and_save(const Config& config, const Model& model, int world, int steps,
                      const std::string& dir, const std::string& tag);

// What load_and_train() saw, per rank but `masters`.
struct LoadedRun {
  std::vector<Status> status;
  // MemoryReport::host_bytes after finalize() and after the load.
  std::vector<std::uint64_t> finalized_host_bytes, loaded_host_bytes;
  // Rank 0's read_masters() after the steps.
  std::vector<std::vector<float>> masters;
};
// On every rank of `ranks`: registers `model`, finalizes, loads checkpoint `tag` from `dir`, and
// trains steps first_step .. last_step with the gathered values not checked.
LoadedRun load_and_train(const Config& config, Ranks& ranks, const Model& model,
                         const std::string& dir, const std::string& tag, int first_step,
                         int last_step);

// Every parameter's fp32 master as the engine reads it back (Engine::read_parameters), in the
// model's order.
Result<std::vector<std::vector<float>>> read_masters(Engine& engine, const Model& model);
// The whole file's bytes; empty when it cannot be opened.
std::string read_file(const std::string& path);

// `count` values drawn uniformly from [lo, hi) by std::mt19937_64 seeded with `seed`.
std::vector<float> seeded(std::size_t count, std::uint64_t seed, float lo, float hi);

// A gathered parameter (host-accessible memory) widened to f32.
std::vector<float> widen_view(const TensorView& view);
// Gradient values rounded to nearest even in `dtype` (kBF16 or kF16), as a program hands them.
std::vector<std::uint16_t> narrow_to_half(const std::vector<float>& values, DType dtype);

// The gradient rank `rank` hands for parameter `p` at step `step`, micro-batch `micro`, from the
// parameter values `w` it computed with (f32, widened from the device copy):
//   g = (w - target) * 0.5, target uniform in [-1, 1) from a seed of (rank, step, micro, p),
// rounded to the parameter's dtype. It depends on w, so a stale or wrong gather shows up.
std::vector<float> make_grad(const ParamDef& def, const std::vector<float>& w, int rank, int step,
                             int micro, std::size_t p);

struct TrainOptions {
  int steps = 20;
  // train_rank() runs steps first_step .. steps (to resume after something done in between).
  int first_step = 1;
  int micro_batches = 1;
  // When set, each gathered parameter is compared with `expected_device` (the reference's
  // master rounded to the dtype) before use; a mismatch fails the run.
  bool check_gathered = true;
  // 0: the gathered values must be the same bits; else the largest relative difference allowed
  // (for runs whose step arithmetic differs from the reference's in the last bit, as clipping's
  // norm does).
  double gathered_tolerance = 0.0;
  // The rank's device. When it is not host-accessible (CudaDevice, an opaque HostDevice) the
  // gathered parameters are read by device-to-host copies and the gradients handed to the engine
  // in device memory, as a training program on a GPU does; else (or null) both are read and
  // written in place.
  Device* device = nullptr;
  // When set (with a device that is not host-accessible), the engine's compute stream
  // (Engine::set_compute_stream, cleared at the end), on which the parameters are read and the
  // gradients uploaded (each synchronised before the host uses the data).
  Stream* compute_stream = nullptr;
  // run_reference(): step with the device's Adam/AdamW (kernels::adam_step_ref with
  // kernels::adam_step_args, every operation rounded) on the scaled gradients, as the engine's
  // DeviceOptimizer does, instead of the CPU optimizer (optimizer_step, fused multiply-adds).
  bool device_adam = false;
  // run_reference(): from step `resharded_from_step` on, the gradients are those of
  // `resharded_world` ranks (a run saved at one world size and resumed at another); 0: never.
  int resharded_from_step = 0;
  int resharded_world = 0;
};

// Trains `model` on one rank through `engine` (registered already or not: registers it when
// not finalized), checking gathered values against `reference_device[step][p]` when given.
// Returns the step reports.
Status train_rank(Engine& engine, const Model& model, int rank, const TrainOptions& options,
                  const std::vector<std::vector<std::vector<float>>>* reference_device,
                  std::vector<StepReport>* reports);

Status register_model(Engine& engine, const Model& model);

// open_rank(), with `model` registered and the engine finalized.
Result<std::unique_ptr<Engine>> open_finalized(Ranks& ranks, int rank, const Config& config,
                                               const Model& model,
                                               std::shared_ptr<FaultInjector> faults = nullptr);

// The single-process reference: AdamW (or config.optimizer) on whole parameters, gradients
// averaged over `world` ranks in rank order and accumulated over micro-batches exactly as the
// stage does (stage 1 sums micro-batches per rank before the average, stages 2-3 average per
// micro-batch and sum). Returns the final fp32 masters, and for each step (0 .. steps - 1) the
// device-dtype values the model computes with during that step (widened to f32).
struct Reference {
  std::vector<std::vector<float>> master;
  // The final moments (Adam/AdamW's; zeros for a parameter left out of the step).
  std::vector<std::vector<float>> exp_avg, exp_avg_sq;
  std::vector<std::vector<std::vector<float>>> device_per_step;
};
Reference run_reference(const Config& config, const Model& model, int world,
                        const TrainOptions& options);

// train_against_reference()'s results, per rank.
struct RankRuns {
  std::vector<Status> status;
  std::vector<std::vector<std::vector<float>>> finals;  // read_masters() after the training
  std::vector<std::vector<StepReport>> reports;
  std::vector<EngineCounters> counters;
};
// Trains `model` with `config` on every rank of `ranks` (train_rank(), each rank's device in its
// options), the gathered values compared at every step with `reference`'s.
RankRuns train_against_reference(const Config& config, Ranks& ranks, const Model& model,
                                 const TrainOptions& options, const Reference& reference);

// Whether a and b hold the same floats bit for bit (NaNs and signed zeros included).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b);

// The middle value of v (the upper one of the two middles for an even count); v not empty.
double median(std::vector<double> v);

// max |a - b| / max(|b|, floor) over all elements.
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b, double floor = 1e-3);
// The largest max_rel_diff() over the parameters of `want` (`got` has at least as many).
double worst_rel_diff(const std::vector<std::vector<float>>& got,
                      const std::vector<std::vector<float>>& want);

// A config for small test models: tiny buckets, sub-groups and prefetch so that every path runs
// with several pieces.
Config small_config(int stage, OffloadDevice optimizer, OffloadDevice params,
                    const std::string& nvme_path);

}  // namespace zinf::engine_test
