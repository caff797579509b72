// Communicator: the collectives ZeRO needs across the ranks of a job, asynchronous on a Device
// stream, shaped after NCCL so that `NcclComm` maps onto it one call for one call:
//
//   Communicator              NCCL
//   all_gather                ncclAllGather   (send: element_count, recv: element_count * world)
//   reduce_scatter            ncclReduceScatter (send: element_count * world, recv: element_count)
//   all_reduce                ncclAllReduce   (element_count in and out; in place allowed)
//   broadcast                 ncclBroadcast   (from `root`; in place allowed)
//   group_start / group_end   ncclGroupStart / ncclGroupEnd
//   wait(event, timeout)      cudaEventQuery polled with ncclCommGetAsyncError; ncclCommAbort on
//                             timeout
//   abort                     ncclCommAbort
//
// Every rank must issue the same collectives in the same order with the same element_count,
// dtype, reduction and root (as NCCL requires), and under the same name where both name it.
// LocalComm and MpiComm check this: ranks whose calls differ fail with kCommError ("ranks
// disagree", naming both calls); see Collective::name for how each compares names. NcclComm
// checks nothing: such calls there hang or mix data, as in NCCL. A collective is enqueued on
// `stream`: it starts after the work issued on the stream before it, and work issued after it sees
// its result. To wait for it on the host, record an event on the stream after it and call
// wait(event, timeout).
//
// Data: f32, bf16 or f16. Reductions of bf16 and f16 accumulate in f32 and round once
// (LocalComm; NCCL rounds at its own points). kAverage is the sum divided by world_size().
//
// Errors and aborts: a call whose arguments are wrong returns kInvalidArgument naming the
// collective and its `name`, and aborts the communicator, so the other ranks' matching collective
// fails instead of waiting for a rank that will never arrive. A collective that fails on any rank
// (a mismatch between ranks, a timeout, an abort) fails on every rank: its stream gets the error
// (kCommError, kTimeout or kAborted) and wait() returns it. After that the communicator is
// aborted: every later call returns kAborted with the first error's message. No collective waits
// forever: LocalComm gives each one a timeout; wait() takes one.
//
// Thread-safety: issue collectives from one thread per communicator (their order defines the
// matching between ranks). status(), abort() and wait() may be called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/status.hpp"

namespace zinf {

enum class ReduceOp : std::uint8_t {
  kSum = 0,
  kAverage = 1,  // sum / world_size
  kMax = 2,      // NaN when any input is NaN
  kMin = 3,      // NaN when any input is NaN
};
// "sum", "average", "max", "min".
std::string_view reduce_op_name(ReduceOp op);

enum class CollectiveKind : std::uint8_t {
  kAllGather = 0,
  kReduceScatter = 1,
  kAllReduce = 2,
  kBroadcast = 3,
};
// "all_gather", "reduce_scatter", "all_reduce", "broadcast".
std::string_view collective_kind_name(CollectiveKind kind);

// The reduction of the host-memory communicators (LocalComm, MpiComm), for a Communicator written
// outside the library (zinf.torch's over torch.distributed) that must give their bits:
// out[i] = `op` over ranks r = 0, 1, ... in that order of pieces[r * element_count + i], the
// pieces laid out end to end, accumulated in f32 and rounded once to `dtype` (kAverage divides
// the f32 sum by `world`; a NaN wins for kMax and kMin). `out` may be the first piece.
// REQUIRES: world >= 1; `pieces` holds world * element_count elements of `dtype`.
void reduce_host_pieces(const void* pieces, int world, std::size_t element_count, DType dtype,
                        ReduceOp op, void* out);

// One collective call, as the backends receive it.
struct Collective {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  // Device pointers of this rank. See each convenience method for their sizes and the in-place
  // forms allowed.
  const void* send = nullptr;
  void* recv = nullptr;
  // all_gather: elements each rank sends; reduce_scatter: elements each rank receives;
  // all_reduce and broadcast: elements of the whole buffer.
  std::size_t element_count = 0;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;  // reduce_scatter and all_reduce only
  int root = 0;                  // broadcast only
  // What the data is (a tensor, a bucket), for errors and traces; may be empty. Only needs to
  // live until the call returns. Ranks whose calls agree in shape but carry different non-empty
  // names fail with kCommError ("ranks disagree"); an empty name matches any. LocalComm compares
  // the names' first 95 bytes (it keeps a name cut there), so names that differ only after them
  // match. MpiComm compares a 64-bit hash of the whole name (its message shows the peer's first
  // 40 bytes). NcclComm compares nothing.
  std::string_view name;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // The device whose streams this communicator's collectives run on.
  virtual Device& device() const = 0;
  // For example "local rank 2 of 4" or "nccl rank 2 of 8".
  virtual std::string_view name() const = 0;

