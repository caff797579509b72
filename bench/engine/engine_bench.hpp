// What the engine benchmarks share: one rank (a HostDevice and a LocalComm group of one) with an
// engine at stage 2, AdamW, its optimizer state offloaded to `offload` in `dir`; the raw drive
// under it, the limit a pass of the engine over its NVMe state answers to; a failure's report;
// elapsed seconds; and the command line of --key value options they all take.
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
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
  // open(), then the file written once, untimed, as the engine's swap file is there before its
  // first pass: ready to read. invalid_argument when `bytes` is under one 8 MiB request.
  Status open_written(const std::string& path, std::uint64_t bytes) {
    ZINF_RETURN_IF_ERROR(open(path, bytes));
    if (bytes_ == 0) {
      return Status::invalid_argument(
          fmt::format("{}: {} bytes are under one 8 MiB request of the raw drive", path, bytes));
    }
    return move(IoOp::kWrite).status();
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

// Parameter `tensor`'s values of write `generation`: a cheap seeded pattern in [-0.5, 0.5),
// different for each.
inline void make_values(std::uint64_t generation, std::size_t tensor, std::span<float> out) {
  std::uint64_t x = generation * 0x9e3779b97f4a7c15ull + tensor * 0xbf58476d1ce4e5b9ull + 1;
  for (float& v : out) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<float>(x >> 40) * 0x1.0p-24f - 0.5f;
  }
}

// Registers `tensors` f32 parameters "w<i>" of `each` elements, each in a module "m<i>" of its
// own, parameter i's elements [first, first + count) made by init(i, first, count, out); returns
// their names.
inline Result<std::vector<std::string>> register_tensors(
    Engine& engine, std::size_t tensors, std::size_t each,
    const std::function<void(std::size_t, std::size_t, std::size_t, float*)>& init) {
  std::vector<std::string> names(tensors);
  for (std::size_t i = 0; i < tensors; ++i) {
    names[i] = fmt::format("w{}", i);
    ParameterSpec spec;
    spec.name = names[i];
    spec.module = fmt::format("m{}", i);
    spec.shape = {static_cast<std::int64_t>(each)};
    spec.initializer = [i, init](std::size_t first, std::size_t count, float* out) {
      init(i, first, count, out);
      return Status::ok();
    };
    ZINF_RETURN_IF_ERROR(engine.register_parameter(spec).with_context(names[i]));
  }
  return names;
}

inline int fail(std::string_view what, const Status& st) {
  fmt::print(stderr, "{}: {}\n", what, st.to_string());
  return 1;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One option of a benchmark's command line, "--key value": every option takes a value.
struct Option {
  std::string_view key;    // "--params"
  std::string_view value;  // what the usage line calls the value: "N" gives "[--params N]"
  // Takes the value: "" when taken, else why it is refused ("expected a count").
  std::function<std::string(std::string_view)> take;
};

// A count (decimal digits only), raised to `at_least`.
inline std::function<std::string(std::string_view)> count_into(std::size_t* out,
                                                               std::size_t at_least = 0) {
  return [out, at_least](std::string_view text) -> std::string {
    std::size_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size()) return "expected a count";
    *out = std::max(value, at_least);
    return "";
  };
}
// A count of rounds: at least 1.
inline std::function<std::string(std::string_view)> rounds_into(int* out) {
  return [out](std::string_view text) -> std::string {
    std::size_t value = 0;
    if (std::string why = count_into(&value, 1)(text); !why.empty()) return why;
    if (value > 1'000'000) return "expected at most 1000000 rounds";
    *out = static_cast<int>(value);
    return "";
  };
}
inline std::function<std::string(std::string_view)> text_into(std::string* out) {
  return [out](std::string_view text) -> std::string {
    *out = text;
    return "";
  };
}
// "cpu" (host memory) or "nvme", as the config's offload_optimizer.device spells them.
inline std::function<std::string(std::string_view)> offload_into(OffloadDevice* out) {
  return [out](std::string_view text) -> std::string {
    if (text != "cpu" && text != "nvme") return "expected cpu or nvme";
    *out = text == "cpu" ? OffloadDevice::kHost : OffloadDevice::kNvme;
    return "";
  };
}

// Hands each "--key value" of argv to its option's taker, in order. Returns 0, or 2 (main's exit
// code for a bad command line) after printing why on stderr: the usage line for an odd count of
// words or an unknown key, the key, value and reason for a value refused.
inline int parse_options(int argc, char** argv, std::string_view program,
                         const std::vector<Option>& options) {
  auto usage = [&] {
    std::string line = fmt::format("usage: {}", program);
    for (const Option& o : options) line += fmt::format(" [{} {}]", o.key, o.value);
    fmt::print(stderr, "{}\n", line);
    return 2;
  };
  if (argc % 2 == 0) return usage();  // the program's name, then pairs: an even count is a mistake
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view key = argv[i];
    const auto option =
        std::find_if(options.begin(), options.end(), [&](const Option& o) { return o.key == key; });
    if (option == options.end()) {
      fmt::print(stderr, "unknown option {}\n", key);
      return usage();
    }
    if (const std::string why = option->take(argv[i + 1]); !why.empty()) {
      fmt::print(stderr, "{} {}: {}\n", key, argv[i + 1], why);
      return 2;
    }
  }
  return 0;
}
}  // namespace zinf::bench
