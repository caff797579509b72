#include "base/membw.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "base/aligned.hpp"
#include "base/assert.hpp"
#include "base/cpu.hpp"
#include "base/membw_kernel.hpp"
#include "base/random.hpp"
#include "zinf/trace.hpp"

namespace zinf {
namespace {

// Blocks of elements handed to the threads; inside a block all streams advance together in
// groups of membw::kGroupElements (membw_kernel.hpp).
constexpr std::size_t kBlockElements = 2048;
static_assert(kBlockElements % membw::kGroupElements == 0);

constexpr std::size_t kStreamStaggerBytes = 576;  // 9 cache lines: distinct mod 4 KiB for 7 streams

using Vec16 = unsigned long long __attribute__((vector_size(16)));

void pass_range_sse2(const membw::StreamView* reads, int read_count,
                     const membw::StreamView* in_place, int in_place_count,
                     const membw::StreamView* writes, int write_count, std::size_t begin,
                     std::size_t end) {
  membw::pass_range<Vec16>(reads, read_count, in_place, in_place_count, writes, write_count, begin,
                           end);
}

// The widest the CPU has, as the kernels measured against it use.
membw::PassRangeFn pick_pass_range() {
  if (cpu_features().has_avx512_path()) return &membw::pass_range_avx512;
  if (cpu_features().has_avx2_path()) return &membw::pass_range_avx2;
  return &pass_range_sse2;
}

}  // namespace

std::size_t StreamPattern::bytes_per_element() const {
  std::size_t bytes = 0;
  for (int b : read_only_bytes) bytes += static_cast<std::size_t>(b);
  for (int b : in_place_bytes) bytes += 2 * static_cast<std::size_t>(b);
  for (int b : write_only_bytes) bytes += static_cast<std::size_t>(b);
  return bytes;
}

struct BandwidthProbe::Impl {
  struct Stream {
    AlignedBuffer buffer;
    int elem_bytes;
    // Each stream starts at a different offset within a 4 KiB page, so that a load of one stream
    // never waits on a recent store to another at the same page offset (4K aliasing), which
    // arrays that all start page-aligned would suffer and measure instead of the memory.
    std::size_t offset_bytes;
    std::byte* data() { return buffer.data() + offset_bytes; }
  };
  StreamPattern pattern;
  std::size_t elements;
  std::vector<Stream> reads, in_place, writes;
  tbb::task_arena arena;
  std::vector<membw::StreamView> read_views, in_place_views, write_views;
  membw::PassRangeFn pass_range = pick_pass_range();

  Impl(const StreamPattern& p, std::size_t n, int threads)
      : pattern(p), elements(n), arena(threads > 0 ? threads : cpu_count()) {
    std::uint64_t seed = 0x5eed;
    std::size_t stream_index = 0;
    auto make = [&](int elem_bytes) {
      ZINF_ASSERT(elem_bytes == 2 || elem_bytes == 4);
      const std::size_t offset = (stream_index++ % 7) * kStreamStaggerBytes;
      Stream s{AlignedBuffer(elements * static_cast<std::size_t>(elem_bytes) + offset, 64),
               elem_bytes, offset};
      fill_random_bytes(s.buffer.data(), s.buffer.bytes(), ++seed);
      if (elem_bytes == 4) {
        // Finite values, so no NaN/denormal slow paths.
        fill_uniform(reinterpret_cast<float*>(s.data()), elements, seed, -1.0f, 1.0f);
      }
      return s;
    };
    for (int b : pattern.read_only_bytes) reads.push_back(make(b));
    for (int b : pattern.in_place_bytes) in_place.push_back(make(b));
    for (int b : pattern.write_only_bytes) writes.push_back(make(b));
    for (Stream& s : reads) read_views.push_back({s.data(), s.elem_bytes});
    for (Stream& s : in_place) in_place_views.push_back({s.data(), s.elem_bytes});
    for (Stream& s : writes) write_views.push_back({s.data(), s.elem_bytes});
  }

  void pass() {
    const std::size_t blocks = (elements + kBlockElements - 1) / kBlockElements;
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<std::size_t>(0, blocks, 64),
          [&](const tbb::blocked_range<std::size_t>& range) {
            const std::size_t begin = range.begin() * kBlockElements;
            const std::size_t end = std::min(elements, range.end() * kBlockElements);
            pass_range(read_views.data(), static_cast<int>(read_views.size()),
                       in_place_views.data(), static_cast<int>(in_place_views.size()),
                       write_views.data(), static_cast<int>(write_views.size()), begin, end);
          },
          tbb::static_partitioner());
    });
  }
};

BandwidthProbe::BandwidthProbe(const StreamPattern& pattern, std::size_t elements, int threads)
    : impl_(new Impl(pattern, elements, threads)) {
  impl_->pass();  // Warm-up: faults every page in.
}

BandwidthProbe::~BandwidthProbe() { delete impl_; }

std::size_t BandwidthProbe::bytes_per_pass() const {
  return impl_->pattern.bytes_per_element() * impl_->elements;
}

double BandwidthProbe::run_once() {
  const std::int64_t start = Trace::now_ns();
  impl_->pass();
  const std::int64_t end = Trace::now_ns();
  return static_cast<double>(bytes_per_pass()) / static_cast<double>(end - start);
}

BandwidthResult measure_bandwidth(const StreamPattern& pattern, std::size_t elements, int threads,
                                  int reps) {
  BandwidthProbe probe(pattern, elements, threads);
  BandwidthResult result;
  for (int r = 0; r < std::max(reps, 1); ++r) result.rep_gbps.push_back(probe.run_once());
  std::vector<double> sorted = result.rep_gbps;
  std::sort(sorted.begin(), sorted.end());
  result.best_gbps = sorted.back();
  const std::size_t n = sorted.size();
  result.median_gbps = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  return result;
}

}  // namespace zinf
