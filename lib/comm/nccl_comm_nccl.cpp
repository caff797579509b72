// NcclComm (see nccl_comm.hpp).
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/assert.hpp"
#include "comm/nccl_comm.hpp"
#include "comm/nccl_comm_handle.hpp"
#include "device/cuda_status.hpp"
#if defined(ZINF_HAVE_MPI)
#include "comm/mpi_comm.hpp"
#endif
#include "zinf/log.hpp"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;

// How long a call that returns ncclInProgress (non-blocking communicators) may take to settle,
// and how long the destructor lets ncclCommFinalize flush before it aborts instead.
constexpr auto kSettleTimeout = std::chrono::minutes(5);
constexpr auto kFinalizeTimeout = std::chrono::seconds(30);

// A backoff for polling loops: a yield, then sleeps doubling from 10 us up to 1 ms.
class Backoff {
 public:
  void pause() {
    if (sleep_.count() == 0) {
      std::this_thread::yield();
      sleep_ = std::chrono::microseconds(10);
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min<std::chrono::microseconds>(sleep_ * 2, std::chrono::milliseconds(1));
  }

 private:
  std::chrono::microseconds sleep_{0};
};

// Polls the communicator's state until it leaves ncclInProgress, the deadline passes, or
// `aborted` (when given) turns true: another thread aborted the communicator meanwhile.
ncclResult_t settle_state(ncclComm_t comm, Clock::time_point deadline,
                          const AbortableHandle<ncclComm_t>* aborted = nullptr) {
  ncclResult_t state = ncclInProgress;
  Backoff backoff;
  for (;;) {
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) return ncclInternalError;
    if (state != ncclInProgress || Clock::now() >= deadline) return state;
    if (aborted != nullptr && aborted->aborted()) return ncclInProgress;
    backoff.pause();
  }
}

Result<ncclDataType_t> nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF16:
      return ncclFloat16;
    case DType::kBF16:
      return ncclBfloat16;
  }
  return Status::invalid_argument("unknown dtype");
}

Result<ncclRedOp_t> nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAverage:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return Status::invalid_argument("unknown reduction");
}

class NcclComm final : public Communicator {
 public:
  NcclComm(ncclComm_t comm, Device& device, bool owned, int rank, int world_size)
      : handle_(comm, [](ncclComm_t c) { (void)ncclCommAbort(c); }),
        device_(device),
        owned_(owned),
        rank_(rank),
        world_size_(world_size),
        name_(fmt::format("nccl rank {} of {}", rank, world_size)) {}

  // Creates what barrier() needs: a stream, an event and one float of device memory.
  Status open_barrier() {
    ZINF_ASSIGN_OR_RETURN(barrier_stream_, device_.create_stream("nccl barrier"));
    ZINF_ASSIGN_OR_RETURN(barrier_event_, device_.create_event());
    ZINF_ASSIGN_OR_RETURN(barrier_buffer_, DeviceBuffer::allocate(device_, sizeof(float)));
    ZINF_RETURN_IF_ERROR(
        device_.memset_async(barrier_buffer_.data(), 0, sizeof(float), *barrier_stream_));
    return device_.synchronize(*barrier_stream_);
  }

