// The CPU optimizer step as Google Benchmark cases: every optimizer and SIMD path, fp32 and
// bf16 gradients with and without the fused bf16 parameter copy, in cache (256Ki params) and
// from DRAM (16Mi params), on 1 and 2 threads. bytes_per_second counts the bytes the variant
// must move (4 or 2 for the gradient, 8 for each fp32 state array read and written back, 2 for
// the half copy); compare it with bench_base_membw, or use `zinf bench adam` for a same-run
// ratio against the pattern's bandwidth.
//
// Arguments: {params, threads, simd (1 scalar, 2 avx2, 3 avx512), grad bytes (4 or 2),
// half copy (0 or 1)}.
#include <benchmark/benchmark.h>
#include <tbb/task_arena.h>

#include "base/aligned.hpp"
#include "base/cpu.hpp"
#include "base/random.hpp"
#include "zinf/optim.hpp"

namespace {

using namespace zinf;

void run(benchmark::State& state, OptimizerKind kind) {
  const std::size_t count = static_cast<std::size_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  const Simd simd = static_cast<Simd>(state.range(2));
  const DType grad_dtype = state.range(3) == 4 ? DType::kF32 : DType::kBF16;
  const bool half = state.range(4) != 0;
  if (!resolve_simd(simd).is_ok()) {
    state.SkipWithError("this CPU lacks the SIMD path");
    return;
  }
  const bool has_avg = kind != OptimizerKind::kAdagrad;
  const bool has_avg_sq = kind != OptimizerKind::kLion;
  AlignedBuffer p(count * 4), m(count * 4), v(count * 4), g(count * 4), h(count * 2);
  fill_uniform(p.as<float>(), count, 1);
  fill_uniform(m.as<float>(), count, 2, -0.1f, 0.1f);
  fill_uniform(v.as<float>(), count, 3, 1e-4f, 1e-2f);
  fill_uniform(g.as<float>(), count, 4);
  if (grad_dtype == DType::kBF16) {
    // bf16 gradients: the top half of each random float, packed.
    for (std::size_t i = 0; i < count; ++i)
      g.as<std::uint16_t>()[i] = f32_to_bf16(g.as<float>()[i]);
  }
  fill_random_bytes(h.data(), h.bytes(), 5);
  OptimizerSpan span;
  span.params = p.as<float>();
  span.exp_avg = has_avg ? m.as<float>() : nullptr;
  span.exp_avg_sq = has_avg_sq ? v.as<float>() : nullptr;
  span.grads = g.data();
  span.grad_dtype = grad_dtype;
  span.params_half = half ? h.data() : nullptr;
  span.count = count;
  OptimizerParams hp;
  hp.kind = kind;
  StepOptions options;
  options.simd = simd;
  tbb::task_arena arena(threads);
  std::int64_t step = 0;
  for (auto _ : state) {
    options.step = ++step;
    arena.execute([&] { benchmark::DoNotOptimize(optimizer_step(hp, span, options).is_ok()); });
  }
  const std::size_t bytes_per_param =
      dtype_bytes(grad_dtype) + 8 * (1 + has_avg + has_avg_sq) + (half ? 2 : 0);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(bytes_per_param * count));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(count));
}

void BM_AdamW(benchmark::State& state) { run(state, OptimizerKind::kAdamW); }
void BM_Adam(benchmark::State& state) { run(state, OptimizerKind::kAdam); }
void BM_Adagrad(benchmark::State& state) { run(state, OptimizerKind::kAdagrad); }
void BM_Lion(benchmark::State& state) { run(state, OptimizerKind::kLion); }

void adamw_args(benchmark::internal::Benchmark* b) {
  for (std::int64_t params : {std::int64_t{1} << 18, std::int64_t{1} << 24}) {
    for (std::int64_t threads : {1, 2}) {
      for (std::int64_t simd : {1, 2, 3}) {
        b->Args({params, threads, simd, 4, 0});
        b->Args({params, threads, simd, 2, 1});
      }
    }
  }
}

void other_args(benchmark::internal::Benchmark* b) {
  for (std::int64_t threads : {1, 2}) b->Args({std::int64_t{1} << 24, threads, 3, 4, 0});
}

BENCHMARK(BM_AdamW)->Apply(adamw_args)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Adam)->Apply(other_args)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Adagrad)->Apply(other_args)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Lion)->Apply(other_args)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
