// Each kernel's bandwidth against a device-to-device copy of the same bytes, the limit for a
// memory-bound kernel. Bytes are counted as the kernel's DRAM traffic, reads plus writes (cast:
// 4 + 2 a element; unscale: 4 + 4; squared norm: 4; Adam with a bf16 copy: 16 + 14; flatten: the
// bytes read plus written), and the copy moves the same traffic: cudaMemcpyAsync of half as many
// bytes (it reads them and writes them). Both timed with CUDA events on one stream,
// interleaved round by round; the ratio is the median over rounds of copy time / kernel time.
//
//   build/bin/bench_gpu_kernels [--benchmark_filter=...]
#include <cstdint>
#include <vector>

#include "base/random.hpp"
#include "bench/gpu/gpu_bench.hpp"
#include "kernels/adam.h"
#include "kernels/cast.h"
#include "kernels/flatten.h"
#include "kernels/sq_norm.h"
#include "kernels/unscale.h"

namespace zinf {
namespace {

constexpr std::size_t kElements = std::size_t{64} << 20;  // 64 Mi fp32 = 256 MiB an array.

struct Gpu {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<void*> allocations;
  Gpu() {
    (void)cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    (void)cudaEventCreate(&start);
    (void)cudaEventCreate(&stop);
  }
  ~Gpu() {
    for (void* p : allocations) (void)cudaFree(p);
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
    (void)cudaStreamDestroy(stream);
  }
  // Device memory filled with random floats in [-1, 1) (never time on zeros).
  float* random_floats(std::size_t count, std::uint64_t seed) {
    std::vector<float> host(count);
    fill_uniform(host.data(), count, seed);
    void* p = nullptr;
    if (cudaMalloc(&p, count * 4) != cudaSuccess) return nullptr;
    allocations.push_back(p);
    (void)cudaMemcpy(p, host.data(), count * 4, cudaMemcpyHostToDevice);
    return static_cast<float*>(p);
  }
  void* raw(std::size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
    allocations.push_back(p);
    return p;
  }
  // Seconds `launch` takes on the stream, by events.
  template <typename Launch>
  double time(Launch launch) {
    (void)cudaEventRecord(start, stream);
    launch();
    (void)cudaEventRecord(stop, stream);
    (void)cudaEventSynchronize(stop);
    float ms = 0;
    (void)cudaEventElapsedTime(&ms, start, stop);
    return ms * 1e-3;
  }
};

// Runs `kernel` and a D2D copy of traffic_bytes / 2, interleaved, and reports.
template <typename Kernel>
void measure(benchmark::State& state, Gpu& gpu, const char* name, double traffic_bytes,
             Kernel kernel) {
  const std::size_t copy_bytes = static_cast<std::size_t>(traffic_bytes / 2);
  void* copy_src = gpu.raw(copy_bytes);
  void* copy_dst = gpu.raw(copy_bytes);
  if (copy_src == nullptr || copy_dst == nullptr) {
    state.SkipWithError("out of device memory");
    return;
  }
  (void)cudaMemset(copy_src, 0x3c, copy_bytes);
  auto copy = [&] {
    (void)cudaMemcpyAsync(copy_dst, copy_src, copy_bytes, cudaMemcpyDeviceToDevice, gpu.stream);
  };
  int failed = 0;
  auto run = [&] {
    if (kernel() != 0) ++failed;
  };
  (void)gpu.time(run);  // Warm-up.
  (void)gpu.time(copy);
  gpu_bench::Rounds rounds(traffic_bytes);
  int round = 0;
  for (auto _ : state) {
    double k = 0, c = 0;
    if (round++ % 2 == 0) {
      k = gpu.time(run);
      c = gpu.time(copy);
    } else {
      c = gpu.time(copy);
      k = gpu.time(run);
    }
    rounds.add(k, c);
    state.SetIterationTime(k);
  }
  if (failed != 0 || cudaDeviceSynchronize() != cudaSuccess) {
    state.SkipWithError("kernel launch failed");
    return;
  }
  rounds.report(state, name, "D2D cudaMemcpyAsync");
}

void BM_CastBf16(benchmark::State& state) {
  Gpu gpu;
  float* src = gpu.random_floats(kElements, 1);
  auto* dst = static_cast<std::uint16_t*>(gpu.raw(kElements * 2));
  measure(state, gpu, "cast f32->bf16 64Mi", 6.0 * kElements,
          [&] { return kernels::cast_f32_to_bf16(src, dst, kElements, gpu.stream); });
}

void BM_CastF16(benchmark::State& state) {
  Gpu gpu;
  float* src = gpu.random_floats(kElements, 2);
  auto* dst = static_cast<std::uint16_t*>(gpu.raw(kElements * 2));
  measure(state, gpu, "cast f32->f16 64Mi", 6.0 * kElements,
          [&] { return kernels::cast_f32_to_f16(src, dst, kElements, gpu.stream); });
}

void BM_Unscale(benchmark::State& state) {
  Gpu gpu;
  float* grad = gpu.random_floats(kElements, 3);
  auto* flag = static_cast<std::int32_t*>(gpu.raw(4));
  // inv_scale 1: the values stay random and finite however many rounds run.
  measure(state, gpu, "unscale f32 64Mi", 8.0 * kElements,
          [&] { return kernels::unscale_grads(grad, kElements, 1.0f, flag, gpu.stream); });
}

void BM_SqNorm(benchmark::State& state) {
  Gpu gpu;
  float* x = gpu.random_floats(kElements, 4);
  auto* partials = static_cast<float*>(gpu.raw(kernels::kSqNormPartials * 4));
  auto* out = static_cast<float*>(gpu.raw(4));
  measure(state, gpu, "sq_norm f32 64Mi", 4.0 * kElements, [&] {
    return kernels::sq_norm(x, kernels::HalfType::kNone, kElements, partials, out, false,
                            gpu.stream);
  });
}

void BM_AdamW(benchmark::State& state) {
  Gpu gpu;
  float* p = gpu.random_floats(kElements, 5);
  float* g = gpu.random_floats(kElements, 6);
  float* m = gpu.random_floats(kElements, 7);
  float* v = gpu.random_floats(kElements, 8);
  // A second moment is never negative: start v at zero (the first step's update makes it g * g).
  (void)cudaMemset(v, 0, kElements * 4);
  auto* half = static_cast<std::uint16_t*>(gpu.raw(kElements * 2));
  kernels::AdamHyper hyper;
  hyper.adamw = true;
  hyper.weight_decay = 0.01f;
  std::int64_t step = 0;
  measure(state, gpu, "adamw f32 + bf16 copy 64Mi", 30.0 * kElements, [&] {
    return kernels::adam_step(p, g, m, v, half, kernels::HalfType::kBf16, kElements,
                              kernels::adam_step_args(hyper, ++step), gpu.stream);
  });
}

void BM_Flatten(benchmark::State& state) {
  Gpu gpu;
  // 96 tensors of uneven sizes (a transformer layer's worth of shapes) totalling ~256 MiB.
  std::vector<const void*> tensors;
  std::vector<std::size_t> sizes, offsets;
  std::size_t total = 0;
  SplitMix64 rng(9);
  for (int i = 0; i < 96; ++i) {
    const std::size_t elements = (kElements / 96) + (rng.next() % 4096) * 4 - 8192;
    tensors.push_back(gpu.random_floats(elements, 100 + static_cast<std::uint64_t>(i)));
    sizes.push_back(elements * 4);
    offsets.push_back(total);
    total += elements * 4;
  }
  void* flat = gpu.raw(total);
  measure(state, gpu, "flatten 96 tensors 256MiB", 2.0 * static_cast<double>(total), [&] {
    return kernels::flatten(tensors.data(), sizes.data(), offsets.data(), tensors.size(), flat,
                            gpu.stream);
  });
}

#define ZINF_KERNEL_BENCH(fn) \
  BENCHMARK(fn)->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond)
ZINF_KERNEL_BENCH(BM_CastBf16);
ZINF_KERNEL_BENCH(BM_CastF16);
ZINF_KERNEL_BENCH(BM_Unscale);
ZINF_KERNEL_BENCH(BM_SqNorm);
ZINF_KERNEL_BENCH(BM_AdamW);
ZINF_KERNEL_BENCH(BM_Flatten);

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) {
  return zinf::gpu_bench::run_main(argc, argv, "bench_gpu_kernels");
}