  // REQUIRES: no call on this communicator is in flight on another thread.
  ~NcclComm() override {
    group_borrow_.reset();
    if (barrier_stream_ != nullptr) (void)device_.synchronize(*barrier_stream_);
    barrier_buffer_.reset();
    barrier_event_.reset();
    barrier_stream_.reset();
    // After an abort the handle is gone (ncclCommAbort freed it); a wrapped one is the caller's.
    const std::optional<ncclComm_t> comm = handle_.take();
    if (!comm.has_value() || !owned_) return;
    // Flush what was issued, then free; a finalize that fails or does not finish is aborted so
    // that the destructor cannot hang.
    ncclResult_t r = ncclCommFinalize(*comm);
    if (r == ncclInProgress || r == ncclSuccess)
      r = settle_state(*comm, Clock::now() + kFinalizeTimeout);
    if (r == ncclSuccess) {
      (void)ncclCommDestroy(*comm);
    } else {
      log_warn("{}: ncclCommFinalize did not finish ({}); aborting", name_, ncclGetErrorString(r));
      (void)ncclCommAbort(*comm);
    }
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Device& device() const override { return device_; }
  std::string_view name() const override { return name_; }

  Status issue(const Collective& op, Stream& stream) override {
    const std::string_view kind = collective_kind_name(op.kind);
    // The communicator cannot be freed by an abort() on another thread while this call uses it.
    std::optional<AbortableHandle<ncclComm_t>::Borrow> borrow = handle_.borrow();
    if (!borrow.has_value()) return aborted_status(kind, op.name);
    const ncclComm_t comm = borrow->get();
    if (op.element_count == 0) return Status::ok();
    Status bad = check_args(op, stream);
    if (!bad.is_ok()) {
      abort(bad);
      return bad;
    }
    ZINF_ASSIGN_OR_RETURN(const ncclDataType_t dtype, nccl_dtype(op.dtype));
    ZINF_ASSIGN_OR_RETURN(const ncclRedOp_t red, nccl_op(op.op));
    auto* s = static_cast<cudaStream_t>(stream.native_handle());
    if (world_size_ == 1 && op.op == ReduceOp::kAverage &&
        (op.kind == CollectiveKind::kAllReduce || op.kind == CollectiveKind::kReduceScatter)) {
      // The average over one rank is the input. NCCL before 2.29.7 computes it with a kernel that
      // leaves the last (count mod its block count) elements of an out-of-place result unwritten
      // (NVIDIA/nccl#1950; seen with 2.28.9 on an H200), so it is a copy here.
      if (op.send == op.recv) return Status::ok();
      Status copied = status_from_cuda(
          fmt::format("{} '{}' on {}: one-rank average as a copy", kind, op.name, name_),
          cudaMemcpyAsync(op.recv, op.send, op.element_count * dtype_bytes(op.dtype),
                          cudaMemcpyDeviceToDevice, s));
      if (!copied.is_ok()) abort(copied);
      return copied;
    }
    ncclResult_t r = ncclSuccess;
    switch (op.kind) {
      case CollectiveKind::kAllGather:
        r = ncclAllGather(op.send, op.recv, op.element_count, dtype, comm, s);
        break;
      case CollectiveKind::kReduceScatter:
        r = ncclReduceScatter(op.send, op.recv, op.element_count, dtype, red, comm, s);
        break;
      case CollectiveKind::kAllReduce:
        r = ncclAllReduce(op.send, op.recv, op.element_count, dtype, red, comm, s);
        break;
      case CollectiveKind::kBroadcast:
        r = ncclBroadcast(op.send, op.recv, op.element_count, dtype, op.root, comm, s);
        break;
    }
    return settle(r, comm, fmt::format("{} '{}' of {} elements", kind, op.name, op.element_count));
  }

  Status group_start() override {
    // The outermost group holds the communicator until group_end(): the collectives queued in the
    // group are launched by ncclGroupEnd, which must not meet a communicator freed by an abort.
    std::optional<AbortableHandle<ncclComm_t>::Borrow> borrow;
    if (group_depth_ == 0) {
      borrow = handle_.borrow();
      if (!borrow.has_value()) return aborted_status("group_start", {});
    }
    ZINF_RETURN_IF_ERROR(
        status_from_nccl(fmt::format("{}: ncclGroupStart", name_), ncclGroupStart()));
    if (group_depth_++ == 0) group_borrow_ = std::move(borrow);
    return Status::ok();
  }

  Status group_end() override {
    if (group_depth_ == 0) {
      return Status::failed_precondition(
          fmt::format("{}: group_end() without a matching group_start()", name_));
    }
    --group_depth_;
    ZINF_ASSERT(group_borrow_.has_value());
    const ncclComm_t comm = group_borrow_->get();
    Status st = settle(ncclGroupEnd(), comm, "ncclGroupEnd");
    if (group_depth_ == 0) group_borrow_.reset();
    return st;
  }

  Status barrier(std::chrono::milliseconds timeout) override {
    ZINF_RETURN_IF_ERROR(all_reduce(barrier_buffer_.data(), barrier_buffer_.data(), 1, DType::kF32,
                                    ReduceOp::kSum, *barrier_stream_, "barrier"));
    ZINF_RETURN_IF_ERROR(device_.record(*barrier_event_, *barrier_stream_));
    return wait(*barrier_event_, timeout);
  }

  Status wait(Event& event, std::chrono::milliseconds timeout) override {
    const bool forever = timeout >= std::chrono::hours(24);
    const auto deadline = forever ? Clock::time_point::max() : Clock::now() + timeout;
    Backoff backoff;
    for (;;) {
      Result<bool> reached = device_.query(event);
      if (!reached.is_ok()) {
        abort(reached.status());
        return reached.status();
      }
      if (*reached) return status();
      // Aborted meanwhile (no borrow): the GPU work is failing out.
      std::optional<AbortableHandle<ncclComm_t>::Borrow> borrow = handle_.borrow();
      if (!borrow.has_value()) return status();
      const ncclComm_t comm = borrow->get();
      ncclResult_t async = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
      if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
        Status failed = nccl_status("collective failed", r != ncclSuccess ? r : async, comm);
        abort(failed);
        return failed;
      }
      if (Clock::now() >= deadline) {
        Status late = Status::timeout(fmt::format(
            "{}: collectives not done after {} ms; communicator aborted", name_, timeout.count()));
        abort(late);
        return late;
      }
      backoff.pause();
    }
  }

