// xxh3_64() (the swap space's block checksum) on one thread: the library's SSE2 build against
// the widest path this CPU runs (base/hash.hpp), each beside the limit it answers to, in
// interleaved rounds:
//   memory   a 1 GiB buffer of seeded random bytes hashed in 1 MiB blocks (the swap space's
//            block size), beside one read-only stream of 1 GiB on one thread
//            (BandwidthProbe: the limit of a hash that reads memory once);
//   cache    one 256 KiB buffer hashed over and over (the limit is the hash's own arithmetic).
// Each round prints every rate; the end prints the medians of library / limit, fast / limit and
// fast / library per case.
//
//   build/bin/bench_base_hash [--rounds 5]
#include "base/hash.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/aligned.hpp"
#include "base/cpu.hpp"
#include "base/membw.hpp"
#include "base/random.hpp"
#include "bench/bench_stats.hpp"

namespace {

using zinf::bench::median;

using Clock = std::chrono::steady_clock;

// GB/s of fn over `bytes`, repeated until at least 0.3 s passed.
template <typename Fn>
double rate(std::size_t bytes, Fn&& fn) {
  std::uint64_t sink = 0;
  std::size_t done = 0;
  const auto t0 = Clock::now();
  double seconds = 0;
  do {
    sink ^= fn();
    done += bytes;
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (seconds < 0.3);
  if (sink == 0x5eed) std::fputs("", stderr);  // keeps the work
  return static_cast<double>(done) / seconds / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else {
      fmt::print(stderr, "usage: bench_base_hash [--rounds N]\n");
      return 2;
    }
  }
  const zinf::CpuFeatures& cpu = zinf::cpu_features();
  const char* fast_name = cpu.has_avx512_path() ? "avx512" : cpu.has_avx2_path() ? "avx2" : "sse2";
  const std::size_t big = std::size_t{1} << 30, block = std::size_t{1} << 20;
  const std::size_t small = std::size_t{256} << 10;
  zinf::AlignedBuffer buffer(big);
  zinf::SplitMix64 rng(0x4a5b);
  auto* words = reinterpret_cast<std::uint64_t*>(buffer.data());
  for (std::size_t i = 0; i < big / 8; ++i) words[i] = rng.next();

  auto hash_blocks = [&](auto hash) {
    return [&, hash] {
      std::uint64_t h = 0;
      for (std::size_t o = 0; o < big; o += block) h ^= hash(buffer.data() + o, block);
      return h;
    };
  };
  auto hash_small = [&](auto hash) { return [&, hash] { return hash(buffer.data(), small); }; };
  // The limit: one read-only f32 stream of the same size on one thread (base/membw.hpp).
  zinf::BandwidthProbe read_probe(zinf::StreamPattern{{4}, {}, {}}, big / 4, 1);
  const auto library = &zinf::hash_kernel::xxh3_64_library;
  const auto fast = &zinf::xxh3_64;

  fmt::print("xxh3-64 on one thread, {} ({}), {} rounds\n", zinf::cpu_model_name(), fast_name,
             rounds);
  std::vector<double> mem_lib, mem_fast, mem_gain, cache_gain;
  for (int r = 1; r <= rounds; ++r) {
    const double read = read_probe.run_once();
    const double lib = rate(big, hash_blocks(library));
    const double fst = rate(big, hash_blocks(fast));
    const double c_lib = rate(small, hash_small(library));
    const double c_fast = rate(small, hash_small(fast));
    fmt::print(
        "round {}: memory: read {:.1f} GB/s, library {:.1f}, {} {:.1f}; cache: library {:.1f}, "
        "{} {:.1f}\n",
        r, read, lib, fast_name, fst, c_lib, fast_name, c_fast);
    mem_lib.push_back(lib / read);
    mem_fast.push_back(fst / read);
    mem_gain.push_back(fst / lib);
    cache_gain.push_back(c_fast / c_lib);
  }
  fmt::print(
      "median: memory: library / read {:.2f}, {} / read {:.2f}, {} / library {:.2f}; cache: {} / "
      "library {:.2f}\n",
      median(mem_lib), fast_name, median(mem_fast), fast_name, median(mem_gain), fast_name,
      median(cache_gain));
  return 0;
}
