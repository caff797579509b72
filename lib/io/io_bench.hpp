// Sequential-throughput measurement of an IoEngine on one file, as `zinf io bench` and
// `zinf io tune` run it (and as the planner may run it to learn a drive's speed).
//
// The measurement keeps the engine's queues full: it owns a pool of more blocks than the
// engine keeps in flight (queue_depth * rings, plus a margin so a completed block is never
// the only one waiting to be resubmitted), submits one block_bytes request per block at
// increasing offsets, and resubmits each block as soon as its oldest-first wait returns. The
// engine, not the loop, bounds the pieces at the drive to queue_depth per ring, so the drive
// sees the same depth as fio's --iodepth. Every completion is checked; the first error stops
// the run and is returned.
//
// Thread-safety: run_io_bench() uses the engine, file and pool it is given and nothing else;
// run one at a time per pool.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "io/buffer_pool.hpp"
#include "io/io_engine.hpp"
#include "zinf/status.hpp"

namespace zinf {

struct IoBenchConfig {
  IoOp op = IoOp::kRead;
  std::uint64_t bytes = std::uint64_t{1} << 30;  // to move; rounded down to whole blocks
  std::uint64_t file_bytes = 0;  // offsets wrap within [0, file_bytes); 0 means `bytes`
  // Stop submitting after this long (0 = no limit); the bytes moved so far are reported.
  std::chrono::milliseconds time_limit{0};
  std::chrono::milliseconds wait_timeout{60000};
};

struct IoBenchResult {
  std::uint64_t bytes = 0;  // moved and checked
  double seconds = 0;
  double gbps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
};

// Blocks a pool for run_io_bench() should hold for `options` (queue_depth * rings plus a
// margin).
std::size_t io_bench_pool_blocks(const IoOptions& options);

// REQUIRES: pool.block_bytes() == engine.options().block_bytes; the file is at least
// file_bytes long for reads. For writes, the blocks' content is written as it is (fill it
// with random bytes first: never time zeros).
Result<IoBenchResult> run_io_bench(IoEngine& engine, FileHandle file, BufferPool& pool,
                                   const IoBenchConfig& config);

}  // namespace zinf
