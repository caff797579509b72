// Engine::read_optimizer_state and read_parameters of every parameter in turn, as a loop over
// model.parameters() calling deepspeed.utils.safe_get_full_optimizer_state does, on one rank,
// beside the limit they answer to: a model of --params f32 parameters in --tensors parameters of
// equal size (one module each), stage 2, AdamW with its state on NVMe in --dir, sub-groups of
// --sub-group elements. One step (so the moments are not zero), then every master written with
// seeded values. Each of --rounds rounds runs, in an order that turns round by round (each
// subject in each place in turn, so drift in the machine's load falls on all of them):
//   exp_avg loop  read_optimizer_state(name, "exp_avg") of every parameter
//   master loop   read_parameters(name) of every parameter
//   raw read      the partition's bytes (one moment of every parameter) read once from a file of
//                 their own in --dir, beside the swap file, as `zinf io bench` reads
//                 (bench::RawDrive: O_DIRECT, 8 MiB requests, 32 pieces of 1 MiB in flight); the
//                 file is written once, untimed, before the first round
// For each loop a round prints its time, the bytes the process read from the drive meanwhile
// (/proc/self/io read_bytes: the block layer's count, which the O_DIRECT reads of the swap file go
// through) over the partition's, its time over the raw read's, and its time over the raw read's
// scaled to the bytes the loop read. The end prints the medians, and checks, untimed, every
// parameter's master against the values written and its exp_avg against one AdamW step's from
// zero moments, (1 - beta1) * g in f32, bit for bit; the exit code is 1 when one differs.
//
//   build/bin/bench_engine_read_state --params 16777216 --tensors 64 --dir /tmp/zinf-rs
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "bench/bench_stats.hpp"
#include "bench/engine/engine_bench.hpp"
#include "io/io_bench.hpp"
#include "io/io_engine.hpp"
#include "zinf/config.hpp"
#include "zinf/engine.hpp"

using namespace zinf;
using namespace zinf::bench;

namespace {

// Bytes this process has had the block layer read for it so far (every thread).
std::uint64_t read_bytes() {
  std::ifstream in("/proc/self/io");
  std::string key;
  std::uint64_t value = 0;
  while (in >> key >> value) {
    if (key == "read_bytes:") return value;
  }
  return 0;
}

// Parameter `tensor`'s gradient of the one step.
void make_grad(std::size_t tensor, std::span<float> out) {
  for (std::size_t k = 0; k < out.size(); ++k) {
    out[k] = static_cast<float>((k * 31 + tensor) % 97) * 1e-2f;
  }
}

int run(std::size_t params, std::size_t tensors, std::size_t sub_group, const std::string& dir,
        int rounds) {
  Result<bench::OneRank> opened = bench::open_one_rank(dir, OffloadDevice::kNvme, sub_group);
  if (!opened.is_ok()) return fail("open", opened.status());
  Engine& engine = *opened->engine;
  const std::size_t each = params / tensors;
  Result<std::vector<std::string>> registered = bench::register_tensors(
      engine, tensors, each, [](std::size_t i, std::size_t first, std::size_t count, float* out) {
        for (std::size_t k = 0; k < count; ++k) {
          out[k] = static_cast<float>((first + k + i * 7919) % 1000) * 1e-3f - 0.5f;
        }
      });
  if (!registered.is_ok()) return fail("register", registered.status());
  const std::vector<std::string>& names = *registered;
  if (Status st = engine.finalize(); !st.is_ok()) return fail("finalize", st);
  // One step, so that the moments hold the gradients' traces.
  std::vector<float> grad(each);
  for (std::size_t i = 0; i < tensors; ++i) {
    Result<ScopedGather> g = engine.scoped_gather(fmt::format("m{}", i));
    if (!g.is_ok()) return fail("gather", g.status());
    make_grad(i, grad);
    const GradientRef ref{names[i], grad.data(), each, DType::kF32};
    const Status st = engine.reduce_gradients(fmt::format("m{}", i), std::span(&ref, 1));
    if (!st.is_ok()) return fail("reduce", st);
  }
  if (Result<StepReport> rep = engine.step(); !rep.is_ok()) return fail("step", rep.status());
  // Masters of known values (the moments stay the step's). write_parameters waits for the
  // step's pass, which may run on behind step(), so nothing of it is counted below.
  std::vector<float> out(each), want(each);
  for (std::size_t i = 0; i < tensors; ++i) {
    make_values(1, i, want);
    if (Status st = engine.write_parameters(names[i], want.data()); !st.is_ok()) {
      return fail("write_parameters", st);
    }
  }

  // The limit: the raw drive reading the partition's bytes (one moment, or the master, of every
  // parameter) once, sequentially, from a file of its own beside the swap file, as `zinf io bench`
  // reads (bench::RawDrive). The file holds them to whole 8 MiB requests; its times are scaled
  // to the partition's bytes. It is written once, untimed, before the first round.
  const std::uint64_t partition_bytes = std::uint64_t{4} * each * tensors;
  RawDrive raw;
  if (Status st = raw.open_written(dir + "/raw.bin", partition_bytes); !st.is_ok()) {
    return fail("raw file", st);
  }
  const double raw_scale = static_cast<double>(partition_bytes) / static_cast<double>(raw.bytes());

  // A loop over every parameter; its seconds, and the bytes the process read meanwhile over the
  // partition's.
  double read_ratio = 0;
  auto loop = [&](bool moment) -> Result<double> {
    const std::uint64_t before = read_bytes();
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < tensors; ++i) {
      ZINF_RETURN_IF_ERROR(moment ? engine.read_optimizer_state(names[i], "exp_avg", out.data())
                                  : engine.read_parameters(names[i], out.data()));
    }
    const double s = seconds_since(t0);
    read_ratio = static_cast<double>(read_bytes() - before) / static_cast<double>(partition_bytes);
    return s;
  };
  auto raw_read = [&]() -> Result<double> {
    ZINF_ASSIGN_OR_RETURN(IoBenchResult r, raw.move(IoOp::kRead));
    return r.seconds * raw_scale;
  };