  // Enqueues `op` on `stream` (see the file comment). Returns kInvalidArgument for bad arguments,
  // kAborted after an abort.
  virtual Status issue(const Collective& op, Stream& stream) = 0;

  // Collectives issued between group_start() and group_end() may be launched together
  // (ncclGroupStart/End); a no-op grouping on LocalComm. Groups nest.
  // group_end() without a matching group_start() is kFailedPrecondition.
  virtual Status group_start() = 0;
  virtual Status group_end() = 0;

  // Blocks until every rank has called barrier(), or kTimeout (after which the communicator is
  // aborted on every rank). Orders nothing on the device.
  virtual Status barrier(std::chrono::milliseconds timeout = kWaitForever) = 0;

  // Blocks until `event` (recorded after collectives of this communicator) is reached. Returns the
  // first error of the work before it, or kTimeout after aborting the communicator on every rank.
  virtual Status wait(Event& event, std::chrono::milliseconds timeout = kWaitForever) = 0;

  // Fails the collectives in flight on every rank with `reason` and makes every later call
  // return kAborted. Idempotent: the first reason wins.
  // REQUIRES: !reason.is_ok().
  virtual void abort(Status reason) = 0;
  // OK, or the error that aborted this communicator.
  virtual Status status() const = 0;
  // How long a collective waits for the other ranks once this rank reached it (the options'
  // timeout it was made with); kWaitForever where only wait()'s own timeout bounds it (NCCL).
  // Engine::open warns when it differs from zinf.collective_timeout_ms.
  virtual std::chrono::milliseconds collective_timeout() const = 0;

  // recv[r * element_count + i] = send_of_rank_r[i] on every rank.
  // In place: send == recv + rank() * element_count.
  Status all_gather(const void* send, void* recv, std::size_t element_count, DType dtype,
                    Stream& stream, std::string_view name = {}) {
    return issue(
        {CollectiveKind::kAllGather, send, recv, element_count, dtype, ReduceOp::kSum, 0, name},
        stream);
  }
  // recv[i] = op over ranks r (in rank order) of send_of_rank_r[rank() * element_count + i].
  // In place: recv == send + rank() * element_count.
  Status reduce_scatter(const void* send, void* recv, std::size_t element_count, DType dtype,
                        ReduceOp op, Stream& stream, std::string_view name = {}) {
    return issue({CollectiveKind::kReduceScatter, send, recv, element_count, dtype, op, 0, name},
                 stream);
  }
  // recv[i] = op over ranks r of send_of_rank_r[i]; every rank gets the same bits.
  // In place: send == recv.
  Status all_reduce(const void* send, void* recv, std::size_t element_count, DType dtype,
                    ReduceOp op, Stream& stream, std::string_view name = {}) {
    return issue({CollectiveKind::kAllReduce, send, recv, element_count, dtype, op, 0, name},
                 stream);
  }
  // recv = send_of_rank_root on every rank. `send` is read on the root only. In place: send ==
  // recv.
  Status broadcast(const void* send, void* recv, std::size_t element_count, DType dtype, int root,
                   Stream& stream, std::string_view name = {}) {
    return issue(
        {CollectiveKind::kBroadcast, send, recv, element_count, dtype, ReduceOp::kSum, root, name},
        stream);
  }

