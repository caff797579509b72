// What the engine benchmarks share: one rank (a HostDevice and a LocalComm group of one) with an
// engine at stage 2, AdamW, its optimizer state offloaded to `offload` in `dir`; a failure's
// report; and elapsed seconds.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

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

inline int fail(std::string_view what, const Status& st) {
  fmt::print(stderr, "{}: {}\n", what, st.to_string());
  return 1;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace zinf::bench
