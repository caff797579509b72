// Engine::write_parameters one parameter at a time against the batch form, and the batch against
// the limit it answers to, on one rank: a model of --params f32 parameters in --tensors
// parameters of equal size, stage 2, AdamW with its state on NVMe (--offload nvme, default) or in
// host memory (--offload cpu), in --dir. Each of --rounds rounds writes every parameter twice,
// with new seeded values each time, and with the state on NVMe moves the master's bytes once each
// way on the raw drive:
//   singles   write_parameters(name, values) for each parameter in turn (each a pass over the
//             sub-groups holding its groups and a publish of its groups alone)
//   batch     write_parameters(names, values_fn) once (one pass, one publish), values_fn making
//             each parameter's values when the pass asks for them
//   values    the batch's values made alone, as values_fn makes them (the caller's share of the
//             batch's time, which no pass over the state can save)
//   raw pass  one sequential read and one sequential write of the rank's master partition's
//             bytes (4 per parameter: the batch rewrites the master and leaves the moments) in a
//             file of its own in --dir, beside the engine's swap file, as `zinf io bench` moves
//             them (bench::RawDrive: O_DIRECT, 8 MiB requests, 32 pieces of 1 MiB in flight,
//             seeded random bytes); the file is written once, untimed, before the first round,
//             as the swap file is there before the first write
// in an order that turns round by round (each subject in each place in turn), so drift in the
// machine's load falls on all of them. The values are made the same way in singles and batch
// (one parameter's worth at a time), inside the timed call. Each round prints the times,
// singles / batch and batch / raw pass; the end prints the medians of those ratios and of
// (batch - values) / raw pass, and checks that every master equals the last values written, bit
// for bit.
//
//   build/bin/bench_engine_write_parameters --params 16777216 --tensors 32 --dir /tmp/zinf-wp
//
// --case far instead times, round by round in a turning order, writes of the first and the last
// parameter, which lie in the partition's first and last groups (the embedding and the LM head
// of a model):
//   pair      write_parameters({first, last}, values_fn): one batch of the two
//   two       write_parameters(first, values), then write_parameters(last, values)
//   whole     write_parameters(names, values_fn): every parameter in one batch
// A batch costs its parameters' groups alone, not the groups between them: with the two in
// different sub-groups, pair moves what two does and, with the state on NVMe, a fraction of
// whole; where both lie in one sub-group (--sub-group 1000000000, the default sub_group_size: the
// partition is one sub-group), pair reads and rewrites it once where two does so twice, and
// rounds and writes the two parameters' groups alone. The end prints the medians of pair / two
// and pair / whole and checks the masters as above.
//
// --case singles-loop instead times the host-side cost of one single write against the model's
// size: one engine per count K of 1000, 4000 and 16000 parameters of 64 f32 elements each (every
// parameter its own module, so its own group; --params and --tensors are not used), each round
// timing K calls of write_parameters(name, values), one per parameter in order, on each engine in
// a turning order. A call costs its own parameter's group, so the time per call should not grow
// with K; each round prints the per-call wall time and the calling thread's user CPU time (the
// host work on the rank's thread, steadier than the wall time on a loaded machine), the end each
// K's medians, and checks the masters as above. No hardware limit applies (64 elements are nothing
// to move): the comparison is the per-call time across K.
//
//   build/bin/bench_engine_write_parameters --case singles-loop --offload cpu --rounds 5
//
// --sub-group S: the state's sub_group_size (default 4194304).
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "bench/bench_stats.hpp"
#include "bench/engine/engine_bench.hpp"
#include "io/io_bench.hpp"
#include "io/io_engine.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

using namespace zinf;
using namespace zinf::bench;