  // Any thread, also from inside a call that has the communicator borrowed: ncclCommAbort runs
  // here when no call is using the communicator, else when the last such call returns (calls
  // polling NCCL see the abort and return at once). Never under a call in flight.
  void abort(Status reason) override {
    ZINF_ASSERT(!reason.is_ok());
    std::string text;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_.is_ok()) return;
      error_ = std::move(reason);
      text = error_.to_string();
    }
    log_warn("{}: aborting: {}", name_, text);
    // ncclCommAbort makes the kernels of this communicator's collectives in flight return, on
    // this rank; the other ranks' collectives then fail on their own (their peers are gone), and
    // their wait() sees it through ncclCommGetAsyncError or its timeout.
    (void)handle_.abort();
  }

  Status status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  // NCCL's collectives have no deadline of their own: wait() polls them against its timeout.
  std::chrono::milliseconds collective_timeout() const override { return kWaitForever; }

 private:
  Status aborted_status(std::string_view what, std::string_view tensor) const {
    return Status::aborted(fmt::format("{} '{}' on {}: the communicator was aborted: {}", what,
                                       tensor, name_, status().to_string()));
  }

  Status check_args(const Collective& op, Stream& stream) const {
    const std::string_view kind = collective_kind_name(op.kind);
    if (stream.native_handle() == nullptr) {
      return Status::invalid_argument(fmt::format("{} '{}' on {}: stream '{}' is not a CUDA stream",
                                                  kind, op.name, name_, stream.name()));
    }
    if (op.recv == nullptr ||
        (op.send == nullptr && (op.kind != CollectiveKind::kBroadcast || op.root == rank_))) {
      return Status::invalid_argument(
          fmt::format("{} '{}' on {}: null buffer", kind, op.name, name_));
    }
    if (op.kind == CollectiveKind::kBroadcast && (op.root < 0 || op.root >= world_size_)) {
      return Status::invalid_argument(fmt::format("{} '{}' on {}: root {} is not a rank of {}",
                                                  kind, op.name, name_, op.root, world_size_));
    }
    return Status::ok();
  }

  Status nccl_status(std::string_view what, ncclResult_t r, ncclComm_t comm) const {
    if (r == ncclSuccess) return Status::ok();
    const char* detail = comm != nullptr ? ncclGetLastError(comm) : nullptr;
    return Status::comm_error(
        fmt::format("{}: {}: {}{}{}", name_, what, ncclGetErrorString(r),
                    detail != nullptr && *detail != 0 ? ": " : "", detail != nullptr ? detail : ""),
        static_cast<int>(r));
  }

  // Completes a call that may return ncclInProgress (non-blocking communicators); an error
  // aborts the communicator, so the other ranks do not wait for this one.
  // REQUIRES: `comm` is borrowed by the caller.
  Status settle(ncclResult_t r, ncclComm_t comm, std::string_view what) {
    if (r == ncclInProgress) r = settle_state(comm, Clock::now() + kSettleTimeout, &handle_);
    if (r == ncclSuccess) return Status::ok();
    if (r == ncclInProgress && handle_.aborted()) return status();  // aborted by another thread
    Status failed = r == ncclInProgress
                        ? Status::timeout(fmt::format("{}: {} did not settle", name_, what))
                        : nccl_status(what, r, comm);
    abort(failed);
    return failed;
  }

  AbortableHandle<ncclComm_t> handle_;  // the ncclComm_t, borrowed by every call that uses it
  Device& device_;
  const bool owned_;
  const int rank_;
  const int world_size_;
  const std::string name_;
  int group_depth_ = 0;  // only touched by the issuing thread
  // Held from the outermost group_start() to its group_end(); only touched by the issuing thread.
  std::optional<AbortableHandle<ncclComm_t>::Borrow> group_borrow_;
  mutable std::mutex mu_;
  Status error_;  // sticky: the reason of the first abort
  std::unique_ptr<Stream> barrier_stream_;
  std::unique_ptr<Event> barrier_event_;
  DeviceBuffer barrier_buffer_;
};

}  // namespace

