// NcclComm: the Communicator interface (include/zinf/comm.hpp) over NCCL, on a CudaDevice.
//
// Two ways in. wrap_nccl_comm() takes an ncclComm_t the caller already has (the embedding case:
// a framework that set up NCCL itself). make_nccl_comm() bootstraps one from the environment a
// launcher sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, as torchrun does): rank
// 0 makes the ncclUniqueId, lib/comm/tcp_bootstrap hands it to every rank, and each rank calls
// ncclCommInitRankConfig in non-blocking mode, polled against the timeout.
//
// Collectives map one for one (ncclAllGather, ncclReduceScatter, ncclAllReduce, ncclBroadcast on
// the stream's cudaStream_t; kAverage is ncclAvg; group_start/end are ncclGroupStart/End, for
// buckets). No call waits forever: wait() polls the event and ncclCommGetAsyncError, and on an
// NCCL error or at the timeout calls ncclCommAbort, which makes the collectives in flight on
// every rank fail rather than hang. A rank whose peer has died learns it from NCCL's own error
// (a broken connection) or from its own timeout, so pass wait() a timeout: with kWaitForever it
// waits as long as NCCL does. barrier() is an all-reduce of one float on an internal stream,
// waited on with its timeout.
//
// Thread-safety: as Communicator.
#pragma once

#if defined(ZINF_HAVE_NCCL)

#include <chrono>
#include <memory>
#include <string_view>

#include "comm/tcp_bootstrap.hpp"
#include "zinf/comm.hpp"

namespace zinf {

// The one place an ncclResult_t becomes a Status: OK for ncclSuccess, otherwise kCommError with
// sys_code() = result and "<context>: <ncclGetErrorString>" (plus ncclGetLastError's detail).
Status status_from_nccl(std::string_view context, int result);

// Wraps the caller's ncclComm_t (passed as void* so that this header needs no NCCL headers).
// With `take_ownership` the communicator is finalized and destroyed with the NcclComm; without
// it the caller destroys it afterwards, except after an abort (status() not OK), when the
// handle has been freed by ncclCommAbort and must not be used again.
// REQUIRES: `device` is the CudaDevice of the GPU the communicator was created on, and outlives
// the result.
Result<std::unique_ptr<Communicator>> wrap_nccl_comm(void* nccl_comm, Device& device,
                                                     bool take_ownership);

struct NcclBootstrapOptions {
  // Bounds the TCP exchange of the unique id and then ncclCommInitRankConfig.
  std::chrono::milliseconds init_timeout = std::chrono::minutes(5);
  // The CUDA ordinal the communicator is created on; -1 means env.local_rank. Must be the GPU
  // `device` was opened on.
  int cuda_ordinal = -1;
};

// Bootstraps a communicator for `env` (see launch_env_from_environment()) on `device`.
// kTimeout when some rank did not arrive or NCCL initialisation did not finish in time;
// kCommError for NCCL failures; kInvalidArgument for a device that is not CUDA.
Result<std::unique_ptr<Communicator>> make_nccl_comm(const LaunchEnv& env, Device& device,
                                                     const NcclBootstrapOptions& options = {});

}  // namespace zinf

#endif  // ZINF_HAVE_NCCL