namespace {

// One rank's engine with parameters "w<i>" of f32 elements registered, generation 0 of
// make_values, and finalized, and their names in order.
struct Model {
  bench::OneRank rank;
  std::vector<std::string> names;
  std::uint64_t generation = 0;  // --case singles-loop: the values last written to all of them
};

// Opens an engine in `dir` with `tensors` parameters of `each` elements.
Result<Model> open_model(const std::string& dir, OffloadDevice offload, std::size_t sub_group,
                         std::size_t tensors, std::size_t each) {
  Model model;
  ZINF_ASSIGN_OR_RETURN(model.rank, bench::open_one_rank(dir, offload, sub_group));
  ZINF_ASSIGN_OR_RETURN(
      model.names,
      bench::register_tensors(*model.rank.engine, tensors, each,
                              [](std::size_t i, std::size_t /*first*/, std::size_t count,
                                 float* out) { make_values(0, i, std::span<float>(out, count)); }));
  ZINF_RETURN_IF_ERROR(model.rank.engine->finalize());
  return model;
}

// Whether every master of `engine`'s parameters `names` (of `each` elements) equals the values
// last written to it, generation generation_of(i) of parameter i, bit for bit.
Result<bool> masters_equal(Engine& engine, const std::vector<std::string>& names, std::size_t each,
                           const std::function<std::uint64_t(std::size_t)>& generation_of) {
  bool same = true;
  std::vector<float> out(each), expected(each);
  for (std::size_t i = 0; i < names.size(); ++i) {
    ZINF_RETURN_IF_ERROR(engine.read_parameters(names[i], out.data()));
    make_values(generation_of(i), i, expected);
    same = same && std::memcmp(out.data(), expected.data(), each * sizeof(float)) == 0;
  }
  return same;
}

int run(std::size_t params, std::size_t tensors, std::size_t sub_group, const std::string& dir,
        OffloadDevice offload, int rounds) {
  const std::size_t each = params / tensors;
  Result<Model> opened = open_model(dir, offload, sub_group, tensors, each);
  if (!opened.is_ok()) return fail("open", opened.status());
  Engine& engine = *opened->rank.engine;
  const std::vector<std::string>& names = opened->names;
  const std::vector<std::string_view> views(names.begin(), names.end());

  std::uint64_t generation = 0;
  std::vector<float> one(each);  // the singles' values, one parameter at a time
  auto singles = [&]() -> Result<double> {
    ++generation;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < tensors; ++i) {
      make_values(generation, i, one);
      ZINF_RETURN_IF_ERROR(engine.write_parameters(names[i], one.data()));
    }
    return seconds_since(t0);
  };
  auto batch = [&]() -> Result<double> {
    ++generation;
    const auto t0 = std::chrono::steady_clock::now();
    ZINF_RETURN_IF_ERROR(
        engine.write_parameters(views, [&](std::string_view name, std::span<float> out) {
          make_values(generation, std::stoull(std::string(name.substr(1))), out);
          return Status::ok();
        }));
    return seconds_since(t0);
  };

  // The raw pass, with the state on a drive: the master partition's bytes read and written once
  // each. The raw file holds them to whole 8 MiB requests; its times are scaled to the master's
  // bytes.
  const bool on_drive = offload == OffloadDevice::kNvme;
  const std::uint64_t master_bytes = std::uint64_t{4} * each * tensors;
  RawDrive raw;
  if (on_drive) {
    if (Status st = raw.open_written(dir + "/raw.bin", master_bytes); !st.is_ok()) {
      return fail("raw file", st);
    }
  }
  const double raw_scale = static_cast<double>(master_bytes) / static_cast<double>(raw.bytes());
  double read_s = 0, write_s = 0;  // the last raw pass's, scaled to the master's bytes
  auto raw_pass = [&]() -> Result<double> {
    ZINF_ASSIGN_OR_RETURN(IoBenchResult r, raw.move(IoOp::kRead));
    ZINF_ASSIGN_OR_RETURN(IoBenchResult w, raw.move(IoOp::kWrite));
    read_s = r.seconds * raw_scale;
    write_s = w.seconds * raw_scale;
    return read_s + write_s;
  };

