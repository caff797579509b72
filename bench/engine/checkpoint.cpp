// Engine::save_checkpoint / load_checkpoint on one rank beside the raw drive: a model of --params
// parameters (bf16, 64 parameters of params/64 elements) with its AdamW state on NVMe
// (--offload nvme, default) or in host memory (--offload cpu), stepped once with seeded random
// gradients (so the moments are not zeros), then --rounds rounds of, in this order:
//   raw write   the rank file's bytes into a file of its own in --dir, as `zinf io bench --op
//               write` moves them (run_io_bench: 1 MiB pieces, 32 in flight, 8 MiB requests,
//               O_DIRECT, 2 MiB pages, seeded random bytes)
//   save        save_checkpoint() into --dir/ckpt (the previous round's tag removed first, not
//               timed)
//   raw read    the raw file read back the same way
//   load        load_checkpoint() of that tag
// with one optimizer step, not timed, before every round but the first.
// Rates are the rank file's bytes over the call's time (manifest, fsyncs, renames included); the
// raw file holds the same bytes less the rank file's header and padding. The raw file is
// truncated after its read (its space back to the filesystem before the load), so that at 1B
// parameters with NVMe state the raw file, the swap file and a checkpoint linked from an earlier
// generation of it never need the drive at once.
// Each round prints save / raw write and load / raw read; the end prints their medians. The
// state is checked after the last load: the masters equal those before the last save, bit for
// bit.
//
//   build/bin/bench_engine_checkpoint --params 268435456 --dir /path/on/the/drive --offload cpu
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "bench/bench_stats.hpp"
#include "bench/engine/engine_bench.hpp"
#include "io/io_engine.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

