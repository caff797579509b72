// Engine::save_checkpoint / load_checkpoint on one rank: seconds and GB/s of the checkpoint files
// for a model of --params parameters (bf16, 64 parameters of params/64 elements) with its AdamW
// state on NVMe (--offload nvme, default) or in host memory (--offload cpu). The initial values
// come from an initializer, so nothing but the state itself is held. Compare the rates with the
// drive's raw rate (`zinf io bench`); the load's checksum pass reads what the save just wrote,
// usually from the page cache.
//
//   build/bin/bench_engine_checkpoint --params 268435456 --dir /path/on/the/drive
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run(std::size_t params, const std::string& dir, zinf::OffloadDevice offload) {
  using namespace zinf;
  std::filesystem::create_directories(dir);
  auto device = std::move(make_host_device({})).value();
  auto comms = std::move(make_local_comm_group({device.get()})).value();
  Config config;
  config.optimizer.kind = OptimizerKind::kAdamW;
  config.zero.stage = 2;
  config.zero.offload_optimizer.device = offload;
  config.zero.offload_optimizer.nvme_path = dir;
  config.zero.sub_group_size = std::size_t{1} << 24;
  Env env;
  env.device = device.get();
  env.comm = comms[0].get();
  Result<std::unique_ptr<Engine>> opened = Engine::open(config, env);
  if (!opened.is_ok()) {
    fmt::print(stderr, "open: {}\n", opened.status().to_string());
    return 1;
  }
  Engine& engine = **opened;
  constexpr std::size_t kTensors = 64;
  const std::size_t each = params / kTensors;
  for (std::size_t i = 0; i < kTensors; ++i) {
    ParameterSpec spec;
    spec.name = fmt::format("w{}", i);
    spec.module = fmt::format("m{}", i % 8);
    spec.shape = {static_cast<std::int64_t>(each)};
    spec.dtype = DType::kBF16;
    spec.initializer = [i](std::size_t first, std::size_t count, float* out) {
      for (std::size_t k = 0; k < count; ++k) {
        out[k] = static_cast<float>(((first + k) * 2654435761u + i) % 1000) * 1e-3f - 0.5f;
      }
      return Status::ok();
    };
    if (Status st = engine.register_parameter(spec); !st.is_ok()) {
      fmt::print(stderr, "{}\n", st.to_string());
      return 1;
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  if (Status st = engine.finalize(); !st.is_ok()) {
    fmt::print(stderr, "finalize: {}\n", st.to_string());
    return 1;
  }
  const double finalize_s = seconds_since(t0);
  const std::string ckpt = dir + "/ckpt";
  t0 = std::chrono::steady_clock::now();
  if (Status st = engine.save_checkpoint(ckpt); !st.is_ok()) {
    fmt::print(stderr, "save: {}\n", st.to_string());
    return 1;
  }
  const double save_s = seconds_since(t0);
  const double bytes =
      static_cast<double>(std::filesystem::file_size(ckpt + "/global_step0/rank0.zinfckpt"));
  t0 = std::chrono::steady_clock::now();
  if (Status st = engine.load_checkpoint(ckpt); !st.is_ok()) {
    fmt::print(stderr, "load: {}\n", st.to_string());
    return 1;
  }
  const double load_s = seconds_since(t0);
  fmt::print(
      "params {} ({} state), file {:.2f} GB: finalize {:.2f} s; save {:.2f} s ({:.2f} GB/s); load "
      "{:.2f} s ({:.2f} GB/s of file, read twice: checksum then state)\n",
      each * kTensors, offload_device_name(offload), bytes / 1e9, finalize_s, save_s,
      bytes / 1e9 / save_s, load_s, bytes / 1e9 / load_s);
  std::filesystem::remove_all(ckpt);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t params = std::size_t{1} << 28;
  std::string dir = "/tmp/zinf-bench-checkpoint";
  zinf::OffloadDevice offload = zinf::OffloadDevice::kNvme;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    const std::string value = argv[i + 1];
    if (key == "--params") {
      params = std::stoull(value);
    } else if (key == "--dir") {
      dir = value;
    } else if (key == "--offload") {
      offload = value == "cpu" ? zinf::OffloadDevice::kHost : zinf::OffloadDevice::kNvme;
    } else {
      fmt::print(stderr, "unknown option {}\n", key);
      return 2;
    }
  }
  return run(params, dir, offload);
}