  // The values alone, made as the batch makes them: the caller's share of the batch's time.
  auto values_alone = [&]() -> Result<double> {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < tensors; ++i) make_values(generation + 1, i, one);
    return seconds_since(t0);
  };

  fmt::print("{} f32 parameters in {} tensors, state {}, sub-groups of {} elements\n",
             each * tensors, tensors, offload_device_name(offload),
             engine.config().zero.sub_group_size);
  if (on_drive) {
    fmt::print("raw pass: {:.1f} MB of master, read then written, in {} (raw file {:.1f} MB)\n",
               static_cast<double>(master_bytes) / 1e6, dir,
               static_cast<double>(raw.bytes()) / 1e6);
    fmt::print(
        "| round | {} singles | one batch | its values alone | raw read + write | singles / batch "
        "| batch / raw pass |\n|---|---|---|---|---|---|---|\n",
        tensors);
  } else {
    fmt::print(
        "| round | {} singles | one batch | its values alone | singles / batch |\n"
        "|---|---|---|---|---|\n",
        tensors);
  }
  enum Subject { kSingles, kBatch, kValues, kRaw };  // the raw pass last: only on a drive
  const char* const subject_names[] = {"singles", "batch", "values", "raw pass"};
  const int subjects = on_drive ? 4 : 3;
  std::vector<double> ratios, raw_ratios, engine_ratios, read_gbps, write_gbps;
  for (int round = 1; round <= rounds; ++round) {
    double times[4] = {0, 0, 0, 0};
    for (int k = 0; k < subjects; ++k) {
      const auto subject = static_cast<Subject>((round - 1 + k) % subjects);
      Result<double> s = subject == kSingles  ? singles()
                         : subject == kBatch  ? batch()
                         : subject == kValues ? values_alone()
                                              : raw_pass();
      if (!s.is_ok()) return fail(subject_names[subject], s.status());
      times[subject] = *s;
    }
    ratios.push_back(times[kSingles] / times[kBatch]);
    if (!on_drive) {
      fmt::print("| {} | {:.3f} s | {:.3f} s | {:.3f} s | {:.1f} |\n", round, times[kSingles],
                 times[kBatch], times[kValues], ratios.back());
      continue;
    }
    raw_ratios.push_back(times[kBatch] / times[kRaw]);
    engine_ratios.push_back((times[kBatch] - times[kValues]) / times[kRaw]);
    read_gbps.push_back(static_cast<double>(master_bytes) / read_s / 1e9);
    write_gbps.push_back(static_cast<double>(master_bytes) / write_s / 1e9);
    fmt::print(
        "| {} | {:.3f} s | {:.3f} s | {:.3f} s | {:.3f} s ({:.3f} + {:.3f}) | {:.1f} | {:.2f} |\n",
        round, times[kSingles], times[kBatch], times[kValues], times[kRaw], read_s, write_s,
        ratios.back(), raw_ratios.back());
  }
  Result<bool> equal = masters_equal(engine, names, each, [&](std::size_t) { return generation; });
  if (!equal.is_ok()) return fail("read_parameters", equal.status());
  const bool same = *equal;
  if (on_drive) {
    fmt::print(
        "median singles / batch {:.1f}; median batch / raw pass {:.2f}, {:.2f} without its "
        "values (raw read {:.2f} GB/s, write {:.2f} GB/s, medians); masters {} the last values "
        "written\n",
        median(ratios), median(raw_ratios), median(engine_ratios), median(read_gbps),
        median(write_gbps), same ? "equal" : "DIFFER FROM");
  } else {
    fmt::print("median singles / batch {:.1f}; masters {} the last values written\n",
               median(ratios), same ? "equal" : "DIFFER FROM");
  }
  return same ? 0 : 1;
}