namespace {

using zinf::bench::fail;
using zinf::bench::median;
using zinf::bench::RawDrive;
using zinf::bench::seconds_since;

using namespace zinf;

Result<std::vector<float>> masters(Engine& engine, std::size_t tensors, std::size_t each) {
  std::vector<float> all(tensors * each);
  for (std::size_t i = 0; i < tensors; ++i) {
    ZINF_RETURN_IF_ERROR(engine.read_parameters(fmt::format("w{}", i), all.data() + i * each));
  }
  return all;
}

int run(std::size_t params, const std::string& dir, OffloadDevice offload, int rounds) {
  Result<bench::OneRank> opened = bench::open_one_rank(dir, offload, std::size_t{1} << 24);
  if (!opened.is_ok()) return fail("open", opened.status());
  Engine& engine = *opened->engine;
  constexpr std::size_t kTensors = 64;
  const std::size_t each = params / kTensors;
  for (std::size_t i = 0; i < kTensors; ++i) {
    ParameterSpec spec;
    spec.name = fmt::format("w{}", i);
    spec.module = fmt::format("m{}", i % 8);
    spec.shape = {static_cast<std::int64_t>(each)};
    spec.dtype = DType::kBF16;
    spec.initializer = [i](std::size_t first, std::size_t count, float* out) {
      for (std::size_t k = 0; k < count; ++k) {
        out[k] = static_cast<float>(((first + k) * 2654435761u + i) % 1000) * 1e-3f - 0.5f;
      }
      return Status::ok();
    };
    if (Status st = engine.register_parameter(spec); !st.is_ok()) return fail("register", st);
  }
  auto t0 = std::chrono::steady_clock::now();
  if (Status st = engine.finalize(); !st.is_ok()) return fail("finalize", st);
  const double finalize_s = seconds_since(t0);
  // One step with seeded random gradients (the moments become non-zero), before the first round
  // and, untimed, at the start of every later one: checkpoints are taken between training steps,
  // and with the state on NVMe the step is what moves it out of the previous round's checkpoint
  // file (linked by the save, taken in place by the load) into the swap file again.
  constexpr std::size_t kModules = 8;
  std::vector<std::vector<float>> grads(kTensors / kModules, std::vector<float>(each));
  std::vector<std::string> names(kTensors / kModules);
  std::vector<GradientRef> refs(kTensors / kModules);
  SplitMix64 random(7);
  auto step_once = [&]() -> Result<double> {
    for (std::size_t m = 0; m < kModules; ++m) {
      for (std::size_t k = 0; k < refs.size(); ++k) {
        for (float& g : grads[k]) {
          g = static_cast<float>(static_cast<double>(random.next() >> 11) * 0x1.0p-53 - 0.5);
        }
        names[k] = fmt::format("w{}", k * kModules + m);
        refs[k] = GradientRef{names[k], grads[k].data(), each, DType::kF32};
      }
      ZINF_RETURN_IF_ERROR(engine.reduce_gradients(fmt::format("m{}", m), refs));
    }
    const auto start = std::chrono::steady_clock::now();
    Result<StepReport> stepped = engine.step();
    if (!stepped.is_ok()) return stepped.status();
    return seconds_since(start);
  };
  {
    Result<double> step_s = step_once();
    if (!step_s.is_ok()) return fail("step", step_s.status());
    fmt::print("params {} ({} state): finalize {:.2f} s, one step {:.2f} s\n", each * kTensors,
               offload_device_name(offload), finalize_s, *step_s);
  }
  Result<std::vector<float>> before = std::vector<float>();

  const std::string ckpt = dir + "/ckpt";
  std::filesystem::remove_all(ckpt);
  // The raw file: the master and two moments' bytes (the rank file adds its 4096-byte header and
  // padding), to whole 8 MiB requests.
  RawDrive raw;
  if (Status st = raw.open(dir + "/raw.bin", std::uint64_t{12} * each * kTensors); !st.is_ok()) {
    return fail("raw file", st);
  }
  std::uint64_t file_bytes = 0;
  std::vector<double> save_ratio, load_ratio;
  fmt::print(
      "| round | raw write | save | save / raw write | raw read | load | load / raw read |\n");
  fmt::print("|---|---|---|---|---|---|---|\n");
  for (int round = 1; round <= rounds; ++round) {
    const std::string tag = fmt::format("r{}", round);
    std::filesystem::remove_all(ckpt);
    if (round > 1) {
      Result<double> step_s = step_once();
      if (!step_s.is_ok()) return fail("step", step_s.status());
    }
    before = masters(engine, kTensors, each);
    if (!before.is_ok()) return fail("read_parameters", before.status());
    Result<double> w = raw.gbps(IoOp::kWrite);
    if (!w.is_ok()) return fail("raw write", w.status());
    const double raw_write = *w;
    t0 = std::chrono::steady_clock::now();
    if (Status st = engine.save_checkpoint(ckpt, tag); !st.is_ok()) return fail("save", st);
    const double save_s = seconds_since(t0);
    // The rank file's layout: header, master, two moments, to 4096 bytes. A rank file linked
    // from the swap space is longer (the swap file's other extents follow); a load reads this.
    file_bytes = (4096 + std::uint64_t{12} * each * kTensors + 4095) / 4096 * 4096;
    Result<double> r = raw.gbps(IoOp::kRead);
    if (!r.is_ok()) return fail("raw read", r.status());
    if (Status st = raw.release(); !st.is_ok()) return fail("raw file", st);
    t0 = std::chrono::steady_clock::now();
    if (Status st = engine.load_checkpoint(ckpt, tag); !st.is_ok()) return fail("load", st);
    const double load_s = seconds_since(t0);
    const double save = static_cast<double>(file_bytes) / save_s / 1e9;
    const double load = static_cast<double>(file_bytes) / load_s / 1e9;
    save_ratio.push_back(save / raw_write);
    load_ratio.push_back(load / *r);
    fmt::print(
        "| {} | {:.2f} GB/s | {:.2f} GB/s ({:.2f} s) | {:.2f} | {:.2f} GB/s | {:.2f} GB/s "
        "({:.2f} s) | {:.2f} |\n",
        round, raw_write, save, save_s, save_ratio.back(), *r, load, load_s, load_ratio.back());
  }
  Result<std::vector<float>> after = masters(engine, kTensors, each);
  if (!after.is_ok()) return fail("read_parameters", after.status());
  const bool same = std::memcmp(before->data(), after->data(), before->size() * sizeof(float)) == 0;
  fmt::print(
      "rank file {:.2f} GB (raw file {:.2f} GB); median save / raw write {:.2f}, median load / raw "
      "read {:.2f}; masters after the last load {} those saved\n",
      static_cast<double>(file_bytes) / 1e9, static_cast<double>(raw.bytes()) / 1e9,
      median(save_ratio), median(load_ratio), same ? "equal" : "DIFFER FROM");
  std::filesystem::remove_all(ckpt);
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace zinf::bench;
  std::size_t params = std::size_t{1} << 28;
  std::string dir = "/tmp/zinf-bench-checkpoint";
  zinf::OffloadDevice offload = zinf::OffloadDevice::kNvme;
  int rounds = 3;
  const int parsed = parse_options(argc, argv, "bench_engine_checkpoint",
                                   {{"--params", "N", count_into(&params)},
                                    {"--dir", "DIR", text_into(&dir)},
                                    {"--offload", "cpu|nvme", offload_into(&offload)},
                                    {"--rounds", "R", rounds_into(&rounds)}});
  if (parsed != 0) return parsed;
  return run(params, dir, offload, rounds);
}
