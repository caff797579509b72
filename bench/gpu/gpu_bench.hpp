// Shared by the GPU benchmarks: the no-device skip, round-by-round ratio bookkeeping, and the
// summary lines scripts/gpu-check collects into its table.
//
// Every benchmark here measures a zinf operation and its limit in the same run, interleaved
// round by round (the order alternating each round), and reports the median of the per-round
// ratios, so a noisy machine moves both sides together instead of biasing one.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_stats.hpp"

namespace zinf::gpu_bench {

inline std::string no_device_reason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
  if (count == 0) return "cudaGetDeviceCount returned 0 devices";
  return {};
}

using zinf::bench::median;

// One line of the summary, printed after the benchmarks have run.
struct Row {
  std::string name;
  double bytes;  // bytes counted per operation (see each benchmark)
  double ours_gbps;
  std::string limit_name;
  double limit_gbps;
  double ratio;  // median over rounds of ours_time^-1 / limit_time^-1
};

inline std::vector<Row>& rows() {
  static std::vector<Row> all;
  return all;
}

// Records per-round times of the operation and its limit; `bytes` is what one run moves.
class Rounds {
 public:
  explicit Rounds(double bytes) : bytes_(bytes) {}
  void add(double ours_s, double limit_s) {
    ours_.push_back(ours_s);
    limit_.push_back(limit_s);
    ratios_.push_back(limit_s / ours_s);  // >1 would mean ours is faster than its limit
  }
  void report(benchmark::State& state, const std::string& name, const std::string& limit_name) {
    const double ours = bytes_ / median(ours_) / 1e9;
    const double limit = bytes_ / median(limit_) / 1e9;
    const double ratio = median(ratios_);
    state.counters["GB/s"] = ours;
    state.counters["limit_GB/s"] = limit;
    state.counters["ratio"] = ratio;
    rows().push_back(Row{name, bytes_, ours, limit_name, limit, ratio});
  }

 private:
  double bytes_;
  std::vector<double> ours_, limit_, ratios_;
};

inline void print_rows(const char* binary) {
  for (const Row& r : rows()) {
    if (r.limit_gbps > 0) {
      std::printf("zinf-gpu-bench | %-36s | %8.1f MB | %8.1f GB/s | %-20s | %8.1f GB/s | %.3f\n",
                  r.name.c_str(), r.bytes / 1e6, r.ours_gbps, r.limit_name.c_str(), r.limit_gbps,
                  r.ratio);
    } else {
      std::printf("zinf-gpu-bench | %-36s | %8.1f MB | %8.1f GB/s | %-20s | %13s | %5s\n",
                  r.name.c_str(), r.bytes / 1e6, r.ours_gbps, "(context only)", "-", "-");
    }
  }
  if (rows().empty()) std::printf("zinf-gpu-bench | %s: no results\n", binary);
}

// Google Benchmark 1.7 has Run::error_occurred / error_message; 1.8 replaced them with skipped /
// skip_message, where only SkippedWithError is an error. Templates, so that only the branch of
// the installed version is compiled.
template <typename RunT>
bool error_of(const RunT& run) {
  if constexpr (requires { run.error_occurred; }) {
    return run.error_occurred;
  } else {
    // benchmark::internal::SkippedWithError, spelled as its value: the name does not exist in
    // 1.7, and a non-dependent name is looked up even in a discarded branch.
    return static_cast<int>(run.skipped) == 2;
  }
}
template <typename RunT>
std::string message_of(const RunT& run) {
  if constexpr (requires { run.error_message; }) {
    return run.error_message;
  } else {
    return run.skip_message;
  }
}

// Passes every run on to the console and remembers the ones that ended in an error
// (state.SkipWithError), which Google Benchmark itself reports only as a line of text.
class ErrorCountingReporter : public benchmark::ConsoleReporter {
 public:
  // Colours only on a terminal: OO_Defaults would colour a log too (the reporter ignores
  // --benchmark_color when it is built by hand), and the closing escape would then start the
  // summary's first line.
  ErrorCountingReporter()
      : benchmark::ConsoleReporter(static_cast<OutputOptions>(
            isatty(fileno(stdout)) ? (OO_Color | OO_Tabular) : OO_Tabular)) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (error_of(run)) errors_.push_back(run.benchmark_name() + ": " + message_of(run));
    }
    benchmark::ConsoleReporter::ReportRuns(runs);
  }
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  std::vector<std::string> errors_;
};

// Runs the registered benchmarks and prints the summary lines. Returns 1 when any benchmark
// ended in an error (each named on stderr as "<binary>: benchmark error: <name>: <message>"), 0
// otherwise: a benchmark that could not measure is a failure, not a row without figures.
inline int run_benchmarks(int argc, char** argv, const char* binary) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  ErrorCountingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  print_rows(binary);
  for (const std::string& error : reporter.errors()) {
    std::fprintf(stderr, "%s: benchmark error: %s\n", binary, error.c_str());
  }
  return reporter.errors().empty() ? 0 : 1;
}

// main(): skips cleanly (exit 0, reason printed) without a device; otherwise run_benchmarks().
inline int run_main(int argc, char** argv, const char* binary) {
  const std::string reason = no_device_reason();
  if (!reason.empty()) {
    std::printf("%s: skipped: no CUDA device: %s\n", binary, reason.c_str());
    return 0;
  }
  return run_benchmarks(argc, argv, binary);
}

}  // namespace zinf::gpu_bench
