// Host <-> device copies through CudaDevice from registered (pinned) host memory, against a plain
// cudaMemcpy of the same bytes from the same memory (the driver's best: the limit), and, for
// context, cudaMemcpy from ordinary pageable memory. Then a copy overlapping compute on separate
// streams, against perfect overlap: max(copy alone, compute alone). Interleaved round by round;
// median of ratios.
//
//   build/bin/bench_gpu_copy [--benchmark_filter=...]
#include <algorithm>
#include <chrono>
#include <cstring>

#include "base/aligned.hpp"
#include "base/random.hpp"
#include "bench/gpu/gpu_bench.hpp"
#include "device/cuda_device.hpp"
#include "kernels/adam.h"

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

// A 512 MiB host-to-device copy on one stream while AdamW runs on another (64 Mi parameters,
// repeated to take about as long as the copy). The limit is perfect overlap: the longer of the
// two run alone; the ratio is that over the time of both together (1 = full overlap, 0.5 =
// serialised when the two take equally long).
void BM_CopyComputeOverlap(benchmark::State& state) {
  const std::size_t bytes = std::size_t{512} << 20;
  const std::size_t params = std::size_t{64} << 20;
  Result<std::unique_ptr<Device>> dev = make_cuda_device();
  if (!dev.is_ok()) {
    state.SkipWithError(dev.status().to_string().c_str());
    return;
  }
  Device& device = **dev;
  AlignedBuffer pinned(bytes);
  fill_random_bytes(pinned.data(), bytes, 2);
  std::vector<float> host(params);
  Result<DeviceBuffer> dst = DeviceBuffer::allocate(device, bytes);
  Result<DeviceBuffer> p = DeviceBuffer::allocate(device, params * 4);
  Result<DeviceBuffer> g = DeviceBuffer::allocate(device, params * 4);
  Result<DeviceBuffer> m = DeviceBuffer::allocate(device, params * 4);
  Result<DeviceBuffer> v = DeviceBuffer::allocate(device, params * 4);
  Result<std::unique_ptr<Stream>> copy_stream = device.create_stream("copy");
  Result<std::unique_ptr<Stream>> compute_stream = device.create_stream("compute");
  if (!device.register_host(pinned.data(), bytes).is_ok() || !dst.is_ok() || !p.is_ok() ||
      !g.is_ok() || !m.is_ok() || !v.is_ok() || !copy_stream.is_ok() || !compute_stream.is_ok()) {
    state.SkipWithError("setup failed");
    return;
  }
  Stream& cs = **copy_stream;
  Stream& ks = **compute_stream;
  fill_uniform(host.data(), params, 3);
  (void)cudaMemcpy(p->data(), host.data(), params * 4, cudaMemcpyHostToDevice);
  fill_uniform(host.data(), params, 4);
  (void)cudaMemcpy(g->data(), host.data(), params * 4, cudaMemcpyHostToDevice);
  (void)cudaMemset(m->data(), 0, params * 4);
  (void)cudaMemset(v->data(), 0, params * 4);
  kernels::AdamHyper hyper;
  hyper.adamw = true;
  std::int64_t step = 0;
  int launches = 1;
  bool ok = true;
  auto copy = [&] { ok &= device.copy_h2d(dst->data(), pinned.data(), bytes, cs).is_ok(); };
  auto compute = [&] {
    for (int i = 0; i < launches; ++i) {
      ok &= kernels::adam_step(p->as<float>(), g->as<float>(), m->as<float>(), v->as<float>(),
                               nullptr, kernels::HalfType::kNone, params,
                               kernels::adam_step_args(hyper, ++step), ks.native_handle()) == 0;
    }
  };
  auto timed = [&](bool do_copy, bool do_compute) {
    const auto t = Clock::now();
    if (do_copy) copy();
    if (do_compute) compute();
    ok &= device.synchronize(cs).is_ok() && device.synchronize(ks).is_ok();
    return seconds_since(t);
  };
  // Size the compute to the copy: launches so that both take about as long.
  const double copy_s = timed(true, false);
  const double one_s = timed(false, true);
  launches = std::max(1, static_cast<int>(copy_s / one_s + 0.5));
  (void)timed(true, true);
  std::vector<double> both_s, alone_s;
  gpu_bench::Rounds rounds(static_cast<double>(bytes) + 28.0 * params * launches);
  int round = 0;
  for (auto _ : state) {
    double c = 0, k = 0, b = 0;
    if (round++ % 2 == 0) {
      c = timed(true, false);
      k = timed(false, true);
      b = timed(true, true);
    } else {
      b = timed(true, true);
      k = timed(false, true);
      c = timed(true, false);
    }
    rounds.add(b, std::max(c, k));
    state.SetIterationTime(b);
  }
  (void)device.unregister_host(pinned.data());
  if (!ok) {
    state.SkipWithError("a copy or kernel failed");
    return;
  }
  state.counters["adam_launches"] = launches;
  rounds.report(state, "h2d 512MiB || adamw x" + std::to_string(launches), "max(copy, compute)");
}

BENCHMARK(BM_CopyComputeOverlap)->UseManualTime()->Iterations(10)->Unit(benchmark::kMillisecond);

BENCHMARK(BM_PinnedCopy)
    ->ArgsProduct({{64, 512}, {0, 1}})
    ->ArgNames({"MiB", "d2h"})
    ->UseManualTime()
    ->Iterations(20)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) { return zinf::gpu_bench::run_main(argc, argv, "bench_gpu_copy"); }
