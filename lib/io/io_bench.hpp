// Sequential-throughput measurement of an IoEngine on one file, as `zinf io bench` and
// `zinf io tune` run it (and as the planner may run it to learn a drive's speed).
//
// The measurement keeps the engine's queues full: it owns a pool of request buffers holding
// more than the engine keeps in flight (queue_depth * rings pieces of block_bytes, plus a
// margin so the queue never runs dry while a finished request waits to be resubmitted),
// submits one request per pool block at increasing offsets, and resubmits each as soon as its
// oldest-first wait returns. The engine cuts each request into block_bytes pieces and bounds
// the pieces at the drive to queue_depth per ring, so the drive sees the same request size and
// depth as fio's --bs and --iodepth. A request of several blocks (request_bytes) is how the
// optimizer uses the engine (a sub-group's tensors are large requests), and it lets the
// engine's ring thread refill the queue without waking the caller for every block. Every
// completion is checked; the first error stops the run and is returned.
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

// The request size run_io_bench() uses by default: block_bytes * max(1, queue_depth / 4).
std::size_t io_bench_request_bytes(const IoOptions& options);
// Pool blocks of `request_bytes` (0: one engine block, options.block_bytes) that
// run_io_bench() should have for `options`: enough requests to cover queue_depth * rings
// pieces, plus a margin.
std::size_t io_bench_pool_blocks(const IoOptions& options, std::size_t request_bytes = 0);

// The run over an existing file of `file_bytes` named `path` (an owned one is made `bytes` long):
// a read moves at most the file, a write moves `bytes` wrapping within it, so a bench never grows
// or shrinks the file it is given. Errors: invalid_argument naming `path` and both sizes when the
// file holds less than one request of `request_bytes`.
Result<IoBenchConfig> io_bench_file_config(IoOp op, std::uint64_t bytes, std::uint64_t file_bytes,
                                           std::uint64_t request_bytes, const std::string& path);

// Each pool block is one request. REQUIRES: pool.block_bytes() is a multiple of
// engine.options().block_bytes; the file is at least file_bytes long for reads. For writes, the
// blocks' content is written as it is (fill it with random bytes first: never time zeros).
Result<IoBenchResult> run_io_bench(IoEngine& engine, FileHandle file, BufferPool& pool,
                                   const IoBenchConfig& config);

}  // namespace zinf
