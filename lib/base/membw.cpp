#include "base/membw.hpp"

#include <algorithm>
#include <cstring>
#include <memory>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include "base/aligned.hpp"
#include "base/assert.hpp"
#include "base/cpu.hpp"
#include "base/random.hpp"
#include "zinf/trace.hpp"

namespace zinf {
namespace {

// Work is done in blocks small enough to stay in L1: first the read streams are summed into a
// block-sized accumulator, then each written stream is updated from it. Each loop is a plain
// vectorisable pass, so the memory traffic is exactly one read or write per stream element.
constexpr std::size_t kBlockElements = 2048;

struct Stream {
  AlignedBuffer buffer;
  int elem_bytes;
};

void accumulate(const Stream& s, std::size_t begin, std::size_t count, float* acc) {
  if (s.elem_bytes == 4) {
    const float* p = s.buffer.as<float>() + begin;
    for (std::size_t i = 0; i < count; ++i) acc[i] += p[i];
  } else {
    const std::uint16_t* p = s.buffer.as<std::uint16_t>() + begin;
    for (std::size_t i = 0; i < count; ++i) acc[i] += static_cast<float>(p[i]);
  }
}

void update_in_place(Stream& s, std::size_t begin, std::size_t count, const float* acc) {
  if (s.elem_bytes == 4) {
    float* p = s.buffer.as<float>() + begin;
    for (std::size_t i = 0; i < count; ++i) p[i] = p[i] * 0.5f + acc[i];
  } else {
    std::uint16_t* p = s.buffer.as<std::uint16_t>() + begin;
    for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<std::uint16_t>(p[i] + 1);
  }
}

void write_only(Stream& s, std::size_t begin, std::size_t count, const float* acc) {
  if (s.elem_bytes == 4) {
    float* p = s.buffer.as<float>() + begin;
    for (std::size_t i = 0; i < count; ++i) p[i] = acc[i];
  } else {
    std::uint16_t* p = s.buffer.as<std::uint16_t>() + begin;
    for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<std::uint16_t>(acc[i]);
  }
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
  StreamPattern pattern;
  std::size_t elements;
  std::vector<Stream> reads, in_place, writes;
  tbb::task_arena arena;

  Impl(const StreamPattern& p, std::size_t n, int threads)
      : pattern(p), elements(n), arena(threads > 0 ? threads : cpu_count()) {
    std::uint64_t seed = 0x5eed;
    auto make = [&](int elem_bytes) {
      ZINF_ASSERT(elem_bytes == 2 || elem_bytes == 4);
      Stream s{AlignedBuffer(elements * static_cast<std::size_t>(elem_bytes), 64), elem_bytes};
      fill_random_bytes(s.buffer.data(), s.buffer.bytes(), ++seed);
      if (elem_bytes == 4) {
        // Finite values, so no NaN/denormal slow paths.
        fill_uniform(s.buffer.as<float>(), elements, seed, -1.0f, 1.0f);
      }
      return s;
    };
    for (int b : pattern.read_only_bytes) reads.push_back(make(b));
    for (int b : pattern.in_place_bytes) in_place.push_back(make(b));
    for (int b : pattern.write_only_bytes) writes.push_back(make(b));
  }

  void pass() {
    const std::size_t blocks = (elements + kBlockElements - 1) / kBlockElements;
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<std::size_t>(0, blocks, 64),
          [&](const tbb::blocked_range<std::size_t>& range) {
            alignas(64) float acc[kBlockElements];
            for (std::size_t b = range.begin(); b != range.end(); ++b) {
              const std::size_t begin = b * kBlockElements;
              const std::size_t count = std::min(kBlockElements, elements - begin);
              std::memset(acc, 0, sizeof(float) * count);
              for (const Stream& s : reads) accumulate(s, begin, count, acc);
              for (Stream& s : in_place) update_in_place(s, begin, count, acc);
              for (Stream& s : writes) write_only(s, begin, count, acc);
            }
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