Status status_from_nccl(std::string_view context, int result) {
  if (result == ncclSuccess) return Status::ok();
  return Status::comm_error(
      fmt::format("{}: {}", context, ncclGetErrorString(static_cast<ncclResult_t>(result))),
      result);
}

Result<std::unique_ptr<Communicator>> wrap_nccl_comm(void* nccl_comm, Device& device,
                                                     bool take_ownership) {
  if (nccl_comm == nullptr) return Status::invalid_argument("wrap_nccl_comm: null ncclComm_t");
  if (device.kind() != DeviceKind::kCuda) {
    return Status::invalid_argument(
        fmt::format("wrap_nccl_comm: device {} is not a CUDA device", device.name()));
  }
  auto comm = static_cast<ncclComm_t>(nccl_comm);
  int rank = 0, world = 0;
  ZINF_RETURN_IF_ERROR(
      status_from_nccl("wrap_nccl_comm: ncclCommUserRank", ncclCommUserRank(comm, &rank)));
  ZINF_RETURN_IF_ERROR(
      status_from_nccl("wrap_nccl_comm: ncclCommCount", ncclCommCount(comm, &world)));
  auto out = std::make_unique<NcclComm>(comm, device, take_ownership, rank, world);
  ZINF_RETURN_IF_ERROR(out->open_barrier());
  return std::unique_ptr<Communicator>(std::move(out));
}

namespace {

// Hands rank 0's blob (the ncclUniqueId) to every rank: TCP under torchrun, MPI under mpirun.
using BlobExchange = std::function<Result<std::vector<std::byte>>(std::span<const std::byte>)>;

Result<std::unique_ptr<Communicator>> init_nccl_comm(const LaunchEnv& env, Device& device,
                                                     const NcclBootstrapOptions& options,
                                                     const BlobExchange& exchange) {
  const auto start = Clock::now();
  const auto deadline = start + options.init_timeout;
  if (device.kind() != DeviceKind::kCuda) {
    return Status::invalid_argument(
        fmt::format("make_nccl_comm: device {} is not a CUDA device", device.name()));
  }
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (env.rank == 0) {
    ZINF_RETURN_IF_ERROR(status_from_nccl("make_nccl_comm: ncclGetUniqueId", ncclGetUniqueId(&id)));
  }
  ZINF_ASSIGN_OR_RETURN(const std::vector<std::byte> blob,
                        exchange(std::as_bytes(std::span<const ncclUniqueId>(&id, 1))));
  if (blob.size() != sizeof(id)) {
    return Status::comm_error(
        fmt::format("make_nccl_comm: rank 0 sent {} bytes, not an ncclUniqueId of {}", blob.size(),
                    sizeof(id)));
  }
  std::memcpy(&id, blob.data(), sizeof(id));

  const int ordinal = options.cuda_ordinal >= 0 ? options.cuda_ordinal : env.local_rank;
  const cudaError_t cuda_err = cudaSetDevice(ordinal);
  if (cuda_err != cudaSuccess) {
    return Status::device_error(
        fmt::format("make_nccl_comm: cudaSetDevice({}): {}", ordinal, cudaGetErrorString(cuda_err)),
        static_cast<int>(cuda_err));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // So that initialisation can be bounded by the timeout.
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, env.world_size, id, env.rank, &config);
  if (r == ncclInProgress) r = settle_state(comm, deadline);
  if (r != ncclSuccess) {
    if (comm != nullptr) (void)ncclCommAbort(comm);
    if (r == ncclInProgress) {
      return Status::timeout(
          fmt::format("make_nccl_comm: rank {} of {}: ncclCommInitRankConfig not done within {} ms",
                      env.rank, env.world_size, options.init_timeout.count()));
    }
    return status_from_nccl(fmt::format("make_nccl_comm: rank {} of {}: ncclCommInitRankConfig",
                                        env.rank, env.world_size),
                            r);
  }
  return wrap_nccl_comm(comm, device, /*take_ownership=*/true);
}

std::optional<std::string> getenv_string(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

// The first of `names` that is set, parsed as a non-negative int; -1 when none is set.
Result<int> env_int(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    std::optional<std::string> text = getenv_string(name);
    if (!text) continue;
    char* end = nullptr;
    const long value = std::strtol(text->c_str(), &end, 10);
    if (text->empty() || *end != '\0' || value < 0 || value > 1'000'000) {
      return Status::invalid_argument(
          fmt::format("make_nccl_comm: {}='{}' is not a rank or a count", name, *text));
    }
    return static_cast<int>(value);
  }
  return -1;
}

}  // namespace