  fmt::print(
      "{} parameters of {} f32, sub-groups of {}, state in {}: raw read of the partition's "
      "{:.1f} MB (raw file {:.1f} MB)\n",
      tensors, each, sub_group, dir, static_cast<double>(partition_bytes) / 1e6,
      static_cast<double>(raw.bytes()) / 1e6);
  fmt::print(
      "| round | exp_avg loop | its reads (x partition) | master loop | its reads | raw read | "
      "exp_avg / raw | master / raw | exp_avg / raw of its reads | master / raw of its reads "
      "|\n|---|---|---|---|---|---|---|---|---|---|\n");
  enum Subject { kMoment, kMaster, kRaw };
  const char* const subject_names[] = {"read_optimizer_state", "read_parameters", "raw read"};
  std::vector<double> moment_s, master_s, raw_s, moment_reads, master_reads;
  std::vector<double> moment_ratio, master_ratio, moment_read_ratio, master_read_ratio;
  for (int round = 1; round <= rounds; ++round) {
    double times[3] = {0, 0, 0};
    double reads[2] = {0, 0};
    // Each subject in each place in turn, so drift in the machine's load falls on all of them.
    for (int k = 0; k < 3; ++k) {
      const auto subject = static_cast<Subject>((round - 1 + k) % 3);
      Result<double> s = subject == kRaw ? raw_read() : loop(subject == kMoment);
      if (!s.is_ok()) return fail(subject_names[subject], s.status());
      times[subject] = *s;
      if (subject != kRaw) reads[subject] = read_ratio;
    }
    moment_s.push_back(times[kMoment]);
    master_s.push_back(times[kMaster]);
    raw_s.push_back(times[kRaw]);
    moment_reads.push_back(reads[kMoment]);
    master_reads.push_back(reads[kMaster]);
    moment_ratio.push_back(times[kMoment] / times[kRaw]);
    master_ratio.push_back(times[kMaster] / times[kRaw]);
    // Against the raw drive reading as many bytes as the loop had read.
    moment_read_ratio.push_back(times[kMoment] / (times[kRaw] * reads[kMoment]));
    master_read_ratio.push_back(times[kMaster] / (times[kRaw] * reads[kMaster]));
    fmt::print(
        "| {} | {:.3f} s | {:.2f} | {:.3f} s | {:.2f} | {:.3f} s | {:.2f} | {:.2f} | {:.2f} | "
        "{:.2f} |\n",
        round, times[kMoment], reads[kMoment], times[kMaster], reads[kMaster], times[kRaw],
        moment_ratio.back(), master_ratio.back(), moment_read_ratio.back(),
        master_read_ratio.back());
  }

  // The values, untimed: every master is what was written, and every exp_avg what one AdamW step
  // from zero moments leaves, m = fma(1 - beta1, g, beta1 * 0) in f32 (lib/optim/kernel.hpp),
  // bit for bit.
  const auto omb1 = static_cast<float>(1.0 - engine.config().optimizer.beta1);
  std::size_t masters_differ = 0, moments_differ = 0;
  for (std::size_t i = 0; i < tensors; ++i) {
    if (Status st = engine.read_parameters(names[i], out.data()); !st.is_ok()) {
      return fail("read_parameters", st);
    }
    make_values(1, i, want);
    masters_differ += std::memcmp(out.data(), want.data(), each * sizeof(float)) != 0;
    if (Status st = engine.read_optimizer_state(names[i], "exp_avg", out.data()); !st.is_ok()) {
      return fail("read_optimizer_state", st);
    }
    make_grad(i, grad);
    for (std::size_t k = 0; k < each; ++k) want[k] = std::fma(omb1, grad[k], 0.0f);
    moments_differ += std::memcmp(out.data(), want.data(), each * sizeof(float)) != 0;
  }
  fmt::print(
      "medians of {} rounds: exp_avg loop {:.3f} s reading {:.2f} x the partition, master loop "
      "{:.3f} s reading {:.2f} x, raw read {:.3f} s ({:.2f} GB/s); exp_avg / raw {:.2f}, master / "
      "raw {:.2f}; against the raw read of the bytes each loop read: exp_avg {:.2f}, master "
      "{:.2f}\n",
      rounds, median(moment_s), median(moment_reads), median(master_s), median(master_reads),
      median(raw_s), static_cast<double>(partition_bytes) / median(raw_s) / 1e9,
      median(moment_ratio), median(master_ratio), median(moment_read_ratio),
      median(master_read_ratio));
  fmt::print(
      "values: {} of {} masters differ from those written, {} of {} exp_avg from one step's "
      "(1 - beta1) * g\n",
      masters_differ, tensors, moments_differ, tensors);
  return masters_differ == 0 && moments_differ == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t params = std::size_t{1} << 24;
  std::size_t tensors = 64;
  std::size_t sub_group = zinf::Config().zero.sub_group_size;
  std::string dir = "/tmp/zinf-bench-read-state";
  int rounds = 3;
  const int parsed = parse_options(argc, argv, "bench_engine_read_state",
                                   {{"--params", "N", count_into(&params)},
                                    {"--tensors", "K", count_into(&tensors, 1)},
                                    {"--sub-group", "S", count_into(&sub_group, 1)},
                                    {"--dir", "DIR", text_into(&dir)},
                                    {"--rounds", "R", rounds_into(&rounds)}});
  if (parsed != 0) return parsed;
  return run(params, tensors, sub_group, dir, rounds);
}
