// Host <-> device copies through CudaDevice from registered (pinned) host memory, against a plain
// cudaMemcpy of the same bytes from the same memory (the driver's best: the limit), and, for
// context, cudaMemcpy from ordinary pageable memory. Interleaved round by round; median of ratios.
//
//   build/bin/bench_gpu_copy [--benchmark_filter=...]
#include <chrono>
#include <cstring>

#include "base/aligned.hpp"
#include "base/random.hpp"
#include "bench/gpu/gpu_bench.hpp"
#include "device/cuda_device.hpp"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// state.range(0): MiB; state.range(1): 0 host-to-device, 1 device-to-host.
void BM_PinnedCopy(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) << 20;
  const bool h2d = state.range(1) == 0;
  Result<std::unique_ptr<Device>> dev = make_cuda_device();
  if (!dev.is_ok()) {
    state.SkipWithError(dev.status().to_string().c_str());
    return;
  }
  Device& device = **dev;
  AlignedBuffer pinned(bytes), pageable(bytes);
  fill_random_bytes(pinned.data(), bytes, 1);
  std::memcpy(pageable.data(), pinned.data(), bytes);
  Status st = device.register_host(pinned.data(), bytes);
  Result<DeviceBuffer> buf = DeviceBuffer::allocate(device, bytes);
  Result<std::unique_ptr<Stream>> stream = device.create_stream("copy");
  if (!st.is_ok() || !buf.is_ok() || !stream.is_ok()) {
    state.SkipWithError("setup failed");
    return;
  }
  const auto kind = h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  void* dst = h2d ? buf->data() : pinned.data();
  const void* src = h2d ? static_cast<const void*>(pinned.data()) : buf->data();
  auto ours = [&] {
    const auto t = Clock::now();
    Status s = h2d ? device.copy_h2d(buf->data(), pinned.data(), bytes, **stream)
                   : device.copy_d2h(pinned.data(), buf->data(), bytes, **stream);
    if (s.is_ok()) s = device.synchronize(**stream);
    if (!s.is_ok()) state.SkipWithError(s.to_string().c_str());
    return seconds_since(t);
  };
  auto limit = [&] {
    const auto t = Clock::now();
    (void)cudaMemcpy(dst, src, bytes, kind);
    return seconds_since(t);
  };
  std::vector<double> pageable_s;
  (void)ours();  // Warm-up: first-touch and driver paths.
  (void)limit();
  gpu_bench::Rounds rounds(static_cast<double>(bytes));
  int round = 0;
  for (auto _ : state) {
    double a = 0, b = 0;
    if (round++ % 2 == 0) {
      a = ours();
      b = limit();
    } else {
      b = limit();
      a = ours();
    }
    rounds.add(a, b);
    state.SetIterationTime(a);
    const auto t = Clock::now();
    (void)cudaMemcpy(h2d ? buf->data() : pageable.data(),
                     h2d ? static_cast<const void*>(pageable.data()) : buf->data(), bytes, kind);
    pageable_s.push_back(seconds_since(t));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
  state.counters["pageable_GB/s"] =
      static_cast<double>(bytes) / gpu_bench::median(pageable_s) / 1e9;
  const std::string name = std::string(h2d ? "h2d" : "d2h") + " pinned CudaDevice " +
                           std::to_string(state.range(0)) + "MiB";
  rounds.report(state, name, "cudaMemcpy pinned");
  gpu_bench::rows().push_back(
      gpu_bench::Row{std::string(h2d ? "h2d" : "d2h") + " pageable cudaMemcpy " +
                         std::to_string(state.range(0)) + "MiB",
                     static_cast<double>(bytes), state.counters["pageable_GB/s"], "", 0.0, 0.0});
  (void)device.unregister_host(pinned.data());
}

BENCHMARK(BM_PinnedCopy)
    ->ArgsProduct({{64, 512}, {0, 1}})
    ->ArgNames({"MiB", "d2h"})
    ->UseManualTime()
    ->Iterations(20)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) { return zinf::gpu_bench::run_main(argc, argv, "bench_gpu_copy"); }
