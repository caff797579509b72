// Memory bandwidth of the patterns the optimizer answers to, as Google Benchmark cases.
// bytes_per_second is counted as StreamPattern::bytes_per_element() per element.
#include "base/membw.hpp"

#include <benchmark/benchmark.h>

namespace {

void run(benchmark::State& state, const zinf::StreamPattern& pattern) {
  const std::size_t elements = static_cast<std::size_t>(state.range(0));
  zinf::BandwidthProbe probe(pattern, elements, static_cast<int>(state.range(1)));
  for (auto _ : state) benchmark::DoNotOptimize(probe.run_once());
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(probe.bytes_per_pass()));
}

void BM_Triad(benchmark::State& state) { run(state, zinf::StreamPattern::triad()); }
void BM_AdamPattern(benchmark::State& state) { run(state, zinf::StreamPattern::adam_f32()); }

BENCHMARK(BM_Triad)
    ->Args({1 << 26, 1})
    ->Args({1 << 26, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AdamPattern)
    ->Args({1 << 26, 1})
    ->Args({1 << 26, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
