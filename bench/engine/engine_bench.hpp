// What the engine benchmarks share: one rank (a HostDevice and a LocalComm group of one) with an
// engine at stage 2, AdamW, its optimizer state offloaded to `offload` in `dir`; the raw drive
// under it, the limit a pass of the engine over its NVMe state answers to; a failure's report;
// and elapsed seconds.
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/random.hpp"
#include "io/buffer_pool.hpp"
#include "io/io_bench.hpp"
#include "io/io_engine.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

namespace zinf::bench {

// The engine is declared last, so it goes before the communicator and the device it runs on.
struct OneRank {
  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::unique_ptr<Engine> engine;
};

inline Result<OneRank> open_one_rank(const std::string& dir, OffloadDevice offload,
                                     std::size_t sub_group_size) {
  std::filesystem::create_directories(dir);
  OneRank r;
  ZINF_ASSIGN_OR_RETURN(r.device, make_host_device({}));
  ZINF_ASSIGN_OR_RETURN(r.comms, make_local_comm_group({r.device.get()}));
  Config config;
  config.optimizer.kind = OptimizerKind::kAdamW;
  config.zero.stage = 2;
  config.zero.offload_optimizer.device = offload;
  config.zero.offload_optimizer.nvme_path = dir;
  config.zero.sub_group_size = sub_group_size;
  Env env;
  env.device = r.device.get();
  env.comm = r.comms[0].get();
  ZINF_ASSIGN_OR_RETURN(r.engine, Engine::open(config, env));
  return r;
}

// One file's sequential reads and writes as `zinf io bench` moves them by default
// (tools/zinf/io.cpp; run_io_bench: 1 MiB pieces, 32 in flight, 8 MiB requests, O_DIRECT, seeded
// random bytes). Put it in the directory the engine's NVMe state uses, so both meet the same
// drive and filesystem.
class RawDrive {
 public:
  // Creates `path` empty; bytes() is `bytes` rounded down to whole 8 MiB requests. The first
  // write extends the file; a read needs one before it.
  Status open(const std::string& path, std::uint64_t bytes) {
    path_ = path;
    IoOptions options;  // 1 MiB pieces, depth 32: the CLI's defaults
    const std::size_t request = io_bench_request_bytes(options);
    const std::size_t blocks = io_bench_pool_blocks(options, request);
    options.max_requests = static_cast<std::uint32_t>(blocks + 16);
    ZINF_ASSIGN_OR_RETURN(engine_, open_engine(options));
    BufferPoolOptions pool_options;
    pool_options.block_bytes = request;
    pool_options.block_count = blocks;
    ZINF_ASSIGN_OR_RETURN(pool_, BufferPool::create(pool_options));
    ZINF_RETURN_IF_ERROR(pool_->register_with(*engine_));
    SplitMix64 random(20261202);
    auto* words = reinterpret_cast<std::uint64_t*>(pool_->data());
    for (std::size_t i = 0; i < pool_->bytes() / 8; ++i) words[i] = random.next();
    bytes_ = bytes / request * request;
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return status_from_errno(fmt::format("create {}", path), errno);
    ::close(fd);
    OpenFileOptions file_options;
    file_options.direct = true;
    ZINF_ASSIGN_OR_RETURN(file_, engine_->open_file(path, file_options));
    return Status::ok();
  }
  ~RawDrive() {
    if (engine_ != nullptr && file_.valid()) (void)engine_->close_file(file_);
    if (!path_.empty()) std::filesystem::remove(path_);
  }
  // bytes() moved from offset 0 on, one direction.
  Result<IoBenchResult> move(IoOp op) {
    IoBenchConfig config;
    config.op = op;
    config.bytes = bytes_;
    return run_io_bench(*engine_, file_, *pool_, config);
  }
  Result<double> gbps(IoOp op) {
    ZINF_ASSIGN_OR_RETURN(IoBenchResult r, move(op));
    return r.gbps();
  }
  std::uint64_t bytes() const { return bytes_; }
  // Gives the file's blocks back to the filesystem (the next write extends it again, as the
  // first one did), so the raw file and the engine's files need not fit on the drive at once.
  Status release() {
    if (::truncate(path_.c_str(), 0) != 0) {
      return status_from_errno(fmt::format("truncate {}", path_), errno);
    }
    return Status::ok();
  }

 private:
  std::string path_;
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<BufferPool> pool_;
  FileHandle file_;
  std::uint64_t bytes_ = 0;
};

inline int fail(std::string_view what, const Status& st) {
  fmt::print(stderr, "{}: {}\n", what, st.to_string());
  return 1;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace zinf::bench
