// Per-request overhead of the I/O engines, on a small file that stays in the page cache (no
// O_DIRECT), so the time is the engine's and the kernel's request path, not the drive's.
//
//   BM_PreadBaseline        one 4 KiB pread per iteration: the floor a thread engine can reach
//   BM_RoundTrip/<engine>   submit one 4 KiB read and wait for it (latency of one request)
//   BM_Batch/<engine>/<n>   submit n 4 KiB reads, then wait for all (requests/s in flight)
//
// Run: build-io/bin/bench_io_engine_overhead --benchmark_min_time=0.2
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "base/aligned.hpp"
#include "base/random.hpp"
#include "io/buffer_pool.hpp"
#include "io/io_engine.hpp"

namespace zinf {
namespace {

constexpr std::size_t kFileBytes = 4 << 20;
constexpr std::size_t kRequestBytes = 4096;

std::string bench_file() {
  const char* dir = std::getenv("ZINF_BENCH_DIR");
  static const std::string path =
      std::string(dir != nullptr ? dir : "/tmp") + "/zinf-bench-io-" + std::to_string(getpid());
  static bool made = [] {
    AlignedBuffer data(kFileBytes);
    fill_random_bytes(data.data(), kFileBytes, 42);
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    const bool ok =
        fd >= 0 && ::pwrite(fd, data.data(), kFileBytes, 0) == static_cast<ssize_t>(kFileBytes);
    if (fd >= 0) ::close(fd);
    std::atexit([] { ::unlink(path.c_str()); });
    return ok;
  }();
  (void)made;
  return path;
}

struct Fixture {
  std::unique_ptr<IoEngine> engine;
  std::unique_ptr<BufferPool> pool;
  FileHandle file;
  bool ok = false;

  Fixture(EngineKind kind, std::uint32_t depth) {
    IoOptions options;
    options.kind = kind;
    options.block_bytes = kRequestBytes;
    options.queue_depth = depth;
    options.max_requests = 1024;
    Result<std::unique_ptr<IoEngine>> e = open_engine(options);
    if (!e.is_ok()) return;
    engine = std::move(e).value();
    Result<std::unique_ptr<BufferPool>> p =
        BufferPool::create({.block_bytes = kRequestBytes, .block_count = 256});
    if (!p.is_ok()) return;
    pool = std::move(p).value();
    if (!pool->register_with(*engine).is_ok()) return;
    Result<FileHandle> f = engine->open_file(bench_file(), {.write = false, .direct = false});
    if (!f.is_ok()) return;
    file = *f;
    ok = true;
  }
};

void BM_PreadBaseline(benchmark::State& state) {
  const int fd = ::open(bench_file().c_str(), O_RDONLY);
  AlignedBuffer buffer(kRequestBytes);
  std::uint64_t offset = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(::pread(fd, buffer.data(), kRequestBytes, static_cast<off_t>(offset)));
    offset = (offset + kRequestBytes) % kFileBytes;
  }
  ::close(fd);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PreadBaseline);

void BM_RoundTrip(benchmark::State& state) {
  Fixture f(static_cast<EngineKind>(state.range(0)), 1);
  if (!f.ok) return state.SkipWithError("engine unavailable");
  state.SetLabel(std::string(engine_kind_name(f.engine->kind())));
  std::uint64_t offset = 0;
  for (auto _ : state) {
    Status s = f.engine->read_sync(f.file, offset, kRequestBytes, f.pool->block(0));
    if (!s.is_ok()) return state.SkipWithError(s.to_string().c_str());
    offset = (offset + kRequestBytes) % kFileBytes;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_RoundTrip)
    ->Arg(static_cast<int>(EngineKind::kUring))
    ->Arg(static_cast<int>(EngineKind::kThread))
    ->UseRealTime();

void BM_Batch(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(1));
  Fixture f(static_cast<EngineKind>(state.range(0)), 32);
  if (!f.ok) return state.SkipWithError("engine unavailable");
  state.SetLabel(std::string(engine_kind_name(f.engine->kind())));
  std::vector<Ticket> tickets(n);
  std::uint64_t offset = 0;
  for (auto _ : state) {
    for (std::size_t i = 0; i < n; ++i) {
      Result<Ticket> t = f.engine->read(f.file, offset, kRequestBytes, f.pool->block(i));
      if (!t.is_ok()) return state.SkipWithError(t.status().to_string().c_str());
      tickets[i] = *t;
      offset = (offset + kRequestBytes) % kFileBytes;
    }
    for (Ticket t : tickets) {
      Status s = f.engine->wait(t, std::chrono::seconds(10));
      if (!s.is_ok()) return state.SkipWithError(s.to_string().c_str());
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));
}
BENCHMARK(BM_Batch)
    ->Args({static_cast<int>(EngineKind::kUring), 64})
    ->Args({static_cast<int>(EngineKind::kThread), 64})
    ->Args({static_cast<int>(EngineKind::kUring), 256})
    ->Args({static_cast<int>(EngineKind::kThread), 256})
    ->UseRealTime();

}  // namespace
}  // namespace zinf

BENCHMARK_MAIN();
