// Memory bandwidth of a streaming access pattern, measured on this machine now.
//
// The CPU optimizer is memory-bound, so its limit is the bandwidth of its own access pattern
// (so many streams read, so many read and written in place, so many written) with trivial
// arithmetic. This measures exactly that, for any mix of 4-byte and 2-byte streams, so every
// optimizer variant can be put beside the limit it answers to in the same run.
// Thread-safety: each call allocates and frees its own arrays; calls may not overlap in time
// without disturbing each other's figures.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zinf {

struct StreamPattern {
  // Element size in bytes (4 or 2) of each stream that is only read.
  std::vector<int> read_only_bytes;
  // ... of each stream that is read and written back in place.
  std::vector<int> in_place_bytes;
  // ... of each stream that is only written.
  std::vector<int> write_only_bytes;

  // Bytes moved per element: every read counted once, every write once (no write-allocate).
  std::size_t bytes_per_element() const;

  // STREAM triad: a = b + s*c (two reads, one write, 12 bytes an element).
  static StreamPattern triad() { return {{4, 4}, {}, {4}}; }
  // fp32 Adam: read g; read and write p, m, v (28 bytes an element).
  static StreamPattern adam_f32() { return {{4}, {4, 4, 4}, {}}; }
};

struct BandwidthResult {
  double best_gbps = 0;    // 1e9 bytes/s, fastest repetition
  double median_gbps = 0;  // median over repetitions
  std::vector<double> rep_gbps;
};

// Runs `pattern` over `elements` elements per stream on `threads` threads (0 = all cores),
// `reps` timed repetitions after one warm-up. Arrays are filled with seeded random data.
BandwidthResult measure_bandwidth(const StreamPattern& pattern, std::size_t elements, int threads,
                                  int reps);

// Opaque handle for interleaving: allocate once, time one repetition at a time.
class BandwidthProbe {
 public:
  BandwidthProbe(const StreamPattern& pattern, std::size_t elements, int threads);
  ~BandwidthProbe();
  BandwidthProbe(const BandwidthProbe&) = delete;
  BandwidthProbe& operator=(const BandwidthProbe&) = delete;
  // One pass over all streams; returns GB/s (1e9 bytes/s).
  double run_once();
  std::size_t bytes_per_pass() const;

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace zinf
