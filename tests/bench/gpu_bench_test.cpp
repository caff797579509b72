// The GPU benchmarks' main (bench/gpu/gpu_bench.hpp): a benchmark that ends in an error must fail
// the run, since scripts/gpu-check decides PASS on the exit status. Runs on any machine: the
// benchmarks registered here need no device, and run_benchmarks() is what run_main() calls once
// it has found one.
#include "bench/gpu/gpu_bench.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace zinf::gpu_bench {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

void BM_SetupFails(benchmark::State& state) {
  state.SkipWithError("setup failed: cudaMalloc: out of memory");
  for (auto _ : state) {
  }
}
void BM_Works(benchmark::State& state) {
  int x = 0;
  for (auto _ : state) benchmark::DoNotOptimize(++x);
}
BENCHMARK(BM_SetupFails);
BENCHMARK(BM_Works);

int run_with_filter(const std::string& filter, std::string* err, std::string* out) {
  std::vector<std::string> args = {"gpu_bench_test", "--benchmark_filter=" + filter,
                                   "--benchmark_min_time=0.001"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  testing::internal::CaptureStderr();
  testing::internal::CaptureStdout();
  const int rc = run_benchmarks(static_cast<int>(argv.size()), argv.data(), "gpu_bench_test");
  *out = testing::internal::GetCapturedStdout();
  *err = testing::internal::GetCapturedStderr();
  return rc;
}

TEST(GpuBenchMain, ABenchmarkErrorFailsTheRunAndIsNamed) {
  std::string err, out;
  EXPECT_EQ(run_with_filter("BM_SetupFails|BM_Works", &err, &out), 1) << out << err;
  EXPECT_THAT(err, HasSubstr("gpu_bench_test: benchmark error: BM_SetupFails: setup failed: "
                             "cudaMalloc: out of memory"));
  EXPECT_THAT(err, Not(HasSubstr("BM_Works")));
}

TEST(GpuBenchMain, RunsWithoutErrorsExitZero) {
  std::string err, out;
  EXPECT_EQ(run_with_filter("BM_Works", &err, &out), 0) << out << err;
  EXPECT_THAT(out, HasSubstr("BM_Works"));
  EXPECT_THAT(err, Not(HasSubstr("benchmark error")));
}

}  // namespace
}  // namespace zinf::gpu_bench
