#include "io/io_bench.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "base/assert.hpp"
#include "io/engine_core.hpp"

namespace zinf {

std::size_t io_bench_request_bytes(const IoOptions& options) {
  return options.block_bytes * std::max<std::size_t>(1, options.queue_depth / 4);
}

std::size_t io_bench_pool_blocks(const IoOptions& options, std::size_t request_bytes) {
  if (request_bytes == 0) request_bytes = options.block_bytes;
  const std::size_t in_flight_bytes =
      static_cast<std::size_t>(options.queue_depth) * options.rings * options.block_bytes;
  const std::size_t requests = (in_flight_bytes + request_bytes - 1) / request_bytes;
  return requests + std::max<std::size_t>(2, requests / 2);
}

Result<IoBenchConfig> io_bench_file_config(IoOp op, std::uint64_t bytes, std::uint64_t file_bytes,
                                           std::uint64_t request_bytes, const std::string& path) {
  if (file_bytes < request_bytes) {
    return Status::invalid_argument(
        fmt::format("{}: the file has {} bytes, less than one request of {} bytes (--request, or "
                    "--block x --depth / 4 by default)",
                    path, file_bytes, request_bytes));
  }
  IoBenchConfig config;
  config.op = op;
  config.bytes = op == IoOp::kRead ? std::min(bytes, file_bytes) : bytes;
  config.file_bytes = file_bytes;
  return config;
}

Result<IoBenchResult> run_io_bench(IoEngine& engine, FileHandle file, BufferPool& pool,
                                   const IoBenchConfig& config) {
  const std::uint64_t block = pool.block_bytes();  // one request
  if (block % engine.options().block_bytes != 0) {
    return Status::invalid_argument(
        "run_io_bench: the pool's blocks are not a multiple of the engine's block_bytes");
  }
  const std::uint64_t total = config.bytes / block * block;
  const std::uint64_t span = (config.file_bytes == 0 ? total : config.file_bytes) / block * block;
  if (total == 0 || span == 0) {
    return Status::invalid_argument(
        fmt::format("run_io_bench: {} bytes is less than one block of {}", config.bytes, block));
  }
  const std::size_t blocks = pool.block_count();
  std::vector<Ticket> tickets(blocks);
  io_detail::BoundedQueue<std::uint32_t> order;  // blocks in flight, oldest first
  order.reset(blocks);

  std::uint64_t submitted = 0;
  std::uint64_t done = 0;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + config.time_limit;
  Status first_error;
  auto submit = [&](std::uint32_t index) {
    const std::uint64_t offset = submitted % span;
    Result<Ticket> ticket =
        engine.submit(IoRequest{config.op, file, offset, block, pool.block(index)});
    if (!ticket.is_ok()) {
      first_error = ticket.status();
      return;
    }
    tickets[index] = *ticket;
    order.push(index);
    submitted += block;
  };
  for (std::uint32_t i = 0; i < blocks && submitted < total && first_error.is_ok(); ++i) submit(i);
  while (!order.empty()) {
    const std::uint32_t index = order.pop();
    Status status = engine.wait(tickets[index], config.wait_timeout);
    if (status.code() == Code::kTimeout) return status;  // still in flight: cannot go on
    if (!status.is_ok()) {
      if (first_error.is_ok()) first_error = std::move(status);
      continue;  // drain the others before returning
    }
    done += block;
    if (submitted < total && first_error.is_ok() &&
        (config.time_limit.count() == 0 || std::chrono::steady_clock::now() < deadline)) {
      submit(index);
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!first_error.is_ok()) return first_error;
  return IoBenchResult{done, seconds};
}

}  // namespace zinf
