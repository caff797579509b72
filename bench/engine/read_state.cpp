// Engine::read_optimizer_state and read_parameters of every parameter in turn, as a loop over
// model.parameters() calling deepspeed.utils.safe_get_full_optimizer_state does, on one rank: a
// model of --params f32 parameters in --tensors parameters of equal size (one module each),
// stage 2, AdamW with its state on NVMe in --dir, sub-groups of --sub-group elements. After one
// step (so the moments are not zero), each of --rounds rounds reads every parameter's exp_avg,
// then every parameter's master, and prints for each loop its time and the bytes the process
// read from the drive meanwhile (/proc/self/io read_bytes: the block layer's count, which the
// O_DIRECT reads of the swap file go through), against the bytes of the moment (or master) the
// loop hands back: one partition's worth. The end prints the medians.
//
//   build/bin/bench_engine_read_state --params 16777216 --tensors 64 --dir /tmp/zinf-rs
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "bench/bench_stats.hpp"
#include "bench/engine/engine_bench.hpp"
#include "zinf/config.hpp"
#include "zinf/engine.hpp"

namespace {

using zinf::bench::fail;
using zinf::bench::median;
using zinf::bench::seconds_since;

using namespace zinf;

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

int run(std::size_t params, std::size_t tensors, std::size_t sub_group, const std::string& dir,
        int rounds) {
  Result<bench::OneRank> opened = bench::open_one_rank(dir, OffloadDevice::kNvme, sub_group);
  if (!opened.is_ok()) return fail("open", opened.status());
  Engine& engine = *opened->engine;
  const std::size_t each = params / tensors;
  std::vector<std::string> names(tensors);
  for (std::size_t i = 0; i < tensors; ++i) {
    names[i] = fmt::format("w{}", i);
    ParameterSpec spec;
    spec.name = names[i];
    spec.module = fmt::format("m{}", i);
    spec.shape = {static_cast<std::int64_t>(each)};
    spec.initializer = [i](std::size_t first, std::size_t count, float* out) {
      for (std::size_t k = 0; k < count; ++k) {
        out[k] = static_cast<float>((first + k + i * 7919) % 1000) * 1e-3f - 0.5f;
      }
      return Status::ok();
    };
    if (Status st = engine.register_parameter(spec); !st.is_ok()) return fail("register", st);
  }
  if (Status st = engine.finalize(); !st.is_ok()) return fail("finalize", st);
  // One step, so that the moments hold the gradients' traces.
  std::vector<float> grad(each);
  for (std::size_t i = 0; i < tensors; ++i) {
    Result<ScopedGather> g = engine.scoped_gather(fmt::format("m{}", i));
    if (!g.is_ok()) return fail("gather", g.status());
    for (std::size_t k = 0; k < each; ++k) grad[k] = static_cast<float>((k * 31 + i) % 97) * 1e-2f;
    const GradientRef ref{names[i], grad.data(), each, DType::kF32};
    const Status st = engine.reduce_gradients(fmt::format("m{}", i), std::span(&ref, 1));
    if (!st.is_ok()) return fail("reduce", st);
  }
  if (Result<StepReport> rep = engine.step(); !rep.is_ok()) return fail("step", rep.status());

  // The step's pass may run on behind step(): a read waits for it, before anything is counted.
  std::vector<float> out(each);
  if (Status st = engine.read_parameters(names[0], out.data()); !st.is_ok()) {
    return fail("read_parameters", st);
  }

  const double partition_bytes = 4.0 * static_cast<double>(each * tensors);
  std::vector<double> moment_s, moment_ratio, master_s, master_ratio;
  for (int round = 0; round < rounds; ++round) {
    for (int which = 0; which < 2; ++which) {
      const std::uint64_t before = read_bytes();
      const auto t0 = std::chrono::steady_clock::now();
      for (std::size_t i = 0; i < tensors; ++i) {
        const Status st = which == 0 ? engine.read_optimizer_state(names[i], "exp_avg", out.data())
                                     : engine.read_parameters(names[i], out.data());
        if (!st.is_ok()) return fail(which == 0 ? "read_optimizer_state" : "read_parameters", st);
      }
      const double s = seconds_since(t0);
      const double ratio = static_cast<double>(read_bytes() - before) / partition_bytes;
      fmt::print("round {} {:<20} {:8.3f} s, read {:8.2f} x the partition's bytes\n", round,
                 which == 0 ? "exp_avg, each param" : "master, each param", s, ratio);
      (which == 0 ? moment_s : master_s).push_back(s);
      (which == 0 ? moment_ratio : master_ratio).push_back(ratio);
    }
  }
  fmt::print(
      "{} parameters of {} f32, sub-groups of {}: medians: exp_avg loop {:.3f} s reading {:.2f} x "
      "the partition ({:.1f} MB); master loop {:.3f} s reading {:.2f} x\n",
      tensors, each, sub_group, median(moment_s), median(moment_ratio), partition_bytes / 1e6,
      median(master_s), median(master_ratio));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace zinf::bench;
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
