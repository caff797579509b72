// The gradient spill (SpillAccumulator, zinf.gradients_on_nvme) against the raw I/O of the same
// bytes in the same run. 32 Mi fp32 elements (128 MiB) in 16 sub-groups of 8 MiB, 4 buffers,
// chunks of 1 MiB handed over from the partition's end to its start, as backward does.
//
//   BM_Spill/<micro_batches>/<read_ahead>  zero(), the micro-batches' adds, flush(): every
//                                          sub-group written each micro-batch, read back in each
//                                          later one (all but the first of a micro-batch read
//                                          ahead when read_ahead is 1)
//   BM_RawRead                             every sub-group's extent read synchronously, one
//                                          after the other: one later micro-batch's read-backs
//   BM_RawWrite                            every sub-group's extent written synchronously
//   BM_AddAndSquare                        the CPU work alone, in memory: the adds, then
//                                          zinf::sum_of_squares over each sub-group (the work a
//                                          write used to add on top of the adds)
//
// Run: build/bin/bench_zero_spill --benchmark_min_time=1 (ZINF_BENCH_DIR: where the swap file
// goes, /tmp by default).
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "base/aligned.hpp"
#include "base/random.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "tier/state_store.hpp"
#include "zero/grad_accumulator.hpp"

namespace zinf {
namespace {

constexpr std::size_t kParams = std::size_t{32} << 20;
constexpr std::size_t kSubGroup = std::size_t{2} << 20;
constexpr std::size_t kChunk = std::size_t{256} << 10;

struct Rig {
  std::string dir;
  std::unique_ptr<IoEngine> io;
  std::unique_ptr<SwapSpace> swap;
  std::unique_ptr<StateStore> store;
  std::vector<float> grads;
  Status status;

  Rig() {
    const char* root = std::getenv("ZINF_BENCH_DIR");
    dir = std::string(root != nullptr ? root : "/tmp") + "/zinf-bench-spill-" +
          std::to_string(::getpid());
    status = open();
    grads.resize(kParams);
    fill_uniform(grads.data(), kParams, 42);
  }
  ~Rig() {
    store.reset();
    swap.reset();
    io.reset();
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  Status open() {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::io_error("bench: cannot create " + dir);
    IoOptions io_options;
    io_options.queue_depth = 32;
    ZINF_ASSIGN_OR_RETURN(io, open_engine(io_options));
    StateStoreOptions so;
    so.param_count = kParams;
    so.sub_group_params = kSubGroup;
    so.tiers = {StoreMedium::kHost, StoreMedium::kHost, StoreMedium::kHost, StoreMedium::kNvme,
                StoreMedium::kHost};
    so.key_prefix = "rank0/opt";
    ZINF_ASSIGN_OR_RETURN(StoreLayout layout, StateStore::layout(so));
    SwapOptions swap_options;
    swap_options.dirs = {dir};
    swap_options.capacity_bytes = layout.nvme_bytes + (std::uint64_t{1} << 20);
    ZINF_ASSIGN_OR_RETURN(swap, SwapSpace::open(*io, swap_options));
    ZINF_ASSIGN_OR_RETURN(store, StateStore::open(so, swap.get()));
    return Status::ok();
  }
};

Rig& rig() {
  static Rig r;
  return r;
}

void BM_Spill(benchmark::State& state) {
  Rig& r = rig();
  if (!r.status.is_ok()) return state.SkipWithError(r.status.to_string().c_str());
  SpillOptions options;
  options.read_ahead = state.range(1) != 0;
  ZeroCounters counters;
  auto acc = SpillAccumulator::create(*r.store, options, &counters);
  if (!acc.is_ok()) return state.SkipWithError(acc.status().to_string().c_str());
  const auto micro_batches = static_cast<int>(state.range(0));
  for (auto _ : state) {
    (*acc)->zero();
    for (int m = 0; m < micro_batches; ++m) {
      for (std::size_t end = kParams; end > 0; end -= kChunk) {
        Status st = (*acc)->add(end - kChunk, kChunk, r.grads.data() + end - kChunk);
        if (!st.is_ok()) return state.SkipWithError(st.to_string().c_str());
      }
    }
    Status st = (*acc)->flush();
    if (!st.is_ok()) return state.SkipWithError(st.to_string().c_str());
  }
  state.SetBytesProcessed(state.iterations() * micro_batches *
                          static_cast<std::int64_t>(kParams * sizeof(float)));
  state.counters["read_backs"] = benchmark::Counter(
      static_cast<double>(counters.grad_spill_read_backs), benchmark::Counter::kAvgIterations);
  state.counters["read_aheads"] = benchmark::Counter(
      static_cast<double>((*acc)->read_ahead_count()), benchmark::Counter::kAvgIterations);
}
BENCHMARK(BM_Spill)
    ->Args({1, 1})
    ->Args({2, 0})
    ->Args({2, 1})
    ->Args({4, 0})
    ->Args({4, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_RawRead(benchmark::State& state) {
  Rig& r = rig();
  if (!r.status.is_ok()) return state.SkipWithError(r.status.to_string().c_str());
  AlignedBuffer buf(kSubGroup * sizeof(float));
  // The extents must hold data: write them once.
  for (std::size_t i = 0; i < r.store->sub_group_count(); ++i) {
    Status st = r.swap->write_sync(r.store->extent(Piece::kGrads, i), buf.data());
    if (!st.is_ok()) return state.SkipWithError(st.to_string().c_str());
  }
  for (auto _ : state) {
    for (std::size_t i = 0; i < r.store->sub_group_count(); ++i) {
      Status st = r.swap->read_sync(r.store->extent(Piece::kGrads, i), buf.data());
      if (!st.is_ok()) return state.SkipWithError(st.to_string().c_str());
    }
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kParams * sizeof(float)));
}
BENCHMARK(BM_RawRead)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_RawWrite(benchmark::State& state) {
  Rig& r = rig();
  if (!r.status.is_ok()) return state.SkipWithError(r.status.to_string().c_str());
  AlignedBuffer buf(kSubGroup * sizeof(float));
  for (auto _ : state) {
    for (std::size_t i = 0; i < r.store->sub_group_count(); ++i) {
      Status st = r.swap->write_sync(r.store->extent(Piece::kGrads, i), buf.data());
      if (!st.is_ok()) return state.SkipWithError(st.to_string().c_str());
    }
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kParams * sizeof(float)));
}
BENCHMARK(BM_RawWrite)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_AddAndSquare(benchmark::State& state) {
  Rig& r = rig();
  std::vector<float> acc(kParams, 0.0f);
  MemoryAccumulator memory(acc.data(), kParams);
  double sink = 0.0;
  for (auto _ : state) {
    for (std::size_t end = kParams; end > 0; end -= kChunk) {
      (void)memory.add(end - kChunk, kChunk, r.grads.data() + end - kChunk);
    }
    for (std::size_t first = 0; first < kParams; first += kSubGroup) {
      sink += sum_of_squares(acc.data() + first, kSubGroup);
    }
  }
  benchmark::DoNotOptimize(sink);
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kParams * sizeof(float)));
}
BENCHMARK(BM_AddAndSquare)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace zinf

BENCHMARK_MAIN();