// --case far (the file's comment).
int run_far(std::size_t params, std::size_t tensors, std::size_t sub_group, const std::string& dir,
            OffloadDevice offload, int rounds) {
  if (tensors < 2) {
    fmt::print(stderr, "--case far needs --tensors 2 or more\n");
    return 2;
  }
  const std::size_t each = params / tensors;
  Result<Model> opened = open_model(dir, offload, sub_group, tensors, each);
  if (!opened.is_ok()) return fail("open", opened.status());
  Engine& engine = *opened->rank.engine;
  const std::vector<std::string>& names = opened->names;
  const std::vector<std::string_view> views(names.begin(), names.end());
  const std::vector<std::string_view> ends = {views.front(), views.back()};

  // Each write's values are generation `last[i]` of parameter i, made inside the timed call.
  std::uint64_t generation = 0;
  std::vector<std::uint64_t> last(tensors, 0);
  std::vector<float> one(each);
  auto batch = [&](std::span<const std::string_view> which) -> Result<double> {
    ++generation;
    const auto t0 = std::chrono::steady_clock::now();
    ZINF_RETURN_IF_ERROR(
        engine.write_parameters(which, [&](std::string_view name, std::span<float> out) {
          const std::size_t i = std::stoull(std::string(name.substr(1)));
          make_values(generation, i, out);
          last[i] = generation;
          return Status::ok();
        }));
    return seconds_since(t0);
  };
  auto two = [&]() -> Result<double> {
    ++generation;
    const auto t0 = std::chrono::steady_clock::now();
    for (const std::size_t i : {std::size_t{0}, tensors - 1}) {
      make_values(generation, i, one);
      last[i] = generation;
      ZINF_RETURN_IF_ERROR(engine.write_parameters(names[i], one.data()));
    }
    return seconds_since(t0);
  };

  fmt::print(
      "{} f32 parameters in {} tensors, state {}, sub-groups of {} elements; {} and {} "
      "written\n",
      each * tensors, tensors, offload_device_name(offload), engine.config().zero.sub_group_size,
      names.front(), names.back());
  fmt::print(
      "| round | pair (one batch of the two) | two (two singles) | whole (every parameter) | "
      "pair / two | pair / whole |\n|---|---|---|---|---|---|\n");
  enum Subject { kPair, kTwo, kWhole };
  const char* const subject_names[] = {"pair", "two", "whole"};
  std::vector<double> to_two, to_whole;
  for (int round = 1; round <= rounds; ++round) {
    double times[3] = {0, 0, 0};
    for (int k = 0; k < 3; ++k) {
      const auto subject = static_cast<Subject>((round - 1 + k) % 3);
      Result<double> s = subject == kPair ? batch(ends) : subject == kTwo ? two() : batch(views);
      if (!s.is_ok()) return fail(subject_names[subject], s.status());
      times[subject] = *s;
    }
    to_two.push_back(times[kPair] / times[kTwo]);
    to_whole.push_back(times[kPair] / times[kWhole]);
    fmt::print("| {} | {:.4f} s | {:.4f} s | {:.4f} s | {:.2f} | {:.2f} |\n", round, times[kPair],
               times[kTwo], times[kWhole], to_two.back(), to_whole.back());
  }
  Result<bool> equal = masters_equal(engine, names, each, [&](std::size_t i) { return last[i]; });
  if (!equal.is_ok()) return fail("read_parameters", equal.status());
  const bool same = *equal;
  fmt::print("median pair / two {:.2f}, pair / whole {:.2f}; masters {} the last values written\n",
             median(to_two), median(to_whole), same ? "equal" : "DIFFER FROM");
  return same ? 0 : 1;
}

