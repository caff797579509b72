// LocalComm collectives on HostDevice against the machine's copy bandwidth, measured in the same
// run and interleaved round by round: each iteration times one collective over every rank, then
// one pass of a copy (one 4-byte read stream, one 4-byte write stream) on as many threads as
// ranks. Reported: the collective's memory traffic per second (GBps), the copy's (limit_GBps), and
// the median over rounds of their ratio (ratio_median; 1.0 would be a collective that moves its
// bytes as fast as a plain copy does).
//
// Memory traffic counted per collective (reads once, writes once, f32, W ranks, N elements):
//   all_gather     N per rank in, W*N out per rank:  W*W*N read + W*W*N written
//   reduce_scatter W*N per rank in, N out:           W*W*N read + W*N written
//   all_reduce     N in, N out (reduce a 1/W share, then copy the result): 2*W*N read,
//                  W*N + N written
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "base/membw.hpp"
#include "base/random.hpp"
#include "bench/bench_stats.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"

namespace {

using zinf::bench::median;

using zinf::CollectiveKind;

double traffic_bytes(CollectiveKind kind, double world, double elements) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return 4 * (2 * world * world * elements);
    case CollectiveKind::kReduceScatter:
      return 4 * (world * world * elements + world * elements);
    case CollectiveKind::kAllReduce:
      return 4 * (3 * world * elements + elements);
    case CollectiveKind::kBroadcast:
      return 4 * (2 * world * elements);
  }
  return 0;
}

void run(benchmark::State& state, CollectiveKind kind) {
  const int world = static_cast<int>(state.range(0));
  const std::size_t elements = static_cast<std::size_t>(state.range(1));
  const auto uworld = static_cast<std::size_t>(world);
  std::vector<std::unique_ptr<zinf::Device>> devices;
  std::vector<zinf::Device*> raw;
  for (int r = 0; r < world; ++r) {
    zinf::HostDeviceOptions options;
    options.ordinal = r;
    options.poison_allocations = false;
    devices.push_back(std::move(zinf::make_host_device(options)).value());
    raw.push_back(devices.back().get());
  }
  auto comms = std::move(zinf::make_local_comm_group(raw)).value();
  std::vector<std::unique_ptr<zinf::Stream>> streams;
  std::vector<std::unique_ptr<zinf::Event>> events;
  std::vector<zinf::DeviceBuffer> sends, recvs;
  const std::size_t send_elements =
      kind == CollectiveKind::kReduceScatter ? elements * uworld : elements;
  const std::size_t recv_elements =
      kind == CollectiveKind::kAllGather ? elements * uworld : elements;
  for (int r = 0; r < world; ++r) {
    zinf::Device& device = *devices[static_cast<std::size_t>(r)];
    streams.push_back(std::move(device.create_stream("bench")).value());
    events.push_back(std::move(device.create_event()).value());
    sends.push_back(std::move(zinf::DeviceBuffer::allocate(device, send_elements * 4)).value());
    recvs.push_back(std::move(zinf::DeviceBuffer::allocate(device, recv_elements * 4)).value());
    zinf::fill_uniform(sends.back().as<float>(), send_elements, 17 + static_cast<unsigned>(r));
    zinf::fill_uniform(recvs.back().as<float>(), recv_elements, 71 + static_cast<unsigned>(r));
  }
  // The limit: a plain copy on one thread per rank, over as many bytes as the collective moves.
  const double bytes = traffic_bytes(kind, world, static_cast<double>(elements));
  zinf::BandwidthProbe copy({{4}, {}, {4}}, static_cast<std::size_t>(bytes / 8), world);

  std::vector<double> gbps, limit_gbps, ratios;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < world; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      zinf::Collective op;
      op.kind = kind;
      op.send = sends[ur].data();
      op.recv = recvs[ur].data();
      op.element_count = elements;
      op.dtype = zinf::DType::kF32;
      op.op = zinf::ReduceOp::kSum;
      if (!comms[ur]->issue(op, *streams[ur]).is_ok() ||
          !devices[ur]->record(*events[ur], *streams[ur]).is_ok()) {
        state.SkipWithError("issue failed");
        return;
      }
    }
    for (int r = 0; r < world; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      if (!comms[ur]->wait(*events[ur]).is_ok()) {
        state.SkipWithError("collective failed");
        return;
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(seconds);
    const double limit = copy.run_once();
    gbps.push_back(bytes / seconds / 1e9);
    limit_gbps.push_back(limit);
    ratios.push_back(gbps.back() / limit);
  }
  state.counters["GBps"] = median(gbps);
  state.counters["limit_GBps"] = median(limit_gbps);
  state.counters["ratio_median"] = median(ratios);
}

void BM_AllReduce(benchmark::State& state) { run(state, CollectiveKind::kAllReduce); }
void BM_ReduceScatter(benchmark::State& state) { run(state, CollectiveKind::kReduceScatter); }
void BM_AllGather(benchmark::State& state) { run(state, CollectiveKind::kAllGather); }

// 4 Mi f32 elements (16 MiB) a rank: well past the caches, small enough for a shared machine.
#define ZINF_COMM_ARGS \
  ->Args({2, 1 << 22})->Args({4, 1 << 22})->UseManualTime()->Unit(benchmark::kMillisecond)
BENCHMARK(BM_AllReduce) ZINF_COMM_ARGS;
BENCHMARK(BM_ReduceScatter) ZINF_COMM_ARGS;
BENCHMARK(BM_AllGather) ZINF_COMM_ARGS;

}  // namespace

BENCHMARK_MAIN();
