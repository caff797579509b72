// run_local: a job of world_size ranks as threads of this process, with everything a rank needs
// set up and torn down in the right order.
//
// A program that trains on one machine without GPUs (or tests its training code) would otherwise
// write the same lines each time: one HostDevice per rank, a LocalComm group over them, one
// thread per rank that opens an Engine, and a teardown in the order the headers require (every
// engine before the communicators, the communicators before the devices). run_local does that
// and calls `fn(engine, rank)` on each rank's thread:
//
//   zinf::Status status = zinf::run_local(2, config, [&](zinf::Engine& engine, int rank) {
//     ... register parameters, then the training loop ...
//     return zinf::Status::ok();
//   });
//
// Errors. run_local returns OK when every rank's fn returned OK. Otherwise it returns the first
// error in time, with "rank <r>: " in front of its message and its code unchanged; the ranks
// still running are then told to stop: their communicators are aborted, so a rank waiting in a
// collective for the failed one returns kAborted at once instead of waiting for
// collective_timeout_ms. Errors setting up (a device, the group, Engine::open on some rank) are
// returned the same way, and fn is not called on that rank. An exception thrown by fn is caught
// on its thread and becomes kInternal naming the rank and its what(). run_local returns only
// after every rank's thread has been joined and everything it made has been destroyed.
//
// Thread-safety: fn runs on world_size threads at once, one per rank; it must call its Engine
// only from its own thread (as Engine requires) and synchronise any state the ranks share.
// run_local itself may be called from any thread, and several may run at once.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"
#include "zinf/status.hpp"
#include "zinf/trace.hpp"

namespace zinf {

struct LocalRunOptions {
  // Every rank's HostDevice; the ordinal is replaced by the rank.
  HostDeviceOptions device;
  // How long a rank waits in a collective for the others: the communicators' timeout and, for
  // the engines, zinf.collective_timeout_ms in place of the config's. 0: the config's
  // zinf.collective_timeout_ms.
  std::chrono::milliseconds collective_timeout{0};
  // As Env::nvme_paths and Env::trace, for every rank's engine.
  std::vector<std::string> nvme_paths;
  Trace* trace = nullptr;
};

// What each rank runs: its engine (opened on `config`, nothing registered yet) and its rank.
using LocalRankFn = std::function<Status(Engine& engine, int rank)>;

// Runs a job of `world_size` ranks as threads (see the file comment). kInvalidArgument for a
// world_size below 1; a config whose zinf.world_size is neither 0 nor world_size fails every
// rank's Engine::open, which names the key.
Status run_local(int world_size, const Config& config, const LocalRankFn& fn,
                 const LocalRunOptions& options = {});

}  // namespace zinf