// --case singles-loop (the file's comment).
int run_singles_loop(std::size_t sub_group, const std::string& dir, OffloadDevice offload,
                     int rounds) {
  constexpr std::size_t kEach = 64;
  const std::size_t counts[] = {1000, 4000, 16000};
  constexpr int kCounts = 3;
  std::vector<Model> models(kCounts);
  for (int c = 0; c < kCounts; ++c) {
    Result<Model> opened =
        open_model(fmt::format("{}/k{}", dir, counts[c]), offload, sub_group, counts[c], kEach);
    if (!opened.is_ok()) return fail("open", opened.status());
    models[c] = std::move(*opened);
  }
  // Every parameter of model c written once, one call each: per call, the seconds of wall time
  // and of the calling thread's user CPU time (the host work the call does on the rank's thread,
  // without the kernel's share of waking and waiting for the engine's other threads, which
  // dominates the wall time of so small a call on a loaded machine).
  std::vector<float> one(kEach);
  auto thread_cpu_s = [] {
    rusage usage{};
    getrusage(RUSAGE_THREAD, &usage);
    return static_cast<double>(usage.ru_utime.tv_sec) +
           1e-6 * static_cast<double>(usage.ru_utime.tv_usec);
  };
  double cpu_s = 0;  // the last loop's CPU time per call
  auto loop = [&](Model& m) -> Result<double> {
    ++m.generation;
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = thread_cpu_s();
    for (std::size_t i = 0; i < m.names.size(); ++i) {
      make_values(m.generation, i, one);
      ZINF_RETURN_IF_ERROR(m.rank.engine->write_parameters(m.names[i], one.data()));
    }
    cpu_s = (thread_cpu_s() - c0) / static_cast<double>(m.names.size());
    return seconds_since(t0) / static_cast<double>(m.names.size());
  };

  fmt::print("single write_parameters calls, {} f32 elements a parameter, state {}\n", kEach,
             offload_device_name(offload));
  fmt::print(
      "per call, wall time / the calling thread's user CPU time\n"
      "| round | K = {} | K = {} | K = {} |\n|---|---|---|---|\n",
      counts[0], counts[1], counts[2]);
  std::vector<double> per_call_us[kCounts], per_call_cpu_us[kCounts];
  for (int round = 1; round <= rounds; ++round) {
    double us[kCounts] = {0, 0, 0}, cpu_us[kCounts] = {0, 0, 0};
    for (int k = 0; k < kCounts; ++k) {
      const int c = (round - 1 + k) % kCounts;
      Result<double> s = loop(models[c]);
      if (!s.is_ok()) return fail(fmt::format("K = {}", counts[c]), s.status());
      us[c] = *s * 1e6;
      cpu_us[c] = cpu_s * 1e6;
      per_call_us[c].push_back(us[c]);
      per_call_cpu_us[c].push_back(cpu_us[c]);
    }
    fmt::print("| {} | {:.1f} / {:.1f} us | {:.1f} / {:.1f} us | {:.1f} / {:.1f} us |\n", round,
               us[0], cpu_us[0], us[1], cpu_us[1], us[2], cpu_us[2]);
  }
  bool same = true;
  for (const Model& m : models) {
    Result<bool> equal =
        masters_equal(*m.rank.engine, m.names, kEach, [&](std::size_t) { return m.generation; });
    if (!equal.is_ok()) return fail("read_parameters", equal.status());
    same = same && *equal;
  }
  fmt::print(
      "median per call (wall / thread user CPU): K = {} {:.1f} / {:.1f} us, K = {} {:.1f} / {:.1f} "
      "us, "
      "K = {} {:.1f} / {:.1f} us; masters {} the last values written\n",
      counts[0], median(per_call_us[0]), median(per_call_cpu_us[0]), counts[1],
      median(per_call_us[1]), median(per_call_cpu_us[1]), counts[2], median(per_call_us[2]),
      median(per_call_cpu_us[2]), same ? "equal" : "DIFFER FROM");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t params = std::size_t{1} << 24;
  std::size_t tensors = 32;
  std::string dir = "/tmp/zinf-bench-write-parameters";
  zinf::OffloadDevice offload = zinf::OffloadDevice::kNvme;
  int rounds = 5;
  std::string which = "all";
  std::size_t sub_group = std::size_t{1} << 22;
  const int parsed = parse_options(argc, argv, "bench_engine_write_parameters",
                                   {{"--params", "N", count_into(&params)},
                                    {"--tensors", "K", count_into(&tensors, 1)},
                                    {"--dir", "DIR", text_into(&dir)},
                                    {"--offload", "cpu|nvme", offload_into(&offload)},
                                    {"--rounds", "R", rounds_into(&rounds)},
                                    {"--case", "all|far|singles-loop", text_into(&which)},
                                    {"--sub-group", "S", count_into(&sub_group, 1)}});
  if (parsed != 0) return parsed;
  if (which != "all" && which != "far" && which != "singles-loop") {
    fmt::print(stderr, "--case {}: expected all, far or singles-loop\n", which);
    return 2;
  }
  if (which == "singles-loop") return run_singles_loop(sub_group, dir, offload, rounds);
  if (which == "far") return run_far(params, tensors, sub_group, dir, offload, rounds);
  return run(params, tensors, sub_group, dir, offload, rounds);
}