 protected:
  Communicator() = default;
};

// --- LocalComm ---------------------------------------------------------------------------------

struct LocalCommOptions {
  // How long a rank waits in a collective or barrier for the other ranks before the collective
  // fails with kTimeout on every rank. Bounds every wait, so a lost rank never hangs a test.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
};

// World size devices.size() communicators, rank r on devices[r], all in this process: each rank
// is meant to be driven by its own thread. Collectives move data through shared memory; sums run
// in rank order, so results are the same bits on every rank and in every run.
// Returns kInvalidArgument for no devices, a device that is not a HostDevice (opaque ones are
// fine: the collectives use the memory's host addresses), or one device given to two ranks.
// REQUIRES: the devices outlive the communicators.
Result<std::vector<std::unique_ptr<Communicator>>> make_local_comm_group(
    const std::vector<Device*>& devices, const LocalCommOptions& options = {});

// --- MpiComm: one process per rank -------------------------------------------------------------

struct MpiCommOptions {
  // How long opening (make_mpi_comm: the communicator's duplication, which every rank must join)
  // and each collective or barrier wait for the other ranks once this rank has reached them. Past
  // it the collective fails with kTimeout naming the ranks it still waited for, and the
  // communicator is aborted on every rank still alive. This is what turns a rank that died or
  // stalled into an error instead of a hang (MPI itself waits forever for a dead peer). Give it
  // the engine's collective_timeout_ms.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
};

// This process's rank of MPI_COMM_WORLD, with `device` its device (a HostDevice, opaque or not, or
// a CudaDevice, whose buffers go through host staging copies). Collectives move data with
// nonblocking point-to-point messages on a duplicate of the communicator, polled against
// `options.timeout` by one progress thread; reductions gather the pieces and sum them in rank
// order as LocalComm does, so results are the same bits as LocalComm's at the same world size.
// Initialises MPI (MPI_THREAD_MULTIPLE) when the program has not, and then finalises it at exit
// unless a collective failed (MPI_Finalize would wait for a dead peer).
// Errors: kUnsupported naming ZINF_WITH_MPI when zinf was built without MPI;
// kFailedPrecondition when the program initialised MPI below MPI_THREAD_MULTIPLE or finalised it;
// kTimeout when not every rank called it within options.timeout (it duplicates the communicator,
// which every rank must join); kCommError for an MPI error. MPI_Init, when zinf calls it, has no
// deadline (MPI offers none).
// Opening is thus bounded by the collective timeout (60 s by default), where NcclComm's opening
// has an init_timeout of its own (5 min): ranks that reach make_mpi_comm further apart than
// options.timeout (one loading a large checkpoint or data set first) fail with kTimeout instead
// of waiting for each other; such a program raises options.timeout or meets at its own barrier
// first.
// REQUIRES: `device` outlives the result.
Result<std::unique_ptr<Communicator>> make_mpi_comm(Device& device,
                                                    const MpiCommOptions& options = {});
// The same over a communicator of the caller's (an embedding framework's): `mpi_comm` points at
// an MPI_Comm (pass &comm; a pointer, so that this header needs no mpi.h). The ranks are that
// communicator's; it is duplicated, so the caller's own traffic on it never mixes with zinf's.
Result<std::unique_ptr<Communicator>> make_mpi_comm(const void* mpi_comm, Device& device,
                                                    const MpiCommOptions& options = {});

// --- NcclComm: one GPU per rank ----------------------------------------------------------------

struct NcclCommOptions {
  // Bounds the exchange of NCCL's unique id and ncclCommInitRankConfig.
  std::chrono::milliseconds init_timeout = std::chrono::minutes(5);
  // The CUDA ordinal the communicator is created on (the GPU `device` was opened on); -1: the
  // launcher's local rank (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID).
  int cuda_ordinal = -1;
};

// Wraps an ncclComm_t the caller already has (passed as void*, so that this header needs no
// nccl.h). With `take_ownership` it is finalised and destroyed with the result; otherwise the
// caller destroys it afterwards, except after an abort (status() not OK): ncclCommAbort has freed
// it then. kUnsupported naming ZINF_WITH_NCCL when zinf was built without NCCL.
// REQUIRES: `device` is the CudaDevice of the communicator's GPU and outlives the result.
Result<std::unique_ptr<Communicator>> make_nccl_comm(void* nccl_comm, Device& device,
                                                     bool take_ownership = false);

// Bootstraps a communicator from the environment the launcher set:
//   torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): rank 0's ncclUniqueId goes
//     to every rank over TCP (lib/comm/tcp_bootstrap), rank 0 listening on ZINF_BOOTSTRAP_PORT
//     when set, else under torchrun on MASTER_PORT+1 (MASTER_PORT is torch's own store's), else
//     on MASTER_PORT;
//   mpirun or srun (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_SIZE or SLURM_STEP_NUM_TASKS, and no
//     RANK; a batch script's SLURM_NTASKS alone is no launch): the id is
//     broadcast over MPI_COMM_WORLD (needs zinf built with MPI, which is then initialised);
//   neither: a job of one rank.
// kUnsupported naming ZINF_WITH_NCCL (or ZINF_WITH_MPI under mpirun) when that backend was not
// built; kInvalidArgument naming a malformed variable; kTimeout when some rank did not arrive
// within options.init_timeout; kCommError for NCCL failures.
// REQUIRES: `device` is a CudaDevice and outlives the result.
Result<std::unique_ptr<Communicator>> make_nccl_comm(Device& device,
                                                     const NcclCommOptions& options = {});

}  // namespace zinf