Result<std::unique_ptr<Communicator>> make_nccl_comm(const LaunchEnv& env, Device& device,
                                                     const NcclBootstrapOptions& options) {
  return init_nccl_comm(env, device, options, [&](std::span<const std::byte> blob) {
    return tcp_broadcast_blob(env, blob, options.init_timeout);
  });
}

Result<std::unique_ptr<Communicator>> make_nccl_comm(void* nccl_comm, Device& device,
                                                     bool take_ownership) {
  return wrap_nccl_comm(nccl_comm, device, take_ownership);
}

Result<std::unique_ptr<Communicator>> make_nccl_comm(Device& device,
                                                     const NcclCommOptions& options) {
  NcclBootstrapOptions bootstrap;
  bootstrap.init_timeout = options.init_timeout;
  bootstrap.cuda_ordinal = options.cuda_ordinal;
  // torchrun (and anything else that sets RANK): the TCP bootstrap.
  if (getenv_string("RANK")) {
    ZINF_ASSIGN_OR_RETURN(const LaunchEnv env, launch_env_from_environment());
    return make_nccl_comm(env, device, bootstrap);
  }
  // srun sets SLURM_STEP_NUM_TASKS for the tasks it starts; SLURM_NTASKS is set in the whole
  // allocation, around a program a batch script starts without srun too.
  ZINF_ASSIGN_OR_RETURN(const int mpi_world, env_int({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                                      "PMIX_SIZE", "SLURM_STEP_NUM_TASKS"}));
  if (mpi_world < 0) {
    LaunchEnv single;  // no launcher: a job of one rank
    return init_nccl_comm(single, device, bootstrap, [](std::span<const std::byte> blob) {
      return Result<std::vector<std::byte>>(std::vector<std::byte>(blob.begin(), blob.end()));
    });
  }
#if defined(ZINF_HAVE_MPI)
  // mpirun or srun: the unique id goes over MPI_COMM_WORLD.
  ZINF_ASSIGN_OR_RETURN(const MpiWorld world, mpi_world_of_process(options.init_timeout));
  LaunchEnv env;
  env.rank = world.rank;
  env.world_size = world.world_size;
  env.local_rank = world.local_rank;
  return init_nccl_comm(env, device, bootstrap, [&](std::span<const std::byte> blob) {
    return mpi_broadcast_blob(blob, options.init_timeout);
  });
#else
  return Status::unsupported(fmt::format(
      "make_nccl_comm: the process runs under an MPI launcher (world size {}) but zinf was built "
      "without MPI (configure with -DZINF_WITH_MPI=ON where libopenmpi-dev is installed), so the "
      "NCCL unique id cannot be broadcast; launch with torchrun (RANK, WORLD_SIZE, MASTER_ADDR, "
      "MASTER_PORT) instead",
      mpi_world));
#endif
}

}  // namespace zinf
